"""Grouped MoE experts in pure Paddle: the ``MoEOps.experts`` slot's reference (``moe_expert_fusion`` off).

``grouped_mlp(rows, counts, weight1, weight2, limit)``: the rows of expert ``e`` are the contiguous segment
``[sum(counts[:e]), sum(counts[:e + 1]))`` of the expert-sorted ``rows`` and get
``clamped_swiglu(rows @ weight1[e], limit) @ weight2[e]``. Computed on tokens grouped on the device, with no
Python loop over experts: each GEMM (gate+up, down) puts every row at slot (expert, place in its segment) of a
zero-padded [E, C, K] buffer, runs one batched GEMM over it and gathers the N rows back (``_GroupedGemm``, which
keeps only the compact rows for its backward and rebuilds the buffer there, so the activations kept are the
per-expert loop's, plus the slots); the SwiGLU runs on the compact rows. The slots come from device ops of static
shape (a prefix sum of ``counts`` and a ``searchsorted``); the one host value needed is max(counts), which a
caller that reads the host anyway passes in (the MoE layer folds it into its one read).

C is max(counts) rounded up to a multiple of ``ALIGN`` (16), and the SwiGLU's compact rows get zero rows appended
until its element count is a multiple of 8. On the CPU (PaddlePaddle 3.3.1, fp32) that makes every row's output
and input gradient independent of the other rows, of C and of E: the CPU GEMM computes the last ``M % 4`` rows of
a matrix (all of them when M < 8) in another summation order than the rest, and ``silu`` takes ``exp`` eight lanes
at a time and the leftover elements with a scalar ``exp`` (an ulp apart at times); here no row and no element is a
leftover. Expert parallelism relies on it (a source's rows grouped on their owner give the bits the source would
get). The weight gradients sum over the C rows of each expert (the padding adds exact zeros), which the GEMM
blocks by its length: bitwise equal for equal C; for any C when no expert has more than 200 rows (measured: from
352 summed rows on, the blocking changes).

Against one ``matmul`` -> SwiGLU -> ``matmul`` per expert segment (the loop this replaced) the results are bitwise
equal on the CPU when that loop has no leftovers either: every segment 0 or a multiple of 4 of at least 8 rows,
its SwiGLU a multiple of 8 elements, ``moe_intermediate_size`` >= 8, and no segment over 200 rows (the weight
gradients' blocking, above). Otherwise the loop's own rows depend on their segment's length and no grouped
computation reproduces them; the differences are rounding, in the loop's leftover rows and in the weight gradients
(``tests/single_card_tests/test_moe_grouped_experts.py`` measures them: <= 2.3e-7 of each tensor's largest entry).
The buffer costs E * C rows of compute and of transient memory (during each GEMM), so a skewed routing pays for
its busiest expert (the fused kernel pads nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

__all__ = ["ALIGN", "capacity_for", "check_grouped_args", "clamped_swiglu", "grouped_mlp"]

# Rows per expert in the padded buffer are a multiple of this (see the module docstring): every row then sits in a
# full row tile of the CPU GEMMs and the SwiGLU has no leftover elements outside the 8-wide exp.
ALIGN = 16


def clamped_swiglu(gate_up: paddle.Tensor, limit: float) -> paddle.Tensor:
    """``silu(min(gate, limit)) * clip(up, -limit, limit)`` of a packed ``[..., gate | up]`` tensor.

    DSv4 clamps the pre-activations so that outliers in low precision cannot blow up the product;
    ``limit == 0`` disables both clamps (the plain SwiGLU).
    """
    gate, up = paddle.chunk(gate_up, 2, axis=-1)
    if limit > 0:
        gate = paddle.clip(gate, max=limit)
        up = paddle.clip(up, min=-limit, max=limit)
    return F.silu(gate) * up


def check_grouped_args(rows: Any, counts: Any, weight1: Any, weight2: Any, fn: str = "grouped_mlp") -> None:
    """Shapes and dtypes of the experts slot's inputs; errors name the tensor, what was expected and what was given."""
    tensors = (("rows", rows), ("counts", counts), ("weight1", weight1), ("weight2", weight2))
    for name, t in tensors:
        if not isinstance(t, paddle.Tensor):
            raise ValueError(f"{fn}: `{name}` must be a paddle.Tensor, got {type(t).__name__}")
    if weight1.ndim != 3 or weight1.shape[2] % 2:
        raise ValueError(f"{fn}: `weight1` must be [E, D, 2I] (gate | up), got {list(weight1.shape)}")
    experts, dim, inter = weight1.shape[0], weight1.shape[1], weight1.shape[2] // 2
    if list(weight2.shape) != [experts, inter, dim]:
        raise ValueError(f"{fn}: `weight2` must be [{experts}, {inter}, {dim}] (from `weight1`), got "
                         f"{list(weight2.shape)}")
    if rows.ndim != 2 or rows.shape[1] != dim or not paddle.is_floating_point(rows):
        raise ValueError(f"{fn}: `rows` must be [N, {dim}] float, got {list(rows.shape)} {rows.dtype}")
    if list(counts.shape) != [experts] or counts.dtype != paddle.int64:
        raise ValueError(f"{fn}: `counts` must be int64 [{experts}] (rows per expert), got {counts.dtype} "
                         f"{list(counts.shape)}")


