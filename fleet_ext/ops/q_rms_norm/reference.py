"""Weightless RMS normalisation in pure Paddle: the per-head q norm of DSv4 (no learnable gain).

``rms_normalize`` is the one definition of the weightless normalisation's arithmetic; the layers use it
too (``fleet_ext.layers.norm`` re-exports it: layers import ops, never the reverse). ``inv_sqrt`` is the one
definition of the norms' ``1 / sqrt(mean(x^2) + eps)`` (the weighted ``qkv_prologue.reference.rms_norm`` takes
it too).
"""

from __future__ import annotations

import paddle


def inv_sqrt(v: paddle.Tensor) -> paddle.Tensor:
    """``1 / sqrt(v)`` for fp32 ``v``, correctly rounded twice (``fl(1 / fl(sqrt(v)))``), whatever ``v``'s length.

    Why not ``paddle.rsqrt``: on the CPU it is Eigen's ``rsqrtps`` estimate plus a Newton step on the vectorised
    part of a tensor and ``1/sqrt`` on the scalar tail, so an element's bits depend on its place in the tensor, and
    a context-parallel rank's ``[.., 1]`` statistics (shorter than one process's) got other bits. Paddle CPU's fp32
    ``sqrt`` is position-dependent the same way, and its fp32 ``divide`` is deterministic but not correctly
    rounded; its fp64 ``sqrt`` and fp32 ``reciprocal`` are IEEE (measured on Paddle 3.3.1 CPU,
    ``tests/single_card_tests/test_inv_sqrt.py``). An fp32 square root rounded from the fp64 one is the correctly
    rounded fp32 square root (53 >= 2 * 24 + 2 bits), so this is ``1 / sqrt_rn(v)`` in fp32: what a GPU kernel's
    ``div_rn(1, sqrt_rn(v))`` and torch's eager ``1 / torch.sqrt(v)`` on CUDA compute. Autograd: the reciprocal's
    ``-dout * out * out`` in fp32, the square root's ``0.5 * dout / out`` in fp64 (the fused kernels' Paddle
    gradient flavour reproduces both).
    """
    return paddle.reciprocal(paddle.sqrt(v.astype("float64")).astype("float32"))


def rms_normalize(x: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, computed in fp32 and cast back."""
    xf = x.astype("float32")
    return (xf * inv_sqrt(xf.square().mean(axis=-1, keepdim=True) + eps)).astype(x.dtype)


def q_rms_norm(q: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``q / sqrt(mean(q^2 over the head dim) + eps)`` for q [b, s, h, d]."""
    if q.ndim != 4:
        raise ValueError(f"q_rms_norm: `q` must be [b, s, h, d], got shape {q.shape}")
    return rms_normalize(q, eps)
