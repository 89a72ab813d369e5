"""Fused mHC for Paddle (``use_fused_mhc``): PyLayers over the Triton kernels (``kernel.py``).

``mhc_pre``, ``mhc_head`` and ``mhc_combine`` have the contracts of ``reference.py`` (same arguments, shapes
and output dtypes) with fp32 ``post`` / ``comb`` (what the layers produce) required by the combine. The pre op
(and the head) is two kernel launches forward (the split projection, then gates + collapse) and three backward
(per-token gradients, the streams' gradient with the parameter gradient's split sums, the sums added in a fixed
order); the combine is one each way (``kernel.py`` says why). Not bitwise equal to the reference
(``kernel.py`` says why); within the tolerance the registry documents, and deterministic: no atomics, so two
runs give the same bytes.

bf16/fp16 streams need a GPU: the Triton interpreter's bf16 rounding is wrong, so the CPU path takes fp32 only.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel import

from fleet_ext.ops.mhc import kernel  # noqa: E402


def _tokens(t: paddle.Tensor, width: list[int]) -> paddle.Tensor:
    """``t`` [b, s, *width] as a contiguous [b * s, *width] tensor (a view when it already is contiguous)."""
    t = t if t.is_contiguous() else t.contiguous()
    return t.reshape([-1, *width])


def _check_streams(streams: paddle.Tensor, fn: str) -> tuple[int, int, int, int]:
    if not isinstance(streams, paddle.Tensor) or streams.ndim != 4:
        got = list(streams.shape) if isinstance(streams, paddle.Tensor) else type(streams).__name__
        raise ValueError(f"{fn}: `streams` must be a [b, s, n, D] float paddle.Tensor, got {got}")
    if kernel.is_interpreted() and streams.dtype != paddle.float32:
        raise ValueError(f"{fn}: `streams` must be float32 on CPU (the Triton interpreter's bf16/fp16 rounding is "
                         f"wrong; use a GPU), got {streams.dtype}")
    b, s, n, d = (int(v) for v in streams.shape)
    return b, s, n, d


def _grad_or_zeros(grad: paddle.Tensor | None, shape: list[int], dtype: paddle.dtype) -> paddle.Tensor:
    return paddle.zeros(shape, dtype=dtype) if grad is None else _tokens(grad, shape[1:])


class _Pre(PyLayer):
    """streams, fn, base, scale -> (post, comb, collapsed); ``head``: collapsed only."""

    @staticmethod
    def forward(ctx, streams, fn, base, scale, iterations, eps, norm_eps, head):
        b, s, n, d = (int(v) for v in streams.shape)
        x = _tokens(streams, [n, d])
        post, comb, y, mix, r = kernel.pre_forward(x, fn, base, scale, iterations, eps, norm_eps, head=head)
        ctx.save_for_backward(x, fn, base, scale, mix, r)
        ctx.meta = (b, s, n, d, iterations, eps, head)
        ctx.need = [not t.stop_gradient for t in (streams, fn, base, scale)]
        y = y.reshape([b, s, d])
        if head:
            return y
        return post.reshape([b, s, n]), comb.reshape([b, s, n, n]), y

    @staticmethod
    def backward(ctx, *grads):
        x, fn, base, scale, mix, r = ctx.saved_tensor()
        b, s, n, d, iterations, eps, head = ctx.meta
        tokens = b * s
        d_y = _grad_or_zeros(grads[-1], [tokens, d], x.dtype)
        d_post = None if head else _grad_or_zeros(grads[0], [tokens, n], paddle.float32)
        d_comb = None if head else _grad_or_zeros(grads[1], [tokens, n, n], paddle.float32)
        g_x, g_fn, g_base, g_scale = kernel.pre_backward(x, fn, base, scale, mix, r, d_post, d_comb, d_y,
                                                         iterations, eps, head=head)
        out = (g_x.reshape([b, s, n, d]), g_fn, g_base, g_scale)
        return tuple(g if need else None for g, need in zip(out, ctx.need))


class _Combine(PyLayer):
    @staticmethod
    def forward(ctx, streams, block_out, post, comb):
        b, s, n, d = (int(v) for v in streams.shape)
        x, f = _tokens(streams, [n, d]), _tokens(block_out, [d])
        p, c = _tokens(post, [n]), _tokens(comb, [n, n])
        ctx.save_for_backward(x, f, p, c)
        ctx.need = [not t.stop_gradient for t in (streams, block_out, post, comb)]
        return kernel.combine_forward(x, f, p, c).reshape([b, s, n, d])

    @staticmethod
    def backward(ctx, d_out):
        x, f, p, c = ctx.saved_tensor()
        tokens, n, d = (int(v) for v in x.shape)
        b, s = d_out.shape[0], d_out.shape[1]
        g_x, g_f, g_post, g_comb = kernel.combine_backward(x, f, p, c, _tokens(d_out, [n, d]))
        out = (g_x.reshape([b, s, n, d]), g_f.reshape([b, s, d]), g_post.reshape([b, s, n]),
               g_comb.reshape([b, s, n, n]))
        return tuple(g if need else None for g, need in zip(out, ctx.need))


def _records_grad(*tensors: paddle.Tensor) -> bool:
    return paddle.is_grad_enabled() and any(not t.stop_gradient for t in tensors)


def mhc_pre(
    streams: paddle.Tensor,
    fn: paddle.Tensor,
    base: paddle.Tensor,
    scale: paddle.Tensor,
    iterations: int,
    eps: float,
    norm_eps: float,
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """streams [b, s, n, D] -> (post [b, s, n], comb [b, s, n, n] fp32, collapsed block input [b, s, D])."""
    _check_streams(streams, "mhc_pre")
    args = (int(iterations), float(eps), float(norm_eps), False)
    if _records_grad(streams, fn, base, scale):
        return _Pre.apply(streams, fn, base, scale, *args)
    with paddle.no_grad():
        return _Pre.forward(_NoCtx(), streams, fn, base, scale, *args)


def mhc_head(
    streams: paddle.Tensor, fn: paddle.Tensor, base: paddle.Tensor, scale: paddle.Tensor, eps: float, norm_eps: float
) -> paddle.Tensor:
    """streams [b, s, n, D] -> the final hidden state [b, s, D] (pre gate only, no Sinkhorn)."""
    _check_streams(streams, "mhc_head")
    args = (1, float(eps), float(norm_eps), True)
    if _records_grad(streams, fn, base, scale):
        return _Pre.apply(streams, fn, base, scale, *args)
    with paddle.no_grad():
        return _Pre.forward(_NoCtx(), streams, fn, base, scale, *args)


def mhc_combine(
    streams: paddle.Tensor, block_out: paddle.Tensor, post: paddle.Tensor, comb: paddle.Tensor
) -> paddle.Tensor:
    """``X'_k = post_k * f + sum_j comb[j, k] X_j`` for streams [b, s, n, D], f [b, s, D], fp32 post / comb."""
    b, s, n, d = _check_streams(streams, "mhc_combine")
    for name, t, shape in (("block_out", block_out, [b, s, d]), ("post", post, [b, s, n]),
                           ("comb", comb, [b, s, n, n])):
        if list(t.shape) != shape:
            raise ValueError(f"mhc_combine: `{name}` must be {shape} for streams {[b, s, n, d]}, got {list(t.shape)}")
    if _records_grad(streams, block_out, post, comb):
        return _Combine.apply(streams, block_out, post, comb)
    with paddle.no_grad():
        return _Combine.forward(_NoCtx(), streams, block_out, post, comb)


class _NoCtx:
    """A stand-in for the PyLayer context when nothing records a gradient (the forward runs alone)."""

    def save_for_backward(self, *tensors: paddle.Tensor) -> None:
        pass
