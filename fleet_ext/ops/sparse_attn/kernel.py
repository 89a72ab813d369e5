"""Triton sparse MQA attention with a per-head sink: forward and a deterministic backward.

One kernel family for the DSv4 CSA/HCA core (``d_qk = d_v = 512``, K = V) and the latent MQA core of the
-2 layers (``d_qk = 576``, ``d_v = 512``: the value is the first ``d_v`` channels of the key).

Contract (flat layout): ``q [T, H, d_qk]``, ``kv [N, d_qk]``, ``idx [T, K]`` int32/int64 (an entry is
valid when ``0 <= idx < N``; anything else, e.g. -1, is skipped), optional ``topk_length [T]`` (only the
first ``topk_length[t]`` slots of row t are read), ``sink [H]`` fp32 logits, ``scale``. For query t, head
h and the valid set S_t (dsv4_math.md §2.5, §7)::

    l_j = scale * q_{t,h} . kv_j          LSE = log(sum_{j in S_t} exp(l_j) + exp(sink_h))
    out_{t,h} = sum_j exp(l_j - LSE) kv_j[:d_v]          (the sink is a value-less softmax column)

Forward (``sparse_attn_fwd``): one program per (query, block of <= 64 heads) holds the whole Q tile
(all heads of the query share each gathered KV row, MQA), walks the index row in blocks of ``BLOCK_N``
gathered KV rows, online softmax in base 2 (``scale * log2 e`` folded into one multiply), the running max
starts at the sink logit (so no row ever computes ``-inf - -inf``) and the sink enters the denominator
in the epilogue. The QK contraction is split into the value part ``[0, d_v)`` and the tail
``[d_v, d_qk)`` (576 = 512 + 64: two power-of-two dots over the same gathered rows); PV reuses the value
part of the gathered tile. Returns ``out [T, H, d_v]`` (input dtype) and the sink-inclusive natural-log
``lse [T, H]`` fp32. Heads that do not fill a 64-row tile are masked (zero q, +inf lse in the backward:
exact); widths must be powers of two (``d_v`` and ``d_qk - d_v``, the latter may be 0) — the Paddle
function zero-pads other widths, which is exact.

Backward (``sparse_attn_bwd``), deterministic — no floating-point atomics anywhere, every sum has one
fixed order, so the same inputs give byte-identical ``dq``, ``dkv`` and ``d_sink`` run after run:

1. ``_bwd_preprocess``: ``delta = rowsum(dO * O) - dLSE`` per (t, h) and per-query-block partial sums of
   ``d_sink_h = -sum_t exp(sink_h - LSE) * delta``; ``_dsink_reduce`` sums the partials in a fixed loop.
2. ``_bwd_dq`` (query-major, one program per (query, head block)): recompute ``P = exp2(s - LSE2)``,
   ``dP = dO V^T``, ``dS = scale * P * (dP - delta)``, accumulate ``dq`` over the index row in registers,
   and write ``P`` and ``dS`` (input dtype) to a pair-major buffer ``[pairs, H_pad]``.
3. ``_bwd_dkv_partial``: for each (query, block of slots) the per-pair dkv contribution
   ``dS^T Q_t + P^T dO_t`` — a GEMM that reduces over *all* heads at once — written to
   ``part [pairs, d_qk]`` (fp32 by default).
4. A transposed index (CSR) built once per query chunk: keys = kv row (``N`` for invalid pairs), a
   *stable* sort of the keys, ``rowptr`` by binary search (``_csr_keys``, ``_csr_rowptr``). The stable
   sort orders each row's pairs by (query, slot).
5. ``_bwd_dkv_reduce``: one program per kv row sums its pairs' contributions in CSR order (fixed-size
   lanes, then one tree reduction over the lanes) and adds the previous chunks' sum.

Trailing bound (``row_bound``, on by default: ``derive_bound=True``): before any kernel, one small launch
reads the index table once and writes, per row, the position of its last valid slot + 1 (``min``-ed with
``topk_length`` when one is given); the forward and every backward kernel then stop there instead of at
``K``. Slots past it are invalid, and an invalid slot contributes exactly nothing (``p = 0``, rescale
factor exactly 1, ``dS = 0``, no CSR pair), so results are byte-identical with and without the bound;
interior invalid slots (holes before the last valid one) are still masked as before. Causal top-k tables
put their -1 slots last (early queries see fewer keys than ``K``): at s = 4096 with 2048 slots a quarter
of the V3.2 slots are skipped. The dkv-contribution programs whose slot block lies wholly past the bound
exit at once.

Queries are processed in chunks so the pair buffers stay under ``max_partial_bytes``; chunks are summed
in order (deterministic). This moves more bytes than an atomic scatter-add (the contributions are written
once and read once) in exchange for reproducibility.

Host launchers take torch tensors (CUDA, or CPU in interpreter mode) or Paddle tensors (through
:mod:`fleet_ext.ops.launch`); the only framework op used is the stable sort of the CSR build. This module
imports neither Paddle nor torch.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from fleet_ext import capability
from fleet_ext.ops.launch import dtype_name, empty_like, is_paddle, launch, shape_of

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = 1.4426950408889634

# A sink logit at or below this is treated as "no sink": it never becomes the running max.
_NEG_BIG = tl.constexpr(-1.0e30)

MAX_D_V = 512  # the fp32 [64, d_v] accumulators of the forward and dq kernels must stay in registers


def _fix_interpreter_scalar_index() -> None:
    """Let run-time scalars bound loops in the Triton interpreter.

    Triton 3.6's interpreter holds a scalar as a shape-(1,) NumPy array and turns it into a ``range`` bound
    with ``int(array)``, which NumPy 2.4 rejects ("only 0-dimensional arrays can be converted"); compiled
    kernels are unaffected. Wrap its tensor patching so ``__index__`` reads the single element instead.
    Only in interpreter mode; idempotent.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fixed", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched


