"""Fused weightless per-head q RMS norm for Paddle: a PyLayer over the Triton kernels (``kernel.py``).

``q_rms_norm(q, eps)`` has the reference's contract (``reference.py``: q [b, s, h, d] float, fp32 compute,
output in q's dtype) and these guarantees:

- **CPU (Triton interpreter), fp32**: bitwise equal to the reference, forward and backward (the backward
  being Paddle autograd of ``xf * rsqrt(mean(xf^2) + eps)``). The kernels sum in Paddle CPU's order (one
  sequential fp32 sum per row) and reproduce its gradient formula op for op; ``rsqrt(ms + eps)`` itself is
  taken from Paddle on the ``[b, s, h, 1]`` statistics (Paddle CPU's rsqrt is a vendor-specific,
  position-dependent approximation that no kernel can reproduce; see ``kernel.py``). So the forward is
  two kernel launches around two tiny Paddle ops, the backward one launch.
- **GPU**: one forward kernel and one backward kernel in torch CUDA's reduction order and gradient
  formulas (``kernel.torch_cuda_order``, torch 2.11's Reduce.cuh); bitwise against the eager torch op
  sequence (y, r and dx, bf16 and fp32, the production shape included) is what the H200 tests check and
  pass (``tests/gpu/test_q_rms_norm_gpu.py``, torch 2.11.0+cu130). Against Paddle GPU's own eager ops it is unverified
  (no Paddle GPU machine here), so no bitwise claim is made for Paddle GPU.

bf16/fp16 need a GPU: the interpreter's bf16 rounding is wrong, so the CPU path accepts fp32 only.
"""

from __future__ import annotations

import numbers

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel import

from fleet_ext.ops.q_rms_norm import kernel  # noqa: E402


class _QRMSNorm(PyLayer):
    @staticmethod
    def forward(ctx, q, eps):
        order = kernel.default_order(q)
        if order.flavor == kernel.FLAVOR_PADDLE:
            ms = kernel.q_rms_norm_stats(q, order)
            r = paddle.rsqrt(ms + eps)  # Paddle's own rsqrt on the reference's [b, s, h, 1] tensor
            y = kernel.q_rms_norm_apply(q, r)
        else:
            y, r = kernel.q_rms_norm_fused(q, eps, order)
        ctx.save_for_backward(q, r)
        ctx.order = order
        return y

    @staticmethod
    def backward(ctx, dy):
        q, r = ctx.saved_tensor()
        return kernel.q_rms_norm_bwd(dy, q, r, ctx.order)


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
