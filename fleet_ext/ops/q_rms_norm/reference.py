"""Weightless per-head RMS norm of the DSv4 query (no learnable gain)."""

from __future__ import annotations

import paddle

from fleet_ext.layers.norm import rms_normalize


def q_rms_norm(q: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``q / sqrt(mean(q^2 over the head dim) + eps)`` for q [b, s, h, d]."""
    if q.ndim != 4:
        raise ValueError(f"q_rms_norm: `q` must be [b, s, h, d], got shape {q.shape}")
    return rms_normalize(q, eps)
