"""Partial interleaved RoPE on the trailing channels, in pure Paddle (the unfused path).

Adjacent channel pairs (2i, 2i+1) of the last ``2 * cos.shape[-1]`` channels are rotated as complex
numbers; the leading (nope) channels pass through. ``inverse=True`` rotates by the negative angle,
which is what DSv4 applies to the attention output at the query position. The rotation is computed in
fp32 and cast back, out of place (recompute and autograd keep the input intact).
"""

from __future__ import annotations

import paddle


def apply_partial_rope(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, inverse: bool = False
) -> paddle.Tensor:
    """Rotate ``x[..., -rd:]`` of ``x`` [b, s, h, d] (or [b, s, d]) by cos/sin [s, rd/2] or [b, s, rd/2]."""
    if x.ndim not in (3, 4):
        raise ValueError(f"apply_partial_rope: `x` must be [b, s, h, d] or [b, s, d], got shape {x.shape}")
    if cos.ndim not in (2, 3) or (cos.ndim == 3 and cos.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"apply_partial_rope: `cos` must be [s, rd/2] or [b, s, rd/2] with b={x.shape[0]}, "
                         f"got shape {cos.shape}")
    half = cos.shape[-1]
    rope_dim = 2 * half
    if x.shape[-1] < rope_dim:
        raise ValueError(f"apply_partial_rope: `x` last dim {x.shape[-1]} is smaller than the rope width {rope_dim}")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_partial_rope: `cos` {cos.shape} and `sin` {sin.shape} differ")
    seq_axis = 1
    if x.shape[seq_axis] != cos.shape[-2]:
        raise ValueError(f"apply_partial_rope: `x` has {x.shape[seq_axis]} positions, `cos` has {cos.shape[-2]}")
    has_heads = x.ndim == 4
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if has_heads:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if inverse:
        sin = -sin
    nope = x[..., : x.shape[-1] - rope_dim]
    rope = x[..., x.shape[-1] - rope_dim :].astype("float32")
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rot_even = even * cos - odd * sin
    rot_odd = odd * cos + even * sin
    rotated = paddle.stack([rot_even, rot_odd], axis=-1).reshape(rope.shape).astype(x.dtype)
    return paddle.concat([nope, rotated], axis=-1)