if capability.detect().interpreter:
    _fix_interpreter_scalar_index()


# ------------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _unchain(x, live):
    """``x`` (``live`` is always true), passed through a run-time branch.

    Triton (3.6, ``warpsPerTileV3``) lays out a dot whose result feeds another dot — S feeds PV through P
    and through the rescale factor, the key-tail product feeds the main QK dot, S and dP feed dq through
    dS — with every warp along M. With a 64-row head tile and 8 warps that makes both warpgroups compute
    the same S (and dP): half the tensor-core work wasted. A value returned from an ``scf.if`` is outside
    the dot's forward slice, so routing those values through this branch gives S and dP the [4, 2] warp
    grid (each warpgroup half of the columns), checked in the compiled IR (HGMMA count halved). Only small
    values go through it: with the whole softmax inside the branch Triton's software pipeliner fails. The
    ``+ 0.0`` keeps the branch from being folded into a select.
    """
    if live:
        y = x + 0.0
    else:
        y = tl.zeros_like(x)
    return y


@triton.jit
def _sparse_attn_fwd_kernel(
    Q, KV, IDX, TOPK_LEN, SINK, OUT, LSE,
    H, N, K, qk_scale,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    D_V: tl.constexpr, D_TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_H: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, PREC: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    t = pid_t.to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_d = tl.arange(0, D_V)
    offs_n = tl.arange(0, BLOCK_N)

    q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
    if EVEN_H:
        q = tl.load(q_rows + offs_d[None, :])
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=h_ok[:, None], other=0.0)
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        if EVEN_H:
            q_e = tl.load(q_rows + offs_e[None, :])
        else:
            q_e = tl.load(q_rows + offs_e[None, :], mask=h_ok[:, None], other=0.0)

    sink2 = tl.load(SINK + offs_h, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    m_i = tl.maximum(sink2, _NEG_BIG)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_V], dtype=tl.float32)

    n_valid = K
    if HAS_TOPK_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), K)
    idx_row = IDX + t * stride_it
    live = K >= 0
    for start in range(0, n_valid, BLOCK_N):
        kk = start + offs_n
        ids = tl.load(idx_row + kk, mask=kk < n_valid, other=-1)
        ok = (ids >= 0) & (ids < N)
        rows = tl.where(ok, ids, 0).to(tl.int64) * stride_kvn
        kv = tl.load(KV + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        if D_TAIL > 0:
            kv_e = tl.load(KV + rows[:, None] + offs_e[None, :], mask=ok[:, None], other=0.0)
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
    o_rows = OUT + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    if EVEN_H:
        tl.store(o_rows, out.to(OUT.dtype.element_ty))
    else:
        tl.store(o_rows, out.to(OUT.dtype.element_ty), mask=h_ok[:, None])
    tl.store(LSE + t * H + offs_h, lse, mask=h_ok)


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
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
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
        kv = tl.load(KV + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        if D_TAIL > 0:
            kv_e = tl.load(KV + rows[:, None] + offs_e[None, :], mask=ok[:, None], other=0.0)
            s = _unchain(tl.dot(q_e, tl.trans(kv_e), input_precision=PREC), live)
            s = tl.dot(q, tl.trans(kv), s, input_precision=PREC)
        else:
            s = tl.dot(q, tl.trans(kv), input_precision=PREC)
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
def _bwd_dkv_partial_kernel(
    Q, DOUT, TOPK_LEN, P_BUF, DS_BUF, PART,
    H, K, t_begin, H_PAD,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_part,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HP: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_TOPK_LEN: tl.constexpr, PREC: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_m = tl.program_id(1)
    tl_local = pid_t.to(tl.int64)
    t = t_begin + tl_local
    n_valid = K
    if HAS_TOPK_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), K)
        if pid_m * BLOCK_M >= n_valid:  # the whole slot block is past the row's bound: nothing to write
            return
    kk = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_ok = kk < n_valid
    offs_hp = tl.arange(0, BLOCK_HP)
    hp_ok = offs_hp < H
    pair = tl_local * K + kk
    buf = pair[:, None] * H_PAD + offs_hp[None, :]
    buf_ok = k_ok[:, None] & (offs_hp < H_PAD)[None, :]
    ds = tl.load(DS_BUF + buf, mask=buf_ok, other=0.0)
    p = tl.load(P_BUF + buf, mask=buf_ok, other=0.0)
    part_rows = PART + pair[:, None] * stride_part
    q_rows = Q + t * stride_qt + offs_hp[:, None] * stride_qh
    do_rows = DOUT + t * stride_dot + offs_hp[:, None] * stride_doh
    for d0 in range(0, D_V, BLOCK_D):
        offs_c = d0 + tl.arange(0, BLOCK_D)
        qc = tl.load(q_rows + offs_c[None, :], mask=hp_ok[:, None], other=0.0)
        doc = tl.load(do_rows + offs_c[None, :], mask=hp_ok[:, None], other=0.0)
        acc = tl.dot(ds, qc, input_precision=PREC)
        acc = tl.dot(p, doc, acc, input_precision=PREC)
        tl.store(part_rows + offs_c[None, :], acc.to(PART.dtype.element_ty), mask=k_ok[:, None])
    if D_TAIL > 0:
        offs_e = D_V + tl.arange(0, D_TAIL)
        qe = tl.load(q_rows + offs_e[None, :], mask=hp_ok[:, None], other=0.0)
        acc_e = tl.dot(ds, qe, input_precision=PREC)
        tl.store(part_rows + offs_e[None, :], acc_e.to(PART.dtype.element_ty), mask=k_ok[:, None])


# ------------------------------------------------------------------------------------------------------
# Backward 4: transposed index (CSR) — keys, then (after a stable sort) row pointers
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _csr_keys_kernel(IDX, TOPK_LEN, KEYS, N, K, t_begin, stride_it, BLOCK: tl.constexpr, HAS_TOPK_LEN: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    tl_local = pid_t.to(tl.int64)
    t = t_begin + tl_local
    kk = pid_k * BLOCK + tl.arange(0, BLOCK)
    n_valid = K
    if HAS_TOPK_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t).to(tl.int32), 0), K)
    ids = tl.load(IDX + t * stride_it + kk, mask=kk < n_valid, other=-1)
    ok = (ids >= 0) & (ids < N)
    tl.store(KEYS + tl_local * K + kk, tl.where(ok, ids, N).to(tl.int32), mask=kk < K)


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


