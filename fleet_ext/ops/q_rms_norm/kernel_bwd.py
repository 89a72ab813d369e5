"""Device code of the q RMS norm backward: ``dx`` from ``dy``, ``x`` and the forward's ``r`` (read, or recomputed).

The gradient flavours (Paddle CPU autograd's and torch autograd's elementwise formulas) and the orders
are in ``kernel.py``'s docstring. The kernel is split into ``@triton.jit`` helpers (inlined by the
compiler, so the compiled code is that of one function); every expression keeps its order (these kernels
are tested bitwise). Device code only: no Paddle or torch import, nothing decided about the machine at
import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.q_rms_norm.kernel_common import (
    _add_products,
    _bwd_r,
    _combine,
    _d_v,
    _narrow,
    _put,
    _row_offsets,
    _row_sum,
    _row_tiles,
    _row_v,
)


@triton.jit
def _dx_tile(g, x, r, d_sq, FLAVOR: tl.constexpr):
    if FLAVOR == 0:
        d2 = (d_sq[:, None] * 2.0) * x
    else:
        d2 = d_sq[:, None] * (x * 2.0)
    return g * r[:, None] + d2


@triton.jit
def _d_sq(g_r, r, v, inv_d, D: tl.constexpr, BLOCK_R: tl.constexpr, FLAVOR: tl.constexpr):
    """d(loss)/d(x^2) per row from the row sum ``g_r = sum(dy * x)`` (``r = 1 / sqrt(v)``, ``v = mean(x^2) + eps``),
    in the flavour's operation order."""
    if FLAVOR == 0:
        # ``+ 0.0``: the gradient of Paddle's ``ms + eps`` adds a zero, so a -0 (r = 0: mean(x^2) overflowed) is +0
        d_ms = _d_v(g_r, r, v, FLAVOR) + 0.0
        d_sq = tl.math.div_rn(d_ms, tl.full([BLOCK_R], D, tl.float32))
    else:
        d_sq = _d_v(g_r, r, v, FLAVOR) * inv_d
    return d_sq


@triton.jit
def _bwd_one_pass(
    x_ptr, g_ptr, r_ptr, dx_ptr, rows, row_mask, x_row, g_row, x_sd, g_sd, inv_d, mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, LANES: tl.constexpr, ACC_INNER: tl.constexpr,
    HALVING: tl.constexpr, FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr, STREAM: tl.constexpr,
    RECOMPUTE_R: tl.constexpr, STORE_R: tl.constexpr,
):
    """Torch order: each row of ``dy`` and ``x`` read once, its (at most 8) chunks held in registers.

    ``v = mean(x^2) + eps`` is recomputed from the x chunks by the forward's own code (``_one_pass_v``); ``r`` is
    read from ``r_ptr``, or (RECOMPUTE_R) ``1 / sqrt(v)`` as the forward computes it, and with STORE_R also written
    to ``r_ptr`` (tests compare it with the forward's)."""
    C: tl.constexpr = LANES * 4
    NT: tl.constexpr = (D + C - 1) // C
    x0, x1, x2, x3, x4, x5, x6, x7 = _row_tiles(x_ptr, x_row, x_sd, row_mask, C, D, NT, STREAM)
    g0, g1, g2, g3, g4, g5, g6, g7 = _row_tiles(g_ptr, g_row, g_sd, row_mask, C, D, NT, STREAM)
    r, v = _bwd_r(r_ptr, rows, row_mask, x0, x1, x2, x3, x4, x5, x6, x7, mean_factor, eps, NT, BLOCK_R, LANES,
                  ACC_INNER, HALVING, RECOMPUTE_R, STORE_R)
    acc = tl.zeros([BLOCK_R, C], dtype=tl.float32) + g0 * x0  # the identity 0 first: -0 products become +0
    acc = _add_products(acc, g1, g2, g3, g4, g5, g6, g7, x1, x2, x3, x4, x5, x6, x7, NT)
    d_sq = _d_sq(_combine(acc, BLOCK_R, LANES, 4, ACC_INNER, HALVING), r, v, inv_d, D, BLOCK_R, FLAVOR)
    _put_dx_tiles(dx_ptr, rows, row_mask, g0, g1, g2, g3, g4, g5, g6, g7, x0, x1, x2, x3, x4, x5, x6, x7, r, d_sq,
                  NT, C, D, FLAVOR, DOWNCAST, STREAM)


