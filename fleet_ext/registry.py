"""Every fusion in one table: switch, fused and reference callables, and its claims as data.

A claim (bitwise equal per platform, CP-safe, recompute-safe) is "untested" until a named test earns it.

The backend provider reads this table; the README's fusion table is generated from it; the config
rejects a switch that has not landed or can never trigger with the rest of the config (DESIGN.md rule 3).
Callables are named by import path so that this module imports neither Paddle nor Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet_ext.layer_kinds import LayerKind, kinds_of


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
    if all(kind is LayerKind.HYBRID_MLA for kind in kinds_of(m)):
        return "every layer is a -2 hybrid-MLA layer, which has no DSv4 inverse RoPE"
    return None


def _moe_gate(config: Any) -> str | None:
    """Why a MoE fusion can never trigger with this config: no MoE layer."""
    if config.moe.first_k_dense_replace >= config.model.num_hidden_layers:
        return "every layer is dense (first_k_dense_replace >= num_hidden_layers): there is no MoE layer"
    return None


def _moe_router_gate(config: Any) -> str | None:
    """Why ``moe_router_fusion`` can never trigger: no MoE layer, or group-limited routing (not fused)."""
    m = config.moe
    if m.n_group > 1 and m.topk_group < m.n_group:
        return (f"the fused router serves ungrouped top-k (DeepSeek-V4); n_group = {m.n_group} with topk_group = "
                f"{m.topk_group} limits each token to its best groups")
    return _moe_gate(config)


def _mhc_gate(config: Any) -> str | None:
    """Why ``use_fused_mhc`` can never trigger: no hyper-connections."""
    if not config.model.enable_hyper_connections:
        return "enable_hyper_connections is false, so there are no mHC streams to fuse"
    return None


_MHC_TESTS = "tests/single_card_tests/test_fusion_mhc.py::"
_MHC_TOLERANCE = (
    "fp32 vs the Paddle reference (CPU interpreter): every output and gradient within 1e-5 of its tensor's largest "
    "entry (`mhc_fused`; measured <= 1e-6), the gains `scale` within 1e-4 (`mhc_fused_gain`: one cancelling sum over "
    "tokens); other summation orders, the RMS factor applied after the projection. GPU (tests/gpu/test_mhc_gpu.py, "
    "H200, passed 2026-12-01): bf16 and fp32 streams vs a float64 oracle, fp32 outputs and parameter gradients "
    "within the same fp32 entries (the tile products keep fp32 accuracy), bf16 outputs within one bf16 rounding "
    "more. Deterministic: no atomics, byte-identical run to run (checked at T = 16384 x 4 x 4096 on the H200)"
)


YES, NO, UNTESTED = "yes", "no", "untested"


@dataclass(frozen=True)
class Claim:
    """One guarantee on one platform, as data (DESIGN.md rule 4).

    ``yes`` is earned only by the tests named in ``tests`` (``path::function``; a test checks that they
    exist); ``no`` says it does not hold (the fusion's tolerance applies instead; ``tests`` may name what
    holds it to that tolerance); ``untested`` is the default: nothing has shown it either way.
    """

    verdict: str = UNTESTED
    tests: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.verdict not in (YES, NO, UNTESTED):
            raise ValueError(f"claim verdict {self.verdict!r}: expected one of {YES!r}, {NO!r}, {UNTESTED!r}")
        if self.verdict == YES and not self.tests:
            raise ValueError("a 'yes' claim must name the test that earns it (tests=('path::function',))")
        bad = [t for t in self.tests if "::" not in t or not t.split("::", 1)[0].endswith(".py")]
        if bad:
            raise ValueError(f"claim tests {bad}: expected 'tests/<dir>/<file>.py::<test function>'")


def _yes(*tests: str) -> Claim:
    return Claim(YES, tests)


def _no(*tests: str) -> Claim:
    return Claim(NO, tests)


# Where a bitwise claim can be verified: field of BitwiseClaims -> (short label, what is compared, test dir).
PLATFORMS: dict[str, tuple[str, str, str | None]] = {
    "cpu_fp32": ("CPU fp32", "Triton interpreter vs the pure-Paddle reference, fp32", "tests/single_card_tests/"),
    "gpu": ("GPU (torch)", "compiled Triton vs the eager torch op sequence on the H200 (bf16, fp32), no Paddle",
            "tests/gpu/"),
    "paddle_gpu": ("Paddle GPU", "unverified: no Paddle GPU build has run the tests", None),
}


@dataclass(frozen=True)
class BitwiseClaims:
    """``bitwise equal to the unfused path``, qualified by the platform where it was verified (see PLATFORMS)."""

    cpu_fp32: Claim = Claim()
    gpu: Claim = Claim()
    paddle_gpu: Claim = Claim()

    def items(self) -> list[tuple[str, Claim]]:
        return [(platform, getattr(self, platform)) for platform in PLATFORMS]

    def text(self) -> str:
        """``CPU fp32: yes, GPU (torch): yes, Paddle GPU: untested``."""
        return ", ".join(f"{PLATFORMS[p][0]}: {c.verdict}" for p, c in self.items())


CLAIMS_LEGEND = (
    "claims: 'yes' = verified by the tests fleet_ext.registry names; 'no' = does not hold, the tolerance applies; "
    "'untested' = no test yet; "
    + "; ".join(f"{label} = {what}" for label, what, _ in PLATFORMS.values())
)


# The layer-level test every CPU bitwise claim rests on (DESIGN.md rule 4); it covers each switch whose CPU claim
# is "yes" and fails if one is missing from its switch sets.
# Recompute leaves the loss and every gradient byte-equal with the switch on (full and selective policies).
_RECOMPUTE = "tests/single_card_tests/test_recompute.py::test_tiny_model_is_bitwise_equal_under_recompute"
# CP=2 against CP=1 under a real 2-rank launch with the switch on (logits and loss bitwise, gradients within the
# summation-order tolerance, the kernel's launches counted on every rank).
_CP = (
    "tests/multi_card_tests/test_context_parallel.py::test_logits_and_loss_are_bitwise_equal_to_one_process",
    "tests/multi_card_tests/test_context_parallel.py::test_fused_kernels_ran_under_context_parallelism",
)
_LAYER_BITWISE = (
    "tests/single_card_tests/test_fusion_layer_bitwise.py::test_attention_layer_is_bitwise_equal_with_the_fusion"
)
_EXPERTS_TEST = "tests/single_card_tests/test_fusion_moe_experts.py::"
_ROUTER_LOGITS = "tests/single_card_tests/test_moe_router_gemm.py::"
# Another GEMM (blocked fp32 sums in another order) cannot be bitwise to the reference's; measured errors:
# benchmarks/RESULTS.md (issue 14) and the tests the claims name.
EXPERTS_TOLERANCE = (
    "not bitwise (blocked fp32 GEMM sums in another order); weight gradients deterministic (byte-identical run to "
    "run, no atomics). fp32 (CPU interpreter, GPU): out and every gradient within 1e-5 of the largest entry vs "
    "float64; the tiny model's loss and every gradient vs the unfused path within 5e-5 relative (Frobenius, per "
    "tensor; measured <= 5e-6); bf16 (GPU): within 2e-2 relative (Frobenius) of float64 and of the eager torch "
    "mirror (measured at T = 8192 vs fp32: out 3.4e-3, input / weight1 gradients 6.4e-3; torch._grouped_mm 3.7e-3 / "
    "6.8e-3)"
)


@dataclass(frozen=True)
class Fusion:
    """One fusion: the switch, the two implementations and the claims the tests hold it to."""

    switch: str
    summary: str
    fused: str
    reference: str
    bitwise: BitwiseClaims = BitwiseClaims()
    tolerance: str | None = None  # why not bitwise, and the bound the tests use
    cp_safe: Claim = Claim()  # earned by a CP test with the switch on (CPU fp32, 2 gloo ranks)
    recompute_safe: Claim = Claim()  # earned by a recompute test with the switch on (CPU fp32, the tests' platform)
    landed: bool = True
    config_gate: Callable[[Any], str | None] = _never

    @property
    def bitwise_equal(self) -> bool:
        """Verified bitwise on CPU fp32, where CI runs the layer-level tests that select fusions by this."""
        return self.bitwise.cpu_fp32.verdict == YES

    def claims(self) -> list[tuple[str, Claim]]:
        """Every claim with its name: ``bitwise/<platform>``, ``cp_safe``, ``recompute_safe``."""
        return [(f"bitwise/{p}", c) for p, c in self.bitwise.items()] + [
            ("cp_safe", self.cp_safe), ("recompute_safe", self.recompute_safe)]

    def guarantee(self) -> str:
        """The qualified claim in one line, for the start-up table."""
        if self.bitwise_equal:
            head = f"bitwise equal to the reference ({self.bitwise.text()})"
        else:
            head = f"not bitwise ({self.bitwise.text()}); tolerance: {self.tolerance or 'none documented'}"
        recompute = self.recompute_safe.verdict + (" (CPU fp32)" if self.recompute_safe.verdict == YES else "")
        cp = self.cp_safe.verdict + (" (CPU fp32)" if self.cp_safe.verdict == YES else "")
        return f"{head}; CP-safe: {cp}; recompute-safe: {recompute}"

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
            recompute_safe=_yes(_RECOMPUTE),
            cp_safe=_yes(*_CP),
            fused="fleet_ext.ops.kv_idx_remap.function:local_to_global_flat",
            reference="fleet_ext.ops.kv_idx_remap.reference:local_to_global_flat",
            bitwise=BitwiseClaims(
                cpu_fp32=_yes("tests/single_card_tests/test_fusion_kv_idx_remap.py::test_matches_reference_and_oracle",
                              _LAYER_BITWISE),
                gpu=_yes("tests/gpu/test_kv_idx_remap_gpu.py::test_exact_vs_eager_and_oracle"),
            ),
        ),
        Fusion(
            switch="apply_rope_fusion",
            summary="partial interleaved RoPE (forward and inverse) on the trailing qk_pos_emb_head_dim channels",
            recompute_safe=_yes(_RECOMPUTE),
            cp_safe=_yes(*_CP),
            fused="fleet_ext.ops.rope.function:apply_partial_rope",
            reference="fleet_ext.ops.rope.reference:apply_partial_rope",
            bitwise=BitwiseClaims(
                cpu_fp32=_yes(
                    "tests/single_card_tests/test_fusion_rope.py::"
                    "test_forward_and_backward_are_bitwise_equal_to_the_reference",
                    _LAYER_BITWISE,
                ),
                gpu=_yes("tests/gpu/test_rope_gpu.py::test_forward_is_bitwise_equal_to_oracle_and_eager",
                         "tests/gpu/test_rope_gpu.py::test_gradient_is_bitwise_equal_to_autograd_and_oracle"),
            ),
        ),
        Fusion(
            switch="fuse_inv_rope_into_vha_postmix",
            summary="inverse RoPE fused into the ungrouped VHA postmix (no full-width rotated intermediate)",
            recompute_safe=_yes(_RECOMPUTE),
            cp_safe=_yes(*_CP),
            fused="fleet_ext.ops.inv_rope_postmix.function:inv_rope_vha_postmix",
            reference="fleet_ext.ops.inv_rope_postmix.reference:inv_rope_vha_postmix",
            bitwise=BitwiseClaims(
                cpu_fp32=_yes(
                    "tests/single_card_tests/test_fusion_inv_rope_postmix.py::"
                    "test_forward_and_gradients_are_bitwise_equal_to_the_reference",
                    _LAYER_BITWISE,
                ),
                gpu=_yes(
                    "tests/gpu/test_inv_rope_postmix_gpu.py::test_fused_forward_is_bitwise_equal_to_the_unfused_path",
                    "tests/gpu/test_inv_rope_postmix_gpu.py::"
                    "test_backward_pieces_are_bitwise_equal_to_autograd_of_the_unfused_path",
                ),
            ),
            config_gate=_inv_rope_postmix_gate,
        ),
        Fusion(
            switch="dsa_sink_grad_fusion",
            summary="attention-sink gradient d_sink = -sum p_sink * rowsum(dO o O), deterministic",
            recompute_safe=_yes(_RECOMPUTE),
            cp_safe=_yes(*_CP),
            fused="fleet_ext.ops.sink_grad.function:sparse_attention_fused_sink_grad",
            reference="fleet_ext.ops.sparse_attn.reference:sparse_attention_with_sink",
            bitwise=BitwiseClaims(
                cpu_fp32=_no(
                    "tests/single_card_tests/test_fusion_sink_grad.py::"
                    "test_attention_bitwise_except_d_sink_and_d_sink_vs_oracle",
                    "tests/single_card_tests/test_fusion_layer_bitwise.py::"
                    "test_sink_grad_fusion_matches_within_its_documented_tolerance",
                ),
                gpu=_no("tests/gpu/test_sink_grad_gpu.py::test_vs_oracle_and_eager"),
            ),
            tolerance="out, lse, dq, dkv bitwise; d_sink deterministic but summed in a fixed block order, not "
            "autograd's: |err| <= 1e-5 * sum p_sink * (sum_d |dO*O| + |d_lse|)",
        ),
        Fusion(
            switch="dsv4_q_rms_norm_fusion",
            summary="weightless per-head q RMS norm, forward and backward (1 / sqrt from correctly rounded ops, "
            "as the reference: position-independent, unlike Paddle CPU's rsqrt)",
            recompute_safe=_yes(_RECOMPUTE),
            cp_safe=_yes(*_CP),
            fused="fleet_ext.ops.q_rms_norm.function:q_rms_norm",
            reference="fleet_ext.ops.q_rms_norm.reference:q_rms_norm",
            bitwise=BitwiseClaims(
                cpu_fp32=_yes(
                    "tests/single_card_tests/test_fusion_q_rms_norm.py::test_bitwise_forward_and_backward_over_widths",
                    _LAYER_BITWISE,
                ),
                gpu=_yes("tests/gpu/test_q_rms_norm_gpu.py::test_forward_and_backward_bitwise_vs_eager_torch"),
            ),
        ),
        Fusion(
            switch="moe_permute_fusion",
            summary="MoE tokens to expert-contiguous rows (stable counting sort, offsets) and back with each token's "
            "weighted sum in row order: a gather, no atomics",
            fused="fleet_ext.ops.moe_permute.function:permute",
            reference="fleet_ext.ops.moe_permute.reference:permute",
            recompute_safe=_yes("tests/single_card_tests/test_fusion_moe_permute.py::"
                                "test_tiny_model_is_bitwise_equal_with_the_fusion_under_recompute"),
            cp_safe=_yes(*_CP),
            bitwise=BitwiseClaims(
                cpu_fp32=_yes(
                    "tests/single_card_tests/test_fusion_moe_permute.py::"
                    "test_forward_and_backward_are_bitwise_equal_to_the_reference",
                    "tests/single_card_tests/test_fusion_moe_permute.py::test_moe_layer_is_bitwise_equal_with_the_fusion",
                    "tests/single_card_tests/test_fusion_moe_permute.py::test_tiny_model_is_bitwise_equal_with_the_fusion",
                ),
                gpu=_no("tests/gpu/test_moe_permute_gpu.py::test_bitwise_vs_the_eager_mirror"),
            ),
            tolerance="GPU only: d_weights is a blocked fp32 sum over D (deterministic; not eager's order): "
            "|err| <= 1e-5 * sum_d |d_out * y| vs float64; rows, output, d_hidden and d_y bitwise vs eager",
            config_gate=_moe_gate,
        ),
        Fusion(
            switch="moe_router_fusion",
            summary="MoE routing from the scores: biased top-k (ties to the lowest expert id; Paddle's CPU top-k "
            "orders tied experts its own way, so the bitwise claim covers tie-free rows) or the hash lookup, "
            "renormalised scaled weights, per-expert counts; one forward and one backward kernel",
            fused="fleet_ext.ops.moe_router.function:route",
            reference="fleet_ext.ops.moe_router.reference:route",
            recompute_safe=_yes("tests/single_card_tests/test_fusion_moe_router.py::"
                                "test_tiny_model_is_bitwise_equal_with_the_fusion_under_recompute"),
            cp_safe=_yes(*_CP),
            bitwise=BitwiseClaims(
                cpu_fp32=_yes(
                    "tests/single_card_tests/test_fusion_moe_router.py::"
                    "test_forward_and_backward_are_bitwise_equal_to_the_reference",
                    "tests/single_card_tests/test_fusion_moe_router.py::test_moe_layer_is_bitwise_equal_with_the_fusion",
                    "tests/single_card_tests/test_fusion_moe_router.py::test_tiny_model_is_bitwise_equal_with_the_fusion",
                ),
                gpu=_yes("tests/gpu/test_moe_router_gpu.py::test_given_scores_bitwise_vs_the_eager_mirror",
                         "tests/gpu/test_moe_router_gpu.py::test_hash_routing_and_replayed_selection"),
            ),
            config_gate=_moe_router_gate,
        ),
        Fusion(
            switch="moe_router_logits_fusion",
            summary="the router's fp32 logits GEMM x W^T and its backward (d_x, d_W) as Triton kernels: bf16 hidden "
            "states are exact in bf16, so only W (and d_logits) are split into bf16 pieces, three tensor-core "
            "products per tile in a fresh fp32 accumulator (fp32 accurate); no fp32 copy of the hidden states; "
            "the weight gradient's token splits added in a fixed order (no atomics). On a GPU for bf16 hidden states "
            "only: fp32 / fp16 ones (the residual stream under O1 autocast) keep the reference's fp32 GEMM (the "
            "kernels' TF32x3 products measured 0.3-0.4x its backward); the CPU interpreter runs them for fp32 (IEEE)",
            fused="fleet_ext.ops.moe_router.function:router_logits",
            reference="fleet_ext.ops.moe_router.reference:router_logits",
            recompute_safe=_yes(_ROUTER_LOGITS + "test_tiny_model_under_recompute_is_bitwise_equal_to_no_recompute"),
            bitwise=BitwiseClaims(
                cpu_fp32=_no(_ROUTER_LOGITS + "test_kernels_are_fp32_accurate",
                             _ROUTER_LOGITS + "test_tiny_model_matches_the_unfused_path_within_tolerance"),
                gpu=_no("tests/gpu/test_moe_router_gemm_gpu.py::test_logits_and_backward_are_fp32_accurate"),
            ),
            tolerance="another summation order than the library's fp32 GEMM: logits and d_W at most 4x torch / "
            "Paddle fp32's largest error vs float64 on the same values (CPU interpreter; H200, bf16 and fp32 hidden "
            "states); d_x (in the hidden states' dtype) within one rounding of float64 plus 2^-14 of the sum of its "
            "terms' magnitudes; the tiny model's loss and gradients within 5e-5 relative (Frobenius) of the "
            "unfused path. Deterministic: byte-identical run to run (H200)",
            config_gate=_moe_gate,
        ),
        Fusion(
            switch="moe_expert_fusion",
            summary="grouped expert GEMMs over the expert-sorted rows (no padding to a capacity; tile map built on the "
            "device from the counts, no host read): gate+up with the clamped SwiGLU epilogue, down; backward with "
            "the SwiGLU backward in the d_h epilogue and deterministic weight gradients (fixed-order sums, no "
            "atomics); operands through TMA descriptors where widths allow (pointer loads otherwise); on Hopper, "
            "bf16/fp16 with small expert groups (< 512 rows per expert), the gate+up and the weight gradients run "
            "warp-specialised Gluon kernels (a TMA loader warp, two MMA warpgroups; byte-equal to the Triton kernels "
            "on the H200)",
            fused="fleet_ext.ops.moe_experts.function:experts",
            reference="fleet_ext.ops.moe_experts.reference:grouped_mlp",
            recompute_safe=_yes(_EXPERTS_TEST + "test_tiny_model_under_recompute_is_bitwise_equal_to_no_recompute"),
            bitwise=BitwiseClaims(
                cpu_fp32=_no(_EXPERTS_TEST + "test_forward_and_gradients_match_the_float64_oracle",
                             _EXPERTS_TEST + "test_tiny_model_matches_the_unfused_path_within_tolerance"),
                gpu=_no("tests/gpu/test_moe_experts_gpu.py::test_forward_and_gradients_vs_the_float64_oracle",
                        "tests/gpu/test_moe_experts_gpu.py::test_forward_and_gradients_vs_the_eager_torch_mirror"),
            ),
            tolerance=EXPERTS_TOLERANCE,
            config_gate=_moe_gate,
        ),
        Fusion(
            switch="use_fused_mhc",
            summary="mHC: the projection + RMS statistics split over K (one pass over the streams), then gates + "
            "Sinkhorn + pre collapse (the head: without Sinkhorn); the post/comb combine in one kernel; backward: "
            "gate gradients (the Sinkhorn backward's 2 x iterations - 1 states per token kept in registers), the "
            "streams' gradient with the parameter gradient's split sums (on Hopper with bf16 "
            "streams a Gluon kernel, both products as warp-group MMAs), the splits added in a fixed order (no atomics)",
            fused="fleet_ext.ops.mhc.function:mhc_pre",  # its module's `mhc_head` and `mhc_combine` come with it
            reference="fleet_ext.ops.mhc.reference:mhc_pre",
            recompute_safe=_yes(_MHC_TESTS + "test_tiny_model_under_recompute_is_bitwise_equal_to_no_recompute"),
            bitwise=BitwiseClaims(
                cpu_fp32=_no(_MHC_TESTS + "test_ops_match_the_reference_within_the_tolerance",
                             _MHC_TESTS + "test_tiny_model_matches_the_unfused_model_within_the_tolerance"),
                gpu=_no("tests/gpu/test_mhc_gpu.py::test_forward_vs_float64_oracle_and_eager",
                        "tests/gpu/test_mhc_gpu.py::test_gradients_vs_float64_autograd"),
            ),
            tolerance=_MHC_TOLERANCE,
            config_gate=_mhc_gate,
        ),
    )
}

@dataclass(frozen=True)
class DerivedFusion(Fusion):
    """A fusion without a switch of its own: ``switch`` names the op slot it fills, and it is used whenever every
    switch in ``requires`` is on (the fusions it merges); otherwise the slot is those switches' ops composed."""

    requires: tuple[str, ...] = ()
    gpu_withheld: str = ""  # why the GPU route keeps the composition (a failed GPU test); empty: used there too


