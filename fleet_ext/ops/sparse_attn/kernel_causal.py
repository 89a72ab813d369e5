"""Device code of the dense causal mode of the sparse-attention family (no index table).

Query row ``t = b * S + i`` of the flat layout sits at position ``q_offset + i`` of sequence ``b`` and attends
the contiguous key rows ``b * N + 0 .. b * N + min(q_offset + i, N - 1)``. The maths, the sink and the
base-2 online softmax are those of ``kernel_fwd.py`` (the same per-row loop over blocks of ``BLOCK_N``
keys, only the rows are read contiguously instead of gathered, and the loop stops at the row's causal bound,
so key blocks past it are never touched). The backward is deterministic without pair buffers:

- ``_causal_bwd_dq_kernel`` (query-major): recompute ``P`` and ``dS``, accumulate ``dq`` in registers;
- ``_causal_bwd_dkv_kernel`` (key-major, FlashAttention-2 style): one program per (block of keys, slice of
  the flat (query, head) rows, sequence) holds the key block's fp32 gradient in registers and walks its rows in
  order, ``BLOCK_M`` at a time as the M dimension of the tiles (S^T and P^T computed keys-major, so they feed
  the next product from registers): ``dkv += P^T dO + dS^T Q`` — one fixed summation order;
- ``_causal_dkv_reduce_kernel``: when the rows are split over several programs (parallelism), sums the
  fp32 slices in slice order.
``_causal_probs_kernel`` gives the head-summed probabilities ``sum_h P[t, h, j]`` (the DSA indexer warm-up
KL's target) without an [s, h, s] tensor. Launchers: ``causal.py``. Device code only: imports neither
Paddle nor torch and decides nothing about the machine at import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.sparse_attn.kernel_fwd import _NEG_BIG, LOG2E, _block_scores, _finish, _online_softmax_pv, _unchain


@triton.jit
def _row_keys(t, S, N, q_offset):
    """(sequence of flat query row t, number of keys it sees: min(position + 1, N))."""
    seq_b = t // S
    return seq_b, tl.minimum(q_offset + (t - seq_b * S) + 1, N).to(tl.int32)


@triton.jit
def _longest_first(pid, num):
    """Query row of program ``pid``: the last rows (the most keys) first, so the final wave of a launch holds the
    shortest rows instead of the longest (load balance of the causal triangle)."""
    return (num - 1 - pid).to(tl.int64)


@triton.jit
def _load_heads(ptr_rows, offs, h_ok, EVEN_H: tl.constexpr):
    if EVEN_H:
        x = tl.load(ptr_rows + offs[None, :])
    else:
        x = tl.load(ptr_rows + offs[None, :], mask=h_ok[:, None], other=0.0)
    return x


@triton.jit
def _store_heads(ptr_rows, offs, x, h_ok, EVEN_H: tl.constexpr):
    if EVEN_H:
        tl.store(ptr_rows + offs[None, :], x)
    else:
        tl.store(ptr_rows + offs[None, :], x, mask=h_ok[:, None])


# ------------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _causal_fwd_kernel(
    Q, KV, SINK, OUT, LSE,
    H, S, N, q_offset, qk_scale,
    stride_qt, stride_qh, stride_kvn, stride_ot, stride_oh,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_H: tl.constexpr, PREC: tl.constexpr,
):
    t = _longest_first(tl.program_id(0), tl.num_programs(0))
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, D_V)
    offs_n = tl.arange(0, BLOCK_N)
    seq_b, n_keys = _row_keys(t, S, N, q_offset)
    kv_seq = KV + seq_b * N * stride_kvn

    q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q = _load_heads(q_rows, offs_d, h_ok, EVEN_H)
    q_e, offs_e = q, offs_d  # no key-only tail: placeholders, never read
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        q_e = _load_heads(q_rows, offs_e, h_ok, EVEN_H)

    sink2 = tl.load(SINK + offs_h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    m_i = tl.maximum(sink2, _NEG_BIG)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)
    live = n_keys >= 0
    for start in range(0, n_keys, BLOCK_N):
        keys = start + offs_n
        ok = keys < n_keys
        rows = keys.to(tl.int64) * stride_kvn
        kv, _, s = _block_scores(kv_seq, rows, ok, q, q_e, offs_d, offs_e, live, D_TAIL, PREC)
        m_i, l_i, acc = _online_softmax_pv(s, ok, kv, m_i, l_i, acc, qk_scale, live, PREC)

    out, lse = _finish(acc, m_i, l_i, sink2)
    _store_heads(OUT + t * stride_ot + offs_h[:, None] * stride_oh, offs_d, out.to(OUT.dtype.element_ty), h_ok,
                 EVEN_H)
    tl.store(LSE + t * H + offs_h, lse, mask=h_ok)


# ------------------------------------------------------------------------------------------------------
# Backward: dq (query-major)
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _causal_bwd_dq_kernel(
    Q, KV, DOUT, LSE, DELTA, DQ,
    H, S, N, q_offset, qk_scale, scale,
    stride_qt, stride_qh, stride_kvn, stride_dot, stride_doh,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_H: tl.constexpr, PREC: tl.constexpr,
):
    t = _longest_first(tl.program_id(0), tl.num_programs(0))
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, D_V)
    offs_n = tl.arange(0, BLOCK_N)
    seq_b, n_keys = _row_keys(t, S, N, q_offset)
    kv_seq = KV + seq_b * N * stride_kvn

    q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
    q = _load_heads(q_rows, offs_d, h_ok, EVEN_H)
    do = _load_heads(DOUT + t * stride_dot + offs_h[:, None] * stride_doh, offs_d, h_ok, EVEN_H)
    q_e, offs_e = q, offs_d  # no key-only tail: placeholders, never read
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        q_e = _load_heads(q_rows, offs_e, h_ok, EVEN_H)
        dq_e = tl.zeros([BLOCK_H, D_TAIL], dtype=tl.float32)
    # padded heads: lse = +inf -> P = 0, delta = 0 -> dS = 0 (exact)
    lse2 = tl.load(LSE + t * H + offs_h, mask=h_ok, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + t * H + offs_h, mask=h_ok, other=0.0)
    dq = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)
    live = n_keys >= 0
    for start in range(0, n_keys, BLOCK_N):
        keys = start + offs_n
        ok = keys < n_keys
        rows = keys.to(tl.int64) * stride_kvn
        kv, kv_e, s = _block_scores(kv_seq, rows, ok, q, q_e, offs_d, offs_e, live, D_TAIL, PREC)
        p = tl.where(ok[None, :], tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(kv), input_precision=PREC)
        ds = _unchain((p * (dp - delta[:, None]) * scale).to(kv.dtype), live)
        dq = tl.dot(ds, kv, dq, input_precision=PREC)
        if D_TAIL > 0:
            dq_e = tl.dot(ds, kv_e, dq_e, input_precision=PREC)

    dq_rows = DQ + t * stride_qt + offs_h[:, None] * stride_qh
    _store_heads(dq_rows, offs_d, dq.to(DQ.dtype.element_ty), h_ok, EVEN_H)
    if D_TAIL > 0:
        _store_heads(dq_rows, offs_e, dq_e.to(DQ.dtype.element_ty), h_ok, EVEN_H)


# ------------------------------------------------------------------------------------------------------
# Backward: dkv (key-major), one slice of the (query, head) rows per program, fp32 accumulation in row order
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _causal_bwd_dkv_kernel(
    Q, KV, DOUT, LSE, DELTA, DKV,
    H, S, N, q_offset, qk_scale, scale, splits, stride_split,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    SHIFT_LAST: tl.constexpr, PREC: tl.constexpr,
):
    """Program ``(kb * splits + split, b)``: keys ``kb * BLOCK_N + [0, BLOCK_N)`` of sequence ``b`` against slice
    ``split`` of the flat (query, head) rows ``i * H + h`` that see the block's first key, ``BLOCK_M`` rows a step
    (the rows of consecutive queries are contiguous in ``q`` / ``d_out``: the M dimension of every tile). dO and
    the first ``D_V`` channels of q of a step are one interleaved [2 BLOCK_M, D_V] tile, so one product gives
    dP^T and S^T and one gives ``P^T dO + dS^T q`` (a single accumulator chain; two chained dots on one fp32
    [BLOCK_N, D_V] accumulator would take Triton's all-warps-along-M layout, see ``_unchain``). ``SHIFT_LAST``:
    the last step of a slice moves back to end at the sequence's last row (rows before the step's start are
    masked through lse / delta), so q and dO load without masks (16-byte vectors, pipelined copies)."""
    D_QK: tl.constexpr = D_V + D_TAIL
    kb = tl.program_id(0) // splits  # ascending key blocks: the most rows first (load balance)
    split = tl.program_id(0) - kb * splits
    seq_b = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, D_V)
    offs_m = tl.arange(0, BLOCK_M)
    half = tl.arange(0, 2 * BLOCK_M) // 2
    is_q = (tl.arange(0, 2 * BLOCK_M) % 2) == 1  # joint tile row 2m: dO of step row m, row 2m + 1: its q
    keys = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    k_read = keys < tl.minimum(N, q_offset + S)  # keys past the last query's position are never read
    kv_rows = KV + (seq_b * N + keys).to(tl.int64)[:, None] * D_QK
    kv = tl.load(kv_rows + offs_d[None, :], mask=k_read[:, None], other=0.0)
    acc = tl.zeros([BLOCK_N, D_V], dtype=tl.float32)
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        kv_e = tl.load(kv_rows + offs_e[None, :], mask=k_read[:, None], other=0.0)
        acc_e = tl.zeros([BLOCK_N, D_TAIL], dtype=tl.float32)
    # rows (of this sequence) whose query sees the block's first key, cut into `splits` slices of whole steps
    row_lo = tl.maximum(kb * BLOCK_N - q_offset, 0) * H
    chunk = tl.cdiv(tl.cdiv(tl.maximum(S * H - row_lo, 0), splits), BLOCK_M) * BLOCK_M
    lo = row_lo + split * chunk
    hi = tl.minimum(lo + chunk, S * H)
    live = hi >= 0
    base = seq_b * S * H
    for r0 in range(lo, hi, BLOCK_M):
        r_start = r0
        if SHIFT_LAST:
            r_start = tl.minimum(r0, S * H - BLOCK_M)
        rows = r_start + offs_m
        r_ok = (rows >= r0) & (rows < hi)
        grow = base + rows
        g2 = base + r_start + half
        ptr2 = tl.where(is_q, Q + g2 * D_QK, DOUT + g2 * D_V)[:, None] + offs_d[None, :]
        if SHIFT_LAST:
            x2 = tl.load(ptr2)
        else:
            x2 = tl.load(ptr2, mask=(r_start + half < hi)[:, None], other=0.0)
        if D_TAIL > 0:
            q_e_ptr = (Q + grow * D_QK)[:, None] + offs_e[None, :]
            if SHIFT_LAST:
                q_e = tl.load(q_e_ptr)
            else:
                q_e = tl.load(q_e_ptr, mask=r_ok[:, None], other=0.0)
        # padded / foreign rows: lse = +inf -> P = 0, delta = 0 -> dS = 0 (exact)
        lse2 = tl.load(LSE + grow, mask=r_ok, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + grow, mask=r_ok, other=0.0)
        dpt, st = tl.split(tl.reshape(tl.dot(kv, tl.trans(x2), input_precision=PREC), [BLOCK_N, BLOCK_M, 2]))
        if D_TAIL > 0:
            st = st + _unchain(tl.dot(kv_e, tl.trans(q_e), input_precision=PREC), live)
        seen = keys[:, None] <= q_offset + rows[None, :] // H
        pt = tl.where(seen, tl.math.exp2(st * qk_scale - lse2[None, :]), 0.0)
        dst = (pt * (dpt - delta[None, :]) * scale).to(kv.dtype)
        a2 = _unchain(tl.reshape(tl.join(pt.to(kv.dtype), dst), [BLOCK_N, 2 * BLOCK_M]), live)
        acc = tl.dot(a2, x2, acc, input_precision=PREC)
        if D_TAIL > 0:
            acc_e = tl.dot(_unchain(dst, live), q_e, acc_e, input_precision=PREC)

    out_rows = DKV + split.to(tl.int64) * stride_split + (seq_b * N + keys).to(tl.int64)[:, None] * D_QK
    k_ok = keys < N
    tl.store(out_rows + offs_d[None, :], acc.to(DKV.dtype.element_ty), mask=k_ok[:, None])
    if D_TAIL > 0:
        tl.store(out_rows + offs_e[None, :], acc_e.to(DKV.dtype.element_ty), mask=k_ok[:, None])


@triton.jit
def _causal_dkv_reduce_kernel(PART, DKV, NUMEL, SPLITS, BLOCK: tl.constexpr):
    """dkv = sum of the query slices' fp32 partials [SPLITS, NUMEL], in slice order (deterministic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUMEL
    total = tl.zeros([BLOCK], dtype=tl.float32)
    part = PART + offs
    for _ in range(0, SPLITS):
        total += tl.load(part, mask=ok, other=0.0)
        part += NUMEL  # pointer arithmetic: 64-bit
    tl.store(DKV + offs, total.to(DKV.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------------------
# Head-summed probabilities (the DSA indexer warm-up KL's target), no gradient
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _causal_probs_kernel(
    Q, KV, LSE, PROBS,
    H, S, N, n_cols, q_offset, qk_scale,
    stride_qt, stride_qh, stride_kvn, stride_pt,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    N_HB: tl.constexpr, PREC: tl.constexpr,
):
    t = _longest_first(tl.program_id(0), tl.num_programs(0))
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq_b, n_keys = _row_keys(t, S, N, q_offset)
    seen = keys < n_keys
    mass = tl.zeros([BLOCK_N], dtype=tl.float32)
    if tl.program_id(1) * BLOCK_N < n_keys:  # blocks wholly past the causal bound stay 0
        offs_d = tl.arange(0, D_V)
        rows = (seq_b * N + keys).to(tl.int64) * stride_kvn
        kv = tl.load(KV + rows[:, None] + offs_d[None, :], mask=seen[:, None], other=0.0)
        if D_TAIL > 0:
            offs_e = D_V + tl.arange(0, D_TAIL)
            kv_e = tl.load(KV + rows[:, None] + offs_e[None, :], mask=seen[:, None], other=0.0)
        for hb in range(0, N_HB):
            offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
            q = tl.load(q_rows + offs_d[None, :], mask=h_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kv), input_precision=PREC)
            if D_TAIL > 0:
                q_e = tl.load(q_rows + offs_e[None, :], mask=h_ok[:, None], other=0.0)
                s = tl.dot(q_e, tl.trans(kv_e), s, input_precision=PREC)
            lse2 = tl.load(LSE + t * H + offs_h, mask=h_ok, other=float("inf")) * LOG2E
            p = tl.where(h_ok[:, None] & seen[None, :], tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
            mass += tl.sum(p, 0)
    tl.store(PROBS + t * stride_pt + keys, mass, mask=keys < n_cols)
