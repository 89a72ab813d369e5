"""Device code of the fused mHC backward: the pre backward (per token block), the streams' gradient with the
parameter gradient's split sums, the sums' fixed-order reduction, and the combine backward (per token block).
Layouts as in ``kernel_fwd.py``.

Pre backward, per token (``g_*`` are gradients of the loss):

- ``g_pre[j] = sum_d g_y[d] x[j, d]`` (first pass over the streams); the gates' logits get
  ``g_z = g_pre s (1 - s)`` (pre), ``2 g_post s (1 - s)`` (post) and the Sinkhorn backward (comb);
- the Sinkhorn backward differentiates the unrolled iterations; the state entering step k is recomputed from
  the logits (``k`` forward steps, O(ITERS^2) small n x n operations in registers instead of storing
  2 * ITERS states per token);
- ``g_mix = g_z * scale``; with ``r = rsqrt(mean(x^2) + eps)`` and ``mix = r (x @ fn^T)``:
  ``g_x = pre_j g_y + r (g_mix @ fn) - x r^2 / (nD) sum_c g_mix[c] mix[c]`` (second pass).

``_mhc_pre_bwd`` writes ``g_z`` [T, NOUT], ``G = g_mix r`` [T, NO], ``coef = -r^2 / (nD) sum_c g_mix mix`` [T],
the pre gate [T, P] and, per token block, ``sum_t g_z`` and ``sum_t g_z mix``. ``_mhc_dx_bwd`` computes
``g_x = pre_j g_y + G @ fn + coef x`` on a channel tile of one stream over a run of tokens, and that run's
``G^T @ x`` (its share of ``g_fn``); ``_mhc_params_bwd`` adds the runs' shares (``g_fn``) and the blocks' sums
(``g_base``, ``g_scale[g] = sum over the group's columns``) in order. No atomics anywhere: every sum has one
fixed order, so results are byte-identical run to run. Device code only: no Paddle or torch import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.mhc.kernel_fwd import (
    _bf16_pieces,
    _comb_tile,
    _dot,
    _dot_split,
    _group_scale,
    _logits,
    _sigmoid,
    _softmax_rows,
    _store_rounded,
    _stream_tile,
    _sum_combine,
)


@triton.jit
def _sinkhorn_bwd(z, g, valid, rows, eps, ITERS: tl.constexpr):
    """Gradient w.r.t. the logits ``z`` [BT, P, P] of ``kernel_fwd._sinkhorn`` given ``g`` for its output.

    For ``y = x / (sum(x) + eps)`` along an axis: ``g_x = (g_y - sum(g_y y)) / (sum(x) + eps)`` (padded entries
    held at 0). Written out in the loops (see ``kernel_fwd._sinkhorn``: no jitted calls in hot loops)."""
    s = _softmax_rows(z, valid, rows)
    a0 = tl.where(valid, s + eps, 0.0)
    for k in range(ITERS - 1):
        a = a0
        b = a0
        for _ in range(ITERS - 1 - k):  # recompute A_step (a) and B_{step-1} (b), step = ITERS - 1 - k
            b = a / (tl.reduce(a, 1, _sum_combine)[:, None, :] + eps)
            a = b / (tl.reduce(b, 2, _sum_combine)[:, :, None] + eps)
        c = tl.reduce(a, 1, _sum_combine)[:, None, :] + eps  # the step's column normalisation, backwards
        g = tl.where(valid, (g - tl.reduce(g * (a / c), 1, _sum_combine)[:, None, :]) / c, 0.0)
        c = tl.reduce(b, 2, _sum_combine)[:, :, None] + eps  # its row normalisation, backwards
        g = tl.where(valid, (g - tl.reduce(g * (b / c), 2, _sum_combine)[:, :, None]) / c, 0.0)
    c = tl.sum(a0, axis=1)[:, None, :] + eps
    g = tl.where(valid, (g - tl.sum(g * (a0 / c), axis=1)[:, None, :]) / c, 0.0)
    return s * (g - tl.sum(g * s, axis=2)[:, :, None])


@triton.jit
def _gate_grad_pass(x_ptr, dy_ptr, t, t_mask, N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr):
    """``g_pre [BT, P] = sum_d g_y[t, d] x[t, j, d]`` (first pass over the streams)."""
    acc = tl.zeros([BT, P], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        d_mask = d < D
        dy = tl.load(dy_ptr + t[:, None] * D + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        acc += tl.sum(_stream_tile(x_ptr, t, t_mask, d, d_mask, N, P, D) * dy.to(tl.float32)[:, None, :], axis=2)
    return acc


@triton.jit
def _logit_grads(mix_ptr, base_ptr, scale_ptr, dpost_ptr, dcomb_ptr, dz_ptr, d_pre, t, t_mask, eps,
                 N: tl.constexpr, P: tl.constexpr, NOUT: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr):
    """Store ``g_z`` [T, NOUT]: the gates' backward (sigmoid, 2 sigmoid, Sinkhorn) from their output gradients."""
    p = tl.arange(0, P)[None, :]
    tt = t[:, None]
    tm = t_mask[:, None] & (p < N)
    s = _sigmoid(_logits(mix_ptr, base_ptr, scale_ptr, tt, t_mask[:, None], p, p < N, 0, NOUT))
    tl.store(dz_ptr + tt * NOUT + p, d_pre * s * (1.0 - s), mask=tm)
    if not HEAD:
        s = _sigmoid(_logits(mix_ptr, base_ptr, scale_ptr, tt, t_mask[:, None], N + p, p < N, 1, NOUT))
        d_post = tl.load(dpost_ptr + tt * N + p, mask=tm, other=0.0)
        tl.store(dz_ptr + tt * NOUT + N + p, (2.0 * d_post) * s * (1.0 - s), mask=tm)
        i, j, valid, rows = _comb_tile(P, N)
        t3 = t[:, None, None]
        t3_mask = t_mask[:, None, None]
        z = _logits(mix_ptr, base_ptr, scale_ptr, t3, t3_mask, 2 * N + i * N + j, valid, 2, NOUT)
        g = tl.load(dcomb_ptr + t3 * (N * N) + i * N + j, mask=t3_mask & valid, other=0.0)
        tl.store(dz_ptr + t3 * NOUT + 2 * N + i * N + j, _sinkhorn_bwd(z, g, valid, rows, eps, ITERS),
                 mask=t3_mask & valid)


