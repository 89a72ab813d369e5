"""The ``recompute`` section and its resolver: which layers (full) or which modules of which layers (selective).

Key names and meanings follow PaddleFleet / Megatron-core. ``full`` re-runs whole layers in the backward and
keeps only each unit's input: ``uniform`` cuts the backbone into consecutive chunks of
``recompute_num_layers`` layers (the last may be shorter), each chunk one unit; ``block`` recomputes the first
``recompute_num_layers`` layers, one unit per layer, and none of the rest. ``selective`` keeps everything but
the internals of the chosen modules (see :data:`RECOMPUTE_MODULES`), given as a list (every layer that has
the module) or a mapping from module to ``"all"``, a list of layer ids (the ``csa_compress_ratios`` index
space) or a count (the first N layers that have the module).

The section checks what needs only its own keys; :func:`recompute_plan` checks what needs the model (layer
counts, which layers have which module) and is run by the config tree, so every rule fails in
``load_config``. The layers read the resolved :class:`RecomputePlan`, never the raw keys. No Paddle import.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from fleet_ext.config.fields import POSITIVE, Section, fail, key_field
from fleet_ext.layer_kinds import LayerKind, kinds_of

__all__ = ["RECOMPUTE_MODULES", "RecomputeConfig", "RecomputePlan", "module_layers", "recompute_plan"]

_key = key_field

#: The selective-recompute module names, in the order the start-up table prints them, with what each re-runs.
RECOMPUTE_MODULES: dict[str, str] = {
    "full_attn": "query/KV projections, core attention, inverse RoPE, postmix, grouped output projection",
    "vha_postmix": "the VHA postmix (layers other than -2, with use_vha_attention)",
    "core_attn": "the sparse-attention core",
    "mhc": "the mHC residual-stream mixing (with enable_hyper_connections)",
    "moe": "the routed and shared experts (MoE layers)",
    "moe_act": "the clamped SwiGLU activation of the experts only (MoE layers)",
    "mla_up_proj": "the MLA up-projections (-2 hybrid-MLA layers)",
}
_ALL = "all"


@dataclass
class RecomputeConfig(Section):
    """Activation recompute (PaddleFleet / Megatron names)."""

    recompute_granularity: str | None = _key(
        None,
        "Activation recompute: null (none), 'full' (re-run whole layers in the backward, keeping their inputs) "
        "or 'selective' (re-run the chosen modules of recompute_modules).",
        (None, "full", "selective"),
    )
    recompute_method: str | None = _key(
        None,
        "Full recompute only (required there): 'uniform' = consecutive chunks of recompute_num_layers layers, "
        "each recomputed as one unit; 'block' = the first recompute_num_layers layers, one unit each.",
        (None, "uniform", "block"),
    )
    recompute_num_layers: int | None = _key(
        None,
        "Full recompute only (required there): layers per chunk (uniform) or layers recomputed (block), "
        "at most num_hidden_layers.",
        domain=POSITIVE,
        fix="give `recompute_num_layers` a layer count in [1, num_hidden_layers] (or null without full recompute)",
    )
    recompute_modules: list | dict | None = _key(
        None,
        "Selective recompute only (required there): a list of modules, or a mapping module -> 'all' / list of "
        "layer ids (csa_compress_ratios index) / count N (the first N layers having it). Modules: "
        + ", ".join(RECOMPUTE_MODULES) + ".",
    )

    def validate(self) -> None:
        granularity = self.recompute_granularity
        if granularity is None:
            for key in ("recompute_method", "recompute_num_layers", "recompute_modules"):
                if getattr(self, key) is not None:
                    fail(key, getattr(self, key), "null while recompute_granularity is null",
                         "remove the key or set `recompute_granularity: full` or `selective`")
        elif granularity == "full":
            self._check_full()
        else:
            self._check_selective()

    def _check_full(self) -> None:
        if self.recompute_method is None:
            fail("recompute_method", None, "'uniform' or 'block' with recompute_granularity: full",
                 "set `recompute_method: uniform` (chunks of recompute_num_layers layers) or `block` "
                 "(the first recompute_num_layers layers)")
        if self.recompute_num_layers is None:
            fail("recompute_num_layers", None,
                 "a layer count in [1, num_hidden_layers] with recompute_granularity: full",
                 f"set `recompute_num_layers` (layers per chunk under {self.recompute_method})")
        if self.recompute_modules is not None:
            fail("recompute_modules", self.recompute_modules,
                 "null with recompute_granularity: full (full recompute re-runs whole layers)",
                 "remove recompute_modules, or set `recompute_granularity: selective`")

    def _check_selective(self) -> None:
        for key in ("recompute_method", "recompute_num_layers"):
            if getattr(self, key) is not None:
                fail(key, getattr(self, key), "null with recompute_granularity: selective (it applies to full)",
                     f"remove `{key}`, or set `recompute_granularity: full`")
        if not self.recompute_modules:
            fail("recompute_modules", self.recompute_modules,
                 f"a non-empty list or mapping of modules with recompute_granularity: selective, from "
                 f"{list(RECOMPUTE_MODULES)}", "list the modules to recompute, e.g. `recompute_modules: [core_attn]`")
        self.module_specs()

    def module_specs(self) -> dict[str, Any]:
        """``{module: "all" | tuple of layer ids | count}`` of the selective form; raises on a bad entry."""
        modules = self.recompute_modules
        entries = list(modules.items()) if isinstance(modules, dict) else [(name, _ALL) for name in modules]
        specs: dict[str, Any] = {}
        for name, spec in entries:
            _check_module_name(name, modules)
            if name in specs:
                fail("recompute_modules", modules, f"each module once; `{name}` is listed twice",
                     f"list `{name}` once")
            specs[name] = _check_spec(name, spec)
        return specs


def _check_module_name(name: Any, modules: Any) -> None:
    if isinstance(name, str) and name in RECOMPUTE_MODULES:
        return
    close = difflib.get_close_matches(name, list(RECOMPUTE_MODULES), n=1, cutoff=0.6) if isinstance(name, str) else []
    hint = f"did you mean `{close[0]}`?" if close else "use one of the modules listed"
    fail("recompute_modules", modules, f"module names from {list(RECOMPUTE_MODULES)}; {name!r} is not one",
         hint)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_spec(name: str, spec: Any) -> Any:
    """One mapping value: "all", a non-empty list of distinct layer ids >= 0, or a positive count."""
    allowed = f"for module `{name}`: 'all', a non-empty list of distinct layer ids, or a positive layer count"
    fix = f"write e.g. `{name}: all`, `{name}: [0, 2]` or `{name}: 2`"
    if spec == _ALL and isinstance(spec, str):
        return _ALL
    if _is_int(spec):
        if spec < 1:
            fail("recompute_modules", {name: spec}, allowed + f"; a count of {spec} selects no layer", fix)
        return spec
    if isinstance(spec, (list, tuple)) and spec and all(_is_int(i) and i >= 0 for i in spec):
        if len(set(spec)) == len(spec):
            return tuple(spec)
    fail("recompute_modules", {name: spec}, allowed, fix)


def module_layers(model: Any, moe: Any) -> dict[str, tuple[int, ...]]:
    """For every module name, the layers (``csa_compress_ratios`` index) that have it under this config."""
    kinds = kinds_of(model)
    every = tuple(range(len(kinds)))
    mla = tuple(i for i, kind in enumerate(kinds) if kind is LayerKind.HYBRID_MLA)
    moe_layers = tuple(i for i in every if i >= moe.first_k_dense_replace)
    return {
        "full_attn": every,
        "vha_postmix": tuple(i for i in every if i not in mla) if model.use_vha_attention else (),
        "core_attn": every,
        "mhc": every if model.enable_hyper_connections else (),
        "moe": moe_layers,
        "moe_act": moe_layers,
        "mla_up_proj": mla,
    }


def _why_absent(name: str, model: Any, moe: Any, layer: int | None) -> str:
    """Why ``layer`` (or, for None, every layer) lacks module ``name``."""
    if name == "vha_postmix" and not model.use_vha_attention:
        return "use_vha_attention is false"
    if name == "mhc":
        return "enable_hyper_connections is false"
    if name in ("moe", "moe_act"):
        which = f"layer {layer} is" if layer is not None else "every layer is"
        return f"{which} dense (the first first_k_dense_replace = {moe.first_k_dense_replace} layers use a dense MLP)"
    if name == "vha_postmix":
        which = f"layer {layer} is" if layer is not None else "every layer is"
        return f"{which} a -2 (hybrid-MLA) layer, which has no VHA postmix"
    if layer is None:
        return "csa_compress_ratios has no -2 (hybrid-MLA) layer"
    return f"layer {layer} is a {kinds_of(model)[layer].value} layer; only -2 (hybrid-MLA) layers have one"


def _resolve_one(name: str, spec: Any, have: tuple[int, ...], model: Any, moe: Any) -> tuple[int, ...]:
    """The layers ``spec`` selects for module ``name``, given the layers ``have`` that have it."""
    entry = {name: list(spec) if isinstance(spec, tuple) else spec}
    if not have:
        fail("recompute_modules", entry, f"modules some layer has; no layer has `{name}`: "
             f"{_why_absent(name, model, moe, None)}", f"drop `{name}` from recompute_modules")
    if spec == _ALL:
        return have
    if _is_int(spec):
        if spec > len(have):
            fail("recompute_modules", entry, f"for `{name}` a count <= {len(have)} (the layers having it: "
                 f"{list(have)})", f"lower the count, or write `{name}: all`")
        return have[:spec]
    n_layers = len(model.csa_compress_ratios)
    for layer in spec:
        if layer >= n_layers:
            fail("recompute_modules", entry, f"layer ids in [0, {n_layers - 1}] (the csa_compress_ratios index)",
                 f"drop layer {layer} from `{name}`")
        if layer not in have:
            fail("recompute_modules", entry, f"layers that have `{name}`: {list(have)}; "
                 f"{_why_absent(name, model, moe, layer)}", f"drop layer {layer} from `{name}`")
    return tuple(sorted(spec))


def _full_chunks(method: str, per_chunk: int, n_layers: int) -> tuple[tuple[int, ...], ...]:
    if per_chunk > n_layers:
        fail("recompute_num_layers", per_chunk, f"a layer count in [1, num_hidden_layers = {n_layers}]",
             f"set `recompute_num_layers` to at most {n_layers}")
    if method == "block":
        return tuple((layer,) for layer in range(per_chunk))
    return tuple(tuple(range(start, min(start + per_chunk, n_layers))) for start in range(0, n_layers, per_chunk))


@dataclass(frozen=True)
class RecomputePlan:
    """The resolved policy the layers follow.

    ``chunks``: under full recompute, the layer-index chunks each recomputed as one unit (only the chunk's
    input is kept); empty otherwise. ``modules``: under selective recompute, layer index -> the modules of that
    layer to recompute (layers with none are absent); empty otherwise.
    """

    chunks: tuple[tuple[int, ...], ...] = ()
    modules: dict[int, frozenset[str]] = field(default_factory=dict)

    @property
    def granularity(self) -> str | None:
        return "full" if self.chunks else "selective" if self.modules else None

    def chunk_of(self, layer: int) -> tuple[int, ...] | None:
        """The full-recompute chunk holding ``layer``, or None when the layer is not fully recomputed."""
        return next((chunk for chunk in self.chunks if layer in chunk), None)

    def modules_of(self, layer: int) -> frozenset[str]:
        """The selective modules recomputed in ``layer`` (empty when none)."""
        return self.modules.get(layer, frozenset())

    def describe(self, layer: int) -> str:
        """The start-up table's cell for ``layer``: 'full (chunk 0-1)', 'selective: core_attn, moe_act' or 'none'."""
        chunk = self.chunk_of(layer)
        if chunk is not None:
            return f"full (chunk {chunk[0]}-{chunk[-1]})" if len(chunk) > 1 else f"full (chunk {chunk[0]})"
        chosen = self.modules_of(layer)
        if chosen:
            return "selective: " + ", ".join(name for name in RECOMPUTE_MODULES if name in chosen)
        return "none"


def recompute_plan(config: Any) -> RecomputePlan:
    """Resolve ``config.recompute`` against ``config.model`` / ``config.moe``; ``ValueError`` naming the key.

    The config tree runs this in ``load_config``, so a loaded config always resolves.
    """
    section, model, moe = config.recompute, config.model, config.moe
    if section.recompute_granularity == "full":
        return RecomputePlan(chunks=_full_chunks(section.recompute_method, section.recompute_num_layers,
                                                 model.num_hidden_layers))
    if section.recompute_granularity != "selective":
        return RecomputePlan()
    have = module_layers(model, moe)
    per_layer: dict[int, set[str]] = {}
    for name, spec in section.module_specs().items():
        for layer in _resolve_one(name, spec, have[name], model, moe):
            per_layer.setdefault(layer, set()).add(name)
    return RecomputePlan(modules={layer: frozenset(names) for layer, names in sorted(per_layer.items())})
