"""The ``recompute`` section: activation recompute (Megatron names; not built yet, so only null is accepted)."""

from __future__ import annotations

from dataclasses import dataclass

from fleet_ext.config.fields import POSITIVE, Section, fail, key_field, not_yet

__all__ = ["RecomputeConfig"]

_key = key_field


@dataclass
class RecomputeConfig(Section):
    """Activation recompute (Megatron names)."""

    recompute_granularity: str | None = _key(None, "None, 'full' or 'selective'.", (None, "full", "selective"))
    recompute_method: str | None = _key(None, "For full recompute: 'uniform' or 'block'.", (None, "uniform", "block"))
    recompute_num_layers: int | None = _key(None, "Layers per recompute chunk (full recompute).", domain=POSITIVE)
    recompute_modules: list | None = _key(None, "Modules for selective recompute, e.g. ['full_attn'].")

    def validate(self) -> None:
        if self.recompute_granularity is not None:
            not_yet(
                "recompute_granularity",
                self.recompute_granularity,
                "activation recompute",
                "leave `recompute_granularity` unset (null) until the recompute issue lands",
            )
        for key in ("recompute_method", "recompute_num_layers", "recompute_modules"):
            if getattr(self, key) is not None:
                fail(
                    key,
                    getattr(self, key),
                    "null while recompute_granularity is null",
                    "remove the key or set recompute_granularity",
                )
