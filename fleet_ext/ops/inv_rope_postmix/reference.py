"""Unfused inverse RoPE followed by the ungrouped VHA postmix: ``M @ inv_rope(O)`` over the head axis."""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.ops.rope.reference import apply_partial_rope


def inv_rope_vha_postmix(
    out: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mix: paddle.Tensor, rope: Callable = apply_partial_rope
) -> paddle.Tensor:
    """out [b, s, h, d], mix [h, h] -> ``mix @ rope(out, inverse)`` [b, s, h, d] (full-width rotated intermediate)."""
    if out.ndim != 4 or mix.shape != [out.shape[2], out.shape[2]]:
        raise ValueError(f"inv_rope_vha_postmix: `out` [b, s, h, d] and `mix` [h, h] expected, got {out.shape}, "
                         f"{mix.shape}")
    return paddle.matmul(mix.astype(out.dtype), rope(out, cos, sin, inverse=True))
