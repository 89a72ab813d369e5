"""Device code of the sparse-attention forward: the attention kernel and the per-row trailing bound.

The maths, the layout contract and the host launchers are in ``kernel.py``; the backward kernels are in
``kernel_bwd.py``. Device code only: this module imports neither Paddle nor torch and decides nothing
about the machine at import.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# A sink logit at or below this is treated as "no sink": it never becomes the running max.
_NEG_BIG = tl.constexpr(-1.0e30)


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
def _block_scores(kv_base, rows, ok, q, q_e, offs_d, offs_e, live, D_TAIL: tl.constexpr, PREC: tl.constexpr):
    """(kv, kv_e, S) of one block of keys: the rows ``rows`` (offsets from ``kv_base``; ``ok`` False reads zeros),
    ``S = q k^T`` with the key-only tail's product first (``kv_e`` is ``kv`` when there is no tail)."""
    kv = tl.load(kv_base + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
    kv_e = kv
    if D_TAIL > 0:
        kv_e = tl.load(kv_base + rows[:, None] + offs_e[None, :], mask=ok[:, None], other=0.0)
        s = _unchain(tl.dot(q_e, tl.trans(kv_e), input_precision=PREC), live)
        s = tl.dot(q, tl.trans(kv), s, input_precision=PREC)
    else:
        s = tl.dot(q, tl.trans(kv), input_precision=PREC)
    return kv, kv_e, s


@triton.jit
def _online_softmax_pv(s, ok, kv, m_i, l_i, acc, qk_scale, live, PREC: tl.constexpr):
    """One block of the online softmax in base 2 (``qk_scale`` has log2(e) folded in) and ``acc += P V``."""
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = _unchain(p.to(kv.dtype), live)
    acc = acc * _unchain(alpha, live)[:, None]
    acc = tl.dot(p, kv, acc, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _finish(acc, m_i, l_i, sink2):
    """(out, lse) from the running max, sum and accumulator, the sink's mass added; rows without mass: 0, -inf."""
    l_i = l_i + tl.math.exp2(sink2 - m_i)
    has_mass = l_i > 0.0
    out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    lse = tl.where(has_mass, (m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0))) * LN2, float("-inf"))
    return out, lse


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
    q_e, offs_e = q, offs_d  # no key-only tail: placeholders, never read
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
        kv, _, s = _block_scores(KV, rows, ok, q, q_e, offs_d, offs_e, live, D_TAIL, PREC)
        m_i, l_i, acc = _online_softmax_pv(s, ok, kv, m_i, l_i, acc, qk_scale, live, PREC)

    out, lse = _finish(acc, m_i, l_i, sink2)
    o_rows = OUT + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    if EVEN_H:
        tl.store(o_rows, out.to(OUT.dtype.element_ty))
    else:
        tl.store(o_rows, out.to(OUT.dtype.element_ty), mask=h_ok[:, None])
    tl.store(LSE + t * H + offs_h, lse, mask=h_ok)


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
