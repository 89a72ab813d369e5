"""Device code of the q RMS norm forward: statistics, apply, and the fused one-kernel forward.

The phases, orders and the reasons behind them are in ``kernel.py``'s docstring. The kernel is split into
``@triton.jit`` helpers (inlined by the compiler, so the compiled code is that of one function); every
expression keeps its order (these kernels are tested bitwise). Device code only: no Paddle or torch
import, nothing decided about the machine at import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.q_rms_norm.kernel_common import _combine, _narrow, _put, _row_offsets, _row_sum, _tile


@triton.jit
def _fwd_one_pass(
    x_ptr, y_ptr, stat_ptr, rows, row_mask, x_row, s_d, mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, LANES: tl.constexpr, ACC_INNER: tl.constexpr,
    HALVING: tl.constexpr, DOWNCAST: tl.constexpr, STREAM: tl.constexpr,
):
    """PHASE 2, torch order: each row read once, its (at most 8) chunks held in registers for the sum and y."""
    C: tl.constexpr = LANES * 4
    NT: tl.constexpr = (D + C - 1) // C
    x0 = _tile(x_ptr, x_row, s_d, row_mask, 0, C, D, STREAM)
    if NT > 1:
        x1 = _tile(x_ptr, x_row, s_d, row_mask, 1, C, D, STREAM)
    if NT > 2:
        x2 = _tile(x_ptr, x_row, s_d, row_mask, 2, C, D, STREAM)
    if NT > 3:
        x3 = _tile(x_ptr, x_row, s_d, row_mask, 3, C, D, STREAM)
    if NT > 4:
        x4 = _tile(x_ptr, x_row, s_d, row_mask, 4, C, D, STREAM)
    if NT > 5:
        x5 = _tile(x_ptr, x_row, s_d, row_mask, 5, C, D, STREAM)
    if NT > 6:
        x6 = _tile(x_ptr, x_row, s_d, row_mask, 6, C, D, STREAM)
    if NT > 7:
        x7 = _tile(x_ptr, x_row, s_d, row_mask, 7, C, D, STREAM)
    acc = x0 * x0  # = 0 + x0^2 (squares are never -0)
    if NT > 1:
        acc = acc + x1 * x1
    if NT > 2:
        acc = acc + x2 * x2
    if NT > 3:
        acc = acc + x3 * x3
    if NT > 4:
        acc = acc + x4 * x4
    if NT > 5:
        acc = acc + x5 * x5
    if NT > 6:
        acc = acc + x6 * x6
    if NT > 7:
        acc = acc + x7 * x7
    total = _combine(acc, BLOCK_R, LANES, 4, ACC_INNER, HALVING)
    r = tl.math.rsqrt(total * mean_factor + eps)
    tl.store(stat_ptr + rows, r, mask=row_mask)
    rb = r[:, None]
    _put(y_ptr, rows, x0 * rb, row_mask, 0, C, D, DOWNCAST, STREAM)
    if NT > 1:
        _put(y_ptr, rows, x1 * rb, row_mask, 1, C, D, DOWNCAST, STREAM)
    if NT > 2:
        _put(y_ptr, rows, x2 * rb, row_mask, 2, C, D, DOWNCAST, STREAM)
    if NT > 3:
        _put(y_ptr, rows, x3 * rb, row_mask, 3, C, D, DOWNCAST, STREAM)
    if NT > 4:
        _put(y_ptr, rows, x4 * rb, row_mask, 4, C, D, DOWNCAST, STREAM)
    if NT > 5:
        _put(y_ptr, rows, x5 * rb, row_mask, 5, C, D, DOWNCAST, STREAM)
    if NT > 6:
        _put(y_ptr, rows, x6 * rb, row_mask, 6, C, D, DOWNCAST, STREAM)
    if NT > 7:
        _put(y_ptr, rows, x7 * rb, row_mask, 7, C, D, DOWNCAST, STREAM)


@triton.jit
def _fwd_streamed(
    x_ptr, y_ptr, stat_ptr, rows, row_mask, x_row, s_d, mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    PHASE: tl.constexpr, FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
):
    """Any phase and order, any width: the row is streamed for the sum, then again for y."""
    if PHASE == 1:
        r = tl.load(stat_ptr + rows, mask=row_mask, other=0.0)
    else:
        total = _row_sum(x_ptr, x_row, s_d, x_ptr, x_row, s_d, row_mask, True, D, BLOCK_R, LANES, NACC,
                         ACC_INNER, HALVING)
        if FLAVOR == 0:
            ms = tl.math.div_rn(total, tl.full([BLOCK_R], D, tl.float32))
        else:
            ms = total * mean_factor
        if PHASE == 0:
            tl.store(stat_ptr + rows, ms, mask=row_mask)
        else:
            r = tl.math.rsqrt(ms + eps)
            tl.store(stat_ptr + rows, r, mask=row_mask)
    if PHASE != 0:
        out_dtype = y_ptr.dtype.element_ty
        for c0 in range(0, D, BLOCK_D):
            col = c0 + tl.arange(0, BLOCK_D)
            mask = row_mask[:, None] & (col < D)[None, :]
            x = tl.load(x_ptr + x_row[:, None] + col[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
            y = _narrow(x * r[:, None], out_dtype, DOWNCAST)
            tl.store(y_ptr + rows[:, None] * D + col[None, :], y, mask=mask)


@triton.jit
def _q_rms_norm_fwd_kernel(
    x_ptr, y_ptr, stat_ptr,
    n_rows, S, H, s_b, s_s, s_h, s_d,
    mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    PHASE: tl.constexpr, FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
    ONE_PASS: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr,
):
    """PHASE 0: stat = mean(x^2). PHASE 1: y = x * stat (stat = r). PHASE 2: stat = r = rsqrt(mean + eps), y.

    ONE_PASS (PHASE 2, torch order, NACC = 4, at most MAX_TILES chunks): each row is read once, its chunks
    held in registers for both the sum and y; else the row is streamed twice (sum, then y).
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, s_b, s_s, s_h, FLAT_ROWS)
    if ONE_PASS:
        _fwd_one_pass(x_ptr, y_ptr, stat_ptr, rows, row_mask, x_row, s_d, mean_factor, eps,
                      D, BLOCK_R, LANES, ACC_INNER, HALVING, DOWNCAST, STREAM)
    else:
        _fwd_streamed(x_ptr, y_ptr, stat_ptr, rows, row_mask, x_row, s_d, mean_factor, eps,
                      D, BLOCK_R, BLOCK_D, LANES, NACC, ACC_INNER, HALVING, PHASE, FLAVOR, DOWNCAST)
