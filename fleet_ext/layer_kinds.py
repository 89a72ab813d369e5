"""The one table of attention layer kinds: what a ``csa_compress_ratios`` entry means.

PaddleFleet encodes each layer's attention kind as one integer per layer:

=========  ==================  ================================================================
entry      kind                attention
=========  ==================  ================================================================
``-2``     ``HYBRID_MLA``      MLA (dense, or absorbed latent MQA with the DSA indexer)
``-1``     ``FULL_CAUSAL``     single-head MQA over every key ``0..t``
``0``      ``WINDOW``          sliding window only
``2..127`` ``CSA``             window + indexer top-k over an overlapping compressor's entries
``128``    ``HCA``             window + every visible entry of a non-overlapping compressor
=========  ==================  ================================================================

The entry ``128`` is a *marker* (PaddleFleet's encoding); the rate at which an HCA layer compresses is
``hca_compress_ratio`` (default 128), so a model whose HCA rate is not 128 is expressible. Every module
that needs a layer's kind, compression rate, RoPE or window asks :func:`layer_attention`; no other
module compares ratios with literals. This module imports neither Paddle nor the config (it reads the
model config duck-typed), so the config can validate entries with it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HCA_ENTRY",
    "LayerAttention",
    "LayerKind",
    "RopeSpec",
    "kind_of_entry",
    "kinds_of",
    "layer_attention",
]

HCA_ENTRY = 128  # PaddleFleet's csa_compress_ratios marker of an HCA layer
_ENTRIES = {-2: "HYBRID_MLA", -1: "FULL_CAUSAL", 0: "WINDOW"}


class LayerKind(enum.Enum):
    """Attention kind of one layer; the value is the name the start-up table prints."""

    HYBRID_MLA = "hybrid_mla"
    FULL_CAUSAL = "full_causal_mqa"
    WINDOW = "window"
    CSA = "csa"
    HCA = "hca"

    @property
    def compressed(self) -> bool:
        """CSA and HCA layers own a KV compressor."""
        return self in (LayerKind.CSA, LayerKind.HCA)


def kind_of_entry(entry: Any) -> LayerKind:
    """The kind a ``csa_compress_ratios`` entry selects; ``ValueError`` naming the key otherwise."""
    if isinstance(entry, int) and not isinstance(entry, bool):
        if entry in _ENTRIES:
            return LayerKind[_ENTRIES[entry]]
        if entry == HCA_ENTRY:
            return LayerKind.HCA
        if 2 <= entry < HCA_ENTRY:
            return LayerKind.CSA
    hint = "Ratio 1 would compress nothing; use 0 for a window-only layer." if entry == 1 else "Fix the entry."
    raise ValueError(
        f"config key `csa_compress_ratios` entry {entry!r} is invalid: allowed -2 (hybrid-MLA sparse MQA), "
        f"-1 (full-causal MQA), 0 (window only), 2..{HCA_ENTRY - 1} (CSA at that rate), {HCA_ENTRY} (HCA, "
        f"compressing at `hca_compress_ratio`). {hint}"
    )


@dataclass(frozen=True)
class RopeSpec:
    """Rotary frequencies of one layer kind: ``dim`` channels, plain RoPE or YaRN at ``base``."""

    dim: int
    base: float
    rope_type: str  # "rope" or "yarn"
    scaling_factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class LayerAttention:
    """Everything one layer's attention needs to know about its kind.

    ``compress_ratio`` is the number of tokens pooled into one compressed entry (0 without a
    compressor); ``window`` the sliding-window length (DSv4 kinds), or the forced window of a -2
    layer's sparse phase (0 when ``dsa_indexer_force_window`` is off); ``None`` for full-causal MQA.
    """

    kind: LayerKind
    entry: int
    compress_ratio: int
    window: int | None
    rope: RopeSpec

    @property
    def has_compressor(self) -> bool:
        return self.kind.compressed

    @property
    def overlapping_compressor(self) -> bool:
        """CSA compressors pool two blocks per entry (this block and the previous one); HCA's one."""
        return self.kind is LayerKind.CSA

    def has_csa_indexer(self, csa_dense_mode: bool) -> bool:
        """CSA layers pick compressed entries with the lightning indexer unless ``csa_dense_mode``."""
        return self.kind is LayerKind.CSA and not csa_dense_mode


def _rope_spec(model: Any, kind: LayerKind) -> RopeSpec:
    if kind is LayerKind.HYBRID_MLA:
        return RopeSpec(
            dim=model.hybrid_mla_qk_rope_head_dim or 0,
            base=model.hybrid_mla_rotary_base,
            rope_type=model.hybrid_mla_rope_type,
            scaling_factor=model.hybrid_mla_rotary_scaling_factor,
            original_max_position=model.hybrid_mla_original_max_position_embeddings,
            beta_fast=model.beta_fast,
            beta_slow=model.beta_slow,
        )
    if not kind.compressed:
        return RopeSpec(dim=model.qk_pos_emb_head_dim, base=model.rotary_base, rope_type="rope")
    return RopeSpec(
        dim=model.qk_pos_emb_head_dim,
        base=model.csa_compress_rotary_base,
        rope_type=model.hca_rope_type if kind is LayerKind.HCA else model.csa_rope_type,
        scaling_factor=model.rotary_scaling_factor,
        original_max_position=model.original_max_position_embeddings,
        beta_fast=model.beta_fast,
        beta_slow=model.beta_slow,
    )


def layer_attention(model: Any, layer_index: int) -> LayerAttention:
    """Kind, compression rate, window and RoPE of layer ``layer_index`` (the ``csa_compress_ratios``
    index space: backbone layers first, then MTP layers) of the model config ``model``."""
    ratios = model.csa_compress_ratios
    if not 0 <= layer_index < len(ratios):
        raise ValueError(f"layer_attention: `layer_index` must be in [0, {len(ratios)}), got {layer_index}")
    entry = ratios[layer_index]
    kind = kind_of_entry(entry)
    compress_ratio = {LayerKind.CSA: entry, LayerKind.HCA: model.hca_compress_ratio}.get(kind, 0)
    if kind is LayerKind.FULL_CAUSAL:
        window = None
    elif kind is LayerKind.HYBRID_MLA:
        window = model.csa_window_size if model.dsa_indexer_force_window else 0
    else:
        window = model.csa_window_size
    return LayerAttention(kind=kind, entry=entry, compress_ratio=compress_ratio, window=window,
                          rope=_rope_spec(model, kind))


def kinds_of(model: Any) -> list[LayerKind]:
    """The kind of every layer of the model config ``model``, in order."""
    return [kind_of_entry(entry) for entry in model.csa_compress_ratios]
