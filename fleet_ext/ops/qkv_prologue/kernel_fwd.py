"""Device code of the prologue forward: norm (weightless or weighted) and RoPE of one row in one program.

PHASE 1 (apply; the CPU path): ``r`` is given (the reference's own ``inv_sqrt``, see ``kernel.py``). PHASE 2
(fused; the GPU path): ``r = 1 / sqrt(mean(x^2) + eps)`` (two correctly rounded operations) is computed here,
in the summation order of the eager path (``fleet_ext.ops.q_rms_norm.kernel_order``), and stored for the
backward unless the backward recomputes it (``STORE_R`` false: one-pass plans only). ``ONE_PASS`` (torch's
order, at most ``MAX_TILES`` chunks): the row's chunks stay in registers for the sum and the output, so each
input byte is read once (plus the pe partners of the last chunks, from the same cache lines). Device code only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.q_rms_norm.kernel_common import _inv_sqrt, _one_pass_v, _put, _row_offsets, _row_tiles, _row_v
from fleet_ext.ops.qkv_prologue.kernel_common import _out_cols, _table_offsets


@triton.jit
def _put_out(
    x, T: tl.constexpr, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s,
    c_sk, n_sk, C: tl.constexpr, NOPE: tl.constexpr, D: tl.constexpr, HAS_W: tl.constexpr,
    DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr, STREAM: tl.constexpr,
):
    """Chunk T of the output rows (the rotation only where the chunk reaches the pe channels)."""
    col = T * C + tl.arange(0, C)
    y = _out_cols(x, x_ptr, x_row, x_sd, col, row_mask, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk,
                  NOPE, D, HAS_W, (T + 1) * C > NOPE, y_ptr.dtype.element_ty, DOWNCAST, USE_PTX)
    _put(y_ptr, rows, y, row_mask, T, C, D, DOWNCAST, STREAM)


@triton.jit
def _fwd_one_pass(
    x_ptr, y_ptr, r_ptr, w_ptr, cos_ptr, sin_ptr, rows, row_mask, x_row, x_sd, tab_c, tab_s, c_sk, n_sk,
    mean_factor, eps, D: tl.constexpr, NOPE: tl.constexpr, BLOCK_R: tl.constexpr, LANES: tl.constexpr,
    ACC_INNER: tl.constexpr, HALVING: tl.constexpr, HAS_W: tl.constexpr, DOWNCAST: tl.constexpr,
    USE_PTX: tl.constexpr, STREAM: tl.constexpr, STORE_R: tl.constexpr,
):
    """PHASE 2, torch order: the row's (at most 8) chunks held in registers for the sum and the output; ``r``
    from the q norm's ``_one_pass_v`` and ``_inv_sqrt`` (the code a backward that recomputes ``r`` runs), written if
    STORE_R."""
    C: tl.constexpr = LANES * 4
    NT: tl.constexpr = (D + C - 1) // C
    x0, x1, x2, x3, x4, x5, x6, x7 = _row_tiles(x_ptr, x_row, x_sd, row_mask, C, D, NT, STREAM)
    r = _inv_sqrt(_one_pass_v(x0, x1, x2, x3, x4, x5, x6, x7, mean_factor, eps, NT, BLOCK_R, LANES, ACC_INNER,
                              HALVING))
    if STORE_R:
        tl.store(r_ptr + rows, r, mask=row_mask)
    _put_out(x0, 0, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk,
             C, NOPE, D, HAS_W, DOWNCAST, USE_PTX, STREAM)
    if NT > 1:
        _put_out(x1, 1, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk,
                 n_sk, C, NOPE, D, HAS_W, DOWNCAST, USE_PTX, STREAM)
    if NT > 2:
        _put_out(x2, 2, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk,
                 n_sk, C, NOPE, D, HAS_W, DOWNCAST, USE_PTX, STREAM)
    if NT > 3:
        _put_out(x3, 3, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk,
                 n_sk, C, NOPE, D, HAS_W, DOWNCAST, USE_PTX, STREAM)
    if NT > 4:
        _put_out(x4, 4, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk,
                 n_sk, C, NOPE, D, HAS_W, DOWNCAST, USE_PTX, STREAM)
    if NT > 5:
        _put_out(x5, 5, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk,
                 n_sk, C, NOPE, D, HAS_W, DOWNCAST, USE_PTX, STREAM)
    if NT > 6:
        _put_out(x6, 6, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk,
                 n_sk, C, NOPE, D, HAS_W, DOWNCAST, USE_PTX, STREAM)
    if NT > 7:
        _put_out(x7, 7, x_ptr, y_ptr, rows, row_mask, x_row, x_sd, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk,
                 n_sk, C, NOPE, D, HAS_W, DOWNCAST, USE_PTX, STREAM)


@triton.jit
def _fwd_streamed(
    x_ptr, y_ptr, r_ptr, w_ptr, cos_ptr, sin_ptr, rows, row_mask, x_row, x_sd, tab_c, tab_s, c_sk, n_sk,
    mean_factor, eps, D: tl.constexpr, NOPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    PHASE: tl.constexpr, FLAVOR: tl.constexpr, HAS_W: tl.constexpr, DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr,
):
    """Any phase and order, any width: ``r`` loaded (PHASE 1) or summed streaming the row, then the output in
    ``BLOCK_D``-column steps."""
    if PHASE == 1:
        r = tl.load(r_ptr + rows, mask=row_mask, other=0.0)
    else:
        r = _inv_sqrt(_row_v(x_ptr, x_row, x_sd, row_mask, mean_factor, eps, D, BLOCK_R, LANES, NACC, ACC_INNER,
                             HALVING, FLAVOR))
        tl.store(r_ptr + rows, r, mask=row_mask)
    out_dtype = y_ptr.dtype.element_ty
    for c0 in range(0, D, BLOCK_D):
        col = c0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (col < D)[None, :]
        x = tl.load(x_ptr + x_row[:, None] + col[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        y = _out_cols(x, x_ptr, x_row, x_sd, col, row_mask, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk,
                      NOPE, D, HAS_W, True, out_dtype, DOWNCAST, USE_PTX)
        if DOWNCAST:
            y = y.to(out_dtype, fp_downcast_rounding="rtne")
        else:
            y = y.to(out_dtype)
        tl.store(y_ptr + rows[:, None] * D + col[None, :], y, mask=mask)


@triton.jit
def _norm_rope_fwd_kernel(
    x_ptr, y_ptr, r_ptr, w_ptr, cos_ptr, sin_ptr,
    n_rows, S, H, s_b, s_s, s_h, s_d,
    c_sb, c_ss, c_sk, n_sb, n_ss, n_sk,
    mean_factor, eps,
    D: tl.constexpr, NOPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    PHASE: tl.constexpr, FLAVOR: tl.constexpr, HAS_W: tl.constexpr, DOWNCAST: tl.constexpr,
    ONE_PASS: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr, USE_PTX: tl.constexpr,
    STORE_R: tl.constexpr,
):
    """y = rope(norm(x)) for BLOCK_R rows of x [b, s, h, d] (kv: h = 1); r = the norm's 1 / sqrt, per row (written
    unless STORE_R is false, which only a one-pass plan sets: its backward recomputes r)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, s_b, s_s, s_h, FLAT_ROWS)
    tab_c, tab_s = _table_offsets(rows, S, H, c_sb, c_ss, n_sb, n_ss)
    if ONE_PASS:
        _fwd_one_pass(x_ptr, y_ptr, r_ptr, w_ptr, cos_ptr, sin_ptr, rows, row_mask, x_row, s_d, tab_c, tab_s,
                      c_sk, n_sk, mean_factor, eps, D, NOPE, BLOCK_R, LANES, ACC_INNER, HALVING, HAS_W, DOWNCAST,
                      USE_PTX, STREAM, STORE_R)
    else:
        _fwd_streamed(x_ptr, y_ptr, r_ptr, w_ptr, cos_ptr, sin_ptr, rows, row_mask, x_row, s_d, tab_c, tab_s,
                      c_sk, n_sk, mean_factor, eps, D, NOPE, BLOCK_R, BLOCK_D, LANES, NACC, ACC_INNER, HALVING,
                      PHASE, FLAVOR, HAS_W, DOWNCAST, USE_PTX)
