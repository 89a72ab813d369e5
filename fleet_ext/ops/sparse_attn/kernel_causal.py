"""Device code of the dense causal mode of the sparse-attention family (no index table).

Query row ``t = b * S + i`` of the flat layout sits at position ``q_offset + i`` of sequence ``b`` and attends
the contiguous key rows ``b * N + 0 .. b * N + min(q_offset + i, N - 1)``. The maths, the sink and the
base-2 online softmax are those of ``kernel_fwd.py`` (the same per-row loop over blocks of ``BLOCK_N``
keys, only the rows are read contiguously instead of gathered, and the loop stops at the row's causal bound,
so key blocks past it are never touched). The backward is deterministic without pair buffers:

- ``_causal_bwd_dq_kernel`` (query-major): recompute ``P`` and ``dS``, accumulate ``dq`` in registers;
- ``_causal_bwd_dkv_kernel`` (key-major, FlashAttention-2 style): one program per (block of keys, slice of
  the queries, sequence) holds the key block's fp32 gradient in registers and walks its queries in order
  (each query's heads in blocks of ``BLOCK_H``): ``dkv += P^T dO + dS^T Q`` — one fixed summation order;
- ``_causal_dkv_reduce_kernel``: when the queries are split over several programs (parallelism), sums the
  fp32 slices in slice order.
``_causal_probs_kernel`` gives the head-summed probabilities ``sum_h P[t, h, j]`` (the DSA indexer warm-up
KL's target) without an [s, h, s] tensor. Launchers: ``causal.py``. Device code only: imports neither
Paddle nor torch and decides nothing about the machine at import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.sparse_attn.kernel_fwd import _NEG_BIG, LN2, LOG2E, _unchain


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
        kv = tl.load(kv_seq + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        if D_TAIL > 0:
            kv_e = tl.load(kv_seq + rows[:, None] + offs_e[None, :], mask=ok[:, None], other=0.0)
            s = _unchain(tl.dot(q_e, tl.trans(kv_e), input_precision=PREC), live)
            s = tl.dot(q, tl.trans(kv), s, input_precision=PREC)
        else:
            s = tl.dot(q, tl.trans(kv), input_precision=PREC)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = _unchain(p.to(kv.dtype), live)
        acc = acc * _unchain(alpha, live)[:, None]
        acc = tl.dot(p, kv, acc, input_precision=PREC)
        m_i = m_new

    l_i = l_i + tl.math.exp2(sink2 - m_i)
    has_mass = l_i > 0.0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    lse = tl.where(has_mass, (m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0))) * LN2, float("-inf"))
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
        kv = tl.load(kv_seq + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        if D_TAIL > 0:
            kv_e = tl.load(kv_seq + rows[:, None] + offs_e[None, :], mask=ok[:, None], other=0.0)
            s = _unchain(tl.dot(q_e, tl.trans(kv_e), input_precision=PREC), live)
            s = tl.dot(q, tl.trans(kv), s, input_precision=PREC)
        else:
            s = tl.dot(q, tl.trans(kv), input_precision=PREC)
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
# Backward: dkv (key-major), one slice of the queries per program, fp32 accumulation in query order
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _causal_bwd_dkv_kernel(
    Q, KV, DOUT, LSE, DELTA, DKV,
    H, S, N, q_offset, qk_scale, scale, q_slice,
    stride_qt, stride_qh, stride_kvn, stride_dot, stride_doh, stride_split, stride_dn,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    N_HB: tl.constexpr, PREC: tl.constexpr,
):
    first_key = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    seq_b = tl.program_id(2).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_V)
    offs_hb = tl.arange(0, BLOCK_H)
    keys = first_key + offs_n
    k_ok = keys < N
    k_read = keys < tl.minimum(N, q_offset + S)  # keys past the last query's position are never read
    rows = (seq_b * N + keys).to(tl.int64)
    kv = tl.load(KV + rows[:, None] * stride_kvn + offs_d[None, :], mask=k_read[:, None], other=0.0)
    acc = tl.zeros([BLOCK_N, D_V], dtype=tl.float32)
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        kv_e = tl.load(KV + rows[:, None] * stride_kvn + offs_e[None, :], mask=k_read[:, None], other=0.0)
        acc_e = tl.zeros([BLOCK_N, D_TAIL], dtype=tl.float32)
    # queries of this slice that see at least the block's first key (position q_offset + i >= first_key)
    lo = tl.maximum(tl.maximum(first_key - q_offset, 0), split * q_slice)
    hi = tl.minimum(S, (split + 1) * q_slice)
    live = hi >= 0
    for step in range(lo * N_HB, hi * N_HB):
        i = step // N_HB
        offs_h = (step - i * N_HB) * BLOCK_H + offs_hb
        h_ok = offs_h < H
        t = seq_b * S + i
        q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
        q = tl.load(q_rows + offs_d[None, :], mask=h_ok[:, None], other=0.0)
        do = tl.load(DOUT + t * stride_dot + offs_h[:, None] * stride_doh + offs_d[None, :], mask=h_ok[:, None],
                     other=0.0)
        lse2 = tl.load(LSE + t * H + offs_h, mask=h_ok, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + t * H + offs_h, mask=h_ok, other=0.0)
        if D_TAIL > 0:
            q_e = tl.load(q_rows + offs_e[None, :], mask=h_ok[:, None], other=0.0)
            s = _unchain(tl.dot(q_e, tl.trans(kv_e), input_precision=PREC), live)
            s = tl.dot(q, tl.trans(kv), s, input_precision=PREC)
        else:
            s = tl.dot(q, tl.trans(kv), input_precision=PREC)
        seen = keys <= q_offset + i
        p = tl.where(seen[None, :], tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(kv), input_precision=PREC)
        ds = _unchain((p * (dp - delta[:, None]) * scale).to(kv.dtype), live)
        acc = tl.dot(tl.trans(p.to(kv.dtype)), do, acc, input_precision=PREC)
        acc = tl.dot(tl.trans(ds), q, acc, input_precision=PREC)
        if D_TAIL > 0:
            acc_e = tl.dot(tl.trans(ds), q_e, acc_e, input_precision=PREC)

    out_rows = DKV + split.to(tl.int64) * stride_split + rows[:, None] * stride_dn
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