@triton.jit
def _mhc_pre_bwd(
    x_ptr, base_ptr, scale_ptr, mix_ptr, r_ptr, dpost_ptr, dcomb_ptr, dy_ptr, dz_ptr, g_ptr, coef_ptr, pre_ptr,
    sums_ptr, T, eps,
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr, NO: tl.constexpr,
    ITERS: tl.constexpr, HEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """BT tokens: g_pre (one pass over the streams), the logits' gradient ``g_z`` (stored, read back after a
    barrier), then per token what the streams' gradient needs (``_mhc_dx_bwd``): ``G = g_mix r`` [T, NO] (0 past
    NOUT), ``coef`` [T] and the pre gate [T, P]; and this block's sums of ``g_z`` and ``g_z mix`` (``sums``)."""
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BT + tl.arange(0, BT)
    t_mask = t < T
    d_pre = _gate_grad_pass(x_ptr, dy_ptr, t, t_mask, N, P, D, BT, BD)
    _logit_grads(mix_ptr, base_ptr, scale_ptr, dpost_ptr, dcomb_ptr, dz_ptr, d_pre, t, t_mask, eps, N, P, NOUT,
                 ITERS, HEAD)
    tl.debug_barrier()  # g_z is read back as [BT, NO] rows (other threads' stores)
    c = tl.arange(0, NO)
    mask = t_mask[:, None] & (c < NOUT)[None, :]
    dz = tl.load(dz_ptr + t[:, None] * NOUT + c[None, :], mask=mask, other=0.0, cache_modifier=".cg")  # see _logits
    mix = tl.load(mix_ptr + t[:, None] * NOUT + c[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + t, mask=t_mask, other=0.0)
    d_mix = dz * _group_scale(scale_ptr, c, N, HEAD)[None, :]
    tl.store(g_ptr + t[:, None] * NO + c[None, :], d_mix * r[:, None], mask=t_mask[:, None])
    tl.store(coef_ptr + t, -((r * r) / (N * D)) * tl.sum(d_mix * mix, axis=1), mask=t_mask)
    p = tl.arange(0, P)[None, :]
    pre = _sigmoid(_logits(mix_ptr, base_ptr, scale_ptr, t[:, None], t_mask[:, None], p, p < N, 0, NOUT)) + eps
    tl.store(pre_ptr + t[:, None] * P + p, pre, mask=t_mask[:, None] & (p < N))
    tl.store(sums_ptr + (2 * pid) * NO + c, tl.sum(dz, axis=0))
    tl.store(sums_ptr + (2 * pid + 1) * NO + c, tl.sum(dz * mix, axis=0))


@triton.jit
def _mhc_dx_bwd(
    x_ptr, fn_ptr, g_ptr, pre_ptr, coef_ptr, dy_ptr, dx_ptr, part_ptr, T, TS,
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr, NO: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, GX: tl.constexpr, DOT: tl.constexpr, DOWNCAST: tl.constexpr,
):
    """Program (i, s): channels ``[b BD, (b + 1) BD)`` of stream ``j`` (``i = b N + j``: the N streams of one
    channel tile run side by side, so ``g_y``'s tile is read from memory once; ``fn``'s slab is loaded once) over
    the tokens ``[s TS, (s + 1) TS)`` in order: the streams' gradient ``g_x = pre_j g_y + G @ fn + coef x``
    (second pass), and ``part[s] = G^T @ x`` [NO, N D] summed over those tokens (the parameter gradient's split;
    ``_mhc_params_bwd`` adds the splits in order)."""
    K: tl.constexpr = N * D
    split = tl.program_id(1)
    j = tl.program_id(0) % N
    d = (tl.program_id(0) // N) * BD + tl.arange(0, BD)
    d_mask = d < D
    k = j * D + d
    c = tl.arange(0, NO)
    w = tl.load(fn_ptr + c[:, None] * K + k[None, :], mask=(c < NOUT)[:, None] & d_mask[None, :], other=0.0)
    if GX >= 3:  # fn's pieces once per program
        w_hi, w_mid, w_lo = _bf16_pieces(w)
    acc = tl.zeros([NO, BD], dtype=tl.float32)
    t_end = tl.minimum(split * TS + TS, T)
    for t0 in range(split * TS, t_end, BT):
        t = t0 + tl.arange(0, BT).to(tl.int64)
        t_mask = t < t_end
        mask = t_mask[:, None] & d_mask[None, :]
        g = tl.load(g_ptr + t[:, None] * NO + c[None, :], mask=t_mask[:, None], other=0.0)
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        pre = tl.load(pre_ptr + t * P + j, mask=t_mask, other=0.0)
        coef = tl.load(coef_ptr + t, mask=t_mask, other=0.0)
        if GX >= 3:
            g_hi, g_mid, g_lo = _bf16_pieces(g)
            gx = _dot_split(g_hi, g_mid, g_lo, w_hi, w_mid, w_lo, GX)
        else:
            gx = _dot(g, w, GX, 0)
        dx = pre[:, None] * dy + gx + coef[:, None] * x.to(tl.float32)
        _store_rounded(dx_ptr + t[:, None] * K + k[None, :], dx, mask, DOWNCAST)
        acc += _dot(tl.trans(g), x, DOT, 2)
    tl.store(part_ptr + (split.to(tl.int64) * NO + c[:, None]) * K + k[None, :], acc, mask=d_mask[None, :])


@triton.jit
def _base_scale_sums(sums_ptr, dbase_ptr, dscale_ptr, BLOCKS, N: tl.constexpr, NOUT: tl.constexpr,
                     NO: tl.constexpr, BB: tl.constexpr, HEAD: tl.constexpr, GROUPS: tl.constexpr):
    """``g_base = sum_t g_z[t]`` and ``g_scale[g] = sum_t sum_{c in g} g_z[t, c] mix[t, c]`` from the token
    blocks' sums (``_mhc_pre_bwd``), blocks in order."""
    c = tl.arange(0, NO)
    b = tl.arange(0, BB)
    acc_b = tl.zeros([NO], dtype=tl.float32)
    acc_s = tl.zeros([NO], dtype=tl.float32)
    for b0 in range(0, BLOCKS, BB):
        rows = b0 + b
        m = (rows < BLOCKS)[:, None]
        acc_b += tl.sum(tl.load(sums_ptr + (2 * rows[:, None]) * NO + c[None, :], mask=m, other=0.0), axis=0)
        acc_s += tl.sum(tl.load(sums_ptr + (2 * rows[:, None] + 1) * NO + c[None, :], mask=m, other=0.0), axis=0)
    c_mask = c < NOUT
    tl.store(dbase_ptr + c, acc_b, mask=c_mask)
    if HEAD:
        group = c * 0
    else:
        group = tl.where(c < N, 0, tl.where(c < 2 * N, 1, 2))
    for gi in range(GROUPS):
        tl.store(dscale_ptr + gi, tl.sum(tl.where(c_mask & (group == gi), acc_s, 0.0), axis=0))


@triton.jit
def _mhc_params_bwd(
    part_ptr, sums_ptr, dfn_ptr, dbase_ptr, dscale_ptr, SPLITS, BLOCKS,
    N: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr, NO: tl.constexpr, BLOCK: tl.constexpr, BB: tl.constexpr,
    HEAD: tl.constexpr, GROUPS: tl.constexpr,
):
    """Programs 0 .. cdiv(NOUT N D, BLOCK) - 1: ``g_fn`` = the splits of ``_mhc_dx_bwd`` added in order, BLOCK
    entries each; the last one: ``g_base`` and ``g_scale``."""
    pid = tl.program_id(0)
    if pid * BLOCK < NOUT * N * D:
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < NOUT * N * D
        ptrs = part_ptr + i
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(SPLITS):
            acc += tl.load(ptrs, mask=m, other=0.0)
            ptrs += NO * N * D
        tl.store(dfn_ptr + i, acc, mask=m)
    else:
        _base_scale_sums(sums_ptr, dbase_ptr, dscale_ptr, BLOCKS, N, NOUT, NO, BB, HEAD, GROUPS)


@triton.jit
def _mhc_combine_bwd(
    x_ptr, f_ptr, post_ptr, comb_ptr, dout_ptr, dx_ptr, df_ptr, dpost_ptr, dcomb_ptr, T,
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    DOWNCAST_X: tl.constexpr, DOWNCAST_F: tl.constexpr,
):
    """BT tokens over all channels: ``g_x[j] = sum_k comb[j, k] g[k]``, ``g_f = sum_k post_k g[k]`` per tile;
    ``g_post[k] = sum_d g[k] f`` and ``g_comb[j, k] = sum_d x[j] g[k]`` summed over the tiles in order."""
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    t_mask = t < T
    p = tl.arange(0, P)[None, :]
    post = tl.load(post_ptr + t[:, None] * N + p, mask=t_mask[:, None] & (p < N), other=0.0)
    d_post = tl.zeros([BT, P], dtype=tl.float32)
    d_comb = tl.zeros([BT, P, P], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        d_mask = d < D
        mask = t_mask[:, None] & d_mask[None, :]
        g3 = _stream_tile(dout_ptr, t, t_mask, d, d_mask, N, P, D)
        f = tl.load(f_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        _store_rounded(df_ptr + t[:, None] * D + d[None, :], tl.sum(post[:, :, None] * g3, axis=1), mask, DOWNCAST_F)
        d_post += tl.sum(g3 * f[:, None, :], axis=2)
        for j in range(N):
            c_j = tl.load(comb_ptr + t[:, None] * (N * N) + j * N + p, mask=t_mask[:, None] & (p < N), other=0.0)
            dx_ptrs = dx_ptr + t[:, None] * (N * D) + j * D + d[None, :]
            _store_rounded(dx_ptrs, tl.sum(c_j[:, :, None] * g3, axis=1), mask, DOWNCAST_X)
            x_j = tl.load(x_ptr + t[:, None] * (N * D) + j * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
            row = tl.sum(x_j[:, None, :] * g3, axis=2)
            d_comb += tl.where(p[:, :, None] == j, row[:, None, :], 0.0)
    tl.store(dpost_ptr + t[:, None] * N + p, d_post, mask=t_mask[:, None] & (p < N))
    i = tl.arange(0, P)[None, :, None]
    k = tl.arange(0, P)[None, None, :]
    tl.store(dcomb_ptr + t[:, None, None] * (N * N) + i * N + k, d_comb,
             mask=t_mask[:, None, None] & (i < N) & (k < N))

