"""Fused attention prologue for Paddle: q norm + RoPE and kv norm + RoPE as PyLayers over ``kernel.py``.

``q_norm_rope`` / ``kv_norm_rope`` have the contracts of ``reference.py`` (the separate ops composed) and:

- **CPU (Triton interpreter), fp32**: bitwise equal to the composition, forward and backward, the kv gain's
  gradient included (Paddle CPU's sequential sum over the rows). The forward is the q norm's statistics
  launch, the reference's own ``inv_sqrt`` (``fleet_ext.ops.q_rms_norm.reference``: ``1 / sqrt`` from correctly
  rounded ops) on the ``[.., 1]`` statistics, and one apply launch that writes the rotated output; no RoPE
  launch. The backward is one launch.
- **GPU**: one forward launch; one backward launch for q, and for kv one plus a small launch adding the
  gain gradient's row segments. Where the one-pass kernels apply (and for kv the gain gradient is summed in the
  row programs) the forward writes only ``y`` and the backward recomputes ``r`` from ``x`` with the forward's
  code (``kernel.recomputes_r``; tests compare that ``r`` with the forward's byte for byte). Orders and
  flavours are torch CUDA's (``tests/gpu/test_qkv_prologue_gpu.py`` compares with the eager torch op
  sequence); the gain's gradient is summed in a fixed blocked order (deterministic), not torch's, so it is
  held to a tolerance (the registry says which and why).

``cos``/``sin`` are constants (no gradient), as in the fused RoPE. bf16/fp16 need a GPU (the interpreter's
bf16 rounding is wrong), so the CPU path accepts fp32 only.
"""

from __future__ import annotations

import numbers

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel imports

from fleet_ext.ops.q_rms_norm import kernel as q_kernel  # noqa: E402
from fleet_ext.ops.q_rms_norm.reference import inv_sqrt  # noqa: E402
from fleet_ext.ops.qkv_prologue import kernel  # noqa: E402
from fleet_ext.ops.rope import function as rope_function  # noqa: E402


def _forward(ctx, x: paddle.Tensor, weight: paddle.Tensor | None, eps: float, cos, sin) -> paddle.Tensor:
    """The forward of both PyLayers: statistics + the reference's 1 / sqrt + apply on the CPU, one fused launch on a
    GPU."""
    order = kernel.default_order(x)
    if order.flavor == q_kernel.FLAVOR_PADDLE:
        x4 = x if x.ndim == 4 else x.unsqueeze(2)
        ms = q_kernel.q_rms_norm_stats(x4, order).reshape(kernel._rows_shape(x))
        r = inv_sqrt(ms + eps)  # the reference's own 1 / sqrt on its [.., 1] tensor
        y = kernel.norm_rope_apply(x, r, cos, sin, weight)
    else:  # r None where the backward recomputes it (one output: one allocation less per call)
        y, r = kernel.norm_rope_fused(x, eps, cos, sin, weight, order, keep_r=False)
    if r is None:
        ctx.save_for_backward(x)
    else:
        ctx.save_for_backward(x, r)
    ctx.cos, ctx.sin, ctx.order, ctx.eps = cos, sin, order, eps  # constant tables ride on ctx (as in the fused RoPE)
    return y


def _saved(ctx) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """(x, r) as the forward saved them; r None where the backward recomputes it."""
    saved = ctx.saved_tensor()
    return saved[0], saved[1] if len(saved) > 1 else None


class _QNormRope(PyLayer):
    @staticmethod
    def forward(ctx, q, eps, cos, sin):
        return _forward(ctx, q, None, eps, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        q, r = _saved(ctx)
        dq, _ = kernel.norm_rope_bwd(dy, q, r, ctx.cos, ctx.sin, order=ctx.order, eps=ctx.eps)
        return dq, None, None


class _KVNormRope(PyLayer):
    @staticmethod
    def forward(ctx, kv, weight, eps, cos, sin):
        ctx.weight, ctx.need_w = weight, not weight.stop_gradient
        return _forward(ctx, kv, weight, eps, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        kv, r = _saved(ctx)
        dkv, dw = kernel.norm_rope_bwd(dy, kv, r, ctx.cos, ctx.sin, ctx.weight, order=ctx.order, eps=ctx.eps)
        return dkv, dw if ctx.need_w else None, None, None


def _check(x: paddle.Tensor, eps: float, cos, sin, weight, fn: str) -> None:
    if not isinstance(x, paddle.Tensor):
        raise ValueError(f"{fn}: `x` must be a paddle.Tensor, got {type(x).__name__}")
    kernel.check_args(x, cos, sin, weight, fn)
    if kernel.is_interpreted() and x.dtype != paddle.float32:
        raise ValueError(f"{fn}: `x` must be float32 on CPU (the Triton interpreter's bf16/fp16 rounding is wrong; "
                         f"use a GPU), got {x.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"{fn}: `eps` must be a float >= 0, got {eps!r}")
    rope_function.check_tables(cos, sin, fn)


def q_norm_rope(q: paddle.Tensor, eps: float, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """q [b, s, h, d]: the per-head weightless RMS norm, then RoPE on the trailing ``2 * cos.shape[-1]`` channels."""
    _check(q, eps, cos, sin, None, "q_norm_rope")
    return _QNormRope.apply(q, float(eps), cos, sin)


def kv_norm_rope(
    kv: paddle.Tensor, weight: paddle.Tensor, eps: float, cos: paddle.Tensor, sin: paddle.Tensor
) -> paddle.Tensor:
    """kv [b, s, d]: the RMSNorm with fp32 gain ``weight`` [d], then RoPE on the trailing channels."""
    _check(kv, eps, cos, sin, weight, "kv_norm_rope")
    return _KVNormRope.apply(kv, weight, float(eps), cos, sin)
