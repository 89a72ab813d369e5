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
