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
    mqa_sparse_attn: Callable  # latent MQA of the -2 layers (mqa_sparse_attn_backend)


@dataclass(frozen=True)
class MoEOps:
    """The callables a MoE layer uses (``moe_permute_fusion``, ``moe_router_fusion``).

    ``permute(hidden [T, D], indices [T, k], num_experts) -> (rows [T*k, D] grouped by expert, plan)`` and
    ``unpermute(y [T*k, D], weights [T, k], plan) -> [T, D]``; the plan is opaque to the layer and goes from
    one to the other unchanged (each implementation has its own).
    """

    permute: Callable
    unpermute: Callable
    # ``moe_router_fusion``: ``router(scores, bias, topk, norm_topk_prob, scaling, indices=, table=, ids=) ->
    # (weights, indices, counts)``; None: the routers' own (reference) maths.
    router: Callable | None = None