@triton.jit
def _put_dx_tiles(
    dx_ptr, rows, row_mask, g0, g1, g2, g3, g4, g5, g6, g7, x0, x1, x2, x3, x4, x5, x6, x7, r, d_sq,
    NT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
    STREAM: tl.constexpr,
):
    """The one-pass backwards' tail: ``dx`` of chunks 0 .. NT-1 from their gradient and input chunks, stored."""
    _put(dx_ptr, rows, _dx_tile(g0, x0, r, d_sq, FLAVOR), row_mask, 0, C, D, DOWNCAST, STREAM)
    if NT > 1:
        _put(dx_ptr, rows, _dx_tile(g1, x1, r, d_sq, FLAVOR), row_mask, 1, C, D, DOWNCAST, STREAM)
    if NT > 2:
        _put(dx_ptr, rows, _dx_tile(g2, x2, r, d_sq, FLAVOR), row_mask, 2, C, D, DOWNCAST, STREAM)
    if NT > 3:
        _put(dx_ptr, rows, _dx_tile(g3, x3, r, d_sq, FLAVOR), row_mask, 3, C, D, DOWNCAST, STREAM)
    if NT > 4:
        _put(dx_ptr, rows, _dx_tile(g4, x4, r, d_sq, FLAVOR), row_mask, 4, C, D, DOWNCAST, STREAM)
    if NT > 5:
        _put(dx_ptr, rows, _dx_tile(g5, x5, r, d_sq, FLAVOR), row_mask, 5, C, D, DOWNCAST, STREAM)
    if NT > 6:
        _put(dx_ptr, rows, _dx_tile(g6, x6, r, d_sq, FLAVOR), row_mask, 6, C, D, DOWNCAST, STREAM)
    if NT > 7:
        _put(dx_ptr, rows, _dx_tile(g7, x7, r, d_sq, FLAVOR), row_mask, 7, C, D, DOWNCAST, STREAM)


@triton.jit
def _bwd_streamed(
    x_ptr, g_ptr, dx_ptr, rows, row_mask, x_row, g_row, x_sd, g_sd, r, inv_d, mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
):
    """Any order, any width: the rows are streamed for the sums (``v = mean(x^2) + eps`` again, as the forward
    summed it: the gradient needs ``sqrt(v)``), then again for ``dx``."""
    v = _row_v(x_ptr, x_row, x_sd, row_mask, mean_factor, eps, D, BLOCK_R, LANES, NACC, ACC_INNER, HALVING, FLAVOR)
    g_r = _row_sum(g_ptr, g_row, g_sd, x_ptr, x_row, x_sd, row_mask, False, D, BLOCK_R, LANES, NACC, ACC_INNER,
                   HALVING)
    d_sq = _d_sq(g_r, r, v, inv_d, D, BLOCK_R, FLAVOR)
    for c0 in range(0, D, BLOCK_D):
        col = c0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (col < D)[None, :]
        x = tl.load(x_ptr + x_row[:, None] + col[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + g_row[:, None] + col[None, :] * g_sd, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * D + col[None, :], _narrow(_dx_tile(g, x, r, d_sq, FLAVOR),
                 dx_ptr.dtype.element_ty, DOWNCAST), mask=mask)


@triton.jit
def _q_rms_norm_bwd_kernel(
    x_ptr, g_ptr, r_ptr, dx_ptr,
    n_rows, S, H,
    x_sb, x_ss, x_sh, x_sd,
    g_sb, g_ss, g_sh, g_sd,
    inv_d, mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
    ONE_PASS: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr,
    RECOMPUTE_R: tl.constexpr, STORE_R: tl.constexpr,
):
    """dx for BLOCK_R rows; ONE_PASS as in the forward (torch order, at most MAX_TILES chunks), where
    RECOMPUTE_R (one pass only) recomputes ``r`` from ``x`` instead of reading it, and STORE_R then writes it to
    ``r_ptr``. Every path recomputes ``v = mean(x^2) + eps`` from ``x`` (``mean_factor``, ``eps``: the forward's)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, x_sb, x_ss, x_sh, FLAT_ROWS)
    g_row = _row_offsets(rows, S, H, g_sb, g_ss, g_sh, FLAT_ROWS)
    if ONE_PASS:
        _bwd_one_pass(x_ptr, g_ptr, r_ptr, dx_ptr, rows, row_mask, x_row, g_row, x_sd, g_sd, inv_d, mean_factor, eps,
                      D, BLOCK_R, LANES, ACC_INNER, HALVING, FLAVOR, DOWNCAST, STREAM, RECOMPUTE_R, STORE_R)
    else:
        r = tl.load(r_ptr + rows, mask=row_mask, other=0.0)
        _bwd_streamed(x_ptr, g_ptr, dx_ptr, rows, row_mask, x_row, g_row, x_sd, g_sd, r, inv_d, mean_factor, eps,
                      D, BLOCK_R, BLOCK_D, LANES, NACC, ACC_INNER, HALVING, FLAVOR, DOWNCAST)
