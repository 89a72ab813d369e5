"""Device helpers of the q/kv prologue kernels: the norm's output and the RoPE gradient on any set of columns.

The rotation works column by column: a rotated (pe) channel is combined with its pair partner (loaded
separately, from the same cache lines), so any column set can be processed without register shuffles and a
row can be tiled exactly as the norm's summation order needs (``fleet_ext.ops.q_rms_norm.kernel``). Every
expression is the one of the separate ops, in their order (``fleet_ext.ops.rope.kernel``,
``fleet_ext.ops.q_rms_norm.kernel``): the products and sums of the rotation are ``_mul_rn`` / ``_add_rn`` /
``_sub_rn`` (never contracted on the GPU), and the norm's output is rounded to the tensor dtype before it is
rotated, as the separate ops' intermediate tensor is. Device code only: no Paddle or torch import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.rounding import _add_rn, _mul_rn, _plus_zero, _sub_rn


@triton.jit
def _table_offsets(rows, S, H, c_sb, c_ss, n_sb, n_ss):
    """Offsets of each row's cos and sin rows: rows are (batch, position, head) flattened, tables [b|1, s, rd/2]."""
    pos = rows // H
    b = pos // S
    s = pos - b * S
    return b * c_sb + s * c_ss, b * n_sb + s * n_ss


@triton.jit
def _pe_pairs(col, NOPE: tl.constexpr, D: tl.constexpr):
    """For columns ``col``: rotated or not, odd member of its pair or not, the partner column, the pair index."""
    rel = col - NOPE
    pe = (rel >= 0) & (col < D)
    rel = tl.where(pe, rel, 0)
    odd = (rel % 2) == 1
    partner = tl.where(odd, col - 1, col + 1)
    return pe, odd, partner, rel // 2


@triton.jit
def _rotate(own, partner, cos, sin, odd, USE_PTX: tl.constexpr):
    """``own*cos - partner*sin`` (even member) / ``own*cos + partner*sin`` (odd member), each op rounded alone."""
    a = _mul_rn(own, cos, USE_PTX)
    b = _mul_rn(partner, sin, USE_PTX)
    return tl.where(odd[None, :], _add_rn(a, b, USE_PTX), _sub_rn(a, b, USE_PTX))


@triton.jit
def _round_trip(v, dtype: tl.constexpr, DOWNCAST: tl.constexpr):
    """``v`` rounded to the tensor dtype (nearest even) and widened back: the separate ops' stored tensor."""
    if DOWNCAST:
        v = v.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    return v


@triton.jit
def _normed(x, r, w_ptr, col, D: tl.constexpr, HAS_W: tl.constexpr, dtype: tl.constexpr, DOWNCAST: tl.constexpr):
    """The norm's output as the separate op stores it: ``x * r`` (q) or ``w * (x * r)`` (kv), in the dtype."""
    y = x * r[:, None]
    if HAS_W:
        w = tl.load(w_ptr + col, mask=col < D, other=0.0)
        y = w[None, :] * y
    return _round_trip(y, dtype, DOWNCAST)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, k, mask):
    cos = tl.load(cos_ptr + tab_c[:, None] + (k * c_sk)[None, :], mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tab_s[:, None] + (k * n_sk)[None, :], mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _out_cols(
    x, x_ptr, x_row, x_sd, col, row_mask, r, w_ptr, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk,
    NOPE: tl.constexpr, D: tl.constexpr, HAS_W: tl.constexpr, HAS_PE: tl.constexpr, dtype: tl.constexpr,
    DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr,
):
    """The prologue's fp32 output on columns ``col`` of the rows (``x``: those columns, loaded, fp32).

    Pass-through channels: the norm's output. Rotated channels: the norm's output of the channel and of its
    partner (read again), rotated. ``HAS_PE`` false (a tile left of the pe channels) skips the rotation.
    """
    y = _normed(x, r, w_ptr, col, D, HAS_W, dtype, DOWNCAST)
    if HAS_PE:
        pe, odd, partner, k = _pe_pairs(col, NOPE, D)
        mask = row_mask[:, None] & pe[None, :]
        xp = tl.load(x_ptr + x_row[:, None] + partner[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        yp = _normed(xp, r, w_ptr, partner, D, HAS_W, dtype, DOWNCAST)
        cos, sin = _cos_sin(cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, k, mask)
        y = tl.where(pe[None, :], _rotate(y, yp, cos, sin, odd, USE_PTX), y)
    return y


@triton.jit
def _grad_cols(
    g, g_ptr, g_row, g_sd, col, row_mask, cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk,
    NOPE: tl.constexpr, D: tl.constexpr, HAS_PE: tl.constexpr, dtype: tl.constexpr, DOWNCAST: tl.constexpr,
    USE_PTX: tl.constexpr,
):
    """The RoPE gradient on columns ``col`` (``g``: the incoming gradient there, loaded, fp32), as the RoPE
    gradient kernel stores it: rotated channels turned back (rounded to the dtype), every channel ``+ 0.0``."""
    if HAS_PE:
        pe, odd, partner, k = _pe_pairs(col, NOPE, D)
        mask = row_mask[:, None] & pe[None, :]
        gp = tl.load(g_ptr + g_row[:, None] + partner[None, :] * g_sd, mask=mask, other=0.0).to(tl.float32)
        cos, sin = _cos_sin(cos_ptr, sin_ptr, tab_c, tab_s, c_sk, n_sk, k, mask)
        back = _round_trip(_rotate(g, gp, cos, -sin, odd, USE_PTX), dtype, DOWNCAST)
        g = tl.where(pe[None, :], back, g)
    return _plus_zero(g, USE_PTX)


@triton.jit
def _weighted(g, w_ptr, col, D: tl.constexpr, HAS_W: tl.constexpr):
    """kv: the gradient reaching the normalised value, ``g * w`` (multiply's gradient); q: ``g``."""
    if HAS_W:
        w = tl.load(w_ptr + col, mask=col < D, other=0.0)
        g = g * w[None, :]
    return g
