"""Layer specs: a class, its constructor params and its sub-specs, built by one function.

Mirrors Megatron-core / PaddleFleet ``ModuleSpec`` + ``build_module``: the spec tree says *which*
implementation each slot gets (chosen once, at build time, by the backend provider); layers receive
their sublayers already decided and never branch on capability in ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LayerSpec:
    """What to build for one slot: ``module(config, sublayers=..., **params)``."""

    module: type
    params: dict[str, Any] = field(default_factory=dict)
    sublayers: dict[str, LayerSpec | None] = field(default_factory=dict)


def build_layer(spec: LayerSpec | None, config: Any, **kwargs: Any) -> Any:
    """Instantiate a spec; ``None`` specs (an absent slot) build to ``None``."""
    if spec is None:
        return None
    if not isinstance(spec, LayerSpec):
        raise TypeError(f"build_layer expected a LayerSpec, got {type(spec).__name__}")
    params = {**spec.params, **kwargs}
    if spec.sublayers:
        params["sublayers"] = spec.sublayers
    return spec.module(config, **params)
