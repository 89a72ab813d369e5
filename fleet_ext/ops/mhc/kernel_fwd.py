"""Device code of the fused mHC forward: the split projection (with the RMS statistics), the pre kernel (gates,
Sinkhorn, collapse), the combine kernel, and the helpers the backward shares (``kernel_bwd.py``).

Layouts (``kernel.py`` makes them so): streams ``x`` [T, N, D] contiguous (a token's row is the flattened
``N * D`` vector the projection reads), ``fn`` [NOUT, N * D] fp32, ``mix`` [T, NOUT] fp32 (the projection of
the normalised row, kept for the backward), ``post`` [T, N], ``comb`` [T, N, N], block input / output [T, D].
Columns of ``mix`` and of the logits: pre ``0 .. N-1``, post ``N .. 2N-1``, comb ``2N + i * N + j`` (row i,
column j); the head mode has the pre columns only. ``P`` is ``N`` rounded up to a power of two (tile width);
padded rows and columns of an n x n tile are held at 0. Device code only: no Paddle or torch import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.split_dot import _bf16_pieces, _dot

# ``tl.sum``'s combine function: hot loops call ``tl.reduce(x, axis, _sum_combine)`` directly (see ``_sinkhorn``).
_sum_combine = tl.standard._sum_combine


@triton.jit
def _group_scale(scale_ptr, c, N: tl.constexpr, HEAD: tl.constexpr):
    """``scale[g]`` of every mix column ``c``: g = 0 (pre), 1 (post), 2 (comb); the head has one scale."""
    if HEAD:
        g = c * 0
    else:
        g = tl.where(c < N, 0, tl.where(c < 2 * N, 1, 2))
    return tl.load(scale_ptr + g)


@triton.jit
def _logits(mix_ptr, base_ptr, scale_ptr, t, t_mask, cols, mask, group, NOUT: tl.constexpr):
    """``mix[t, cols] * scale[group] + base[cols]`` for a tile of columns (``cols``/``mask`` broadcast with t).

    ``mix`` is read from L2 (``.cg``): the pre kernel reads back what other threads of its program stored before a
    barrier, and L1 is not kept coherent with other threads' stores."""
    m = tl.load(mix_ptr + t * NOUT + cols, mask=t_mask & mask, other=0.0, cache_modifier=".cg")
    return m * tl.load(scale_ptr + group) + tl.load(base_ptr + cols, mask=mask, other=0.0)


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _comb_tile(P: tl.constexpr, N: tl.constexpr):
    """Row/column indices and masks of an n x n tile padded to P x P: (i [1, P, 1], j [1, 1, P], valid, rows)."""
    i = tl.arange(0, P)[None, :, None]
    j = tl.arange(0, P)[None, None, :]
    return i, j, (i < N) & (j < N), tl.arange(0, P)[None, :] < N


@triton.jit
def _softmax_rows(z, valid, rows):
    """Row softmax of [BT, P, P] logits; padded entries 0 (fully padded rows too)."""
    zm = tl.where(valid, z, float("-inf"))
    top = tl.where(rows, tl.max(zm, axis=2), 0.0)
    e = tl.exp(zm - top[:, :, None])
    total = tl.where(rows, tl.sum(e, axis=2), 1.0)
    return e / total[:, :, None]


@triton.jit
def _sinkhorn(z, valid, rows, eps, ITERS: tl.constexpr):
    """The reference's Sinkhorn: softmax + eps, column normalise, then (ITERS - 1) x [row, column].

    The loop calls no jitted function (``tl.sum`` is one; ``tl.reduce`` with its combine function is what it
    runs): the interpreter re-patches Triton's builtins on every such call, which would dominate the CPU tests.
    Compiled code is the same either way."""
    a = tl.where(valid, _softmax_rows(z, valid, rows) + eps, 0.0)
    b = a / (tl.reduce(a, 1, _sum_combine)[:, None, :] + eps)
    for _ in range(ITERS - 1):
        b = b / (tl.reduce(b, 2, _sum_combine)[:, :, None] + eps)
        b = b / (tl.reduce(b, 1, _sum_combine)[:, None, :] + eps)
    return b


@triton.jit
def _gates(mix_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, t, t_mask, eps,
           N: tl.constexpr, P: tl.constexpr, NOUT: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr):
    """Pre gate [BT, P] (returned), and unless HEAD the post gate and the Sinkhorn matrix (stored)."""
    p = tl.arange(0, P)[None, :]
    tt = t[:, None]
    tm = t_mask[:, None]
    pre = _sigmoid(_logits(mix_ptr, base_ptr, scale_ptr, tt, tm, p, p < N, 0, NOUT)) + eps
    if not HEAD:
        post = 2.0 * _sigmoid(_logits(mix_ptr, base_ptr, scale_ptr, tt, tm, N + p, p < N, 1, NOUT))
        tl.store(post_ptr + tt * N + p, post, mask=tm & (p < N))
        i, j, valid, rows = _comb_tile(P, N)
        t3 = t[:, None, None]
        t3_mask = t_mask[:, None, None]
        z = _logits(mix_ptr, base_ptr, scale_ptr, t3, t3_mask, 2 * N + i * N + j, valid, 2, NOUT)
        comb = _sinkhorn(z, valid, rows, eps, ITERS)
        tl.store(comb_ptr + t3 * (N * N) + i * N + j, comb, mask=t3_mask & valid)
    return pre


