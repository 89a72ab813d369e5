"""Device code of the q RMS norm forward: statistics, apply, and the fused one-kernel forward.

The phases, orders and the reasons behind them are in ``kernel.py``'s docstring. The kernel is split into
``@triton.jit`` helpers (inlined by the compiler, so the compiled code is that of one function); every
expression keeps its order (these kernels are tested bitwise). Device code only: no Paddle or torch
import, nothing decided about the machine at import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.q_rms_norm.kernel_common import (
    _inv_sqrt,
    _narrow,
    _one_pass_v,
    _put,
    _row_offsets,
    _row_sum,
    _row_tiles,
)


@triton.jit
def _fwd_one_pass(
    x_ptr, y_ptr, stat_ptr, rows, row_mask, x_row, s_d, mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, LANES: tl.constexpr, ACC_INNER: tl.constexpr,
    HALVING: tl.constexpr, DOWNCAST: tl.constexpr, STREAM: tl.constexpr, STORE_R: tl.constexpr,
):
    """PHASE 2, torch order: each row read once, its (at most 8) chunks held in registers for the sum and y.

    STORE_R false: ``r`` is not written (the backward recomputes it with the same ``_one_pass_v`` and ``_inv_sqrt``)."""
    C: tl.constexpr = LANES * 4
    NT: tl.constexpr = (D + C - 1) // C
    x0, x1, x2, x3, x4, x5, x6, x7 = _row_tiles(x_ptr, x_row, s_d, row_mask, C, D, NT, STREAM)
    v = _one_pass_v(x0, x1, x2, x3, x4, x5, x6, x7, mean_factor, eps, NT, BLOCK_R, LANES, ACC_INNER, HALVING)
    r = _inv_sqrt(v)
    if STORE_R:
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
            r = _inv_sqrt(ms + eps)
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
    ONE_PASS: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr, STORE_R: tl.constexpr,
):
    """PHASE 0: stat = mean(x^2). PHASE 1: y = x * stat (stat = r). PHASE 2: stat = r = 1 / sqrt(mean + eps), y.

    ONE_PASS (PHASE 2, torch order, NACC = 4, at most MAX_TILES chunks): each row is read once, its chunks
    held in registers for both the sum and y; else the row is streamed twice (sum, then y). STORE_R false
    (one pass only): ``r`` is not written and ``stat_ptr`` is not touched.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, s_b, s_s, s_h, FLAT_ROWS)
    if ONE_PASS:
        _fwd_one_pass(x_ptr, y_ptr, stat_ptr, rows, row_mask, x_row, s_d, mean_factor, eps,
                      D, BLOCK_R, LANES, ACC_INNER, HALVING, DOWNCAST, STREAM, STORE_R)
    else:
        _fwd_streamed(x_ptr, y_ptr, stat_ptr, rows, row_mask, x_row, s_d, mean_factor, eps,
                      D, BLOCK_R, BLOCK_D, LANES, NACC, ACC_INNER, HALVING, PHASE, FLAVOR, DOWNCAST)
