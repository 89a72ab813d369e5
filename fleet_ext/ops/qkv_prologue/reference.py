"""The attention prologue as the separate ops it fuses, in pure Paddle: norm, then RoPE on the pe channels.

- q: the weightless per-head RMS norm (``fleet_ext.ops.q_rms_norm``), then the partial interleaved RoPE
  (``fleet_ext.ops.rope``);
- kv: the weighted RMSNorm of the single K=V head (``rms_norm`` below: the one definition of its arithmetic,
  which ``fleet_ext.layers.norm.RMSNorm`` runs too), then the same RoPE.

The composition takes the two ops as arguments, so the backend provider can hand a layer the composition of
whichever implementations it resolved for the separate switches (the unfused default of the prologue slots).
"""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.ops.q_rms_norm import reference as q_rms_norm_reference
from fleet_ext.ops.rope import reference as rope_reference


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last axis: fp32 compute, fp32 gain, cast back once."""
    xf = x.astype("float32")
    normed = xf * q_rms_norm_reference.inv_sqrt(xf.square().mean(axis=-1, keepdim=True) + eps)
    return (weight * normed).astype(x.dtype)


def q_norm_rope(
    q: paddle.Tensor, eps: float, cos: paddle.Tensor, sin: paddle.Tensor, *,
    q_rms_norm: Callable = q_rms_norm_reference.q_rms_norm, rope: Callable = rope_reference.apply_partial_rope,
) -> paddle.Tensor:
    """q [b, s, h, d]: ``rope(q_rms_norm(q, eps), cos, sin)``."""
    return rope(q_rms_norm(q, eps), cos, sin)


def kv_norm_rope(
    kv: paddle.Tensor, weight: paddle.Tensor, eps: float, cos: paddle.Tensor, sin: paddle.Tensor, *,
    rope: Callable = rope_reference.apply_partial_rope,
) -> paddle.Tensor:
    """kv [b, s, d], weight [d] fp32: ``rope(rms_norm(kv, weight, eps), cos, sin)``."""
    return rope(rms_norm(kv, weight, eps), cos, sin)