@triton.jit
def _stream_tile(x_ptr, t, t_mask, d, d_mask, N: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """[BT, P, BD] fp32 tile of the streams (padded streams 0)."""
    j = tl.arange(0, P)[None, :, None]
    mask = t_mask[:, None, None] & (j < N) & d_mask[None, None, :]
    ptrs = x_ptr + t[:, None, None] * (N * D) + j * D + d[None, None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rounded(ptrs, v, mask, DOWNCAST: tl.constexpr):
    """Store fp32 ``v`` in the pointer's dtype (bf16/fp16: round to nearest even, as eager's cast)."""
    if DOWNCAST:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _mhc_fn_pieces(fn_ptr, out_ptr, K, NOUT: tl.constexpr, NO: tl.constexpr, BLOCK: tl.constexpr):
    """``fn`` [NOUT, K] fp32 as its three bf16 pieces [3, NO, K] (hi, mid, lo: ``_bf16_pieces``; rows past NOUT
    zero), once per call, for the Gluon projection (``kernel_proj_gluon.py``)."""
    row = tl.program_id(0)
    k = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = k < K
    hi, mid, lo = _bf16_pieces(tl.load(fn_ptr + row * K + k, mask=m & (row < NOUT), other=0.0))
    tl.store(out_ptr + row * K + k, hi, mask=m)
    tl.store(out_ptr + (NO + row) * K + k, mid, mask=m)
    tl.store(out_ptr + (2 * NO + row) * K + k, lo, mask=m)


@triton.jit
def _mhc_proj_fwd(
    x_ptr, fn_ptr, part_ptr, T, KS,
    N: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr, NO: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    DOT: tl.constexpr,
):
    """Program (i, s): BT tokens' ``x @ fn^T`` and ``sum(x^2)`` over the columns ``[s KS, (s + 1) KS)`` of their
    flattened rows (a split of K = N D: more programs than token blocks), one pass over that part of the streams.
    Stores ``part[s]`` [T, NO] fp32: the projection in columns < NOUT, the squares in column NOUT."""
    K: tl.constexpr = N * D
    split = tl.program_id(1)
    row0 = split.to(tl.int64) * T
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    t_mask = t < T
    c = tl.arange(0, NO)
    acc = tl.zeros([BT, NO], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    k_end = tl.minimum(split * KS + KS, K)
    for k0 in range(split * KS, k_end, BK):
        k = k0 + tl.arange(0, BK)
        if K % BK == 0:  # every tile full (KS is a multiple of BK): masks constant along k, 16-byte loads
            k_mask = k < K
        else:
            k_mask = k < k_end
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        w = tl.load(fn_ptr + c[None, :] * K + k[:, None], mask=(c < NOUT)[None, :] & k_mask[:, None], other=0.0)
        acc += _dot(x, w, DOT, 1)
    acc = tl.where(c[None, :] == NOUT, ss[:, None], acc)
    tl.store(part_ptr + (row0 + t[:, None]) * NO + c[None, :], acc, mask=t_mask[:, None])


@triton.jit
def _mhc_pre_fwd(
    x_ptr, part_ptr, base_ptr, scale_ptr, mix_ptr, r_ptr, post_ptr, comb_ptr, y_ptr,
    T, SPLITS, eps, norm_eps,
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr, NO: tl.constexpr,
    ITERS: tl.constexpr, HEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, DOWNCAST: tl.constexpr,
):
    """BT tokens: the projection's splits summed in order (``_mhc_proj_fwd``), the RMS factor, ``mix`` (stored,
    read back in the gates' layouts after a barrier), gates and Sinkhorn in registers, then the collapse in a
    second pass over the streams."""
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    t_mask = t < T
    c = tl.arange(0, NO)
    acc = tl.zeros([BT, NO], dtype=tl.float32)
    ptrs = part_ptr + t[:, None] * NO + c[None, :]
    for _ in range(SPLITS):
        acc += tl.load(ptrs, mask=t_mask[:, None], other=0.0)
        ptrs += T * NO
    ss = tl.sum(tl.where(c[None, :] == NOUT, acc, 0.0), axis=1)
    r = 1.0 / tl.sqrt_rn(ss / (N * D) + norm_eps)
    tl.store(mix_ptr + t[:, None] * NOUT + c[None, :], acc * r[:, None], mask=t_mask[:, None] & (c < NOUT)[None, :])
    tl.store(r_ptr + t, r, mask=t_mask)
    tl.debug_barrier()  # the gates read ``mix`` back in other layouts (other threads' stores)
    pre = _gates(mix_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, t, t_mask, eps, N, P, NOUT, ITERS, HEAD)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        d_mask = d < D
        y = tl.sum(pre[:, :, None] * _stream_tile(x_ptr, t, t_mask, d, d_mask, N, P, D), axis=1)
        _store_rounded(y_ptr + t[:, None] * D + d[None, :], y, t_mask[:, None] & d_mask[None, :], DOWNCAST)


@triton.jit
def _mhc_combine_fwd(
    x_ptr, f_ptr, post_ptr, comb_ptr, out_ptr, T,
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, DOWNCAST: tl.constexpr,
):
    """``out[t, k] = post[t, k] f[t] + sum_j comb[t, j, k] x[t, j]`` on a [BT tokens, BD channels] tile."""
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    t_mask = t < T
    d_mask = d < D
    mask = t_mask[:, None] & d_mask[None, :]
    x3 = _stream_tile(x_ptr, t, t_mask, d, d_mask, N, P, D)
    f = tl.load(f_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    j = tl.arange(0, P)[None, :]
    for k in range(N):
        c_k = tl.load(comb_ptr + t[:, None] * (N * N) + j * N + k, mask=t_mask[:, None] & (j < N), other=0.0)
        p_k = tl.load(post_ptr + t * N + k, mask=t_mask, other=0.0)
        out = p_k[:, None] * f + tl.sum(c_k[:, :, None] * x3, axis=1)
        _store_rounded(out_ptr + t[:, None] * (N * D) + k * D + d[None, :], out, mask, DOWNCAST)

