"""Fused grouped experts for Paddle (``moe_expert_fusion``): the ``MoEOps.experts`` slot, Triton kernels inside.

``experts(rows, counts, weight1, weight2, limit, recompute_activation)`` returns what the reference grouped MLP
returns: ``out[r] = clamped_swiglu(rows[r] @ weight1[e], limit) @ weight2[e]`` for the expert ``e`` whose
segment of the expert-sorted ``rows`` holds row ``r`` (``counts[e]`` rows each, in order). One PyLayer
(``_GroupedExperts``): two forward launches (gate+up with the SwiGLU epilogue, down), four backward launches
(``kernel_bwd.py``), ``counts`` read on the device only (no host sync).

Not bitwise equal to the reference (another GEMM: blocked fp32 sums in another order); the tolerance is the
registry's (``fleet_ext.registry``, ``moe_expert_fusion``). The weight gradients are deterministic: fixed-order
sums, no atomics.

``recompute_activation`` (selective recompute ``moe_act``) is accepted and changes nothing here: the layer saves
only the gate+up pre-activation [N, 2I] for the backward and always recomputes the activation ``h`` [N, I]
from it in the backward's first kernel, which is what ``moe_act`` asks of the reference path.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel import

from fleet_ext.ops.moe_experts import kernel, kernel_bwd  # noqa: E402


def _contiguous(t: paddle.Tensor) -> paddle.Tensor:
    return t if t.is_contiguous() else t.contiguous()


class _GroupedExperts(PyLayer):
    """Forward: out (gate_up saved, h dropped). Backward: d_rows, d_weight1, d_weight2 (counts: no gradient)."""

    @staticmethod
    def forward(ctx, rows, counts, weight1, weight2, limit):
        out, gate_up, _ = kernel.experts_forward(rows, counts, weight1, weight2, limit)
        ctx.save_for_backward(rows, counts, weight1, weight2, gate_up)
        ctx.limit = limit
        ctx.needs = tuple(not t.stop_gradient for t in (rows, weight1, weight2))
        return out

    @staticmethod
    def backward(ctx, d_out):
        rows, counts, weight1, weight2, gate_up = ctx.saved_tensor()
        d_rows, d_w1, d_w2 = kernel_bwd.experts_backward(_contiguous(d_out), rows, counts, weight1, weight2, gate_up,
                                                         ctx.limit, ctx.needs)
        return d_rows, None, d_w1, d_w2


def _check(rows: paddle.Tensor, counts: paddle.Tensor, weight1: paddle.Tensor, weight2: paddle.Tensor,
           limit: float) -> None:
    """Paddle-side checks (types, the limit, the CPU's fp32); shapes and dtypes are the kernel's ``check_args``."""
    for name, t in (("rows", rows), ("counts", counts), ("weight1", weight1), ("weight2", weight2)):
        if not isinstance(t, paddle.Tensor):
            raise ValueError(f"moe_experts: `{name}` must be a paddle.Tensor, got {type(t).__name__}")
    if not limit >= 0:
        raise ValueError(f"moe_experts: `limit` must be >= 0 (0: no clamp), got {limit}")
    if kernel.is_interpreted() and rows.dtype != paddle.float32:
        raise ValueError(f"moe_experts: `rows` must be float32 on CPU (the Triton interpreter's bf16/fp16 rounding "
                         f"is wrong; use a GPU), got {rows.dtype}")
    if rows.place != counts.place:
        raise ValueError(f"moe_experts: `counts` must be on the rows' device {rows.place} (it is read there, never "
                         f"copied to the host), got {counts.place}")


def experts(rows: paddle.Tensor, counts: paddle.Tensor, weight1: paddle.Tensor, weight2: paddle.Tensor,
            limit: float, recompute_activation: bool = False) -> paddle.Tensor:
    """``rows`` [N, D] expert-sorted, ``counts`` [E] int64 on the device -> [N, D] (see the module docstring).

    ``recompute_activation`` is honoured by construction: ``h`` is never kept for the backward.
    """
    _check(rows, counts, weight1, weight2, float(limit))
    rows, counts, weight1, weight2 = (_contiguous(t) for t in (rows, counts, weight1, weight2))
    kernel.check_args(rows, counts, weight1, weight2)
    limit = float(limit)
    needs_grad = not all(t.stop_gradient for t in (rows, weight1, weight2))
    if not (needs_grad and paddle.is_grad_enabled()):
        with paddle.no_grad():
            return kernel.experts_forward(rows, counts, weight1, weight2, limit)[0]
    return _GroupedExperts.apply(rows, counts, weight1, weight2, limit)
