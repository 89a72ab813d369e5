"""Fused weightless per-head q RMS norm for Paddle: a PyLayer over the Triton kernels (``kernel.py``).

``q_rms_norm(q, eps)`` has the reference's contract (``reference.py``: q [b, s, h, d] float, fp32 compute,
output in q's dtype) and these guarantees:

- **CPU (Triton interpreter), fp32**: bitwise equal to the reference, forward and backward (the backward
  being Paddle autograd of ``xf * inv_sqrt(mean(xf^2) + eps)``, ``reference.inv_sqrt``: ``1 / sqrt`` from
  correctly rounded ops, position-independent). The kernels sum in Paddle CPU's order (one sequential fp32 sum
  per row) and reproduce its gradient formula op for op (the square root's in fp64, as the reference takes it);
  ``r`` itself is the reference's ``inv_sqrt`` on the ``[b, s, h, 1]`` statistics. So the forward is two kernel
  launches around three tiny Paddle ops, the backward one launch (which sums ``x^2`` again: the gradient needs
  ``sqrt(ms + eps)``).
- **GPU**: one forward kernel and one backward kernel in torch CUDA's reduction order and gradient
  formulas (``kernel.torch_cuda_order``, torch 2.11's Reduce.cuh); bitwise against the eager torch op
  sequence (y, r and dx, bf16 and fp32, the production shape included) is what the H200 tests check and
  pass (``tests/gpu/test_q_rms_norm_gpu.py``, torch 2.11.0+cu130). Where the one-pass kernels apply (head
  dim up to 1024 at 32 lanes) the forward writes only ``y`` and the backward recomputes ``r`` from ``q`` with
  the forward's code (``kernel.recomputes_r``; the tests compare that ``r`` with the forward's byte for
  byte). Against Paddle GPU's own eager ops it is unverified (no Paddle GPU machine here), so no bitwise
  claim is made for Paddle GPU.

bf16/fp16 need a GPU: the interpreter's bf16 rounding is wrong, so the CPU path accepts fp32 only.
"""

from __future__ import annotations

import numbers

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel import

from fleet_ext.ops.q_rms_norm import kernel  # noqa: E402
from fleet_ext.ops.q_rms_norm.reference import inv_sqrt  # noqa: E402


class _QRMSNorm(PyLayer):
    @staticmethod
    def forward(ctx, q, eps):
        order = kernel.default_order(q)
        if order.flavor == kernel.FLAVOR_PADDLE:
            ms = kernel.q_rms_norm_stats(q, order)
            r = inv_sqrt(ms + eps)  # the reference's own 1 / sqrt on its [b, s, h, 1] tensor
            y = kernel.q_rms_norm_apply(q, r)
        else:  # r None where the backward recomputes it (one output: one allocation less per call)
            y, r = kernel.q_rms_norm_fused(q, eps, order, keep_r=False)
        if r is None:
            ctx.save_for_backward(q)
        else:
            ctx.save_for_backward(q, r)
        ctx.order, ctx.eps = order, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensor()
        r = saved[1] if len(saved) > 1 else None
        return kernel.q_rms_norm_bwd(dy, saved[0], r, ctx.order, eps=ctx.eps)


def q_rms_norm(q: paddle.Tensor, eps: float) -> paddle.Tensor:
    """``q / sqrt(mean(q^2 over the head dim) + eps)`` for q [b, s, h, d] (any strides); fp32 compute."""
    if not isinstance(q, paddle.Tensor):
        raise ValueError(f"q_rms_norm: `q` must be [b, s, h, d] float paddle.Tensor, got {type(q).__name__}")
    kernel.check_q(q)
    if kernel.is_interpreted() and q.dtype != paddle.float32:
        raise ValueError(f"q_rms_norm: `q` must be [b, s, h, d] float32 on CPU (the Triton interpreter's "
                         f"bf16/fp16 rounding is wrong; use a GPU), got {q.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"q_rms_norm: `eps` must be a float >= 0, got {eps!r}")
    return _QRMSNorm.apply(q, float(eps))
