"""Fused partial interleaved RoPE for Paddle: an autograd PyLayer and an in-place variant.

``apply_partial_rope`` has the reference's contract (``reference.py``: same arguments, shapes and
validation errors) and is bitwise equal to it, forward and backward: the forward is the Triton kernel
out of place (what autograd and recompute need: the input stays intact), the backward the opposite
rotation of the gradient with pass-through nope channels, reproducing Paddle autograd's backward of the
reference to the bit (``kernel.rope_grad``). ``cos``/``sin`` are constants (no gradient flows to them).

``apply_partial_rope_`` rotates the trailing channels of ``x`` in place (same storage, nope channels
untouched) and records no autograd.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from fleet_ext.ops.rope import kernel


class _PartialRope(PyLayer):
    @staticmethod
    def forward(ctx, x, cos, sin, inverse):
        # Constant tables ride on ctx, not through save_for_backward: nothing to recompute or free (the tables
        # are cached per layout), and recompute's saved-tensor hooks never see them.
        ctx.cos, ctx.sin = cos, sin
        ctx.inverse = inverse
        return kernel.rope(x, cos, sin, inverse=inverse)

    @staticmethod
    def backward(ctx, grad):
        return kernel.rope_grad(grad, ctx.cos, ctx.sin, inverse=ctx.inverse), None, None


def check_tables(cos: paddle.Tensor, sin: paddle.Tensor, fn: str) -> None:
    """Refuse trainable rotary tables: the fused RoPE (and the ops built on it) treat them as constants."""
    if paddle.is_grad_enabled():
        for name, table in (("cos", cos), ("sin", sin)):
            if not table.stop_gradient:
                raise ValueError(f"{fn}: `{name}` requires a gradient, but the fused RoPE treats the rotary table "
                                 f"as a constant; detach it or use fleet_ext.ops.rope.reference")


def apply_partial_rope(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, inverse: bool = False
) -> paddle.Tensor:
    """Rotate ``x[..., -rd:]`` of ``x`` [b, s, h, d] (or [b, s, d]) by cos/sin [s, rd/2] or [b, s, rd/2]."""
    kernel.check_cached(x, cos, sin)  # the checks, once per layout (a plan lookup after that)
    check_tables(cos, sin, "apply_partial_rope")
    return _PartialRope.apply(x, cos, sin, bool(inverse))


def apply_partial_rope_(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, inverse: bool = False
) -> paddle.Tensor:
    """In place, no autograd: rotate the trailing rd channels of ``x`` (any strides); returns ``x``."""
    kernel.check_cached(x, cos, sin, "apply_partial_rope_")
    if paddle.is_grad_enabled() and not x.stop_gradient:
        raise ValueError("apply_partial_rope_: `x` requires a gradient, but the in-place RoPE records no autograd; "
                         "use apply_partial_rope (out of place) or run under paddle.no_grad()")
    return kernel.rope_(x, cos, sin, inverse=inverse)
