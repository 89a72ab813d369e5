"""Fused MoE permute / unpermute for Paddle: the reference's contract (``reference.py``), Triton kernels inside.

``permute`` and ``unpermute`` take and return what the reference's do (the plan object is this module's own:
the layer only hands it from one to the other) and are bitwise equal to it on the CPU interpreter in fp32,
forward and backward, including the weights' gradient (``kernel.py`` says how each sum is ordered). Two
PyLayers carry the autograd: ``_Permute`` (gradient: each token's row gradients added in row order) and
``_Unpermute`` (gradients for the expert outputs and the routing weights). The routing (a stable counting
sort by expert) runs inside ``_Permute``'s forward, fused with the copy; integer indices carry no gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability
from fleet_ext.ops.moe_permute.reference import check_permute_args, check_unpermute_args, read_expert_range

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel import

from fleet_ext.ops.moe_permute import kernel  # noqa: E402


class FusedPermutePlan(NamedTuple):
    """Each token's k rows in ascending order and the flat (token, slot) index of each, from the kernels."""

    token_rows: paddle.Tensor  # [T, k] int32
    token_srcs: paddle.Tensor  # [T, k] int32
    counts: paddle.Tensor  # [E] int64: rows per expert
    offsets: paddle.Tensor  # [E + 1] int64: first row of each expert, then T*k
    num_tokens: int
    dtype: paddle.dtype  # of the hidden states: the combined output's dtype


def _contiguous(t: paddle.Tensor) -> paddle.Tensor:
    return t if t.is_contiguous() else t.contiguous()


class _Permute(PyLayer):
    @staticmethod
    def forward(ctx, hidden, indices, num_experts, tables):
        """The routing and the row copy in one go (three launches); the integer tables go out through ``tables``."""
        out, *routing = kernel.route_permute(hidden, indices, num_experts)
        ctx.rows = routing[0]  # integer routing tables ride on ctx: no gradient, nothing for recompute to replay
        ctx.dtype = hidden.dtype
        tables.extend(routing)
        return out

    @staticmethod
    def backward(ctx, grad):
        return kernel.permute_backward(_contiguous(grad), ctx.rows, ctx.dtype), None


class _Unpermute(PyLayer):
    @staticmethod
    def forward(ctx, y, weights, rows, srcs, dtype):
        ctx.save_for_backward(y, weights)
        ctx.rows, ctx.srcs = rows, srcs
        return kernel.unpermute(y, weights, rows, srcs, dtype)

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensor()
        d_y, d_w = kernel.unpermute_backward(_contiguous(grad), y, weights, ctx.rows, ctx.srcs)
        return d_y, d_w, None, None


def permute(hidden_states: paddle.Tensor, indices: paddle.Tensor, num_experts: int, check_range: bool = True
            ) -> tuple:
    """``hidden_states`` [T, D], ``indices`` [T, k] -> (rows [T*k, D] grouped by expert, ``FusedPermutePlan``).

    ``check_range``: raise a ValueError unless ``indices`` lie in [0, num_experts) (one host read); False when the
    caller checks them itself (the MoE layer, in its one read per layer, before anything uses the result). The
    kernels then route ids clipped into range, so an id outside it cannot make them read or write out of bounds.
    """
    check_permute_args(hidden_states, indices, "moe_permute")
    kernel.check_route_args(hidden_states, indices, num_experts)
    if kernel.is_interpreted() and hidden_states.dtype != paddle.float32:
        raise ValueError(f"moe_permute: `hidden_states` must be float32 on CPU (the Triton interpreter's "
                         f"bf16/fp16 rounding is wrong; use a GPU), got {hidden_states.dtype}")
    if check_range:
        read_expert_range(indices, int(num_experts), "moe_permute")
    else:
        indices = paddle.clip(indices, 0, int(num_experts) - 1)  # the identity on valid ids
    tables: list = []
    out = _Permute.apply(_contiguous(hidden_states), _contiguous(indices), int(num_experts), tables)
    rows, srcs, counts, offsets = tables
    return out, FusedPermutePlan(rows, srcs, counts, offsets, hidden_states.shape[0], hidden_states.dtype)


def unpermute(y: paddle.Tensor, weights: paddle.Tensor, plan: FusedPermutePlan) -> paddle.Tensor:
    """``y`` [T*k, D] expert outputs in permuted order, ``weights`` [T, k] -> [T, D]: each token's weighted sum."""
    if not isinstance(plan, FusedPermutePlan):
        raise ValueError(f"moe_unpermute: `plan` must come from the fused moe_permute, got {type(plan).__name__}")
    check_unpermute_args(y, weights, plan.num_tokens, plan.token_rows.shape[1], "moe_unpermute")
    return _Unpermute.apply(_contiguous(y), _contiguous(weights), plan.token_rows, plan.token_srcs, plan.dtype)
