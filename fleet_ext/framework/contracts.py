"""Slot contracts: the callables a layer receives from the composition floor (``fleet_ext.specs``).

Layers are built against these and never learn which implementation (pure Paddle reference or fused
Triton kernel) fills a slot: the backend provider decides once, at build time (DESIGN.md rule 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionOps:
    """The callables a DSv4 or hybrid-MLA attention layer uses."""

    rope: Callable
    q_rms_norm: Callable
    sparse_attn: Callable  # DSv4 CSA / HCA / window / full-causal cores (csa_sparse_attn_backend)
    inv_rope_postmix: Callable
    # latent MQA of the -2 layers (mqa_sparse_attn_backend); ``idx=None`` is the dense causal mode of the
    # full-causal / warm-up phases: query i (global position ``q_offset + i``) sees keys 0 .. q_offset + i.
    mqa_sparse_attn: Callable
    # the warm-up KL's target, ``(q, kv, lse, scale, q_offset, n_cols, d_v=) -> [b, s, n_cols]`` fp32 (no gradient):
    # the dense causal attention's probabilities summed over heads (mqa_sparse_attn_backend); None: the reference.
    mqa_causal_probs: Callable | None = None
    # The attention prologue (``fleet_ext.ops.qkv_prologue``): ``q_norm_rope(q [b, s, h, d], eps, cos, sin)`` is
    # ``rope(q_rms_norm(q, eps))`` and ``kv_norm_rope(kv [b, s, d], weight [d], eps, cos, sin)`` is
    # ``rope(rms_norm(kv, weight, eps))``; the provider always fills them: with the one-kernel fusion when the
    # switches it needs are on, else with the composition of the slots above (a DSv4 layer refuses None).
    q_norm_rope: Callable | None = None
    kv_norm_rope: Callable | None = None


@dataclass(frozen=True)
class MoEOps:
    """The callables a MoE layer uses (``moe_permute_fusion``, ``moe_router_fusion``, ``moe_expert_fusion``).

    ``permute(hidden [T, D], indices [T, k], num_experts, check_range=True) -> (rows [T*k, D] grouped by expert,
    plan)`` and ``unpermute(y [T*k, D], weights [T, k], plan) -> [T, D]``; the plan is opaque to the layer and goes
    from one to the other unchanged (each implementation has its own) except for ``plan.counts``: [E] int64 rows
    per expert, on the device, which every plan carries for the grouped expert compute. ``check_range=False``: the
    caller checks that ``indices`` lie in [0, num_experts) itself (the MoE layer, in its one host read) before it
    uses the result, and the permute must not read the host for it nor go out of bounds on a bad id.
    """

    permute: Callable
    unpermute: Callable
    # ``moe_router_fusion``: ``router(scores, bias, topk, norm_topk_prob, scaling, indices=, table=, ids=) ->
    # (weights, indices, counts)``; None: the routers' own (reference) maths.
    router: Callable | None = None
    # ``moe_router_logits_fusion``: ``router_logits(hidden [T, D], weight [E, D] fp32) -> logits [T, E] fp32`` (the
    # GEMM before the score function); None: the reference's fp32 GEMM.
    router_logits: Callable | None = None
    # ``moe_expert_fusion`` slot: ``experts(rows [N, D], counts [E] int64 on the device, weight1 [E, D, 2I],
    # weight2 [E, I, D], limit, recompute_activation) -> [N, D]``: one clamped-SwiGLU expert per contiguous
    # segment of expert-sorted rows (segment e has ``counts[e]`` rows); None: the reference grouped MLP.
    experts: Callable | None = None


@dataclass(frozen=True)
class MHCOps:
    """The callables of the mHC hyper-connections (``use_fused_mhc``); arguments and results as
    ``fleet_ext.ops.mhc.reference``:

    ``pre(streams [b, s, n, D], fn, base, scale, iterations, eps, norm_eps) -> (post [b, s, n], comb [b, s, n, n],
    collapsed [b, s, D])``; ``head(streams, fn, base, scale, eps, norm_eps) -> [b, s, D]``;
    ``combine(streams, block_out [b, s, D], post, comb) -> streams' [b, s, n, D]``.
    """

    pre: Callable
    head: Callable
    combine: Callable