_PROLOGUE = "tests/single_card_tests/test_fusion_qkv_prologue.py::"
_PROLOGUE_GPU = "tests/gpu/test_qkv_prologue_gpu.py::"
# q and kv take the prologue together: both need the norm switch and the RoPE switch (the kv norm has no switch of
# its own; its fusion comes with the q norm's, so apply_rope_fusion alone keeps meaning "the RoPE kernel only").
_PROLOGUE_SWITCHES = ("dsv4_q_rms_norm_fusion", "apply_rope_fusion")
DERIVED_FUSIONS: dict[str, DerivedFusion] = {
    f.switch: f
    for f in (
        DerivedFusion(
            switch="q_norm_rope",
            requires=_PROLOGUE_SWITCHES,
            summary="q prologue: per-head weightless RMS norm + RoPE on the pe channels in one pass, forward and "
            "backward (the q norm's correctly rounded 1 / sqrt)",
            fused="fleet_ext.ops.qkv_prologue.function:q_norm_rope",
            reference="fleet_ext.ops.qkv_prologue.reference:q_norm_rope",
            recompute_safe=_yes(_RECOMPUTE),
            cp_safe=_yes(*_CP),
            bitwise=BitwiseClaims(
                cpu_fp32=_yes(_PROLOGUE + "test_q_forward_and_backward_are_bitwise_equal_to_the_two_ops",
                              _PROLOGUE + "test_attention_layer_is_bitwise_equal_with_the_prologue"),
                gpu=_yes(_PROLOGUE_GPU + "test_q_bitwise_vs_eager_torch", _PROLOGUE_GPU + "test_production_shapes"),
            ),
        ),
        DerivedFusion(
            switch="kv_norm_rope",
            requires=_PROLOGUE_SWITCHES,
            summary="kv prologue: weighted RMSNorm + RoPE of the single K=V head in one pass, forward and backward; "
            "the gain's gradient as per-row-block partials of the backward launch plus one small fixed-order reduce "
            "(no atomics)",
            fused="fleet_ext.ops.qkv_prologue.function:kv_norm_rope",
            reference="fleet_ext.ops.qkv_prologue.reference:kv_norm_rope",
            recompute_safe=_yes(_RECOMPUTE),
            cp_safe=_yes(*_CP),
            bitwise=BitwiseClaims(
                cpu_fp32=_yes(_PROLOGUE + "test_kv_forward_and_backward_are_bitwise_equal_to_the_two_ops",
                              _PROLOGUE + "test_attention_layer_is_bitwise_equal_with_the_prologue"),
                gpu=_no(_PROLOGUE_GPU + "test_kv_vs_eager_torch_and_the_oracle"),
            ),
            tolerance="GPU only: the gain's gradient is summed over the rows in a fixed blocked order (deterministic, "
            "not torch's): |dw - dw64| <= 1e-5 * sum over rows |g * x * r| (fp32 and bf16 inputs); y and dx are held "
            "bitwise to the eager torch sequence by the same GPU test",
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
    "fp32 within 1e-5 relative of the reference, byte-identical run to run; CP-safe: yes (CPU fp32, "
    "tests/multi_card_tests/test_context_parallel.py, cases dsv4_triton, mla_sparse_triton, mla_warmup_triton)"
)


@dataclass(frozen=True)
class FusionMode:
    """A second implementation of a landed fusion, picked by a mode key (``<key>: <value>``), with its own claims.

    The key's default mode is the fusion's own ``FUSIONS`` entry (its claims describe that mode); a mode here
    replaces only the fused callable and says what holds instead of bitwise equality.
    """

    key: str
    value: str
    switch: str
    summary: str
    fused: str
    bitwise: BitwiseClaims
    tolerance: str
    deterministic: Claim = Claim()  # byte-identical run to run, earned by tests on the platforms they name

    def guarantee(self) -> str:
        """The qualified claim in one line, for the start-up table."""
        where = [label for label, _, tests_dir in PLATFORMS.values()
                 if tests_dir and any(t.startswith(tests_dir) for t in self.deterministic.tests)]
        det = self.deterministic.verdict + (f" ({', '.join(where)})" if self.deterministic.verdict == YES else "")
        return (f"{self.summary}; not bitwise ({self.bitwise.text()}); tolerance: {self.tolerance}; "
                f"byte-identical run to run: {det}")

    def load(self) -> Callable:
        module, _, name = self.fused.partition(":")
        return getattr(importlib.import_module(module), name)


# Mode keys: key -> (the fusion switch it refines, its default mode = that switch's FUSIONS entry).
MODE_KEYS: dict[str, tuple[str, str]] = {"inv_rope_postmix_mode": ("fuse_inv_rope_into_vha_postmix", "bitwise")}
_FAST = "tests/single_card_tests/test_fusion_inv_rope_postmix_fast.py::"
_FAST_GPU = "tests/gpu/test_inv_rope_postmix_gpu.py::"
FUSION_MODES: dict[tuple[str, str], FusionMode] = {
    (m.key, m.value): m
    for m in (
        FusionMode(
            key="inv_rope_postmix_mode",
            value="fast",
            switch="fuse_inv_rope_into_vha_postmix",
            summary="one-pass Triton kernels on [t, h, d] tiles, pe channels rotated in registers: forward 2 N of "
            "traffic, backward 3 N (dM split-K over tokens with a fixed-order reduction, dO with the RoPE in the "
            "epilogue)",
            fused="fleet_ext.ops.inv_rope_postmix.function:inv_rope_vha_postmix_fast",
            bitwise=BitwiseClaims(
                cpu_fp32=_no(_FAST + "test_forward_and_gradients_within_tolerance_of_reference_and_oracle",
                             _FAST + "test_tiny_model_with_the_fast_mode_matches_within_tolerance"),
                gpu=_no(_FAST_GPU + "test_fast_mode_within_tolerance_of_the_float64_oracle"),
            ),
            tolerance="Triton's GEMM order, not the library's: y, d_out, d_mix within 1e-5 x the sum of the "
            "magnitudes of their terms (fp32: CPU interpreter vs the reference and a float64 oracle, GPU vs float64); "
            "bf16 (GPU) vs a float64 oracle fed the operands the reference rounds (M and the rotated O in bf16): "
            "half a bf16 ulp of the value plus 1e-5 x that sum; the tiny model's logits and gradients within 1e-5 "
            "relative (Frobenius; the mHC gains, cancelling sums, 1e-4). Measured: CPU <= 3.2e-7 of the sum, the "
            "tiny model <= 4.9e-6; GPU: benchmarks/RESULTS.md",
            # GPU: tests/gpu/test_inv_rope_postmix_gpu.py::test_fast_backward_is_byte_identical_run_to_run, to be
            # named here once it has passed on the H200.
            deterministic=_yes(_FAST + "test_backward_is_byte_identical_run_to_run"),
        ),
    )
}


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
    contributions = config.fusion.sparse_attn_dkv_contribution_dtype
    uses_triton = "triton" in (config.fusion.csa_sparse_attn_backend, config.fusion.mqa_sparse_attn_backend)
    if contributions not in ("auto", "float32") and not uses_triton:
        errors.append(("sparse_attn_dkv_contribution_dtype", contributions,
                       "it sets the triton sparse-attention backward's dkv contributions, and neither sparse-attention "
                       "backend is triton", "set `csa_sparse_attn_backend: triton` (or `mqa_sparse_attn_backend`) or "
                       "`sparse_attn_dkv_contribution_dtype: auto`"))
    for key, (switch, default) in MODE_KEYS.items():
        value = getattr(config.fusion, key)
        if value != default and not getattr(config.fusion, switch):
            errors.append((key, value, f"it picks how `{switch}` runs, and that switch is off",
                           f"set `{switch}: true` or `{key}: {default}`"))
    return errors


def triton_switches(config: Any) -> list[tuple[str, Any]]:
    """(switch, value) for every switch of ``config`` that resolves to a Triton kernel."""
    on = [(s, True) for s, f in FUSIONS.items() if f.landed and getattr(config.fusion, s)]
    return on + [(s, "triton") for s in BACKENDS if getattr(config.fusion, s) == "triton"]


def check_capability(config: Any, cap: Any) -> None:
    """Raise ``ValueError`` if a switch that is on cannot run on a machine with capability ``cap``.

    The one gate for "can this machine run it": the backend provider calls it before resolving any slot,
    and the pretraining start-up calls it with the config checks, before any model is built or process
    group joined, so a job that cannot run fails at once with exit code 2. ``cap`` is a
    ``fleet_ext.capability.Capability``; nothing is imported or built here.
    """
    switches = triton_switches(config)
    reason = cap.triton_unusable_reason() if switches else None
    if reason is None:
        return
    keys = ", ".join(f"`{s}` = {v!r}" for s, v in switches)
    names = ", ".join(f"`{s}`" for s, _ in switches)
    raise ValueError(
        f"config key{'s' if len(switches) > 1 else ''} {keys} cannot run on this machine ({cap.describe()}): "
        f"{reason}. Fix: install what is missing or set {names} off"
    )
