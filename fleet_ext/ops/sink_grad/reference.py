"""The attention-sink gradient in pure Paddle (the unfused op sequence the Triton kernel replaces).

With ``lse`` the sink-inclusive log-sum-exp of a row and ``p_sink = exp(sink_h - lse)`` the probability
the softmax gives the value-less sink column, the loss gradient for the sink logit is

    d_sink[h] = sum_{b,t} p_sink[b,t,h] * (d_lse[b,t,h] - Delta[b,t,h]),   Delta = rowsum(dO * O) over d,

because ``d out / d sink = -p_sink * out`` and ``d lse / d sink = p_sink``; without a gradient for ``lse``
(the usual case) it is ``-sum p_sink * Delta``. A row with no valid index has ``out = 0`` and contributes 0.
"""

from __future__ import annotations

import paddle


def sink_grad(
    d_out: paddle.Tensor,
    out: paddle.Tensor,
    lse: paddle.Tensor,
    sink: paddle.Tensor,
    d_lse: paddle.Tensor | None = None,
) -> paddle.Tensor:
    """d_out, out [B, S, H, d] (any float dtype), lse [B, S, H] fp32, sink [H] fp32 (+ d_lse) -> d_sink [H] fp32."""
    if out.ndim != 4:
        raise ValueError(f"sink_grad: `out` must be [B, S, H, d], got shape {out.shape}")
    if d_out.shape != out.shape:
        raise ValueError(f"sink_grad: `d_out` must have out's shape {out.shape}, got {d_out.shape}")
    if lse.shape != out.shape[:3] or lse.dtype != paddle.float32:
        raise ValueError(f"sink_grad: `lse` must be fp32 {out.shape[:3]}, got {lse.dtype} {lse.shape}")
    if sink.shape != [out.shape[2]] or sink.dtype != paddle.float32:
        raise ValueError(f"sink_grad: `sink` must be fp32 [{out.shape[2]}], got {sink.dtype} {sink.shape}")
    delta = (d_out.astype("float32") * out.astype("float32")).sum(axis=-1)  # [B, S, H]
    p_sink = paddle.exp(sink.reshape([1, 1, -1]) - lse)
    weight = -delta if d_lse is None else d_lse.astype("float32") - delta
    return (p_sink * weight).sum(axis=[0, 1])
