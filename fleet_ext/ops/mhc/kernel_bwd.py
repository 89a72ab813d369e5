"""Device code of the fused mHC backward: the pre backward (per token block), the streams' gradient with the
parameter gradient's split sums, the sums' fixed-order reduction, and the combine backward (per token block).
Layouts as in ``kernel_fwd.py``.

Pre backward, per token (``g_*`` are gradients of the loss):

- ``g_pre[j] = sum_d g_y[d] x[j, d]`` (first pass over the streams); the gates' logits get
  ``g_z = g_pre s (1 - s)`` (pre), ``2 g_post s (1 - s)`` (post) and the Sinkhorn backward (comb);
- the Sinkhorn backward differentiates the unrolled iterations; the 2 ITERS - 1 states it needs are kept in
  registers (``STATES`` 2: the iterations unrolled, no memory), stored once to a scratch buffer
  ([T, 2 ITERS - 1, n, n] fp32, ``STATES`` 1: each read back from L2 in the backward's chain) or recomputed from
  the logits for every step (``STATES`` 0: O(ITERS^2) operations, no scratch); the same bytes every way;
- ``g_mix = g_z * scale``; with ``r = rsqrt(mean(x^2) + eps)`` and ``mix = r (x @ fn^T)``:
  ``g_x = pre_j g_y + r (g_mix @ fn) - x r^2 / (nD) sum_c g_mix[c] mix[c]`` (second pass).

``_mhc_pre_bwd`` writes ``g_z`` [T, NOUT], ``G = g_mix r`` [T, NO] (fp32, or its three bf16 pieces [3, T, NO]),
``coef = -r^2 / (nD) sum_c g_mix mix`` [T],
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
    _comb_tile,
    _group_scale,
    _logits,
    _sigmoid,
    _softmax_rows,
    _store_rounded,
    _sum_combine,
)
from fleet_ext.ops.split_dot import _bf16_pieces, _dot, _dot3, _dot_split


@triton.jit
def _step_bwd(g, a, b, valid, eps):
    """One Sinkhorn step (``b`` row-normalised into ``a``, after ``b`` came from a column normalisation), backwards:
    ``g`` through ``a``'s column sums, then through ``b``'s row sums. For ``y = x / (sum(x) + eps)`` along an axis:
    ``g_x = (g_y - sum(g_y y)) / (sum(x) + eps)`` (padded entries held at 0)."""
    c = tl.reduce(a, 1, _sum_combine)[:, None, :] + eps  # the step's column normalisation, backwards
    g = tl.where(valid, (g - tl.reduce(g * (a / c), 1, _sum_combine)[:, None, :]) / c, 0.0)
    c = tl.reduce(b, 2, _sum_combine)[:, :, None] + eps  # its row normalisation, backwards
    return tl.where(valid, (g - tl.reduce(g * (b / c), 2, _sum_combine)[:, :, None]) / c, 0.0)


@triton.jit
def _first_steps_bwd(g, s, a0, valid, eps):
    """The first column normalisation of ``a0 = softmax + eps`` and the row softmax ``s``, backwards: the logits'
    gradient."""
    c = tl.sum(a0, axis=1)[:, None, :] + eps
    g = tl.where(valid, (g - tl.sum(g * (a0 / c), axis=1)[:, None, :]) / c, 0.0)
    return s * (g - tl.sum(g * s, axis=2)[:, :, None])


@triton.jit
def _sinkhorn_bwd(z, g, valid, rows, eps, ITERS: tl.constexpr):
    """Gradient w.r.t. the logits ``z`` [BT, P, P] of ``kernel_fwd._sinkhorn`` given ``g`` for its output.

    Each step backwards is ``_step_bwd``: one jitted call per step (the interpreter re-patches Triton's builtins
    per call, ``kernel_fwd._sinkhorn``), against the O(ITERS^2) recomputation around it."""
    s = _softmax_rows(z, valid, rows)
    a0 = tl.where(valid, s + eps, 0.0)
    for k in range(ITERS - 1):
        a = a0
        b = a0
        for _ in range(ITERS - 1 - k):  # recompute A_step (a) and B_{step-1} (b), step = ITERS - 1 - k
            b = a / (tl.reduce(a, 1, _sum_combine)[:, None, :] + eps)
            a = b / (tl.reduce(b, 2, _sum_combine)[:, :, None] + eps)
        g = _step_bwd(g, a, b, valid, eps)
    return _first_steps_bwd(g, s, a0, valid, eps)


@triton.jit
def _sinkhorn_bwd_kept(z, g, valid, rows, eps, ITERS: tl.constexpr):
    """``_sinkhorn_bwd`` with the forward's states kept in registers: the iterations unrolled (``static_range``), each
    state a tensor of its own in a tuple, so the backward's chain of small steps never waits on memory (stored, each
    step's states come back from L2 in the chain). The same operations in the same order as the other two forms, so
    the same bytes; 2 ITERS - 1 values per thread for each [P, P] entry it holds."""
    s = _softmax_rows(z, valid, rows)
    a0 = tl.where(valid, s + eps, 0.0)
    a = a0
    kept_a = (a0,)
    kept_b = (a0,)  # slot 0 unused: b_m follows a_(m-1)
    for _ in tl.static_range(1, ITERS):
        b = a / (tl.reduce(a, 1, _sum_combine)[:, None, :] + eps)
        a = b / (tl.reduce(b, 2, _sum_combine)[:, :, None] + eps)
        kept_a = kept_a + (a,)
        kept_b = kept_b + (b,)
    for k in tl.static_range(ITERS - 1):
        a = kept_a[ITERS - 1 - k]
        b = kept_b[ITERS - 1 - k]
        g = _step_bwd(g, a, b, valid, eps)
    return _first_steps_bwd(g, s, a0, valid, eps)


@triton.jit
def _sinkhorn_bwd_stored(z, g, valid, rows, eps, states, mask, ITERS: tl.constexpr, PP: tl.constexpr):
    """``_sinkhorn_bwd`` with the forward's states stored once instead of recomputed for every step: O(ITERS)
    small operations instead of O(ITERS^2). ``states`` [BT, P * P] points at this block's first slot of a
    [T, 2 ITERS - 1, P, P] fp32 scratch (slot 2m: the state after m row normalisations, 2m - 1: the column
    normalisation before it), ``mask`` [BT, P * P] the valid entries of real tokens; each state goes through memory
    as a token's P * P row and is reshaped to [BT, P, P] (see ``_logit_grads``). The same operations in the same
    order as the recomputation, so the same bytes."""
    s = _softmax_rows(z, valid, rows)
    a0 = tl.where(valid, s + eps, 0.0)
    a = a0
    for m in range(1, ITERS):
        b = a / (tl.reduce(a, 1, _sum_combine)[:, None, :] + eps)
        a = b / (tl.reduce(b, 2, _sum_combine)[:, :, None] + eps)
        tl.store(states + (2 * m - 1) * PP, tl.reshape(b, [z.shape[0], PP]), mask=mask)
        tl.store(states + (2 * m) * PP, tl.reshape(a, [z.shape[0], PP]), mask=mask)
    tl.debug_barrier()  # read back below in the same layout; L2 (.cg), as ``kernel_fwd._logits`` says why
    for k in range(ITERS - 1):
        step = ITERS - 1 - k
        a = tl.reshape(tl.load(states + (2 * step) * PP, mask=mask, other=0.0, cache_modifier=".cg"), z.shape)
        b = tl.reshape(tl.load(states + (2 * step - 1) * PP, mask=mask, other=0.0, cache_modifier=".cg"), z.shape)
        g = _step_bwd(g, a, b, valid, eps)
    return _first_steps_bwd(g, s, a0, valid, eps)


@triton.jit
def _gate_tiles(x_ptr, dy_ptr, t, t_mask, d0, N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Channels ``[d0, d0 + BD)`` of the first pass as stored: the streams [BT, P, BD] (padded streams 0) and
    ``g_y`` [BT, BD]; past ``D`` nothing is read."""
    d = d0 + tl.arange(0, BD)
    d_mask = d < D
    j = tl.arange(0, P)[None, :, None]
    x = tl.load(x_ptr + t[:, None, None] * (N * D) + j * D + d[None, None, :],
                mask=t_mask[:, None, None] & (j < N) & d_mask[None, None, :], other=0.0)
    dy = tl.load(dy_ptr + t[:, None] * D + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
    return x, dy


@triton.jit
def _gate_grad_pass(x_ptr, dy_ptr, t, t_mask, N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr, PREFETCH: tl.constexpr, LANES: tl.constexpr):
    """``g_pre [BT, P] = sum_d g_y[t, d] x[t, j, d]`` (first pass over the streams). With ``PREFETCH`` the next
    channel tile is loaded before this one is reduced (the compiler pipelines only loads that feed a tensor-core
    product): the same sums in the same order. ``LANES``: each channel lane sums its products over the tiles and the
    lanes are added once at the end (no cross-thread reduction per tile; another order)."""
    acc = tl.zeros([BT, P], dtype=tl.float32)
    if LANES:
        lanes = tl.zeros([BT, P, BD], dtype=tl.float32)
    if PREFETCH:
        x_next, dy_next = _gate_tiles(x_ptr, dy_ptr, t, t_mask, 0, N, P, D, BD)
    for d0 in range(0, D, BD):
        if PREFETCH:
            x, dy = x_next, dy_next
            x_next, dy_next = _gate_tiles(x_ptr, dy_ptr, t, t_mask, d0 + BD, N, P, D, BD)
        else:
            x, dy = _gate_tiles(x_ptr, dy_ptr, t, t_mask, d0, N, P, D, BD)
        products = x.to(tl.float32) * dy.to(tl.float32)[:, None, :]
        if LANES:
            lanes += products
        else:
            acc += tl.sum(products, axis=2)
    if LANES:
        acc = tl.sum(lanes, axis=2)
    return acc


@triton.jit
def _logit_grads(mix_ptr, base_ptr, scale_ptr, dpost_ptr, dcomb_ptr, dz_ptr, states_ptr, d_pre, t, t_mask, eps,
                 N: tl.constexpr, P: tl.constexpr, NOUT: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr,
                 STATES: tl.constexpr, PARTS: tl.constexpr):
    """Store ``g_z`` [T, NOUT]: the gates' backward from their output gradients; ``PARTS`` 1: the pre gate's
    (sigmoid, from ``d_pre``), 2: the post gate's and the Sinkhorn's (2 sigmoid, Sinkhorn), 3: both."""
    p = tl.arange(0, P)[None, :]
    tt = t[:, None]
    tm = t_mask[:, None] & (p < N)
    if PARTS & 1:
        s = _sigmoid(_logits(mix_ptr, base_ptr, scale_ptr, tt, t_mask[:, None], p, p < N, 0, NOUT))
        tl.store(dz_ptr + tt * NOUT + p, d_pre * s * (1.0 - s), mask=tm)
    if not HEAD and (PARTS & 2):
        s = _sigmoid(_logits(mix_ptr, base_ptr, scale_ptr, tt, t_mask[:, None], N + p, p < N, 1, NOUT))
        d_post = tl.load(dpost_ptr + tt * N + p, mask=tm, other=0.0)
        tl.store(dz_ptr + tt * NOUT + N + p, (2.0 * d_post) * s * (1.0 - s), mask=tm)
        # Each token's P x P tile goes through memory as one row of P * P and is reshaped to [BT, P, P] here: loads
        # through 3-D pointers made Triton spread a tile's rows over warps (every column sum through shared memory
        # and a barrier); loaded as rows, a tile stays within one warp (its sums are shuffles).
        _, _, valid, rows = _comb_tile(P, N)
        f = tl.arange(0, P * P)[None, :]
        fi, fj = f // P, f % P
        flat_valid = (fi < N) & (fj < N)
        tt_mask = t_mask[:, None] & flat_valid
        z = tl.reshape(_logits(mix_ptr, base_ptr, scale_ptr, tt, t_mask[:, None], 2 * N + fi * N + fj, flat_valid, 2,
                               NOUT), [t.shape[0], P, P])
        g = tl.reshape(tl.load(dcomb_ptr + tt * (N * N) + fi * N + fj, mask=tt_mask, other=0.0), [t.shape[0], P, P])
        if STATES == 2:
            g = _sinkhorn_bwd_kept(z, g, valid, rows, eps, ITERS)
        elif STATES:
            states = states_ptr + tt * ((2 * ITERS - 1) * P * P) + f
            g = _sinkhorn_bwd_stored(z, g, valid, rows, eps, states, tt_mask, ITERS, P * P)
        else:
            g = _sinkhorn_bwd(z, g, valid, rows, eps, ITERS)
        tl.store(dz_ptr + tt * NOUT + 2 * N + fi * N + fj, tl.reshape(g, [t.shape[0], P * P]), mask=tt_mask)


@triton.jit
def _mhc_gates_bwd(
    x_ptr, dy_ptr, dpre_ptr, base_ptr, scale_ptr, mix_ptr, dpost_ptr, dcomb_ptr, dz_ptr, states_ptr, T, eps,
    SINKHORN_BLOCKS, N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr, ITERS: tl.constexpr,
    HEAD: tl.constexpr, STATES: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, PREFETCH: tl.constexpr,
    LANES: tl.constexpr, SINKHORN_BT: tl.constexpr, EVERY: tl.constexpr,
):
    """The pre backward's two independent parts in one grid (``_mhc_pre_bwd`` with ``SPLIT`` does the rest):
    SINKHORN_BLOCKS programs run the post gate's and the Sinkhorn's backward of SINKHORN_BT tokens each into
    ``g_z`` (a latency-bound chain of small steps, a few bytes), the others the first pass over the streams, BT
    tokens each, into ``g_pre`` [T, P] (bandwidth-bound). One after the other in one program the SMs' memory pipe
    idles during the chain (measured: 155 + 78 us); in one grid the streaming programs fill the SMs around the
    chains. The Sinkhorn programs are ``0, EVERY, 2 EVERY, ...`` (EVERY 1: the first SINKHORN_BLOCKS)."""
    pid = tl.program_id(0)
    if pid % EVERY == 0 and pid // EVERY < SINKHORN_BLOCKS:
        ts = (pid // EVERY).to(tl.int64) * SINKHORN_BT + tl.arange(0, SINKHORN_BT)  # (names differ by branch)
        _logit_grads(mix_ptr, base_ptr, scale_ptr, dpost_ptr, dcomb_ptr, dz_ptr, states_ptr, 0.0, ts, ts < T, eps,
                     N, P, NOUT, ITERS, HEAD, STATES, 2)
    else:  # stream block: pid less the Sinkhorn programs before it
        t = (pid - tl.minimum(pid // EVERY + 1, SINKHORN_BLOCKS)).to(tl.int64) * BT + tl.arange(0, BT)
        t_mask = t < T
        d_pre = _gate_grad_pass(x_ptr, dy_ptr, t, t_mask, N, P, D, BT, BD, PREFETCH, LANES)
        tl.store(dpre_ptr + t[:, None] * P + tl.arange(0, P)[None, :], d_pre, mask=t_mask[:, None])


@triton.jit
def _mhc_pre_bwd(
    x_ptr, base_ptr, scale_ptr, mix_ptr, r_ptr, dpost_ptr, dcomb_ptr, dy_ptr, dz_ptr, g_ptr, coef_ptr, pre_ptr,
    sums_ptr, states_ptr, dpre_ptr, T, eps,
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr, NO: tl.constexpr,
    ITERS: tl.constexpr, HEAD: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, STATES: tl.constexpr,
    PIECES: tl.constexpr, SPLIT: tl.constexpr,
):
    """BT tokens: g_pre (one pass over the streams), the logits' gradient ``g_z`` (stored, read back after a
    barrier), then per token what the streams' gradient needs (``_mhc_dx_bwd``): ``G = g_mix r`` [T, NO] (0 past
    NOUT; with ``PIECES`` its three bf16 pieces [3, T, NO]), ``coef`` [T] and the pre gate [T, P]; and this
    block's sums of ``g_z`` and ``g_z mix`` (``sums``). ``STATES``: the Sinkhorn backward keeps its states in
    registers (2, ``_sinkhorn_bwd_kept``) or stores them to ``states_ptr`` [T, 2 ITERS - 1, P, P] (1,
    ``_sinkhorn_bwd_stored``) instead of recomputing them (0). ``SPLIT``:
    ``_mhc_gates_bwd`` ran first (``g_pre`` at ``dpre_ptr`` [T, P], the post and Sinkhorn parts of ``g_z``
    stored), so only the pre gate's part is left here."""
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BT + tl.arange(0, BT)
    t_mask = t < T
    if SPLIT:
        p = tl.arange(0, P)[None, :]
        d_pre = tl.load(dpre_ptr + t[:, None] * P + p, mask=t_mask[:, None], other=0.0)
    else:
        d_pre = _gate_grad_pass(x_ptr, dy_ptr, t, t_mask, N, P, D, BT, BD, 0, 0)
    _logit_grads(mix_ptr, base_ptr, scale_ptr, dpost_ptr, dcomb_ptr, dz_ptr, states_ptr, d_pre, t, t_mask, eps, N,
                 P, NOUT, ITERS, HEAD, STATES, 1 if SPLIT else 3)
    tl.debug_barrier()  # g_z is read back as [BT, NO] rows (other threads' stores)
    c = tl.arange(0, NO)
    mask = t_mask[:, None] & (c < NOUT)[None, :]
    dz = tl.load(dz_ptr + t[:, None] * NOUT + c[None, :], mask=mask, other=0.0, cache_modifier=".cg")  # see _logits
    mix = tl.load(mix_ptr + t[:, None] * NOUT + c[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + t, mask=t_mask, other=0.0)
    d_mix = dz * _group_scale(scale_ptr, c, N, HEAD)[None, :]
    g_ptrs = g_ptr + t[:, None] * NO + c[None, :]
    if PIECES:  # G as its three bf16 pieces [3, T, NO], split once here instead of in every _mhc_dx_bwd program
        g_hi, g_mid, g_lo = _bf16_pieces(d_mix * r[:, None])
        tl.store(g_ptrs, g_hi, mask=t_mask[:, None])
        tl.store(g_ptrs + T * NO, g_mid, mask=t_mask[:, None])
        tl.store(g_ptrs + 2 * T * NO, g_lo, mask=t_mask[:, None])
    else:
        tl.store(g_ptrs, d_mix * r[:, None], mask=t_mask[:, None])
    tl.store(coef_ptr + t, -((r * r) / (N * D)) * tl.sum(d_mix * mix, axis=1), mask=t_mask)
    p = tl.arange(0, P)[None, :]
    pre = _sigmoid(_logits(mix_ptr, base_ptr, scale_ptr, t[:, None], t_mask[:, None], p, p < N, 0, NOUT)) + eps
    tl.store(pre_ptr + t[:, None] * P + p, pre, mask=t_mask[:, None] & (p < N))
    tl.store(sums_ptr + (2 * pid) * NO + c, tl.sum(dz, axis=0))
    tl.store(sums_ptr + (2 * pid + 1) * NO + c, tl.sum(dz * mix, axis=0))


@triton.jit
def _dx_token_inputs(dy_ptr, pre_ptr, coef_ptr, t, t_end, j, d, d_mask, P: tl.constexpr, D: tl.constexpr):
    """A token tile's ``g_y`` (as stored), pre gate of stream ``j`` and ``coef``: the loads no tile product reads."""
    t_mask = t < t_end
    dy = tl.load(dy_ptr + t[:, None] * D + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
    pre = tl.load(pre_ptr + t * P + j, mask=t_mask, other=0.0)
    coef = tl.load(coef_ptr + t, mask=t_mask, other=0.0)
    return dy, pre, coef


@triton.jit
def _mhc_dx_bwd(
    x_ptr, fn_ptr, g_ptr, pre_ptr, coef_ptr, dy_ptr, dx_ptr, part_ptr, T, TS,
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr, NO: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, GX: tl.constexpr, DOT: tl.constexpr, DOWNCAST: tl.constexpr, PIECES: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Program (i, s): channels ``[b BD, (b + 1) BD)`` of stream ``j`` (``i = b N + j``: the N streams of one
    channel tile run side by side, so ``g_y``'s tile is read from memory once; ``fn``'s slab is loaded once) over
    the tokens ``[s TS, (s + 1) TS)`` in order: the streams' gradient ``g_x = pre_j g_y + G @ fn + coef x``
    (second pass), and ``part[s] = G^T @ x`` [NO, N D] summed over those tokens (the parameter gradient's split;
    ``_mhc_params_bwd`` adds the splits in order). The split is accumulated transposed, ``x^T @ G`` [BD, NO]:
    both products then have BT or BD rows (>= 64: Hopper's warp-group MMA). With ``PIECES`` (bf16 streams, both
    products on ``G``'s bf16 pieces) ``G`` comes as the pieces ``_mhc_pre_bwd`` split once per token: no fp32 ``G``
    and no splitting in each of the N D / BD programs that read a token, fewer registers (168 instead of 212 at
    64 x 64 tiles in the compiled sm90 code: three programs per SM instead of two). With ``PREFETCH`` the next
    tile's ``g_y``, pre gate and coef are loaded before this tile's products: the compiler pipelines only the loads
    that feed a product (``x``, ``G``), so otherwise every tile waits a full memory round trip for ``g_y``."""
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
    acc = tl.zeros([BD, NO], dtype=tl.float32)
    t_end = tl.minimum(split * TS + TS, T)
    tiles = tl.arange(0, BT).to(tl.int64)
    if PREFETCH:
        dy_next, pre_next, coef_next = _dx_token_inputs(dy_ptr, pre_ptr, coef_ptr, split * TS + tiles, t_end, j, d,
                                                        d_mask, P, D)
    for t0 in range(split * TS, t_end, BT):
        t = t0 + tiles
        t_mask = t < t_end
        mask = t_mask[:, None] & d_mask[None, :]
        g_ptrs = g_ptr + t[:, None] * NO + c[None, :]
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=mask, other=0.0)
        if PREFETCH:
            dy, pre, coef = dy_next, pre_next, coef_next
            dy_next, pre_next, coef_next = _dx_token_inputs(dy_ptr, pre_ptr, coef_ptr, t + BT, t_end, j, d, d_mask,
                                                            P, D)
        else:
            dy, pre, coef = _dx_token_inputs(dy_ptr, pre_ptr, coef_ptr, t, t_end, j, d, d_mask, P, D)
            dy = dy.to(tl.float32)
        if PIECES:  # G's bf16 pieces as _mhc_pre_bwd stored them (GX >= 3, DOT == 2)
            g_hi = tl.load(g_ptrs, mask=t_mask[:, None], other=0.0)
            g_mid = tl.load(g_ptrs + T * NO, mask=t_mask[:, None], other=0.0)
            g_lo = tl.load(g_ptrs + 2 * T * NO, mask=t_mask[:, None], other=0.0)
            gx = _dot_split(g_hi, g_mid, g_lo, w_hi, w_mid, w_lo, GX)
            acc += _dot3(tl.trans(x.to(tl.bfloat16)), g_hi, g_mid, g_lo)
        elif GX >= 3:
            g = tl.load(g_ptrs, mask=t_mask[:, None], other=0.0)
            g_hi, g_mid, g_lo = _bf16_pieces(g)
            gx = _dot_split(g_hi, g_mid, g_lo, w_hi, w_mid, w_lo, GX)
            if DOT == 2:  # x exact in bf16: the three products with G's pieces (split_dot._dot3)
                acc += _dot3(tl.trans(x.to(tl.bfloat16)), g_hi, g_mid, g_lo)
            else:
                acc += _dot(tl.trans(x), g, DOT, 1)
        else:
            g = tl.load(g_ptrs, mask=t_mask[:, None], other=0.0)
            gx = _dot(g, w, GX, 0)
            acc += _dot(tl.trans(x), g, DOT, 1)
        dx = pre[:, None] * dy.to(tl.float32) + gx + coef[:, None] * x.to(tl.float32)
        _store_rounded(dx_ptr + t[:, None] * K + k[None, :], dx, mask, DOWNCAST)
    tl.store(part_ptr + (split.to(tl.int64) * NO + c[None, :]) * K + k[:, None], acc, mask=d_mask[:, None])


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
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, V: tl.constexpr,
    DOWNCAST_X: tl.constexpr, DOWNCAST_F: tl.constexpr,
):
    """BT tokens, all channels in tiles of BD = TH x V: per tile ``g_x[j] = sum_k comb[j, k] g[k]`` and
    ``g_f = sum_k post_k g[k]`` (stored), and the products ``x[j] g[k]``, ``g[k] f`` summed over each thread's V
    adjacent channels only (``reshape`` to [.., TH, V], a sum inside the thread), kept per thread across the
    tiles; the sums over the TH threads' shares happen once, after the last tile (``g_post``, ``g_comb``): no
    reduction across threads per tile. Each (token, j, k) sum has one order for a given geometry.

    Layout (read off the compiled sm90 code, no layout conversion in the loop): x as [BT, P, 1, BD] and g as
    [BT, 1, P, BD], so both loads, their broadcast product and the stores share one layout (16-byte vectors of V
    channels per thread, the threads and warps along the channels, the streams in registers) when BD is a
    multiple of V x 32 x num_warps: ``kernel.combine_backward`` sizes it so."""
    TH: tl.constexpr = BD // V
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)[:, None, None, None]  # [BT, 1, 1, 1]
    t_mask = t < T
    j = tl.arange(0, P)[None, :, None, None]  # [1, P, 1, 1]: the streams of x and of its gradient
    k = tl.arange(0, P)[None, None, :, None]  # [1, 1, P, 1]: the streams of the output gradient
    p = tl.arange(0, P)
    t2 = t.reshape(BT, 1)
    post = tl.load(post_ptr + t2 * N + p[None, :], mask=(t2 < T) & (p < N)[None, :], other=0.0)[:, None, :, None]
    t3 = t.reshape(BT, 1, 1)
    comb = tl.load(comb_ptr + t3 * (N * N) + p[None, :, None] * N + p[None, None, :],
                   mask=(t3 < T) & (p < N)[None, :, None] & (p < N)[None, None, :], other=0.0)[:, :, :, None]
    acc_post = tl.zeros([BT, 1, P, TH], dtype=tl.float32)
    acc_comb = tl.zeros([BT, P, P, TH], dtype=tl.float32)
    row = t * (N * D)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)[None, None, None, :]
        dm = t_mask & (d < D)
        g = tl.load(dout_ptr + row + k * D + d, mask=dm & (k < N), other=0.0).to(tl.float32)  # [BT, 1, P, BD]
        x = tl.load(x_ptr + row + j * D + d, mask=dm & (j < N), other=0.0).to(tl.float32)  # [BT, P, 1, BD]
        f = tl.load(f_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)  # [BT, 1, 1, BD]
        _store_rounded(df_ptr + t * D + d, tl.sum(post * g, axis=2, keep_dims=True), dm, DOWNCAST_F)
        _store_rounded(dx_ptr + row + j * D + d, tl.sum(comb * g, axis=2, keep_dims=True), dm & (j < N),
                       DOWNCAST_X)
        acc_post += tl.sum(tl.reshape(g * f, [BT, 1, P, TH, V]), axis=4)
        acc_comb += tl.sum(tl.reshape(x * g, [BT, P, P, TH, V]), axis=4)
    tl.store(dpost_ptr + t * N + k, tl.sum(acc_post, axis=3, keep_dims=True), mask=t_mask & (k < N))
    tl.store(dcomb_ptr + t * (N * N) + j * N + k, tl.sum(acc_comb, axis=3, keep_dims=True),
             mask=t_mask & (j < N) & (k < N))
