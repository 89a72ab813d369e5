"""The storages the recompute formula traces (``T``, ``Trace``) and the config widths it reads (``Shapes``).

Split out of ``scripts/bench/recompute_formula.py`` (which prices each module's saves with them) to keep that file
within the 600-line limit; see its docstring for the accounting rules.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fleet_ext.layer_kinds import LayerKind, kinds_of  # noqa: E402

BYTES = {"fp32": 4, "bf16": 2, "int64": 8, "int32": 4, "bool": 1, "fp64": 8}
F32, I64, I32, BOOL, F64 = "fp32", "int64", "int32", "bool", "fp64"


@dataclass(frozen=True)
class T:
    """One storage: a name unique within its layer, its element count and dtype."""

    name: str
    numel: int
    dtype: str


@dataclass
class Trace:
    """The storages autograd keeps, in first-saved order; ``act`` is the activation dtype ("fp32" or "bf16")."""

    act: str
    saved: dict[str, T] = field(default_factory=dict)
    depth: int = 0  # > 0 inside a recomputed segment: nothing is saved but its inputs and its decisions
    _count: int = 0

    def new(self, name: str, numel: int, dtype: str) -> T:
        self._count += 1
        return T(f"{name}#{self._count}", numel, dtype)

    def save(self, *tensors: T | None) -> None:
        if self.depth:
            return
        for t in tensors:
            if t is not None and t.numel:
                self.saved.setdefault(t.name, t)

    def decide(self, t: T) -> T:
        """A decision recorded for replay: kept while a recomputed segment waits for its re-run."""
        if self.depth:
            self.saved.setdefault(t.name, t)
        return t

    def cast(self, t: T, dtype: str, numel: int | None = None, name: str | None = None) -> T:
        """``astype``: the same storage when the dtype does not change, else a new one (``numel`` when only a slice
        of ``t`` is cast)."""
        if t.dtype == dtype:
            return t
        return self.new(name or f"{t.name.split('#')[0]}:{dtype}", numel or t.numel, dtype)

    def segment(self, enabled: bool, fn: Callable[..., Any], *args: Any) -> Any:
        """``maybe_checkpointed``: under recompute keep the tensor inputs and run ``fn`` saving nothing."""
        if not enabled or self.depth:
            return fn(*args)
        self.save(*(a for a in args if isinstance(a, T)))
        self.depth += 1
        try:
            return fn(*args)
        finally:
            self.depth -= 1


def promote(*tensors: T) -> str:
    return F32 if any(t.dtype == F32 for t in tensors) else tensors[0].dtype


@dataclass(frozen=True)
class Shapes:
    """The widths the formula needs, read from a loaded config (``Shapes.of``), and the run's batch and length."""

    b: int
    s: int
    D: int
    h: int
    d: int
    rope: int
    q_lora: int
    groups: int
    o_rank: int
    n: int
    iters: int
    E: int
    topk_experts: int
    ffn: int
    shared_F: int
    dense_F: int
    vocab: int
    idx_topk: int
    idx_heads: int
    idx_d: int
    kl: bool  # the CSA indexer KL loss runs (dsa_indexer_loss_coeff > 0)
    mtp: int  # MTP depths (num_nextn_predict_layers)
    vha: bool
    seq_aux: bool
    scoring: str
    norm_topk: bool
    clamp: bool
    dense_csa: bool
    fusion: dict

    @classmethod
    def of(cls, config: Any, batch: int, seq: int) -> Shapes:
        m, moe, f = config.model, config.moe, config.fusion
        if not m.enable_hyper_connections or m.vha_postmix_grouped:
            raise ValueError("recompute_formula models mHC on and the ungrouped VHA postmix (or none): set "
                             "enable_hyper_connections: true and vha_postmix_grouped: false")
        if any(kind is LayerKind.HYBRID_MLA for kind in kinds_of(m)):
            raise ValueError("recompute_formula does not model -2 (hybrid-MLA) layers yet (nor the dense causal "
                             "Triton mode only they run): set csa_compress_ratios without -2")
        if config.parallel.context_parallel_size > 1:
            raise ValueError("recompute_formula models one rank holding whole sequences: context_parallel_size: 1 "
                             "(pass the per-rank length as the sequence length)")
        return cls(
            b=batch, s=seq, D=m.hidden_size, h=m.num_attention_heads, d=m.v_head_dim, rope=m.qk_pos_emb_head_dim,
            q_lora=m.q_lora_rank, groups=m.o_groups, o_rank=m.o_lora_rank, n=m.num_residual_streams,
            iters=m.mhc_sinkhorn_iterations, E=moe.n_routed_experts, topk_experts=moe.num_experts_per_tok,
            ffn=moe.moe_intermediate_size, shared_F=moe.n_shared_experts * moe.moe_intermediate_size,
            dense_F=moe.intermediate_size, vocab=m.vocab_size, idx_topk=m.dsa_index_topk, idx_heads=m.dsa_index_n_heads,
            idx_d=m.dsa_index_head_dim, kl=m.dsa_indexer_loss_coeff > 0, mtp=m.num_nextn_predict_layers,
            vha=m.use_vha_attention,
            seq_aux=moe.moe_router_load_balancing_type == "seq_aux_loss", scoring=moe.scoring_func,
            norm_topk=moe.norm_topk_prob, clamp=moe.swiglu_limit > 0, dense_csa=m.csa_dense_mode,
            fusion={"rope": f.apply_rope_fusion, "q_rms": f.dsv4_q_rms_norm_fusion, "sink": f.dsa_sink_grad_fusion,
                    "backend": f.csa_sparse_attn_backend, "router": f.moe_router_fusion,
                    "permute": f.moe_permute_fusion, "experts": f.moe_expert_fusion, "mhc": f.use_fused_mhc,
                    "inv_rope_postmix": f.fuse_inv_rope_into_vha_postmix and f.inv_rope_postmix_mode},
        )

    @property
    def tokens(self) -> int:
        return self.b * self.s