def capacity_for(max_count: int) -> int:
    """Rows per expert in the padded buffer: ``max_count`` rounded up to a multiple of ``ALIGN`` (at least one)."""
    return max(-(-int(max_count) // ALIGN), 1) * ALIGN


def _read_max_count(counts: paddle.Tensor, num_rows: int) -> int:
    """max(counts), checking that the segments cover the rows (one device-to-host read)."""
    low, high, total = (int(v) for v in paddle.stack([counts.min(), counts.max(), counts.sum()]).tolist())
    if low < 0 or total != num_rows:
        raise ValueError(f"grouped_mlp: `counts` must be >= 0 and sum to the {num_rows} rows of `rows`, got values "
                         f"in [{low}, {high}] summing to {total}")
    return high


def _slots(counts: paddle.Tensor, num_rows: int, capacity: int) -> paddle.Tensor:
    """[N] int64: row r's place ``expert * capacity + (r - first row of its expert)`` in the flat [E*C] buffer."""
    ends = paddle.cumsum(counts)  # one past each expert's last row
    rows = paddle.arange(num_rows, dtype="int64")
    expert = paddle.searchsorted(ends, rows, right=True)  # the experts that end at or before r come before r's
    first = paddle.gather(ends - counts, expert)
    return expert * capacity + (rows - first)


def _to_slots(rows: paddle.Tensor, slots: paddle.Tensor, experts: int, capacity: int) -> paddle.Tensor:
    """[E, C, K]: the first N = len(slots) of ``rows`` [>= N, K] at their slots, zeros elsewhere."""
    n, width = slots.shape[0], rows.shape[1]
    buffer = paddle.zeros([experts * capacity, width], dtype=rows.dtype)
    return paddle.scatter(buffer, slots, rows[:n] if rows.shape[0] > n else rows).reshape([experts, capacity, width])


def _from_slots(padded: paddle.Tensor, slots: paddle.Tensor, num_rows: int) -> paddle.Tensor:
    """[num_rows, K]: the slots' rows of ``padded`` [E, C, K] in row order, then zero rows up to ``num_rows``."""
    out = paddle.gather(padded.reshape([-1, padded.shape[-1]]), slots, axis=0)
    extra = num_rows - slots.shape[0]
    return paddle.concat([out, paddle.zeros([extra, out.shape[1]], dtype=out.dtype)]) if extra else out


class _GroupedGemm(PyLayer):
    """``out[r] = rows[r] @ weight[expert of r]`` by one batched GEMM over the padded [E, C, K] buffer, keeping only
    the compact ``rows`` for the backward (the buffer is rebuilt there): the activations the backward holds are
    the loop's, not E * C rows. Backward: ``d_rows = d_out W^T`` and ``d_W = rows^T d_out``, batched."""

    @staticmethod
    def forward(ctx, rows, weight, slots, capacity, out_rows):
        ctx.save_for_backward(rows, weight, slots)
        ctx.capacity = capacity
        ctx.needs = (not rows.stop_gradient, not weight.stop_gradient)  # Paddle wants None for the others
        padded = _to_slots(rows, slots, weight.shape[0], capacity)
        return _from_slots(paddle.bmm(padded, weight), slots, out_rows)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, slots = ctx.saved_tensor()
        experts, capacity = weight.shape[0], ctx.capacity
        d_out = _to_slots(grad, slots, experts, capacity)
        d_rows = d_weight = None
        if ctx.needs[0]:
            d_rows = _from_slots(paddle.matmul(d_out, weight, transpose_y=True), slots, rows.shape[0])
        if ctx.needs[1]:
            d_weight = paddle.matmul(_to_slots(rows, slots, experts, capacity), d_out, transpose_x=True)
        return d_rows, d_weight, None


def grouped_mlp(
    rows: paddle.Tensor,
    counts: paddle.Tensor,
    weight1: paddle.Tensor,
    weight2: paddle.Tensor,
    limit: float,
    recompute_activation: bool = False,
    *,
    max_count: int | None = None,
    checkpoint: Callable[..., paddle.Tensor] | None = None,
) -> paddle.Tensor:
    """``rows`` [N, D] expert-sorted, ``counts`` [E] int64 (device) -> [N, D] (see the module docstring).

    ``max_count``: max(counts) when the caller has it on the host already (the caller then vouches that ``counts``
    is >= 0 and sums to N); None: read here (one device-to-host read, the sum checked). ``recompute_activation``:
    the SwiGLU runs through ``checkpoint(fn, *args)`` (the caller's recompute wrapper, which knows whether it is
    inside a recomputed segment already; None: Paddle's non-reentrant ``recompute``), so only its input is kept.
    """
    check_grouped_args(rows, counts, weight1, weight2)
    num_rows = rows.shape[0]
    if max_count is None:
        max_count = _read_max_count(counts, num_rows)
    if not isinstance(max_count, int) or max_count < 0:
        raise ValueError(f"grouped_mlp: `max_count` must be an int >= 0 (the largest of `counts`), got {max_count!r}")
    capacity = capacity_for(max_count)
    slots = _slots(counts, num_rows, capacity)
    # The SwiGLU runs on the compact rows, zero rows appended up to a multiple of 8 so that no row's element is a
    # leftover of silu's 8-lane exp (rows stay independent of each other; a no-op for widths that are multiples of 8).
    inter = weight2.shape[1]
    padded_rows = num_rows if num_rows * inter % 8 == 0 else -(-num_rows // 8) * 8
    gate_up = _GroupedGemm.apply(rows, weight1, slots, capacity, padded_rows)
    if recompute_activation:
        h = (checkpoint or _recompute)(clamped_swiglu, gate_up, float(limit))
    else:
        h = clamped_swiglu(gate_up, float(limit))
    return _GroupedGemm.apply(h, weight2, slots, capacity, num_rows)


def _recompute(fn: Callable[..., paddle.Tensor], *args: Any) -> paddle.Tensor:
    """Paddle's non-reentrant recompute of ``fn(*args)`` (for callers outside any recomputed segment)."""
    from paddle.distributed.fleet.utils import recompute

    return recompute(fn, *args, use_reentrant=False)
