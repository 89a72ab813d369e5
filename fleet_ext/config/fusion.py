"""The ``fusion`` section: fusion switches (PaddleFleet names), all off by default.

Whether a switch can ever run with the rest of the config is the registry's call
(``fleet_ext.registry.config_errors``, asked by the config tree); whether it can run on this
machine is decided by the backend provider at build time.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet_ext.config.fields import Section, key_field

__all__ = ["FusionConfig"]

_key = key_field


@dataclass
class FusionConfig(Section):
    """Fusion switches (PaddleFleet names). All default off; a switch is either honoured or raises."""

    apply_rope_fusion: bool = _key(False, "Triton partial interleaved RoPE (forward and inverse).")
    fuse_inv_rope_into_vha_postmix: bool = _key(False, "Inverse RoPE fused into the ungrouped VHA postmix.")
    inv_rope_postmix_mode: str = _key(
        "bitwise",
        "How fuse_inv_rope_into_vha_postmix runs: bitwise (library GEMMs, bitwise equal to the unfused path) or "
        "fast (one-pass Triton kernels, deterministic split-K weight gradient; within the tolerance in "
        "fleet_ext.registry.FUSION_MODES). Needs the switch on.",
        ("bitwise", "fast"),
    )
    sparse_attn_global_kv_idx_remap_fusion: bool = _key(False, "Triton local -> flat-global KV index remap.")
    dsa_sink_grad_fusion: bool = _key(False, "Triton deterministic attention-sink gradient.")
    dsv4_q_rms_norm_fusion: bool = _key(False, "Triton weightless per-head q RMS norm.")
    use_fused_mhc: bool = _key(
        False, "Triton mHC: projection, RMS statistics, gates, Sinkhorn and pre collapse in one kernel, the post "
        "combine in another; deterministic backward (not bitwise: within the registry's tolerance)."
    )
    moe_permute_fusion: bool = _key(
        False, "Triton MoE permute / unpermute: stable counting sort by expert, gather-based weighted combine."
    )
    moe_router_fusion: bool = _key(
        False, "Triton MoE router: biased top-k (or hash lookup), renormalised scaled weights and per-expert counts."
    )
    moe_router_logits_fusion: bool = _key(
        False, "Triton router logits GEMM x W^T at fp32 accuracy on the tensor cores (bf16 products of split "
        "operands) and its backward; no fp32 copy of the hidden states (not bitwise: within the registry's tolerance)."
    )
    moe_expert_fusion: bool = _key(
        False, "Triton grouped expert GEMMs: gate+up with the clamped SwiGLU epilogue, down; deterministic backward."
    )
    csa_sparse_attn_backend: str = _key("unfused", "Sparse attention of DSv4 layers.", ("unfused", "triton"))
    mqa_sparse_attn_backend: str = _key("unfused", "Sparse attention of -2 layers.", ("unfused", "triton"))
    mqa_sparse_attn_backward_backend: str = _key(
        "triton",
        "Backward of the triton sparse-attention backends: the deterministic (atomic-free, byte-identical run to "
        "run) Triton kernel; PaddleFleet's atomic cuDNN backward is not built.",
        ("triton",),
    )
    sparse_attn_dkv_contribution_dtype: str = _key(
        "auto",
        "How the triton sparse-attention backward stores its per-pair dkv contributions, summed in fp32 in a fixed "
        "order in every case (byte-identical run to run): auto (float24 for bf16/fp16 runs, float32 for fp32 ones), "
        "float32, float24 (rounded to nearest at 16 significant bits, 3 bytes: on the H200 the backward 1.06-1.17x "
        "faster than float32, dkv's error against an fp32 reference unchanged to three digits), or bfloat16 "
        "(bf16/fp16 runs only; 1.20-1.39x, that error 2.35e-3 -> 2.87e-3; benchmarks/RESULTS.md). float24 and "
        "bfloat16 need a triton sparse-attention backend.",
        ("auto", "float32", "float24", "bfloat16"),
    )
