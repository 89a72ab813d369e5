"""Device code of the prologue backward: RoPE gradient, norm gradient and (kv) the gain's gradient, one launch.

Row programs: ``g`` = the RoPE gradient of ``dy`` (in registers, as the RoPE gradient kernel would store
it), times the gain for kv, then the norm's gradient in the eager path's order and flavour
(``fleet_ext.ops.q_rms_norm.kernel_bwd``). Gain programs (kv only; the first ``n_dw`` programs of the grid,
so they run alongside the row programs): ``dw = sum over rows of g * (x * r)`` for a block of columns, in a
fixed order: rows in steps of ``DW_ROWS`` into ``[DW_ROWS, BLOCK_C]`` accumulators, each step added in row
order, the accumulators then summed by ``tl.sum``; with several row segments each writes its partial and
``_dw_reduce_kernel`` adds them in a fixed order. ``DW_ROWS = 1`` with one segment is Paddle CPU's order
(one sequential sum from 0 over the rows); interpreted, that order is kept with ``DW_ROWS`` rows a step as
one scan each (NumPy's sequential ``cumsum``), the running sum carried into the step's first row. ``DW_FUSED``
(kv, the one-pass kernel on a GPU, at most 4 chunks a row): no gain programs; each row program (``BLOCK_R``
rows, dx as the row programs compute it) also sums
``g * (x * r)`` over its rows (``tl.sum``) into its own partial row, so ``dy`` and ``x`` are read once for both
gradients, and ``_dw_reduce_kernel`` adds the partials (rows / BLOCK_R of them). No atomics: the result is the
same run to run. Device code only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.q_rms_norm.kernel_bwd import _d_sq, _dx_tile, _put_dx_tiles
from fleet_ext.ops.q_rms_norm.kernel_common import (
    _INTERPRETED,
    _bwd_r,
    _combine,
    _one_pass_v,
    _row_offsets,
    _row_tiles,
    _row_v,
    _sequential_sum,
    _tile,
)
from fleet_ext.ops.qkv_prologue.kernel_common import _grad_cols, _table_offsets, _weighted


@triton.jit
def _g_tile(
    g_ptr, T: tl.constexpr, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk,
    C: tl.constexpr, NOPE: tl.constexpr, D: tl.constexpr, HAS_W: tl.constexpr, DOWNCAST: tl.constexpr,
    USE_PTX: tl.constexpr, STREAM: tl.constexpr,
):
    """Chunk T of the gradient reaching the normalised value (RoPE gradient, times the gain for kv)."""
    col = T * C + tl.arange(0, C)
    g = _tile(g_ptr, g_row, g_sd, row_mask, T, C, D, STREAM)
    g = _grad_cols(g, g_ptr, g_row, g_sd, col, row_mask, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, NOPE, D,
                   (T + 1) * C > NOPE, g_ptr.dtype.element_ty, DOWNCAST, USE_PTX)
    return _weighted(g, w_ptr, col, D, HAS_W)


@triton.jit
def _bwd_one_pass(
    x_ptr, g_ptr, r_ptr, dx_ptr, w_ptr, cos_ptr, sin_ptr, rows, row_mask, x_row, g_row, x_sd, g_sd, inv_d,
    mean_factor, eps, tab_c, tab_s, c_sk, n_sk, D: tl.constexpr, NOPE: tl.constexpr, BLOCK_R: tl.constexpr,
    LANES: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr, FLAVOR: tl.constexpr, HAS_W: tl.constexpr,
    DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr, STREAM: tl.constexpr, RECOMPUTE_R: tl.constexpr,
    STORE_R: tl.constexpr,
):
    """Torch order: each row of ``dy`` and ``x`` read once (plus the pe partners), its chunks in registers; ``v``
    recomputed from the x chunks by the forward's code and ``r`` read or (RECOMPUTE_R) recomputed (``_bwd_r``)."""
    C: tl.constexpr = LANES * 4
    NT: tl.constexpr = (D + C - 1) // C
    x0, x1, x2, x3, x4, x5, x6, x7 = _row_tiles(x_ptr, x_row, x_sd, row_mask, C, D, NT, STREAM)
    g0 = _g_tile(g_ptr, 0, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE, D,
                 HAS_W, DOWNCAST, USE_PTX, STREAM)
    g1, g2, g3, g4, g5, g6, g7 = g0, g0, g0, g0, g0, g0, g0  # the slots from NT on: never read (as _row_tiles')
    acc = tl.zeros([BLOCK_R, C], dtype=tl.float32) + g0 * x0  # the identity 0 first: -0 products become +0
    if NT > 1:
        g1 = _g_tile(g_ptr, 1, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                     D, HAS_W, DOWNCAST, USE_PTX, STREAM)
        acc = acc + g1 * x1
    if NT > 2:
        g2 = _g_tile(g_ptr, 2, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                     D, HAS_W, DOWNCAST, USE_PTX, STREAM)
        acc = acc + g2 * x2
    if NT > 3:
        g3 = _g_tile(g_ptr, 3, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                     D, HAS_W, DOWNCAST, USE_PTX, STREAM)
        acc = acc + g3 * x3
    if NT > 4:
        g4 = _g_tile(g_ptr, 4, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                     D, HAS_W, DOWNCAST, USE_PTX, STREAM)
        acc = acc + g4 * x4
    if NT > 5:
        g5 = _g_tile(g_ptr, 5, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                     D, HAS_W, DOWNCAST, USE_PTX, STREAM)
        acc = acc + g5 * x5
    if NT > 6:
        g6 = _g_tile(g_ptr, 6, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                     D, HAS_W, DOWNCAST, USE_PTX, STREAM)
        acc = acc + g6 * x6
    if NT > 7:
        g7 = _g_tile(g_ptr, 7, g_row, g_sd, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                     D, HAS_W, DOWNCAST, USE_PTX, STREAM)
        acc = acc + g7 * x7
    # r after the gradient chunks, not before: with RECOMPUTE_R in between, the sum of squares and its tree held
    # registers while the gradient chunks loaded (72 a thread against 56 on sm90 at d = 512, bf16; measured on the
    # H200 at q [1, 16384, 64, 512]: 836 us against 745 with r read); here it is 56, as with r read
    r, v = _bwd_r(r_ptr, rows, row_mask, x0, x1, x2, x3, x4, x5, x6, x7, mean_factor, eps, NT, BLOCK_R, LANES,
                  ACC_INNER, HALVING, RECOMPUTE_R, STORE_R)
    d_sq = _d_sq(_combine(acc, BLOCK_R, LANES, 4, ACC_INNER, HALVING), r, v, inv_d, D, BLOCK_R, FLAVOR)
    _put_dx_tiles(dx_ptr, rows, row_mask, g0, g1, g2, g3, g4, g5, g6, g7, x0, x1, x2, x3, x4, x5, x6, x7, r, d_sq,
                  NT, C, D, FLAVOR, DOWNCAST, STREAM)


