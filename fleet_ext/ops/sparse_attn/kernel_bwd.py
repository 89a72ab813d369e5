"""Device code of the deterministic sparse-attention backward (steps 1-5 of ``kernel.py``'s docstring).

No floating-point atomics: every sum has one fixed order. Device code only: this module imports neither
Paddle nor torch and decides nothing about the machine at import.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fleet_ext.ops.sparse_attn.kernel_fwd import LOG2E, _block_scores, _unchain


# ------------------------------------------------------------------------------------------------------
# Backward 1: delta = rowsum(dO * O) - dLSE and d_sink partials per block of queries
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess_kernel(
    OUT, DOUT, LSE, DLSE, SINK, DELTA, DSINK_PART,
    T, H,
    D_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, D_V)
    sink = tl.load(SINK + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    part = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i in range(0, BLOCK_T):
        t = pid_t.to(tl.int64) * BLOCK_T + i
        ok = h_ok & (t < T)
        rows = (t * H + offs_h)[:, None] * D_V + offs_d[None, :]
        o = tl.load(OUT + rows, mask=ok[:, None], other=0.0).to(tl.float32)
        do = tl.load(DOUT + rows, mask=ok[:, None], other=0.0).to(tl.float32)
        delta = tl.sum(o * do, 1)
        if HAS_DLSE:
            delta = delta - tl.load(DLSE + t * H + offs_h, mask=ok, other=0.0).to(tl.float32)
        lse = tl.load(LSE + t * H + offs_h, mask=ok, other=float("inf"))
        p_sink = tl.math.exp2((sink - lse) * LOG2E)
        part = part - tl.where(ok, p_sink * delta, 0.0)
        tl.store(DELTA + t * H + offs_h, delta, mask=ok)
    tl.store(DSINK_PART + pid_t.to(tl.int64) * H + offs_h, part, mask=h_ok)


@triton.jit
def _dsink_reduce_kernel(DSINK_PART, DSINK, NB, H, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_h = tl.program_id(0)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_b = tl.arange(0, BLOCK_B)
    acc = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    for b0 in range(0, NB, BLOCK_B):
        b = b0 + offs_b
        ok = (b < NB)[:, None] & (offs_h < H)[None, :]
        acc += tl.load(DSINK_PART + b.to(tl.int64)[:, None] * H + offs_h[None, :], mask=ok, other=0.0)
    tl.store(DSINK + offs_h, tl.sum(acc, 0), mask=offs_h < H)


# ------------------------------------------------------------------------------------------------------
# Backward 2: dq (query-major), P and dS to the pair buffers
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_dq_kernel(
    Q, KV, DOUT, IDX, TOPK_LEN, LSE, DELTA, DQ, P_BUF, DS_BUF,
    H, N, K, t_begin, qk_scale, scale, H_PAD,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dot, stride_doh,
    D_V: tl.constexpr, D_TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_H: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, PREC: tl.constexpr,
):
    # 1-D grid, a query's head blocks next to each other: they gather the same kv rows close together in time (L2)
    pid_t = tl.program_id(0) // (H_PAD // BLOCK_H)
    pid_h = tl.program_id(0) % (H_PAD // BLOCK_H)
    tl_local = pid_t.to(tl.int64)
    t = t_begin + tl_local
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, D_V)
    offs_n = tl.arange(0, BLOCK_N)

    q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
    do_rows = DOUT + t * stride_dot + offs_h[:, None] * stride_doh
    if EVEN_H:
        q = tl.load(q_rows + offs_d[None, :])
        do = tl.load(do_rows + offs_d[None, :])
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=h_ok[:, None], other=0.0)
        do = tl.load(do_rows + offs_d[None, :], mask=h_ok[:, None], other=0.0)
    q_e, offs_e = q, offs_d  # no key-only tail: placeholders, never read
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        if EVEN_H:
            q_e = tl.load(q_rows + offs_e[None, :])
        else:
            q_e = tl.load(q_rows + offs_e[None, :], mask=h_ok[:, None], other=0.0)
        dq_e = tl.zeros([BLOCK_H, D_TAIL], dtype=tl.float32)
    # padded heads: lse = +inf -> P = 0, delta = 0 -> dS = 0 (exact)
    lse2 = tl.load(LSE + t * H + offs_h, mask=h_ok, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + t * H + offs_h, mask=h_ok, other=0.0)
    dq = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)

    n_valid = K
    if HAS_TOPK_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), K)
    idx_row = IDX + t * stride_it
    live = K >= 0
    for start in range(0, n_valid, BLOCK_N):
        kk = start + offs_n
        k_ok = kk < n_valid
        ids = tl.load(idx_row + kk, mask=k_ok, other=-1)
        ok = (ids >= 0) & (ids < N)
        rows = tl.where(ok, ids, 0).to(tl.int64) * stride_kvn
        kv, kv_e, s = _block_scores(KV, rows, ok, q, q_e, offs_d, offs_e, live, D_TAIL, PREC)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(kv), input_precision=PREC)
        ds = (p * (dp - delta[:, None]) * scale).to(kv.dtype)
        ds = _unchain(ds, live)  # S and dP stay off the all-warps-along-M layout (see _unchain)
        dq = tl.dot(ds, kv, dq, input_precision=PREC)
        if D_TAIL > 0:
            dq_e = tl.dot(ds, kv_e, dq_e, input_precision=PREC)
        pair = (tl_local * K + kk)[None, :] * H_PAD + offs_h[:, None]
        tl.store(P_BUF + pair, p.to(P_BUF.dtype.element_ty), mask=k_ok[None, :])
        tl.store(DS_BUF + pair, ds.to(DS_BUF.dtype.element_ty), mask=k_ok[None, :])

    dq_rows = DQ + t * stride_qt + offs_h[:, None] * stride_qh
    if EVEN_H:
        tl.store(dq_rows + offs_d[None, :], dq.to(DQ.dtype.element_ty))
    else:
        tl.store(dq_rows + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=h_ok[:, None])
    if D_TAIL > 0:
        if EVEN_H:
            tl.store(dq_rows + offs_e[None, :], dq_e.to(DQ.dtype.element_ty))
        else:
            tl.store(dq_rows + offs_e[None, :], dq_e.to(DQ.dtype.element_ty), mask=h_ok[:, None])


# ------------------------------------------------------------------------------------------------------
# Backward 3: per-pair dkv contributions dS^T Q_t + P^T dO_t, reducing over all heads
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _pack24_pairs(x):
    """[M, N] fp32 rounded to nearest at 16 significant bits (a relative error of at most 2^-16) and split into
    their top 24 bits by neighbouring column pairs: [M, N/2] uint32 of the high 16 bits (column 2k in the low half)
    and [M, N/2] uint16 of bits 8-15 (column 2k in the low byte). The rounding is Veltkamp's split, three fp32
    operations on the FMA pipe (the integer form, with ties to even and NaN kept, took more integer instructions
    than the kernel could hide: 1.04x instead of 1.09x at V3.2 h 128 on the H200), exact only when the kernel is
    compiled without FMA contraction (``enable_fp_fusion=False``). Below 2^-126 the low 8 bits are cut (an
    absolute error under 2^-141); |x| >= 2^128 / 257 (and inf) become NaN."""
    big = x * 257.0
    bits = (big - (big - x)).to(tl.uint32, bitcast=True)
    a, b = tl.split(tl.reshape(bits, [x.shape[0], x.shape[1] // 2, 2]))
    return (a >> 16) | (b & 0xFFFF0000), (((a >> 8) & 0xFF) | (b & 0xFF00)).to(tl.uint16)


@triton.jit
def _unpack24(hi, lo):
    """The fp32 value of a packed contribution from its high 16 bits (int16) and bits 8-15 (uint8)."""
    bits = (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16) | (lo.to(tl.uint32) << 8)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_part(PART, PART_LO, rows, rows_lo, col0, acc, row_ok, PACK24: tl.constexpr):
    """A tile of contributions at element offsets ``rows`` [M, 1] + columns ``col0 ..`` (``col0`` even): as
    ``PART``'s dtype, or packed to 24 bits (``_pack24_pairs``): the high 16 bits to ``PART`` (int16), bits 8-15 to
    ``PART_LO`` (uint8, the same offsets), each written by column pairs (``rows_lo``: the rows' offsets in pairs)
    so the packing is a few byte moves per element and every stored tile is 16-bit or wider."""
    width: tl.constexpr = acc.shape[1]
    if PACK24:
        hi, lo = _pack24_pairs(acc)
        pairs = col0 // 2 + tl.arange(0, width // 2)
        tl.store(PART.to(tl.pointer_type(tl.uint32)) + rows_lo + pairs[None, :], hi, mask=row_ok)
        tl.store(PART_LO.to(tl.pointer_type(tl.uint16)) + rows_lo + pairs[None, :], lo, mask=row_ok)
    else:
        cols = col0 + tl.arange(0, width)
        tl.store(PART + rows + cols[None, :], acc.to(PART.dtype.element_ty), mask=row_ok)


@triton.jit
def _load_part(PART, PART_LO, offs, mask, PACK24: tl.constexpr):
    """Contributions as fp32 (0 where ``mask`` is False); ``_store_part``'s inverse up to its rounding."""
    if PACK24:
        return _unpack24(tl.load(PART + offs, mask=mask, other=0), tl.load(PART_LO + offs, mask=mask, other=0))
    return tl.load(PART + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _column_block(ds, p, q_rows, do_rows, hp_ok, d0, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """Value columns ``d0 .. d0 + BLOCK_D`` of the slots' contributions: dS^T Q_t + P^T dO_t."""
    offs_c = d0 + tl.arange(0, BLOCK_D)
    qc = tl.load(q_rows + offs_c[None, :], mask=hp_ok[:, None], other=0.0)
    doc = tl.load(do_rows + offs_c[None, :], mask=hp_ok[:, None], other=0.0)
    acc = tl.dot(ds, qc, input_precision=PREC)
    return tl.dot(p, doc, acc, input_precision=PREC)


@triton.jit
def _bwd_dkv_partial_kernel(
    Q, DOUT, TOPK_LEN, P_BUF, DS_BUF, PART, PART_LO,
    H, K, t_begin, H_PAD, slot0, n_slots,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_part, stride_part_lo,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HP: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, PREC: tl.constexpr, PACK24: tl.constexpr,
):
    """Per (query, ``BLOCK_M`` of the slots ``[slot0, slot0 + n_slots)``, the ones outside the band slots): the
    slots' contributions, ``BLOCK_D`` value columns at a time, then the key-only tail; row ``n_slots * t + j -
    slot0`` of ``PART``. ``stride_part_lo`` = ``stride_part // 2`` (a separate argument so the compiler sees its
    alignment: the low bytes' int16 stores stay vectorised)."""
    # 1-D grid, a query's slot blocks next to each other: they read the same Q_t and dO_t rows (L2, not HBM)
    pid_t = tl.program_id(0) // tl.cdiv(n_slots, BLOCK_M)
    pid_m = tl.program_id(0) % tl.cdiv(n_slots, BLOCK_M)
    tl_local = pid_t.to(tl.int64)
    t = t_begin + tl_local
    n_valid = slot0 + n_slots
    if HAS_TOPK_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), n_valid)
        if slot0 + pid_m * BLOCK_M >= n_valid:  # the whole slot block is past the row's bound: nothing to write
            return
    kk = slot0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_ok = kk < n_valid
    offs_hp = tl.arange(0, BLOCK_HP)
    hp_ok = offs_hp < H
    buf = (tl_local * K + kk)[:, None] * H_PAD + offs_hp[None, :]
    buf_ok = k_ok[:, None] & (offs_hp < H_PAD)[None, :]
    ds = tl.load(DS_BUF + buf, mask=buf_ok, other=0.0)
    p = tl.load(P_BUF + buf, mask=buf_ok, other=0.0)
    pair = tl_local * n_slots + (kk - slot0)
    part_rows = pair[:, None] * stride_part
    part_rows_lo = pair[:, None] * stride_part_lo
    q_rows = Q + t * stride_qt + offs_hp[:, None] * stride_qh
    do_rows = DOUT + t * stride_dot + offs_hp[:, None] * stride_doh
    for d0 in range(0, D_V, BLOCK_D):
        acc = _column_block(ds, p, q_rows, do_rows, hp_ok, d0, BLOCK_D, PREC)
        _store_part(PART, PART_LO, part_rows, part_rows_lo, d0, acc, k_ok[:, None], PACK24)
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        qe = tl.load(q_rows + offs_e[None, :], mask=hp_ok[:, None], other=0.0)
        acc_e = tl.dot(ds, qe, input_precision=PREC)
        _store_part(PART, PART_LO, part_rows, part_rows_lo, D_V, acc_e, k_ok[:, None], PACK24)


# ------------------------------------------------------------------------------------------------------
# Backward 4: transposed index (CSR) — keys, then (after a stable sort) row pointers
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _csr_keys_kernel(IDX, TOPK_LEN, KEYS, N, slot0, n_slots, t_begin, stride_it, BLOCK: tl.constexpr,
                     HAS_TOPK_LEN: tl.constexpr):
    """``KEYS[n_slots * t + j - slot0]`` = the kv row of slot j (``N`` when invalid), j in [slot0, slot0 + n_slots)."""
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    tl_local = pid_t.to(tl.int64)
    t = t_begin + tl_local
    kk = slot0 + pid_k * BLOCK + tl.arange(0, BLOCK)
    n_valid = slot0 + n_slots
    if HAS_TOPK_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), n_valid)
    ids = tl.load(IDX + t * stride_it + kk, mask=kk < n_valid, other=-1)
    ok = (ids >= 0) & (ids < N)
    tl.store(KEYS + tl_local * n_slots + (kk - slot0), tl.where(ok, ids, N).to(tl.int32), mask=kk < slot0 + n_slots)


