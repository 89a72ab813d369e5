"""The Paddle RoPE reference's op sequence in eager torch (torch only: tests/gpu runs without Paddle).

``fleet_ext/ops/rope/reference.py`` op by op: ``x.float()``, ``even*cos - odd*sin`` / ``odd*cos + even*sin``
as separate ops (one rounding each, no FMA), stack, cast back, concatenate after the pass-through channels.
"""

from __future__ import annotations

from typing import Any


def eager_rope(x: Any, cos: Any, sin: Any, inverse: bool = False) -> Any:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of x [b, s, (h,) d]; cos/sin [s, rd/2] or [b, s, rd/2]."""
    import torch

    rope_dim = 2 * cos.shape[-1]
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if x.ndim == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if inverse:
        sin = -sin
    nope = x[..., : x.shape[-1] - rope_dim]
    rope = x[..., x.shape[-1] - rope_dim :].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).reshape(rope.shape)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
