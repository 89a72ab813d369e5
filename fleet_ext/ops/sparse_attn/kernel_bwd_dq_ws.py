"""Warp-specialised dq step of the sparse-attention backward for Hopper (Gluon): ``kernel_bwd._bwd_dq_kernel``'s maths.

Why: the Triton dq kernel splits 64 heads x 32 keys over two warpgroups, so S and dP are 68 wgmma of N = 16 per
block, and ptxas serialises them (C7515, read off its sm90 compile). Here one program (one query, 64 heads) runs
three warpgroups:

- **gather** (worker): Q and dO once, then each block's 32 KV rows with ``cp.async`` into one of two stages;
- **A** (default partition): ``S = Q K^T`` (m64n32), ``P``, waits for B's ``dP``, ``dS``, hands ``dS`` to B,
  writes ``P`` and ``dS`` to the pair buffers, ``dq[:, :256] += dS K[:, :256]``;
- **B** (worker): ``dP = dO V^T`` (m64n32) concurrently with A's ``S``, hands ``dP`` to A, then
  ``dq[:, 256:512] += dS K[:, 256:512]`` and the tail ``dq[:, 512:] += dS K[:, 512:]``.

The same kernel has a dense causal mode (``DENSE``: contiguous keys up to each row's causal bound, no pair
buffers, for ``causal.py``).

Barriers: ``qd_ready`` (Q and dO landed), ``kv_ready`` / ``kv_free`` per stage (the gather's 128 threads; A and B
done with it), ``dp_ready`` / ``dp_free`` and ``ds_ready`` / ``ds_free`` (the two hand-overs through shared memory).
Every async wgmma is waited in the iteration that issues it (a result carried around the loop serialises them).
The same blocks and the same per-element maths as the Triton kernel, other MMA shapes: agrees to rounding (1e-4
relative at V3.2 widths on the H200; DSv4's d 512 came out byte-equal there, not relied on); deterministic. The
pair buffers get the same ``P`` and ``dS`` layout, so the rest of the backward is unchanged. Chosen by
``kernel_config.DQ_KERNEL`` / ``ws_dq_fits``; ``tests/single_card_tests/test_gluon_sm90_compile.py`` holds its sm90
compile to no wgmma serialisation and a few bytes of spill.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fleet_ext.ops.sparse_attn.kernel_fwd_ws import (
    _NARROW,
    _NARROW_ROWS,
    _WIDE,
    _WIDE_ROWS,
    HALF,
    LOG2E,
    _copy_cols,
    _gather_kv_blocks,
    _init_stage_barriers,
    _issue_qk,
    _kv_stages,
    _q_tiles,
    _rows,
    _stage_barriers,
)


@gluon.jit
def _dq_gather(q_base, do_base, kv_base, idx_row, n_valid, bufs, bars, h0, H, N, stride_qh, stride_doh, stride_kvn,
               D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
               GATHER: gl.constexpr):
    q_lo, q_hi, q_tail, do_lo, do_hi, kv_lo, kv_hi, kv_tail, ds_smem, dp_smem = bufs
    qd_ready, kv_ready, kv_free, dp_ready, dp_free, ds_ready, ds_free = bars
    for r in gl.static_range(0, BLOCK_H, 16):
        row, ok = _rows(idx_row, h0 + r, H, N, 16, _WIDE_ROWS, False)
        _copy_cols(q_lo.slice(r, 16), q_base, row, ok, stride_qh, 0, HALF, _WIDE)
        _copy_cols(q_hi.slice(r, 16), q_base, row, ok, stride_qh, HALF, HALF, _WIDE)
        _copy_cols(do_lo.slice(r, 16), do_base, row, ok, stride_doh, 0, HALF, _WIDE)
        _copy_cols(do_hi.slice(r, 16), do_base, row, ok, stride_doh, HALF, HALF, _WIDE)
        if D_TAIL > 0:
            row_t, ok_t = _rows(idx_row, h0 + r, H, N, 16, _NARROW_ROWS, False)
            _copy_cols(q_tail.slice(r, 16), q_base, row_t, ok_t, stride_qh, 2 * HALF, D_TAIL, _NARROW)
    async_copy.mbarrier_arrive(qd_ready, increment_count=False)

    _gather_kv_blocks(kv_base, idx_row, n_valid, kv_lo, kv_hi, kv_tail, kv_ready, kv_free, N, stride_kvn, D_TAIL,
                      BLOCK_N, NUM_STAGES, GATHER)


@gluon.jit
def _dq_store(DQ, acc, t, h0, col0, H, stride_qt, stride_qh, layout: gl.constexpr, BLOCK_H: gl.constexpr,
              WIDTH: gl.constexpr):
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    ptrs = DQ + t * stride_qt + heads.to(gl.int64)[:, None] * stride_qh + cols[None, :]
    gl.store(ptrs, acc.to(DQ.dtype.element_ty), mask=(heads < H)[:, None])


@gluon.jit
def _dq_a(idx_row, n_valid, LSE, DELTA, DQ, P_BUF, DS_BUF, bufs, bars, t, tl_local, h0, H, N, K, H_PAD, qk_scale,
          scale, stride_qt, stride_qh, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
          NUM_STAGES: gl.constexpr, DENSE: gl.constexpr):
    q_lo, q_hi, q_tail, do_lo, do_hi, kv_lo, kv_hi, kv_tail, ds_smem, dp_smem = bufs
    qd_ready, kv_ready, kv_free, dp_ready, dp_free, ds_ready, ds_free = bars
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=row_s)
    h_ok = offs_h < H
    lse2 = gl.load(LSE + t * H + offs_h, mask=h_ok, other=float("inf")) * LOG2E
    delta = gl.load(DELTA + t * H + offs_h, mask=h_ok, other=0.0)
    dq = gl.zeros([BLOCK_H, HALF], gl.float32, o_l)
    mbarrier.wait(qd_ready, 0)
    for i in range(gl.cdiv(n_valid, BLOCK_N)):
        stage = i % NUM_STAGES
        kk = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
        _, ok = _rows(idx_row, i * BLOCK_N, n_valid, N, BLOCK_N, col_s, not DENSE)
        mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
        s = _issue_qk(q_lo, q_hi, q_tail, kv_lo.index(stage), kv_hi.index(stage), kv_tail.index(stage),
                      gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l), D_TAIL)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p = gl.exp2(s * qk_scale - lse2[:, None])
        p = gl.where(ok[None, :], p, 0.0)
        mbarrier.wait(dp_ready, i & 1)
        dp = dp_smem.load(s_l)
        mbarrier.arrive(dp_free, count=1)
        ds = (p * (dp - delta[:, None]) * scale).to(ds_smem.dtype)
        mbarrier.wait(ds_free, (i & 1) ^ 1)
        ds_smem.store(ds)
        fence_async_shared()
        mbarrier.arrive(ds_ready, count=1)
        tok = warpgroup_mma(gl.convert_layout(ds, a_l), kv_lo.index(stage), dq, is_async=True)
        if not DENSE:  # the dense causal backward's dkv pass recomputes P and dS: no pair buffers
            pair = (tl_local * K + kk)[None, :] * H_PAD + offs_h[:, None]  # pair-major: a slot's heads contiguous
            k_ok = (kk < n_valid)[None, :]
            gl.store(P_BUF + pair, p.to(P_BUF.dtype.element_ty), mask=k_ok)
            gl.store(DS_BUF + pair, ds, mask=k_ok)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
        mbarrier.arrive(kv_free.index(stage), count=1)
    _dq_store(DQ, dq, t, h0, 0, H, stride_qt, stride_qh, o_l, BLOCK_H, HALF)


@gluon.jit
def _dq_b(n_valid, DQ, bufs, bars, t, h0, H, stride_qt, stride_qh, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr,
          BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    q_lo, q_hi, q_tail, do_lo, do_hi, kv_lo, kv_hi, kv_tail, ds_smem, dp_smem = bufs
    qd_ready, kv_ready, kv_free, dp_ready, dp_free, ds_ready, ds_free = bars
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    TAIL: gl.constexpr = D_TAIL if D_TAIL > 0 else 64
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TAIL, 16])
    dq = gl.zeros([BLOCK_H, HALF], gl.float32, o_l)
    dq_t = gl.zeros([BLOCK_H, TAIL], gl.float32, t_l)
    mbarrier.wait(qd_ready, 0)
    for i in range(gl.cdiv(n_valid, BLOCK_N)):
        stage = i % NUM_STAGES
        mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
        dp = warpgroup_mma(do_lo, kv_lo.index(stage).permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l),
                           use_acc=False, is_async=True)
        dp = warpgroup_mma(do_hi, kv_hi.index(stage).permute((1, 0)), dp, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        mbarrier.wait(dp_free, (i & 1) ^ 1)
        dp_smem.store(dp)
        fence_async_shared()
        mbarrier.arrive(dp_ready, count=1)
        mbarrier.wait(ds_ready, i & 1)
        dq = warpgroup_mma(ds_smem, kv_hi.index(stage), dq, is_async=True)
        if D_TAIL > 0:
            dq_t = warpgroup_mma(ds_smem, kv_tail.index(stage), dq_t, is_async=True)
            dq, dq_t = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dq_t))
        else:
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(ds_free, count=1)
        mbarrier.arrive(kv_free.index(stage), count=1)
    _dq_store(DQ, dq, t, h0, HALF, H, stride_qt, stride_qh, o_l, BLOCK_H, HALF)
    if D_TAIL > 0:
        _dq_store(DQ, dq_t, t, h0, 2 * HALF, H, stride_qt, stride_qh, t_l, BLOCK_H, TAIL)


@gluon.jit
def _bwd_dq_ws_kernel(
    Q, KV, DOUT, IDX, TOPK_LEN, LSE, DELTA, DQ, P_BUF, DS_BUF,
    H, N, K, t_begin, qk_scale, scale, H_PAD,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dot, stride_doh,
    D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
    NUM_STAGES: gl.constexpr, GATHER_REGS: gl.constexpr, B_REGS: gl.constexpr, HEAD_BLOCKS: gl.constexpr,
    S=1, q_offset=0, DENSE: gl.constexpr = False,
):
    """One program per (query row, 64 heads). Sparse: the row's index slots (up to ``topk_length``), ``P`` and ``dS``
    written to the pair buffers. ``DENSE`` (``causal.py``'s contract; ``IDX``, ``TOPK_LEN``, ``K``, the pair buffers
    unused): query ``t = b * S + i`` sees keys ``b * N + 0 .. min(q_offset + i, N - 1)``, the longest rows first."""
    tile = gl.program_id(0)  # a query's head blocks next to each other (they gather the same KV rows)
    h0 = (tile % HEAD_BLOCKS) * BLOCK_H
    if DENSE:
        tl_local = (gl.num_programs(0) // HEAD_BLOCKS - 1 - tile // HEAD_BLOCKS).to(gl.int64)
        t = tl_local
        seq_b = t // S
        n_valid = gl.minimum(q_offset + (t - seq_b * S) + 1, N).to(gl.int32)
        kv_base = KV + seq_b * N * stride_kvn
    else:
        tl_local = (tile // HEAD_BLOCKS).to(gl.int64)
        t = t_begin + tl_local
        n_valid = K
        if HAS_TOPK_LEN:
            n_valid = gl.minimum(gl.maximum(gl.load(TOPK_LEN + t).to(gl.int32), 0), K)
        kv_base = KV
    idx_row = IDX + t * stride_it
    dtype: gl.constexpr = Q.dtype.element_ty
    qh_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], dtype)
    ds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    dp_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    q_lo, q_hi, q_tail = _q_tiles(dtype, BLOCK_H, D_TAIL)
    do_lo = gl.allocate_shared_memory(dtype, [BLOCK_H, HALF], qh_l)
    do_hi = gl.allocate_shared_memory(dtype, [BLOCK_H, HALF], qh_l)
    kv_lo, kv_hi, kv_tail = _kv_stages(dtype, NUM_STAGES, BLOCK_N, D_TAIL)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], ds_l)
    dp_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H, BLOCK_N], dp_l)

    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    qd_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    kv_ready, kv_free = _stage_barriers(NUM_STAGES)
    dp_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    dp_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    ds_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    ds_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    mbarrier.init(qd_ready, count=128)
    _init_stage_barriers(kv_ready, kv_free, NUM_STAGES)
    mbarrier.init(dp_ready, count=1)
    mbarrier.init(dp_free, count=1)
    mbarrier.init(ds_ready, count=1)
    mbarrier.init(ds_free, count=1)

    bufs = (q_lo, q_hi, q_tail, do_lo, do_hi, kv_lo, kv_hi, kv_tail, ds_smem, dp_smem)
    bars = (qd_ready, kv_ready, kv_free, dp_ready, dp_free, ds_ready, ds_free)
    gl.warp_specialize([
        (_dq_a, (idx_row, n_valid, LSE, DELTA, DQ, P_BUF, DS_BUF, bufs, bars, t, tl_local, h0, H, N, K, H_PAD,
                 qk_scale, scale, stride_qt, stride_qh, D_TAIL, BLOCK_H, BLOCK_N, NUM_STAGES, DENSE)),
        (_dq_b, (n_valid, DQ, bufs, bars, t, h0, H, stride_qt, stride_qh, D_TAIL, BLOCK_H, BLOCK_N, NUM_STAGES)),
        (_dq_gather, (Q + t * stride_qt, DOUT + t * stride_dot, kv_base, idx_row, n_valid, bufs, bars, h0, H, N,
                      stride_qh, stride_doh, stride_kvn, D_TAIL, BLOCK_H, BLOCK_N, NUM_STAGES, not DENSE)),
    ], [4, 4], [B_REGS, GATHER_REGS])
