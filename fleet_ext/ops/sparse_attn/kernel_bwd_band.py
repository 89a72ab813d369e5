"""Backward kernels for *band* slots: the dkv of slots whose key follows from the query's position.

A band ``(slot0, n_slots, step, base)`` says: slot ``j`` in ``[slot0, slot0 + n_slots)`` of the query at local
position ``i`` holds the local key ``step * i + base + j`` or is invalid (the DSv4 window: ``step`` 1; HCA's
compressed entries in order: ``step`` 0). Key ``r`` can then sit only in slot ``j = r - base - step * i``, so
its dkv can be summed key-major straight from the pair buffers ``P`` and ``dS`` that the dq step wrote, with no
per-pair contribution written to memory, sorted and read back (``kernel_bwd``'s steps 3-5, which still serve the
other slots).

``_bwd_dkv_band_kernel``: one program owns ``BLOCK_K`` keys x ``BLOCK_D`` columns and walks, in query order, the
queries of this chunk that may hold them (``step`` 1: ``BLOCK_K + n_slots - 1`` of them; ``step`` 0: all, cut
into ``n_split`` ranges for parallelism); per query it gathers the keys' ``P`` / ``dS`` rows (only where the
index table really holds the key in that slot: ``idx == key`` is checked, not assumed) and accumulates
``dS^T Q_t + P^T dO_t`` in fp32 registers. ``_bwd_band_combine_kernel`` adds the splits, in order, to the fp32
dkv accumulator. No atomics anywhere: byte-identical run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bwd_dkv_band_kernel(
    IDX, TOPK_LEN, Q, DOUT, P_BUF, DS_BUF, PART,
    S, N, K, t_begin, t_end, H, H_PAD, key_lo, n_keys, slot0, n_slots, base, q_per_split,
    stride_it, stride_qt, stride_qh, stride_dot, stride_doh, stride_split, D_QK,
    col0, STEP: tl.constexpr, VALUE: tl.constexpr, DIRECT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HP: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, PREC: tl.constexpr, POISON: tl.constexpr = False,
    QPS: tl.constexpr = 1,
):
    """Grid (column blocks from ``col0``, sequences x key blocks, query splits); writes ``PART[split, b * n_keys +
    key, col]``, or with ``DIRECT`` (one split) adds to the fp32 accumulator ``PART[b * N + key, col]`` itself.
    A key block's column blocks run side by side: they gather the same ``P`` / ``dS`` rows (L2). ``VALUE``: value
    columns (``dS^T Q + P^T dO``), else key-only tail columns (``dS^T Q``).

    The loads' masks follow from the query's position alone (so the loop pipelines them); whether the table
    really holds the key there (``idx``) and the row's bound select the loaded values afterwards. ``QPS`` > 1
    (poison mode only): each step takes that many queries, one product over their (query, head) rows."""
    tl.static_assert(QPS == 1 or POISON, "several queries per step: the poison mode only")
    pid_s = tl.program_id(2)
    key_blocks = tl.cdiv(n_keys, BLOCK_K)
    b = tl.program_id(1) // key_blocks
    r0 = key_lo + (tl.program_id(1) % key_blocks) * BLOCK_K
    d0 = col0 + tl.program_id(0) * BLOCK_D
    r = r0 + tl.arange(0, BLOCK_K)
    r_ok = r < key_lo + n_keys
    key_ids = b * N + r
    seq0 = b.to(tl.int64) * S
    i_lo = tl.maximum(t_begin - seq0, 0)
    i_hi = tl.minimum(t_end - seq0, S)
    if STEP == 1:  # slot j = r - base - i lies in [slot0, slot0 + n_slots) for some key of the block
        i_lo = tl.maximum(i_lo, r0 - base - slot0 - n_slots + 1)
        i_hi = tl.minimum(i_hi, r0 + BLOCK_K - base - slot0)
    else:  # every query may hold the keys: this program takes its split of the chunk's queries
        i_lo = i_lo + pid_s * q_per_split
        i_hi = tl.minimum(i_hi, i_lo + q_per_split)
    cols = d0 + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    bad = r < 0  # POISON: keys whose slot held another key (their dkv becomes NaN)
    if QPS == 1:
        for i in range(i_lo, i_hi):
            acc, bad = _band_step_query(acc, bad, i, IDX, TOPK_LEN, Q, DOUT, P_BUF, DS_BUF, r, r_ok, key_ids, seq0,
                                        t_begin, K, H, H_PAD, base, slot0, n_slots, stride_it, stride_qt, stride_qh,
                                        stride_dot, stride_doh, cols, STEP, VALUE, BLOCK_HP, HAS_TOPK_LEN, PREC, POISON)
    else:
        for i in range(i_lo, i_hi, QPS):
            acc, bad = _band_step_queries(acc, bad, i, i_hi, IDX, TOPK_LEN, Q, DOUT, P_BUF, DS_BUF, r, r_ok, key_ids,
                                          seq0, t_begin, K, H, H_PAD, base, slot0, n_slots, stride_it, stride_qt,
                                          stride_qh, stride_dot, stride_doh, cols, STEP, VALUE, QPS, BLOCK_HP,
                                          HAS_TOPK_LEN, PREC)
    if POISON:
        acc = tl.where(bad[:, None], float("nan"), acc)
    if DIRECT:
        dst = PART + key_ids.to(tl.int64)[:, None] * D_QK + cols[None, :]
        acc += tl.load(dst, mask=r_ok[:, None], other=0.0)
    else:
        dst = PART + pid_s * stride_split + (b * n_keys + (r - key_lo)).to(tl.int64)[:, None] * D_QK + cols[None, :]
    tl.store(dst, acc, mask=r_ok[:, None])


@triton.jit
def _band_step_query(acc, bad, i, IDX, TOPK_LEN, Q, DOUT, P_BUF, DS_BUF, r, r_ok, key_ids, seq0, t_begin, K, H, H_PAD,
                     base, slot0, n_slots, stride_it, stride_qt, stride_qh, stride_dot, stride_doh, cols,
                     STEP: tl.constexpr, VALUE: tl.constexpr, BLOCK_HP: tl.constexpr, HAS_TOPK_LEN: tl.constexpr,
                     PREC: tl.constexpr, POISON: tl.constexpr):
    """One step over query ``i``: its P / dS rows of the block's keys times its Q / dO columns."""
    offs_h = tl.arange(0, BLOCK_HP)
    hp_ok = offs_h < H
    t = seq0 + i
    j = r - base - STEP * i
    in_band = r_ok & (j >= slot0) & (j < slot0 + n_slots)
    ids = tl.load(IDX + t * stride_it + j, mask=in_band, other=-1)
    if POISON:  # P, dS rows inside the bound are exact zeros on invalid slots: load them as they are
        if HAS_TOPK_LEN:
            in_band = in_band & (j < tl.load(TOPK_LEN + t).to(tl.int32))
        bad = bad | (in_band & (ids >= 0) & (ids != key_ids))
        ok = in_band
    else:
        ok = in_band & (ids == key_ids)
        if HAS_TOPK_LEN:
            ok = ok & (j < tl.load(TOPK_LEN + t).to(tl.int32))
    buf = ((t - t_begin) * K + j)[:, None] * H_PAD + offs_h[None, :]
    buf_ok = in_band[:, None] & (offs_h < H_PAD)[None, :]
    if POISON:
        ds = tl.load(DS_BUF + buf, mask=buf_ok, other=0.0)
    else:
        ds = tl.where(ok[:, None], tl.load(DS_BUF + buf, mask=buf_ok, other=0.0), 0.0)
    qc = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + cols[None, :], mask=hp_ok[:, None], other=0.0)
    acc = tl.dot(ds, qc, acc, input_precision=PREC)
    if VALUE:  # P^T dO as well (the key-only tail has dS^T Q alone)
        if POISON:
            p = tl.load(P_BUF + buf, mask=buf_ok, other=0.0)
        else:
            p = tl.where(ok[:, None], tl.load(P_BUF + buf, mask=buf_ok, other=0.0), 0.0)
        doc = tl.load(DOUT + t * stride_dot + offs_h[:, None] * stride_doh + cols[None, :], mask=hp_ok[:, None],
                      other=0.0)
        acc = tl.dot(p, doc, acc, input_precision=PREC)
    return acc, bad