@triton.jit
def _g_cols(
    g_ptr, g_row, g_sd, col, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, NOPE: tl.constexpr,
    D: tl.constexpr, HAS_W: tl.constexpr, DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr,
):
    """The gradient reaching the normalised value on columns ``col`` (any set), read from ``dy``."""
    mask = row_mask[:, None] & (col < D)[None, :]
    g = tl.load(g_ptr + g_row[:, None] + col[None, :] * g_sd, mask=mask, other=0.0).to(tl.float32)
    g = _grad_cols(g, g_ptr, g_row, g_sd, col, row_mask, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, NOPE, D,
                   True, g_ptr.dtype.element_ty, DOWNCAST, USE_PTX)
    return _weighted(g, w_ptr, col, D, HAS_W)


@triton.jit
def _bwd_streamed(
    x_ptr, g_ptr, dx_ptr, w_ptr, cos_ptr, sin_ptr, rows, row_mask, x_row, g_row, x_sd, g_sd, r, v, inv_d,
    tab_c, tab_s, c_sk, n_sk, D: tl.constexpr, NOPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    FLAVOR: tl.constexpr, HAS_W: tl.constexpr, DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr,
):
    """Any order, any width: the row sum over chunks of ``LANES * NACC`` columns (the gradient recomputed per
    chunk), then ``dx`` in ``BLOCK_D``-column steps; ``r`` and ``v = mean(x^2) + eps`` are the row program's."""
    C: tl.constexpr = LANES * NACC
    if C == 1 and _INTERPRETED:  # the one-lane order over the whole row at once (interpreted: BLOCK_D >= D)
        col = tl.arange(0, BLOCK_D)
        g = _g_cols(g_ptr, g_row, g_sd, col, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, NOPE, D,
                    HAS_W, DOWNCAST, USE_PTX)
        mask = row_mask[:, None] & (col < D)[None, :]
        x = tl.load(x_ptr + x_row[:, None] + col[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        total = _sequential_sum(x * g, col, D)
    else:
        acc = tl.zeros([BLOCK_R, C], dtype=tl.float32)
        for c0 in range(0, D, C):
            col = c0 + tl.arange(0, C)
            g = _g_cols(g_ptr, g_row, g_sd, col, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, NOPE,
                        D, HAS_W, DOWNCAST, USE_PTX)
            mask = row_mask[:, None] & (col < D)[None, :]
            x = tl.load(x_ptr + x_row[:, None] + col[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
            acc = acc + x * g
        total = _combine(acc, BLOCK_R, LANES, NACC, ACC_INNER, HALVING)
    d_sq = _d_sq(total, r, v, inv_d, D, BLOCK_R, FLAVOR)
    out_dtype = dx_ptr.dtype.element_ty
    for c0 in range(0, D, BLOCK_D):
        col = c0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (col < D)[None, :]
        g = _g_cols(g_ptr, g_row, g_sd, col, row_mask, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, NOPE, D,
                    HAS_W, DOWNCAST, USE_PTX)
        x = tl.load(x_ptr + x_row[:, None] + col[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        dx = _dx_tile(g, x, r, d_sq, FLAVOR)
        if DOWNCAST:
            dx = dx.to(out_dtype, fp_downcast_rounding="rtne")
        else:
            dx = dx.to(out_dtype)
        tl.store(dx_ptr + rows[:, None] * D + col[None, :], dx, mask=mask)


@triton.jit
def _dw_program(
    pid, x_ptr, g_ptr, r_ptr, dw_ptr, cos_ptr, sin_ptr, n_rows, seg_rows, S, H, x_sb, x_ss, x_sh, x_sd,
    g_sb, g_ss, g_sh, g_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk, D: tl.constexpr, NOPE: tl.constexpr,
    BLOCK_C: tl.constexpr, DW_ROWS: tl.constexpr, FLAT_ROWS: tl.constexpr, DOWNCAST: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    """Columns ``BLOCK_C * (pid % NCOL) ..`` of segment ``pid // NCOL``: sum of ``g * (x * r)`` over its rows."""
    ncol: tl.constexpr = (D + BLOCK_C - 1) // BLOCK_C
    seg = pid // ncol
    col = (pid - seg * ncol) * BLOCK_C + tl.arange(0, BLOCK_C)
    first = seg.to(tl.int64) * seg_rows
    end = tl.minimum(first + seg_rows, n_rows)
    acc = tl.zeros([DW_ROWS, BLOCK_C], dtype=tl.float32)
    carry = tl.zeros([BLOCK_C], dtype=tl.float32)  # interpreted: the sequential sum so far
    step = tl.arange(0, DW_ROWS)
    for start in range(first, end, DW_ROWS):
        rows = start + step
        row_mask = rows < end
        x_row = _row_offsets(rows, S, H, x_sb, x_ss, x_sh, FLAT_ROWS)
        g_row = _row_offsets(rows, S, H, g_sb, g_ss, g_sh, FLAT_ROWS)
        tab_c, tab_s = _table_offsets(rows, S, H, c_sb, c_ss, n_sb, n_ss)
        g = _g_cols(g_ptr, g_row, g_sd, col, row_mask, x_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, NOPE, D,
                    False, DOWNCAST, USE_PTX)
        mask = row_mask[:, None] & (col < D)[None, :]
        x = tl.load(x_ptr + x_row[:, None] + col[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows, mask=row_mask, other=0.0)
        if _INTERPRETED:  # ((carry + t0) + t1) + ...: the step's rows in order (a from-zero sum is never -0.0)
            terms = g * (x * r[:, None])
            terms = tl.where((step == 0)[:, None], carry[None, :] + terms, terms)
            last = tl.minimum(end - start, DW_ROWS) - 1
            carry = tl.sum(tl.where((step == last)[:, None], tl.cumsum(terms, axis=0), 0.0), axis=0)
        else:
            acc = acc + g * (x * r[:, None])
    if _INTERPRETED:
        part = carry
    elif DW_ROWS == 1:
        part = tl.reshape(acc, [BLOCK_C])
    else:
        part = tl.sum(acc, axis=0)
    tl.store(dw_ptr + seg * D + col, part, mask=col < D)


@triton.jit
def _row_program(
    row_pid, x_ptr, g_ptr, r_ptr, dx_ptr, w_ptr, cos_ptr, sin_ptr, n_rows, S, H, x_sb, x_ss, x_sh, x_sd,
    g_sb, g_ss, g_sh, g_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk, inv_d, mean_factor, eps, D: tl.constexpr,
    NOPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, LANES: tl.constexpr, NACC: tl.constexpr,
    ACC_INNER: tl.constexpr, HALVING: tl.constexpr, FLAVOR: tl.constexpr, HAS_W: tl.constexpr,
    DOWNCAST: tl.constexpr, ONE_PASS: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr,
    USE_PTX: tl.constexpr, RECOMPUTE_R: tl.constexpr, STORE_R: tl.constexpr,
):
    """dx for rows ``BLOCK_R * row_pid ..`` (RECOMPUTE_R: one pass only)."""
    rows = row_pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, x_sb, x_ss, x_sh, FLAT_ROWS)
    g_row = _row_offsets(rows, S, H, g_sb, g_ss, g_sh, FLAT_ROWS)
    tab_c, tab_s = _table_offsets(rows, S, H, c_sb, c_ss, n_sb, n_ss)
    if ONE_PASS:
        _bwd_one_pass(x_ptr, g_ptr, r_ptr, dx_ptr, w_ptr, cos_ptr, sin_ptr, rows, row_mask, x_row, g_row, x_sd,
                      g_sd, inv_d, mean_factor, eps, tab_c, tab_s, c_sk, n_sk, D, NOPE, BLOCK_R, LANES, ACC_INNER,
                      HALVING, FLAVOR, HAS_W, DOWNCAST, USE_PTX, STREAM, RECOMPUTE_R, STORE_R)
    else:
        r = tl.load(r_ptr + rows, mask=row_mask, other=0.0)
        v = _row_v(x_ptr, x_row, x_sd, row_mask, mean_factor, eps, D, BLOCK_R, LANES, NACC, ACC_INNER, HALVING,
                   FLAVOR)  # the forward's sum again: the gradient needs sqrt(v)
        _bwd_streamed(x_ptr, g_ptr, dx_ptr, w_ptr, cos_ptr, sin_ptr, rows, row_mask, x_row, g_row, x_sd, g_sd,
                      r, v, inv_d, tab_c, tab_s, c_sk, n_sk, D, NOPE, BLOCK_R, BLOCK_D, LANES, NACC, ACC_INNER,
                      HALVING, FLAVOR, HAS_W, DOWNCAST, USE_PTX)


@triton.jit
def _kv_rope_grad(
    T: tl.constexpr, g_ptr, row_mask, g_row, g_sd, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C: tl.constexpr,
    NOPE: tl.constexpr, D: tl.constexpr, DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr, STREAM: tl.constexpr,
):
    """Chunk T of the RoPE gradient of ``dy`` (before the gain)."""
    col = T * C + tl.arange(0, C)
    g = _tile(g_ptr, g_row, g_sd, row_mask, T, C, D, STREAM)
    return _grad_cols(g, g_ptr, g_row, g_sd, col, row_mask, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, NOPE, D,
                      (T + 1) * C > NOPE, g_ptr.dtype.element_ty, DOWNCAST, USE_PTX)


@triton.jit
def _kv_partial(T: tl.constexpr, g, x, r, part, w_ptr, C: tl.constexpr, D: tl.constexpr):
    """Stores chunk T of the block's gain-gradient partial, the sum over its rows of ``g * (x * r)`` (``g``: the
    RoPE gradient before the gain, as ``_dw_program``); returns ``g`` times the gain."""
    col = T * C + tl.arange(0, C)
    tl.store(part + col, tl.sum(g * (x * r[:, None]), axis=0), mask=col < D)
    return _weighted(g, w_ptr, col, D, True)


@triton.jit
def _kv_chunk(
    T: tl.constexpr, part, x_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, row_mask, x_row, g_row, x_sd, g_sd, r, tab_c,
    tab_s, c_sk, n_sk, C: tl.constexpr, NOPE: tl.constexpr, D: tl.constexpr, DOWNCAST: tl.constexpr,
    USE_PTX: tl.constexpr, STREAM: tl.constexpr,
):
    """Chunk T of a kv row block, ``r`` known: (``_g_tile``'s gradient, times the gain; x), its partial stored."""
    g = _kv_rope_grad(T, g_ptr, row_mask, g_row, g_sd, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE, D,
                      DOWNCAST, USE_PTX, STREAM)
    x = _tile(x_ptr, x_row, x_sd, row_mask, T, C, D, STREAM)
    return _kv_partial(T, g, x, r, part, w_ptr, C, D), x


@triton.jit
def _kv_block(
    pid, x_ptr, g_ptr, r_ptr, dx_ptr, w_ptr, dw_ptr, cos_ptr, sin_ptr, n_rows, S, H, x_sb, x_ss, x_sh, x_sd,
    g_sb, g_ss, g_sh, g_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk, inv_d, mean_factor, eps, D: tl.constexpr,
    NOPE: tl.constexpr, BLOCK_R: tl.constexpr, LANES: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr,
    USE_PTX: tl.constexpr, RECOMPUTE_R: tl.constexpr, STORE_R: tl.constexpr,
):
    """``DW_FUSED``: dx of rows ``BLOCK_R * pid ..`` exactly as ``_bwd_one_pass`` (at most 4 chunks a row), and
    their gain-gradient partial (row ``pid`` of ``dw_ptr``).

    ``r`` read: chunk by chunk (gradient, x, the chunk's partial). RECOMPUTE_R: ``r`` needs the whole row first,
    so every chunk's x and RoPE gradient is loaded, then ``r`` (the forward's code, ``_bwd_r``), then the
    partials; the same values and operations, ordered so that no chunk stays live longer than it does with ``r``
    read (loading x first and the gradients chunk by chunk took 231 registers against 168 on sm90 at d = 512)."""
    C: tl.constexpr = LANES * 4
    NT: tl.constexpr = (D + C - 1) // C
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, x_sb, x_ss, x_sh, FLAT_ROWS)
    g_row = _row_offsets(rows, S, H, g_sb, g_ss, g_sh, FLAT_ROWS)
    tab_c, tab_s = _table_offsets(rows, S, H, c_sb, c_ss, n_sb, n_ss)
    part = dw_ptr + pid.to(tl.int64) * D
    if RECOMPUTE_R:
        x0, x1, x2, x3, x4, x5, x6, x7 = _row_tiles(x_ptr, x_row, x_sd, row_mask, C, D, NT, STREAM)
        g0 = _kv_rope_grad(0, g_ptr, row_mask, g_row, g_sd, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE, D,
                           DOWNCAST, USE_PTX, STREAM)
        g1, g2, g3 = g0, g0, g0
        if NT > 1:
            g1 = _kv_rope_grad(1, g_ptr, row_mask, g_row, g_sd, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                               D, DOWNCAST, USE_PTX, STREAM)
        if NT > 2:
            g2 = _kv_rope_grad(2, g_ptr, row_mask, g_row, g_sd, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                               D, DOWNCAST, USE_PTX, STREAM)
        if NT > 3:
            g3 = _kv_rope_grad(3, g_ptr, row_mask, g_row, g_sd, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, C, NOPE,
                               D, DOWNCAST, USE_PTX, STREAM)
        r, v = _bwd_r(r_ptr, rows, row_mask, x0, x1, x2, x3, x4, x5, x6, x7, mean_factor, eps, NT, BLOCK_R, LANES,
                      ACC_INNER, HALVING, RECOMPUTE_R, STORE_R)
        g0 = _kv_partial(0, g0, x0, r, part, w_ptr, C, D)
        acc = tl.zeros([BLOCK_R, C], dtype=tl.float32) + g0 * x0  # as _bwd_one_pass: the identity 0 first
        if NT > 1:
            g1 = _kv_partial(1, g1, x1, r, part, w_ptr, C, D)
            acc = acc + g1 * x1
        if NT > 2:
            g2 = _kv_partial(2, g2, x2, r, part, w_ptr, C, D)
            acc = acc + g2 * x2
        if NT > 3:
            g3 = _kv_partial(3, g3, x3, r, part, w_ptr, C, D)
            acc = acc + g3 * x3
    else:
        r = tl.load(r_ptr + rows, mask=row_mask, other=0.0)
        g0, x0 = _kv_chunk(0, part, x_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, row_mask, x_row, g_row, x_sd, g_sd, r,
                           tab_c, tab_s, c_sk, n_sk, C, NOPE, D, DOWNCAST, USE_PTX, STREAM)
        g1, g2, g3, x1, x2, x3 = g0, g0, g0, x0, x0, x0  # the chunks from NT on: never read
        acc = tl.zeros([BLOCK_R, C], dtype=tl.float32) + g0 * x0  # as _bwd_one_pass: the identity 0 first
        if NT > 1:
            g1, x1 = _kv_chunk(1, part, x_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, row_mask, x_row, g_row, x_sd, g_sd,
                               r, tab_c, tab_s, c_sk, n_sk, C, NOPE, D, DOWNCAST, USE_PTX, STREAM)
            acc = acc + g1 * x1
        if NT > 2:
            g2, x2 = _kv_chunk(2, part, x_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, row_mask, x_row, g_row, x_sd, g_sd,
                               r, tab_c, tab_s, c_sk, n_sk, C, NOPE, D, DOWNCAST, USE_PTX, STREAM)
            acc = acc + g2 * x2
        if NT > 3:
            g3, x3 = _kv_chunk(3, part, x_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, row_mask, x_row, g_row, x_sd, g_sd,
                               r, tab_c, tab_s, c_sk, n_sk, C, NOPE, D, DOWNCAST, USE_PTX, STREAM)
            acc = acc + g3 * x3
        v = _one_pass_v(x0, x1, x2, x3, x0, x0, x0, x0, mean_factor, eps, NT, BLOCK_R, LANES, ACC_INNER, HALVING)
    d_sq = _d_sq(_combine(acc, BLOCK_R, LANES, 4, ACC_INNER, HALVING), r, v, inv_d, D, BLOCK_R, FLAVOR)
    _put_dx_tiles(dx_ptr, rows, row_mask, g0, g1, g2, g3, g0, g0, g0, g0, x0, x1, x2, x3, x0, x0, x0, x0, r, d_sq,
                  NT, C, D, FLAVOR, DOWNCAST, STREAM)  # at most 4 chunks here


@triton.jit
def _norm_rope_bwd_kernel(
    x_ptr, g_ptr, r_ptr, dx_ptr, w_ptr, dw_ptr, cos_ptr, sin_ptr,
    n_rows, seg_rows, n_dw, S, H,
    x_sb, x_ss, x_sh, x_sd, g_sb, g_ss, g_sh, g_sd,
    c_sb, c_ss, c_sk, n_sb, n_ss, n_sk,
    inv_d, mean_factor, eps,
    D: tl.constexpr, NOPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    FLAVOR: tl.constexpr, HAS_W: tl.constexpr, DOWNCAST: tl.constexpr,
    ONE_PASS: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr, USE_PTX: tl.constexpr,
    BLOCK_C: tl.constexpr, DW_ROWS: tl.constexpr, DW_FUSED: tl.constexpr,
    RECOMPUTE_R: tl.constexpr, STORE_R: tl.constexpr,
):
    """dx for BLOCK_R rows a program; with HAS_W the first n_dw programs compute the gain's gradient instead, or
    (DW_FUSED) each program also writes its rows' gain-gradient partial. RECOMPUTE_R (one-pass row programs only,
    never with the dedicated gain programs, which read ``r``): ``r`` recomputed from ``x`` with the forward's
    ``mean_factor`` and ``eps``; with STORE_R also written to ``r_ptr``."""
    pid = tl.program_id(0)
    if HAS_W and DW_FUSED:
        _kv_block(pid, x_ptr, g_ptr, r_ptr, dx_ptr, w_ptr, dw_ptr, cos_ptr, sin_ptr, n_rows, S, H, x_sb, x_ss, x_sh,
                  x_sd, g_sb, g_ss, g_sh, g_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk, inv_d, mean_factor, eps, D, NOPE,
                  BLOCK_R, LANES, ACC_INNER, HALVING, FLAVOR, DOWNCAST, FLAT_ROWS, STREAM, USE_PTX, RECOMPUTE_R,
                  STORE_R)
    elif HAS_W:
        if pid < n_dw:
            _dw_program(pid, x_ptr, g_ptr, r_ptr, dw_ptr, cos_ptr, sin_ptr, n_rows, seg_rows, S, H, x_sb, x_ss,
                        x_sh, x_sd, g_sb, g_ss, g_sh, g_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk, D, NOPE, BLOCK_C,
                        DW_ROWS, FLAT_ROWS, DOWNCAST, USE_PTX)
        else:
            _row_program(pid - n_dw, x_ptr, g_ptr, r_ptr, dx_ptr, w_ptr, cos_ptr, sin_ptr, n_rows, S, H, x_sb,
                         x_ss, x_sh, x_sd, g_sb, g_ss, g_sh, g_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk, inv_d,
                         mean_factor, eps, D, NOPE, BLOCK_R, BLOCK_D, LANES, NACC, ACC_INNER, HALVING, FLAVOR, HAS_W,
                         DOWNCAST, ONE_PASS, FLAT_ROWS, STREAM, USE_PTX, False, False)
    else:
        _row_program(pid, x_ptr, g_ptr, r_ptr, dx_ptr, w_ptr, cos_ptr, sin_ptr, n_rows, S, H, x_sb, x_ss, x_sh,
                     x_sd, g_sb, g_ss, g_sh, g_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk, inv_d, mean_factor, eps, D,
                     NOPE, BLOCK_R, BLOCK_D, LANES, NACC, ACC_INNER, HALVING, FLAVOR, HAS_W, DOWNCAST, ONE_PASS,
                     FLAT_ROWS, STREAM, USE_PTX, RECOMPUTE_R, STORE_R)


@triton.jit
def _dw_reduce_kernel(part_ptr, dw_ptr, n_seg, D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """dw[c] = sum of the segments' partials, one program per column block, in a fixed order: segment s goes to
    accumulator s % BLOCK_S (segments in increasing order), then ``tl.sum`` over the accumulators."""
    col = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    seg = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, n_seg, BLOCK_S):
        mask = ((s0 + seg) < n_seg)[:, None] & (col < D)[None, :]
        acc = acc + tl.load(part_ptr + (s0 + seg)[:, None] * D + col[None, :], mask=mask, other=0.0)
    tl.store(dw_ptr + col, tl.sum(acc, axis=0), mask=col < D)
