"""Weightless RMS normalisation in pure Paddle: the per-head q norm of DSv4 (no learnable gain).

``rms_normalize`` is the one definition of the weightless normalisation's arithmetic; the layers use it
too (``fleet_ext.layers.norm`` re-exports it: layers import ops, never the reverse).
"""

from __future__ import annotations

import paddle


def rms_normalize(x: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, computed in fp32 and cast back."""
    xf = x.astype("float32")
    return (xf * paddle.rsqrt(xf.square().mean(axis=-1, keepdim=True) + eps)).astype(x.dtype)


def q_rms_norm(q: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``q / sqrt(mean(q^2 over the head dim) + eps)`` for q [b, s, h, d]."""
    if q.ndim != 4:
        raise ValueError(f"q_rms_norm: `q` must be [b, s, h, d], got shape {q.shape}")
    return rms_normalize(q, eps)
