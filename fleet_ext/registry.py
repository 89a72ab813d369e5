"""Every fusion in one table: switch, fused and reference callables, bitwise policy, CP/recompute safety.

The backend provider reads this table; the README's fusion table is generated from it; the config
rejects a switch that has not landed or can never trigger with the rest of the config (DESIGN.md rule 3).
Callables are named by import path so that this module imports neither Paddle nor Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _never(config: Any) -> str | None:
    return None


def _inv_rope_postmix_gate(config: Any) -> str | None:
    """Why ``fuse_inv_rope_into_vha_postmix`` can never trigger with this config (PaddleFleet's rules)."""
    m = config.model
    if not m.use_vha_attention:
        return "use_vha_attention is false, so there is no postmix to fuse into"
    if m.vha_postmix_grouped:
        return "the fused op serves the ungrouped postmix only (vha_postmix_grouped is true)"
    if not config.fusion.apply_rope_fusion:
        return "it builds on the fused RoPE kernel: set apply_rope_fusion: true as well"
    if all(r == -2 for r in m.csa_compress_ratios):
        return "every layer is a -2 hybrid-MLA layer, which has no DSv4 inverse RoPE"
    return None


@dataclass(frozen=True)
class Fusion:
    """One fusion: the switch, the two implementations and the guarantees the tests hold it to."""

    switch: str
    summary: str
    fused: str
    reference: str
    bitwise_equal: bool
    tolerance: str | None = None  # why not bitwise, and the bound the tests use
    cp_safe: bool = True
    recompute_safe: bool = True
    landed: bool = True
    config_gate: Callable[[Any], str | None] = _never

    def load(self, which: str) -> Callable:
        """Import the ``fused`` or ``reference`` callable."""
        module, _, name = getattr(self, which).partition(":")
        return getattr(importlib.import_module(module), name)


FUSIONS: dict[str, Fusion] = {
    f.switch: f
    for f in (
        Fusion(
            switch="sparse_attn_global_kv_idx_remap_fusion",
            summary="per-batch-local -> flat-global KV index remap in one kernel (int64 math; an int32 table "
            "whose B*seqlen_kv would wrap raises instead)",
            fused="fleet_ext.ops.kv_idx_remap.function:local_to_global_flat",
            reference="fleet_ext.ops.kv_idx_remap.reference:local_to_global_flat",
            bitwise_equal=True,
        ),
        Fusion(
            switch="apply_rope_fusion",
            summary="partial interleaved RoPE (forward and inverse) on the trailing qk_pos_emb_head_dim channels",
            fused="fleet_ext.ops.rope.function:apply_partial_rope",
            reference="fleet_ext.ops.rope.reference:apply_partial_rope",
            bitwise_equal=True,
        ),
        Fusion(
            switch="fuse_inv_rope_into_vha_postmix",
            summary="inverse RoPE fused into the ungrouped VHA postmix (no full-width rotated intermediate)",
            fused="fleet_ext.ops.inv_rope_postmix.function:inv_rope_vha_postmix",
            reference="fleet_ext.ops.inv_rope_postmix.reference:inv_rope_vha_postmix",
            bitwise_equal=True,
            config_gate=_inv_rope_postmix_gate,
        ),
        Fusion(
            switch="dsa_sink_grad_fusion",
            summary="attention-sink gradient d_sink = -sum p_sink * rowsum(dO o O), deterministic",
            fused="fleet_ext.ops.sink_grad.function:sparse_attention_fused_sink_grad",
            reference="fleet_ext.ops.sparse_attn.reference:sparse_attention_with_sink",
            bitwise_equal=False,
            tolerance="out, lse, dq, dkv bitwise; d_sink deterministic but summed in a fixed block order, not "
            "autograd's: |err| <= 1e-5 * sum p_sink * (sum_d |dO*O| + |d_lse|)",
        ),
        Fusion(
            switch="dsv4_q_rms_norm_fusion",
            summary="weightless per-head q RMS norm, forward and backward (on CPU the rsqrt stays Paddle's: "
            "its vectorised estimate is position-dependent)",
            fused="fleet_ext.ops.q_rms_norm.function:q_rms_norm",
            reference="fleet_ext.ops.q_rms_norm.reference:q_rms_norm",
            bitwise_equal=True,
        ),
        Fusion(
            switch="use_fused_mhc",
            summary="fused mHC pre/post/Sinkhorn",
            fused="",
            reference="fleet_ext.layers.mhc:HyperConnection",
            bitwise_equal=False,
            landed=False,
        ),
    )
}

# Backend-valued switches: value -> whether that backend has landed.
BACKENDS: dict[str, dict[str, bool]] = {
    "csa_sparse_attn_backend": {"unfused": True, "triton": True},
    "mqa_sparse_attn_backend": {"unfused": True, "triton": True},
}
BACKEND_GUARANTEE = (
    "Triton sparse attention (fwd + deterministic bwd): not bitwise (online softmax, other summation order); "
    "fp32 within 1e-5 relative of the reference, byte-identical run to run"
)


def config_errors(config: Any) -> list[tuple[str, Any, str, str]]:
    """(switch, value, reason, fix) for every switch that can never run with this config."""
    errors = []
    for fusion in FUSIONS.values():
        if not getattr(config.fusion, fusion.switch):
            continue
        if not fusion.landed:
            errors.append((fusion.switch, True, "this fused kernel is not supported yet in fleet_ext",
                           f"set `{fusion.switch}: false` until the kernel lands"))
            continue
        reason = fusion.config_gate(config)
        if reason:
            errors.append((fusion.switch, True, reason, f"set `{fusion.switch}: false` or change the config"))
    if config.fusion.dsa_sink_grad_fusion and config.fusion.csa_sparse_attn_backend == "triton":
        errors.append(("dsa_sink_grad_fusion", True, "the Triton sparse-attention backward computes d_sink itself",
                       "set `dsa_sink_grad_fusion: false` (it serves the unfused backend)"))
    for switch, backends in BACKENDS.items():
        value = getattr(config.fusion, switch)
        if not backends.get(value, False):
            errors.append((switch, value, f"the {value} backend is not supported yet in fleet_ext",
                           f"set `{switch}: unfused`"))
    return errors
