"""Fused MoE router for Paddle: the reference's contract (``reference.py``), one Triton kernel each way.

``route`` takes the scores the layer computed (the score function stays Paddle's op here, so its bits and
its autograd are the reference's on every platform: the Triton interpreter's ``exp`` is numpy's, not
Paddle's) and returns what the reference returns: weights, indices, counts. Selection (biased top-k,
a given selection, or the hash table's rows), the weights and the counts come from one forward kernel; the
weights' gradient w.r.t. the scores from one backward kernel (the PyLayer ``_Route``). Bitwise equal to the
reference on the CPU interpreter in fp32 wherever the biased scores have no tie that Paddle's top-k would
order differently (``kernel.py``: ties go to the lowest expert id). The kernels' in-kernel scoring (from
logits) is exercised by the kernel tests and the GPU benchmark.

``router_logits`` (``moe_router_logits_fusion``) is the fp32-accurate GEMM before the score function
(``kernel_gemm.py``): not bitwise against the library's fp32 GEMM.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability
from fleet_ext.ops.launch import is_interpreted
from fleet_ext.ops.moe_router import reference
from fleet_ext.ops.moe_router.reference import check_route_args

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel import

from fleet_ext.ops.moe_router import kernel, kernel_gemm  # noqa: E402


class _Route(PyLayer):
    """The forward kernel (weights, indices, counts); its backward is the router's backward kernel (d_scores)."""

    @staticmethod
    def forward(ctx, scores, bias, indices, table, ids, topk, norm_topk_prob, scaling):
        _, weights, out_idx, counts = kernel.route(scores.detach(), None if bias is None else bias.detach(), topk,
                                                   norm_topk_prob, scaling, indices=indices, table=table, ids=ids)
        ctx.save_for_backward(scores)
        ctx.indices, ctx.norm_topk_prob, ctx.scaling = out_idx, norm_topk_prob, scaling
        ctx.mark_non_differentiable(out_idx, counts)
        return weights, out_idx, counts

    @staticmethod
    def backward(ctx, d_weights, *_):
        (scores,) = ctx.saved_tensor()
        d_weights = d_weights if d_weights.is_contiguous() else d_weights.contiguous()
        return kernel.route_backward(d_weights, scores, ctx.indices, ctx.norm_topk_prob, ctx.scaling)


def _contiguous(t: paddle.Tensor | None) -> paddle.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def route(
    scores: paddle.Tensor,
    bias: paddle.Tensor | None,
    topk: int,
    norm_topk_prob: bool,
    scaling: float,
    indices: paddle.Tensor | None = None,
    table: paddle.Tensor | None = None,
    ids: paddle.Tensor | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """``scores`` [T, E] fp32 -> (weights [T, k] fp32, indices [T, k] int64, counts [E] int64), as the reference."""
    check_route_args(scores, bias, topk, indices, table, ids)
    scores, bias, indices, table, ids = (_contiguous(t) for t in (scores, bias, indices, table, ids))
    topk, norm_topk_prob, scaling = int(topk), bool(norm_topk_prob), float(scaling)
    if scores.stop_gradient or not paddle.is_grad_enabled():
        with paddle.no_grad():
            _, weights, out_idx, counts = kernel.route(scores, bias, topk, norm_topk_prob, scaling, indices=indices,
                                                       table=table, ids=ids)
        return weights, out_idx, counts
    return _Route.apply(scores, bias, indices, table, ids, topk, norm_topk_prob, scaling)


class _RouterLogits(PyLayer):
    """``kernel_gemm.logits`` forward; its two backward GEMMs (``d_x`` in x's dtype, ``d_w`` fp32)."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        ctx.needs = (not hidden.stop_gradient, not weight.stop_gradient)  # Paddle wants None for the others
        return kernel_gemm.logits(hidden, weight)

    @staticmethod
    def backward(ctx, d_logits):
        hidden, weight = ctx.saved_tensor()
        return kernel_gemm.logits_backward(_contiguous(d_logits), hidden, weight, *ctx.needs)


def router_logits(hidden: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
    """``hidden`` [T, D] (bf16 / fp16 / fp32), ``weight`` [E, D] fp32 -> logits [T, E] fp32, as
    ``reference.router_logits``: ``kernel_gemm``'s fp32-accurate products (no fp32 copy of bf16 hidden states; not
    bitwise against the library's GEMM), autograd through its two backward GEMMs; bf16 autocast does not touch them.

    On a GPU only bf16 hidden states take the kernels: fp32 / fp16 ones (e.g. the fp32 residual stream under O1
    autocast) keep the reference's fp32 GEMM, which the kernels' TF32x3 products did not beat on the H200 (backward
    0.3-0.4x, ``benchmarks/RESULTS.md``). The CPU interpreter runs the kernels for every dtype (the tests)."""
    if hidden.dtype != paddle.bfloat16 and not is_interpreted(kernel_gemm._router_logits):
        return reference.router_logits(hidden, weight)
    hidden = _contiguous(hidden)
    if (hidden.stop_gradient and weight.stop_gradient) or not paddle.is_grad_enabled():
        with paddle.no_grad():
            return kernel_gemm.logits(hidden, weight)
    return _RouterLogits.apply(hidden, weight)
