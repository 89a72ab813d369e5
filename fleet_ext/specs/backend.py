"""The backend provider: reads the fusion switches once, at build time, and hands layers their ops.

Each op slot gets the pure-Paddle reference or the fused Triton callable named in
``fleet_ext.registry``. A switch that is on but cannot run on this machine (no Triton, no torch for the
interpreter, too old a GPU) raises here, naming the switch, the reason and the fix; on a CPU machine
the kernels run in the Triton interpreter. The resolved table (switch -> backend -> reason) is kept
for the start-up printout (DESIGN.md rules 2 and 3).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from fleet_ext import capability
from fleet_ext.config import FleetExtConfig
from fleet_ext.framework.contracts import AttentionOps, MHCOps, MoEOps
from fleet_ext.layers.mqa_latent_attention import dense_causal_through_table
from fleet_ext.registry import (
    BACKEND_GUARANTEE,
    CLAIMS_LEGEND,
    DERIVED_FUSIONS,
    FUSION_MODES,
    FUSIONS,
    MODE_KEYS,
    PLATFORMS,
    check_capability,
)


@dataclass(frozen=True)
class ResolvedSwitch:
    """One row of the start-up table: a switch, the backend it resolved to, and why."""

    switch: str
    value: object
    backend: str
    reason: str


class BackendProvider:
    """Resolves every op slot from the config and the machine's capability; built once per model."""

    def __init__(self, config: FleetExtConfig, cap: capability.Capability | None = None) -> None:
        self.config = config
        self.capability = cap or capability.detect()
        check_capability(config, self.capability)  # the same gate the pretraining start-up runs (exit 2)
        self._rows: list[ResolvedSwitch] = []
        rope = self._resolve("apply_rope_fusion")
        q_norm = self._resolve("dsv4_q_rms_norm_fusion")
        remap = self._resolve("sparse_attn_global_kv_idx_remap_fusion")
        sparse = self._resolve("dsa_sink_grad_fusion")
        inv_rope_postmix = self._resolve_mode("inv_rope_postmix_mode", self._resolve("fuse_inv_rope_into_vha_postmix"))
        mhc_pre = self._resolve("use_fused_mhc")  # its module's `mhc_head` and `mhc_combine` come with it
        mhc = importlib.import_module(mhc_pre.__module__)
        self.mhc_ops = MHCOps(pre=mhc_pre, head=mhc.mhc_head, combine=mhc.mhc_combine)
        permute = self._resolve("moe_permute_fusion")  # its module's `unpermute` is the inverse, resolved with it
        router = self._resolve("moe_router_fusion")  # off: the routers' own maths (the reference's op sequence)
        router_logits = self._resolve("moe_router_logits_fusion")  # off: the reference's fp32 GEMM
        experts = self._resolve("moe_expert_fusion")  # off: the experts layer's own grouped MLP (the reference)
        if config.fusion.moe_expert_fusion:
            self._note_hopper_experts()
        self.moe_ops = MoEOps(permute=permute, unpermute=importlib.import_module(permute.__module__).unpermute,
                              router=router if config.fusion.moe_router_fusion else None,
                              router_logits=router_logits,
                              experts=experts if config.fusion.moe_expert_fusion else None)
        reference_sparse = functools.partial(sparse, remap=remap)
        self.attention_ops = AttentionOps(
            rope=rope,
            q_rms_norm=q_norm,
            sparse_attn=self._sparse_backend("csa_sparse_attn_backend", reference_sparse, remap),
            inv_rope_postmix=functools.partial(inv_rope_postmix, rope=rope),
            mqa_sparse_attn=self._sparse_backend(
                "mqa_sparse_attn_backend", dense_causal_through_table(reference_sparse), remap),
            mqa_causal_probs=self._causal_probs(),
            q_norm_rope=self._derived("q_norm_rope", q_rms_norm=q_norm, rope=rope),
            kv_norm_rope=self._derived("kv_norm_rope", rope=rope),
        )
        uses_triton = "triton" in (config.fusion.csa_sparse_attn_backend, config.fusion.mqa_sparse_attn_backend)
        backward = "deterministic Triton backward" if uses_triton else "unused (unfused backends: autograd)"
        self._rows.append(ResolvedSwitch("mqa_sparse_attn_backward_backend",
                                         config.fusion.mqa_sparse_attn_backward_backend, backward,
                                         "the only backward built: atomic-free, byte-identical run to run"))
        contributions = config.fusion.sparse_attn_dkv_contribution_dtype
        self._rows.append(ResolvedSwitch(
            "sparse_attn_dkv_contribution_dtype", contributions,
            "the Triton backward's per-pair dkv contributions, summed in fp32" if uses_triton else "unused",
            "auto: float24 (16 significant bits) for bf16/fp16 runs, float32 for fp32 ones; float24 backward "
            "1.06-1.17x on the H200 at an unchanged dkv error, bfloat16 1.20-1.39x at 2.35e-3 -> 2.87e-3 "
            "(benchmarks/RESULTS.md)"))

    def _note_hopper_experts(self) -> None:
        """On Hopper the experts' gate+up and weight gradients take warp-specialised Gluon kernels for small expert
        groups (``moe_experts.kernel.ws_choice``): the start-up table says so on their row."""
        from fleet_ext.ops.moe_experts.kernel import SMALL_GROUP_ROWS, hopper_dtype

        if hopper_dtype("bfloat16") is None:
            row = self._rows[-1]
            self._rows[-1] = ResolvedSwitch(row.switch, row.value, row.backend + (
                f"; bf16/fp16 with < {SMALL_GROUP_ROWS} rows per expert: warp-specialised Gluon gate+up and weight "
                "gradient"), row.reason)

    def _sparse_backend(self, switch: str, reference: Callable, remap: Callable) -> Callable:
        """The gather-softmax reference, or the Triton sparse-attention kernel family (fwd + deterministic bwd)."""
        if getattr(self.config.fusion, switch) == "unfused":
            self._rows.append(ResolvedSwitch(switch, "unfused", "reference (pure Paddle)", "gather-softmax with sink"))
            return reference
        where = self._triton_target()
        from fleet_ext.ops.sparse_attn.function import sparse_attention_triton
        from fleet_ext.ops.sparse_attn.kernel_config import ws_forward_fits

        if ws_forward_fits("bfloat16", 512, 512) is None:  # Hopper: warp-specialised Gluon kernels
            where += ("; forward and the backward's dq: warp-specialised Gluon kernels (bf16/fp16, value width 512, "
                      "dq with 64-head tiles)")
        if switch == "csa_sparse_attn_backend":
            where += "; HCA layers: the window and entry slots' dkv summed key-major (band slots)"
        self._rows.append(ResolvedSwitch(switch, "triton", where, f"switch on; {BACKEND_GUARANTEE}"))
        return functools.partial(sparse_attention_triton, remap=remap,
                                 partial_dtype=self.config.fusion.sparse_attn_dkv_contribution_dtype)

    def _causal_probs(self) -> Callable:
        """The -2 warm-up KL's target: the Triton kernel (no [b, s, h, n] logits) or the Paddle reference."""
        if self.config.fusion.mqa_sparse_attn_backend == "unfused":
            from fleet_ext.ops.sparse_attn.reference import causal_attention_probs

            return causal_attention_probs
        from fleet_ext.ops.sparse_attn.function import causal_probs_triton

        return causal_probs_triton

    def _derived(self, slot: str, **ops: Callable) -> Callable:
        """A slot filled by a fusion of other switches' ops (``DERIVED_FUSIONS``): the fused kernel when every switch
        it needs is on, else the reference composition of the ops those switches resolved to."""
        fusion = DERIVED_FUSIONS[slot]
        needs = " and ".join(f"`{s}`" for s in fusion.requires)
        on = [getattr(self.config.fusion, s) for s in fusion.requires]
        if not all(on):
            backend = "reference (pure Paddle)" if not any(on) else "the separate ops, as resolved above"
            self._rows.append(ResolvedSwitch(slot, False, backend, f"used only when {needs} are on"))
            return functools.partial(fusion.load("reference"), **ops)
        if fusion.gpu_withheld and not self.capability.interpreter:
            self._rows.append(ResolvedSwitch(slot, False, "the separate ops, as resolved above", fusion.gpu_withheld))
            return functools.partial(fusion.load("reference"), **ops)
        where = self._triton_target()
        here = PLATFORMS["cpu_fp32" if self.capability.interpreter else "paddle_gpu"][0]
        reason = f"{needs} are on: one kernel instead of the two ops; {fusion.guarantee()}; here: {here}"
        self._rows.append(ResolvedSwitch(slot, True, where, reason))
        return fusion.load("fused")

    def _triton_target(self) -> str:
        """Prepare Triton (``check_capability`` has vouched that it runs here) and say where the kernels run."""
        cap = self.capability
        capability.prepare_triton(interpreter=cap.interpreter)
        return "Triton interpreter (CPU, slow)" if cap.interpreter else f"Triton sm{cap.sm[0]}{cap.sm[1]}"

    def _resolve_mode(self, key: str, resolved: Callable) -> Callable:
        """A mode key picks among implementations of its switch; its default keeps ``resolved`` (the switch's)."""
        switch, default = MODE_KEYS[key]
        value = getattr(self.config.fusion, key)
        if value == default:
            if getattr(self.config.fusion, switch):
                row = ResolvedSwitch(key, value, f"`{switch}` as registered",
                                     f"default mode; claims: the `{switch}` row")
            else:
                row = ResolvedSwitch(key, value, "reference (pure Paddle)", f"default mode; `{switch}` off")
            self._rows.append(row)
            return resolved
        mode = FUSION_MODES[(key, value)]  # config_errors vouched that the switch is on
        reason = f"replaces the bitwise path of the `{switch}` row: {mode.guarantee()}"
        self._rows.append(ResolvedSwitch(key, value, self._triton_target(), reason))
        return mode.load()

    def _resolve(self, switch: str) -> Callable:
        fusion = FUSIONS[switch]
        if not getattr(self.config.fusion, switch):
            self._rows.append(ResolvedSwitch(switch, False, "reference (pure Paddle)", "switch off (default)"))
            return fusion.load("reference")
        where = self._triton_target()
        here = PLATFORMS["cpu_fp32" if self.capability.interpreter else "paddle_gpu"][0]
        self._rows.append(ResolvedSwitch(switch, True, where, f"switch on; {fusion.guarantee()}; here: {here}"))
        return fusion.load("fused")

    @property
    def resolved(self) -> list[ResolvedSwitch]:
        return list(self._rows)

    def format_table(self) -> str:
        """The start-up table: switch | value | backend | reason."""
        header = ("switch", "value", "backend", "reason")
        rows = [header] + [(r.switch, str(r.value), r.backend, r.reason) for r in self._rows]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join([*lines, CLAIMS_LEGEND])