@triton.jit
def _csr_rowptr_kernel(SORTED, ROWPTR, NPAIRS, NROWS, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """rowptr[j] = first position p with sorted[p] >= j (lower bound), j = 0 .. NROWS - 1."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + NPAIRS
    for _ in range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(SORTED + mid, mask=active, other=0)
        go_right = active & (v < j)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & (v >= j), mid, hi)
    tl.store(ROWPTR + j, lo, mask=j < NROWS)


@triton.jit
def _csr_items_kernel(ROWPTR, ITEM_START, NROWS, CHUNK, BLOCK: tl.constexpr):
    """One program: ``ITEM_START[j]`` = the reduce items of the rows before j (exclusive scan, j = 0 .. NROWS; the
    last entry is the total). Row j has ``max(1, cdiv(pairs_j, CHUNK))`` items of at most CHUNK pairs each."""
    running = tl.zeros([], dtype=tl.int64)
    for j0 in range(0, NROWS + 1, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < NROWS
        pairs = tl.load(ROWPTR + j + 1, mask=ok, other=0) - tl.load(ROWPTR + j, mask=ok, other=0)
        items = tl.where(ok, tl.maximum((pairs + CHUNK - 1) // CHUNK, 1), 0)
        tl.store(ITEM_START + j, running + tl.cumsum(items, 0) - items, mask=j <= NROWS)
        running += tl.sum(items, 0)


@triton.jit
def _csr_item_rows_kernel(ITEM_START, ITEM_ROW, NROWS, BLOCK: tl.constexpr):
    """``ITEM_ROW[i]`` = the row of reduce item i (each row writes its own items)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = j < NROWS
    first = tl.load(ITEM_START + j, mask=ok, other=0)
    items = tl.load(ITEM_START + j + 1, mask=ok, other=0) - first
    for c in range(0, tl.max(items, 0)):
        tl.store(ITEM_ROW + first + c, j.to(tl.int32), mask=ok & (c < items))


# ------------------------------------------------------------------------------------------------------
# Backward 5: dkv row j = sum of its pairs' contributions in CSR order (+ previous chunks)
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_dkv_reduce_kernel(
    PART, PART_LO, ORDER, ROWPTR, ITEM_START, ITEM_ROW, SPLIT, ACC, OUT, stride_part, CHUNK, NROWS,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_P: tl.constexpr, ACCUMULATE: tl.constexpr, PACK24: tl.constexpr,
):
    """Program i sums reduce item i: pairs ``[c CHUNK, (c + 1) CHUNK)`` of its row's CSR range (c = the item's
    place in the row). A row of one item is written to ``OUT`` (+ ``ACC``) here; a longer row's items go to
    ``SPLIT`` for ``_bwd_dkv_combine_kernel`` (so a row read by every query, e.g. a DSv4 HCA entry, is summed by
    many programs, not one). Programs past the total exit."""
    i = tl.program_id(0)
    if i >= tl.load(ITEM_START + NROWS):
        return
    j = tl.load(ITEM_ROW + i).to(tl.int64)
    first = tl.load(ITEM_START + j)
    items = tl.load(ITEM_START + j + 1) - first
    start = tl.load(ROWPTR + j) + (i - first) * CHUNK
    end = tl.minimum(tl.load(ROWPTR + j + 1), start + CHUNK)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D_V)
    acc = tl.zeros([BLOCK_P, D_V], dtype=tl.float32)
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        acc_e = tl.zeros([BLOCK_P, D_TAIL], dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        pos = p0 + offs_p
        p_ok = pos < end
        src = tl.load(ORDER + pos, mask=p_ok, other=0).to(tl.int64) * stride_part
        acc += _load_part(PART, PART_LO, src[:, None] + offs_d[None, :], p_ok[:, None], PACK24)
        if D_TAIL > 0:
            acc_e += _load_part(PART, PART_LO, src[:, None] + offs_e[None, :], p_ok[:, None], PACK24)
    if items > 1:  # one part of a long row, summed in order by _bwd_dkv_combine_kernel
        split = SPLIT + i.to(tl.int64) * stride_part
        tl.store(split + offs_d, tl.sum(acc, 0))
        if D_TAIL > 0:
            tl.store(split + offs_e, tl.sum(acc_e, 0))
    else:
        _store_dkv_row(ACC, OUT, j * stride_part, offs_d, tl.sum(acc, 0), ACCUMULATE)
        if D_TAIL > 0:
            _store_dkv_row(ACC, OUT, j * stride_part, offs_e, tl.sum(acc_e, 0), ACCUMULATE)


@triton.jit
def _store_dkv_row(ACC, OUT, row, offs, total, ACCUMULATE: tl.constexpr):
    """dkv[row, offs] = total (+ the previous query chunks' sum)."""
    if ACCUMULATE:
        total = tl.load(ACC + row + offs) + total
    tl.store(OUT + row + offs, total.to(OUT.dtype.element_ty))


@triton.jit
def _bwd_dkv_combine_kernel(SPLIT, ITEM_START, ACC, OUT, stride_part, D_V: tl.constexpr, D_TAIL: tl.constexpr,
                            ACCUMULATE: tl.constexpr):
    """dkv row j of more than one reduce item = the sum of its items' parts in order (+ previous chunks)."""
    j = tl.program_id(0).to(tl.int64)
    first = tl.load(ITEM_START + j)
    items = tl.load(ITEM_START + j + 1) - first
    if items > 1:
        offs_d = tl.arange(0, D_V)
        total = tl.zeros([D_V], dtype=tl.float32)
        for c in range(0, items):
            total += tl.load(SPLIT + (first + c) * stride_part + offs_d)
        _store_dkv_row(ACC, OUT, j * stride_part, offs_d, total, ACCUMULATE)
        if D_TAIL > 0:
            offs_e = D_V + tl.arange(0, D_TAIL)
            total_e = tl.zeros([D_TAIL], dtype=tl.float32)
            for c in range(0, items):
                total_e += tl.load(SPLIT + (first + c) * stride_part + offs_e)
            _store_dkv_row(ACC, OUT, j * stride_part, offs_e, total_e, ACCUMULATE)