@triton.jit
def _band_step_queries(acc, bad, i, i_hi, IDX, TOPK_LEN, Q, DOUT, P_BUF, DS_BUF, r, r_ok, key_ids, seq0, t_begin, K, H,
                       H_PAD, base, slot0, n_slots, stride_it, stride_qt, stride_qh, stride_dot, stride_doh, cols,
                       STEP: tl.constexpr, VALUE: tl.constexpr, QPS: tl.constexpr, BLOCK_HP: tl.constexpr,
                       HAS_TOPK_LEN: tl.constexpr, PREC: tl.constexpr):
    """One poison-mode step over queries ``i .. i + QPS - 1``: the products' inner dimension is their ``QPS x
    BLOCK_HP`` (query, head) rows (column ``c`` of the P / dS tile: query ``c // BLOCK_HP``, head ``c % BLOCK_HP``)."""
    offs_u = tl.arange(0, QPS)
    u_ok = i + offs_u < i_hi
    j_u = r[:, None] - base - STEP * (i + offs_u)[None, :]
    band_u = r_ok[:, None] & (j_u >= slot0) & (j_u < slot0 + n_slots) & u_ok[None, :]
    if HAS_TOPK_LEN:
        band_u = band_u & (j_u < tl.load(TOPK_LEN + seq0 + i + offs_u, mask=u_ok, other=0).to(tl.int32)[None, :])
    ids = tl.load(IDX + (seq0 + i + offs_u)[None, :] * stride_it + j_u, mask=band_u, other=-1)
    bad = bad | (tl.max((band_u & (ids >= 0) & (ids != key_ids[:, None])).to(tl.int32), axis=1) > 0)
    c = tl.arange(0, QPS * BLOCK_HP)
    u_c = c // BLOCK_HP
    h_c = c % BLOCK_HP
    t_c = seq0 + i + u_c
    c_ok = i + u_c < i_hi
    j_c = r[:, None] - base - STEP * (i + u_c)[None, :]
    ok = r_ok[:, None] & (j_c >= slot0) & (j_c < slot0 + n_slots) & (c_ok & (h_c < H_PAD))[None, :]
    if HAS_TOPK_LEN:
        ok = ok & (j_c < tl.load(TOPK_LEN + t_c, mask=c_ok, other=0).to(tl.int32)[None, :])
    buf = ((t_c - t_begin)[None, :] * K + j_c) * H_PAD + h_c[None, :]
    rows_ok = (c_ok & (h_c < H))[:, None]
    ds = tl.load(DS_BUF + buf, mask=ok, other=0.0)
    qc = tl.load(Q + t_c[:, None] * stride_qt + h_c[:, None] * stride_qh + cols[None, :], mask=rows_ok, other=0.0)
    acc = tl.dot(ds, qc, acc, input_precision=PREC)
    if VALUE:
        p = tl.load(P_BUF + buf, mask=ok, other=0.0)
        doc = tl.load(DOUT + t_c[:, None] * stride_dot + h_c[:, None] * stride_doh + cols[None, :], mask=rows_ok,
                      other=0.0)
        acc = tl.dot(p, doc, acc, input_precision=PREC)
    return acc, bad


@triton.jit
def _bwd_band_combine_kernel(PART, ACC, N, n_keys, key_lo, n_split, stride_split, D_QK, BLOCK_D: tl.constexpr):
    """``ACC[b N + key_lo + k] += sum over splits of PART[split, b n_keys + k]``, splits in order."""
    row = tl.program_id(0)
    b = row // n_keys
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D_QK
    dst = ACC + (b.to(tl.int64) * N + key_lo + row % n_keys) * D_QK + cols
    total = tl.load(dst, mask=ok, other=0.0)
    for s in range(0, n_split):
        total += tl.load(PART + s * stride_split + row.to(tl.int64) * D_QK + cols, mask=ok, other=0.0)
    tl.store(dst, total, mask=ok)


@triton.jit
def _fill_zero_kernel(OUT, NUMEL, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + offs, tl.zeros([BLOCK], dtype=OUT.dtype.element_ty), mask=offs < NUMEL)


@triton.jit
def _copy_kernel(SRC, DST, NUMEL, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUMEL
    tl.store(DST + offs, tl.load(SRC + offs, mask=ok).to(DST.dtype.element_ty), mask=ok)