# ------------------------------------------------------------------------------------------------------
# Backward 5: dkv row j = sum of its pairs' contributions in CSR order (+ previous chunks)
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_dkv_reduce_kernel(
    PART, ORDER, ROWPTR, ACC, OUT, stride_part,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_P: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    start = tl.load(ROWPTR + j)
    end = tl.load(ROWPTR + j + 1)
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
        acc += tl.load(PART + src[:, None] + offs_d[None, :], mask=p_ok[:, None], other=0.0).to(tl.float32)
        if D_TAIL > 0:
            acc_e += tl.load(PART + src[:, None] + offs_e[None, :], mask=p_ok[:, None], other=0.0).to(tl.float32)
    total = tl.sum(acc, 0)
    row = j * stride_part
    if ACCUMULATE:
        total = tl.load(ACC + row + offs_d) + total
    tl.store(OUT + row + offs_d, total.to(OUT.dtype.element_ty))
    if D_TAIL > 0:
        total_e = tl.sum(acc_e, 0)
        if ACCUMULATE:
            total_e = tl.load(ACC + row + offs_e) + total_e
        tl.store(OUT + row + offs_e, total_e.to(OUT.dtype.element_ty))


# ------------------------------------------------------------------------------------------------------
# Trailing bound: per row, last valid slot + 1 (within topk_length when given)
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _row_bound_kernel(IDX, TOPK_LEN, BOUND, T, N, K, stride_it,
                      BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, HAS_TOPK_LEN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    if HAS_TOPK_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(TOPK_LEN + rows, mask=r_ok, other=0).to(tl.int32), 0), K)
    else:
        n_valid = tl.zeros([BLOCK_T], dtype=tl.int32) + K
    best = tl.zeros([BLOCK_T], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        m = r_ok[:, None] & (kk[None, :] < n_valid[:, None])
        ids = tl.load(IDX + rows[:, None] * stride_it + kk[None, :], mask=m, other=-1)
        ok = (ids >= 0) & (ids < N)
        best = tl.maximum(best, tl.max(tl.where(ok, kk[None, :] + 1, 0), 1))
    tl.store(BOUND + rows, best, mask=r_ok)


# ------------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()



def _framework_dtype(tensor: Any, name: str) -> Any:
    if is_paddle(tensor):
        import paddle

        return getattr(paddle, name)
    import torch

    return getattr(torch, name)



def _is_contiguous(tensor: Any) -> bool:
    fn = getattr(tensor, "is_contiguous", None)
    return True if fn is None else bool(fn())


def _stable_sort(keys: Any) -> tuple[Any, Any]:
    """(sorted keys, permutation) with equal keys kept in input order — the one framework op used here."""
    if is_paddle(keys):
        import paddle

        order = paddle.argsort(keys, stable=True)
        return paddle.gather(keys, order), order
    import torch

    return torch.sort(keys, stable=True)


_FLOAT = ("float32", "bfloat16", "float16")


def check_inputs(q: Any, kv: Any, idx: Any, sink: Any, d_v: int | None, topk_length: Any = None,
                 fn: str = "sparse_attn") -> tuple[int, int, int, int, int, int]:
    """Validate the flat-layout inputs; returns (T, H, d_qk, N, K, d_v). Errors name the tensor."""
    if len(q.shape) != 3:
        raise ValueError(f"{fn}: `q` must be [T, H, d_qk], got shape {list(q.shape)}")
    num_t, heads, d_qk = shape_of(q)
    if len(kv.shape) != 2 or int(kv.shape[1]) != d_qk:
        raise ValueError(f"{fn}: `kv` must be [N, {d_qk}] (d_qk of `q`), got shape {list(kv.shape)}")
    if len(idx.shape) != 2 or int(idx.shape[0]) != num_t:
        raise ValueError(f"{fn}: `idx` must be [T, K] with T = {num_t}, got shape {list(idx.shape)}")
    if dtype_name(idx) not in ("int32", "int64"):
        raise ValueError(f"{fn}: `idx` must be int32 or int64, got {idx.dtype}")
    if shape_of(sink) != [heads] or dtype_name(sink) != "float32":
        raise ValueError(f"{fn}: `sink` must be fp32 [{heads}], got {sink.dtype} {list(sink.shape)}")
    if dtype_name(q) not in _FLOAT:
        raise ValueError(f"{fn}: `q` must be float32, bfloat16 or float16, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise ValueError(f"{fn}: `kv` must have the dtype of `q` ({q.dtype}), got {kv.dtype}")
    if topk_length is not None and (shape_of(topk_length) != [num_t]
                                    or dtype_name(topk_length) not in ("int32", "int64")):
        raise ValueError(f"{fn}: `topk_length` must be int32/int64 [{num_t}], got {topk_length.dtype} "
                         f"{list(topk_length.shape)}")
    d_v = d_qk if d_v is None else int(d_v)
    d_tail = d_qk - d_v
    if not 0 < d_v <= d_qk:
        raise ValueError(f"{fn}: `d_v` must be in [1, d_qk = {d_qk}], got {d_v}")
    min_w = 16  # tl.dot needs every operand dimension >= 16 (the interpreter checks it too)
    if d_v != _pow2(d_v) or d_v < min_w or d_v > MAX_D_V:
        raise ValueError(f"{fn}: the value width d_v = {d_v} of `q`/`kv` must be a power of two in "
                         f"[{min_w}, {MAX_D_V}] for the Triton kernel (zero-pad it: exact)")
    if d_tail and (d_tail != _pow2(d_tail) or d_tail < min_w or d_tail > MAX_D_V):
        raise ValueError(f"{fn}: the key-only width d_qk - d_v = {d_tail} of `q`/`kv` must be 0 or a power of "
                         f"two in [{min_w}, {MAX_D_V}] for the Triton kernel (zero-pad it: exact)")
    for name, tensor in (("q", q), ("kv", kv), ("idx", idx), ("sink", sink), ("topk_length", topk_length)):
        if tensor is not None and not _is_contiguous(tensor):
            raise ValueError(f"{fn}: `{name}` must be contiguous")
    return num_t, heads, d_qk, int(kv.shape[0]), int(idx.shape[1]), d_v


def _prec(q: Any) -> str:
    # fp32 inputs: full-precision dots (Triton's default for fp32 would be tf32 on a GPU)
    return "ieee" if dtype_name(q) == "float32" else "tf32"


# Per-kernel launch configurations, most preferred first: a configuration that does not fit the
# device (shared memory / registers) at compile time falls through to the next one.
_FWD_CONFIGS_GPU = [
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
]
# Measured on an H200 (benchmarks/RESULTS.md, 2026-11-30): fwd BLOCK_N 64 / 2 stages beats 32 / 3 stages by
# 1.4-1.6x; dq 32 / 3 stages beats 32 / 2 by 3-6 % of the whole backward, 16 / 3 loses 20 %; the dkv-partial
# GEMM with 128-slot tiles and 8 warps beats 64 / 4 warps by 1-6 %. Together (second run, same day, no trailing
# bound): the backward 8-11 % faster on the V3.2 and CSA shapes, 2-7 % on HCA.
_DQ_CONFIGS_GPU = [
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 16, "num_warps": 8, "num_stages": 1},
]
_PARTIAL_CONFIGS_GPU = [
    {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1},
]
_REDUCE_CONFIG_GPU = {"BLOCK_P": 16, "num_warps": 4, "num_stages": 1}
_INTERP = {"fwd": [{"BLOCK_N": 16}], "dq": [{"BLOCK_N": 16}], "partial": [{"BLOCK_M": 16}],
           "reduce": {"BLOCK_P": 4}}

_CHOSEN: dict[tuple, dict] = {}
OVERRIDES: dict[str, list[dict]] = {}  # kernel name -> configurations to try instead (benchmarks)


def _launch_first_fitting(name: str, kernel: Any, grid: tuple, key: tuple, configs: list[dict],
                          *args: Any, **meta: Any) -> None:
    configs = OVERRIDES.get(name, configs)
    cache_key = (name, *key, repr(configs))
    if cache_key in _CHOSEN:
        launch(kernel, grid, *args, **meta, **_CHOSEN[cache_key])
        return
    error = None
    for config in configs:
        try:
            launch(kernel, grid, *args, **meta, **config)
        except Exception as exc:  # noqa: BLE001 - only resource failures fall through, others re-raise
            if type(exc).__name__ not in ("OutOfResources", "OutOfResourcesError"):
                raise
            error = exc
            continue
        _CHOSEN[cache_key] = config
        return
    raise RuntimeError(f"{name}: no launch configuration fits this device: {error}")


def _configs(kind: str, gpu_configs: list[dict]) -> list[dict]:
    return _INTERP[kind] if capability.detect().interpreter else gpu_configs


def row_bound(idx: Any, n_kv: int, topk_length: Any = None) -> Any:
    """Per-row trailing bound of an index table: int32 [T], 1 + the last slot k of row t with
    ``0 <= idx[t, k] < n_kv`` (only slots ``k < topk_length[t]`` count when given), 0 for a row with none.

    Passing it as ``topk_length`` gives byte-identical results to passing nothing (the slots past it are
    invalid, and an invalid slot contributes exactly nothing) while the kernels stop at it. One launch,
    one read of the table (T·K·4 bytes: 134 MB at T = 16384, K = 2048: 44 us measured on an H200).
    """
    if len(idx.shape) != 2 or dtype_name(idx) not in ("int32", "int64") or not _is_contiguous(idx):
        raise ValueError(f"row_bound: `idx` must be a contiguous int32/int64 [T, K], got {idx.dtype} "
                         f"{list(idx.shape)}")
    num_t, width = shape_of(idx)
    if topk_length is not None and (shape_of(topk_length) != [num_t]
                                    or dtype_name(topk_length) not in ("int32", "int64")):
        raise ValueError(f"row_bound: `topk_length` must be int32/int64 [{num_t}], got {topk_length.dtype} "
                         f"{list(topk_length.shape)}")
    bound = empty_like(idx, [num_t], dtype=_framework_dtype(idx, "int32"))
    if num_t == 0:
        return bound
    interp = capability.detect().interpreter
    block_t, block_k = (4, 16) if interp else (8, min(256, max(16, _pow2(width))))
    launch(_row_bound_kernel, (triton.cdiv(num_t, block_t),), idx, idx if topk_length is None else topk_length,
           bound, num_t, int(n_kv), width, width, BLOCK_T=block_t, BLOCK_K=block_k,
           HAS_TOPK_LEN=topk_length is not None, num_warps=4)
    return bound


def sparse_attn_fwd(q: Any, kv: Any, idx: Any, sink: Any, scale: float, d_v: int | None = None,
                    topk_length: Any = None, derive_bound: bool = True) -> tuple[Any, Any]:
    """Forward: q [T, H, d_qk], kv [N, d_qk], idx [T, K], sink [H] fp32 -> (out [T, H, d_v], lse [T, H] fp32).

    ``derive_bound`` (default): stop each row at its last valid slot (``row_bound``, byte-identical
    results); pass ``False`` when ``topk_length`` already is such a bound (the Paddle function does).
    """
    num_t, heads, d_qk, n_kv, width, d_v = check_inputs(q, kv, idx, sink, d_v, topk_length, "sparse_attn_fwd")
    out = empty_like(q, [num_t, heads, d_v])
    lse = empty_like(q, [num_t, heads], dtype=_framework_dtype(q, "float32"))
    if num_t == 0 or heads == 0:
        return out, lse
    if derive_bound and width > 0:
        topk_length = row_bound(idx, n_kv, topk_length)
    block_h = min(64, max(16, _pow2(heads)))
    grid = (num_t, triton.cdiv(heads, block_h))
    _launch_first_fitting(
        "fwd", _sparse_attn_fwd_kernel, grid, (d_qk, d_v, block_h, dtype_name(q)), _configs("fwd", _FWD_CONFIGS_GPU),
        q, kv, idx, q if topk_length is None else topk_length, sink, out, lse,
        heads, n_kv, width, float(scale) * _LOG2E,
        heads * d_qk, d_qk, d_qk, width, heads * d_v, d_v,
        D_V=d_v, D_TAIL=d_qk - d_v, BLOCK_H=block_h, EVEN_H=heads % block_h == 0,
        HAS_TOPK_LEN=topk_length is not None, PREC=_prec(q),
    )
    return out, lse


def sparse_attn_bwd(q: Any, kv: Any, idx: Any, sink: Any, scale: float, out: Any, lse: Any, d_out: Any,
                    d_lse: Any = None, d_v: int | None = None, topk_length: Any = None,
                    partial_dtype: str = "float32", max_partial_bytes: int = 4 << 30,
                    derive_bound: bool = True) -> tuple[Any, Any, Any]:
    """Deterministic backward -> (dq [T, H, d_qk] like q, dkv [N, d_qk] like kv, d_sink [H] fp32).

    ``out``/``lse`` are the forward's outputs, ``d_out`` [T, H, d_v], ``d_lse`` [T, H] (optional, the
    gradient reaching the returned LSE). ``partial_dtype`` is the dtype of the per-pair dkv contributions
    ("float32", or "bfloat16" to halve their traffic at the cost of rounding each contribution);
    ``max_partial_bytes`` bounds the pair buffers (queries are processed in chunks under it);
    ``derive_bound`` as in ``sparse_attn_fwd`` (byte-identical gradients either way).
    """
    fn = "sparse_attn_bwd"
    num_t, heads, d_qk, n_kv, width, d_v = check_inputs(q, kv, idx, sink, d_v, topk_length, fn)
    if shape_of(d_out) != [num_t, heads, d_v] or d_out.dtype != q.dtype:
        raise ValueError(f"{fn}: `d_out` must be {q.dtype} [{num_t}, {heads}, {d_v}], got {d_out.dtype} "
                         f"{list(d_out.shape)}")
    if shape_of(out) != [num_t, heads, d_v]:
        raise ValueError(f"{fn}: `out` must be [{num_t}, {heads}, {d_v}], got {list(out.shape)}")
    if shape_of(lse) != [num_t, heads] or dtype_name(lse) != "float32":
        raise ValueError(f"{fn}: `lse` must be fp32 [{num_t}, {heads}], got {lse.dtype} {list(lse.shape)}")
    if d_lse is not None and (shape_of(d_lse) != [num_t, heads] or dtype_name(d_lse) != "float32"):
        raise ValueError(f"{fn}: `d_lse` must be fp32 [{num_t}, {heads}], got {d_lse.dtype} {list(d_lse.shape)}")
    if partial_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"{fn}: `partial_dtype` must be 'float32' or 'bfloat16', got {partial_dtype!r}")
    for name, tensor in (("out", out), ("lse", lse), ("d_out", d_out), ("d_lse", d_lse)):
        if tensor is not None and not _is_contiguous(tensor):
            raise ValueError(f"{fn}: `{name}` must be contiguous")
    interp = capability.detect().interpreter
    f32 = _framework_dtype(q, "float32")
    prec = _prec(q)

    dq = empty_like(q)
    dkv = empty_like(kv)
    d_sink = empty_like(sink, [heads], dtype=f32)
    if heads == 0:
        return dq, dkv, d_sink
    if num_t == 0:  # nothing attends: zero gradients (rare; no kernel needed beyond the reduce)
        width = 0

    # 1. delta and d_sink
    block_t = 16
    block_hd = min(16, max(2, _pow2(heads)))
    n_tb = max(1, triton.cdiv(num_t, block_t))
    delta = empty_like(q, [max(num_t, 1), heads], dtype=f32)
    dsink_part = empty_like(q, [n_tb, heads], dtype=f32)
    launch(_bwd_preprocess_kernel, (n_tb, triton.cdiv(heads, block_hd)), out, d_out, lse,
           lse if d_lse is None else d_lse, sink, delta, dsink_part, num_t, heads,
           D_V=d_v, BLOCK_T=block_t, BLOCK_H=block_hd, HAS_DLSE=d_lse is not None,
           num_warps=4)
    launch(_dsink_reduce_kernel, (triton.cdiv(heads, 32),), dsink_part, d_sink, n_tb, heads,
           BLOCK_B=32, BLOCK_H=32, num_warps=4)

    # 2-5. dq and dkv, by chunks of queries
    h_pad = max(16, _pow2(heads))
    block_h = min(64, h_pad)
    elem = 4 if dtype_name(q) == "float32" else 2
    part_elem = 4 if partial_dtype == "float32" or dtype_name(q) == "float32" else 2
    part_dt = _framework_dtype(q, "float32" if part_elem == 4 else partial_dtype)
    per_query = max(1, width) * (d_qk * part_elem + 2 * h_pad * elem + 4 + 4 + 8)
    chunk = max(1, min(max(num_t, 1), int(max_partial_bytes) // per_query))
    n_chunks = triton.cdiv(num_t, chunk) if num_t else 0
    pairs = chunk * width
    p_buf = empty_like(q, [max(pairs, 1), h_pad])
    ds_buf = empty_like(q, [max(pairs, 1), h_pad])
    part = empty_like(q, [max(pairs, 1), d_qk], dtype=part_dt)
    keys = empty_like(idx, [max(pairs, 1)], dtype=_framework_dtype(idx, "int32"))
    rowptr = empty_like(idx, [n_kv + 1], dtype=_framework_dtype(idx, "int64"))
    acc = empty_like(kv, [n_kv, d_qk], dtype=f32) if n_chunks > 1 else dkv
    if n_chunks == 0:
        n_chunks, chunk = 1, 0  # one pass of the reduce writes zeros
    if derive_bound and num_t > 0 and width > 0:
        topk_length = row_bound(idx, n_kv, topk_length)
    topk = q if topk_length is None else topk_length
    meta = {"D_V": d_v, "D_TAIL": d_qk - d_v, "HAS_TOPK_LEN": topk_length is not None, "PREC": prec}
    for c in range(n_chunks):
        t0 = c * chunk
        tc = min(chunk, num_t - t0)
        if tc > 0:  # dq (zeros when the index table is empty)
            _launch_first_fitting(
                "dq", _bwd_dq_kernel, (tc, h_pad // block_h), (d_qk, d_v, block_h, dtype_name(q)),
                _configs("dq", _DQ_CONFIGS_GPU),
                q, kv, d_out, idx, topk, lse, delta, dq, p_buf, ds_buf,
                heads, n_kv, width, t0, float(scale) * _LOG2E, float(scale), h_pad,
                heads * d_qk, d_qk, d_qk, width, heads * d_v, d_v,
                BLOCK_H=block_h, EVEN_H=heads % block_h == 0, **meta,
            )
        if tc > 0 and width > 0:
            _launch_first_fitting(
                "partial", _bwd_dkv_partial_kernel, lambda m, tc=tc: (tc, triton.cdiv(width, m["BLOCK_M"])),
                (d_qk, d_v, h_pad, dtype_name(q), partial_dtype), _configs("partial", _PARTIAL_CONFIGS_GPU),
                q, d_out, topk, p_buf, ds_buf, part,
                heads, width, t0, h_pad, heads * d_qk, d_qk, heads * d_v, d_v, d_qk,
                BLOCK_HP=h_pad, BLOCK_D=min(d_v, 16 if interp else 64), **meta,
            )
            launch(_csr_keys_kernel, (tc, triton.cdiv(width, 128 if not interp else 16)), idx, topk, keys,
                   n_kv, width, t0, width, BLOCK=128 if not interp else 16,
                   HAS_TOPK_LEN=topk_length is not None)
            n_pairs = tc * width
            sorted_keys, order = _stable_sort(keys[:n_pairs] if n_pairs < int(keys.shape[0]) else keys)
        else:
            n_pairs = 0
            sorted_keys, order = keys, keys
        steps = max(1, int(n_pairs).bit_length() + 1)
        launch(_csr_rowptr_kernel, (triton.cdiv(n_kv + 1, 128),), sorted_keys, rowptr, n_pairs, n_kv + 1,
               STEPS=steps, BLOCK=128)
        red = _INTERP["reduce"] if interp else _REDUCE_CONFIG_GPU
        launch(_bwd_dkv_reduce_kernel, (n_kv,), part, order, rowptr, acc, dkv if c == n_chunks - 1 else acc,
               d_qk, D_V=d_v, D_TAIL=d_qk - d_v, ACCUMULATE=c > 0, **red)
    return dq, dkv, d_sink


def flops(num_valid_pairs: int, heads: int, d_qk: int, d_v: int) -> dict[str, float]:
    """FLOP accounting of dsv4_math.md §8 over *valid* (query, index) pairs: fwd 2·H·(d_qk + d_v) per pair,
    bwd 2·H·(2·d_v + 3·d_qk) per pair (TileLang's accounting)."""
    return {"fwd": 2.0 * num_valid_pairs * heads * (d_qk + d_v),
            "bwd": 2.0 * num_valid_pairs * heads * (2 * d_v + 3 * d_qk)}


__all__ = ["sparse_attn_fwd", "sparse_attn_bwd", "row_bound", "check_inputs", "flops", "OVERRIDES"]
