"""Ping-pong variant of the warp-specialised sparse-attention forward for Hopper (Gluon): same maths and
contract as ``kernel_fwd_ws.py``, whose gather warpgroup and helpers it reuses.

Why: in ``kernel_fwd_ws.py`` one warpgroup computes every block's ``S = Q K^T`` and softmax while the other only
accumulates the right half of the output, so the first one's chain (S, wait, softmax, PV) sets the pace and the
tensor cores idle during each softmax. Here both consumer warpgroups compute ``S`` — warpgroup 0 for the even
blocks, warpgroup 1 for the odd ones — and each owns one 256-column half of the output, accumulating every block
into it: its own block with ``P`` from registers, the other's with ``P`` from shared memory. Each issues its next
block's ``S`` before it waits for the other's ``P``, so one warpgroup's softmax runs under the other's MMAs.

The online softmax stays one chain in block order: block ``j``'s owner starts from the running max after block
``j - 1`` (published by the other warpgroup with its ``P`` and rescale factor), so both accumulators see every
block's factor in order and end on the same maximum; each keeps the mass of its own blocks, and the two are added
at the end with the sink's. One ``P`` buffer suffices: the warpgroup that publishes block ``j`` is the one that
consumed block ``j - 1``'s, and it waited for that product first. Stage ``s`` of the two KV buffers always holds
warpgroup ``s``'s blocks. Barriers: ``kv_ready[s]`` / ``kv_free[s]`` (the gather's, ``kv_free`` counting both
consumers), ``published[w]`` (warpgroup ``w``'s ``P``, factor and max are in shared memory), ``mass_done`` (both
masses stored). Accumulation order differs from ``kernel_fwd_ws.py`` (the right half's rescale happens per block
before its product, as there, but the left half now takes the odd blocks from shared memory): results agree to
rounding, byte-identical run to run. Device code only; sm90, bf16/fp16, ``d_v = 512``, tail 0 or 64.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fleet_ext.ops.sparse_attn.kernel_fwd_ws import (
    _NEG_BIG,
    HALF,
    LN2,
    LOG2E,
    _gather_partition,
    _issue_qk,
    _rows,
    _softmax_block,
    _store_half,
)


@gluon.jit
def _launder(x):
    """``x`` copied by register moves: the next block's ``S`` is issued before the accumulator is rescaled, and
    ptxas otherwise waits for that wgmma before the rescale (C7517: it treats the loop-carried accumulator as still
    written by a wgmma), which would serialise the two."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _consume_other(j, o, l_i, v_half, bufs, bars, W: gl.constexpr, s_l: gl.constexpr, o_l: gl.constexpr):
    """Block ``j`` of the other warpgroup into this half: its rescale factor and ``P`` once published. Returns the
    running max after block ``j`` too. Waits for every wgmma this warpgroup issued (the caller's ``S`` included)."""
    p_smem, alpha_smem, m_smem, mass_smem = bufs
    kv_free, published, mass_done = bars
    mbarrier.wait(published.index(1 - W), (j // 2) & 1)
    alpha = alpha_smem.load(gl.SliceLayout(1, s_l))
    m_i = m_smem.load(gl.SliceLayout(1, s_l))
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    o = warpgroup_mma(p_smem, v_half.index(1 - W), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    mbarrier.arrive(kv_free.index(1 - W), count=1)
    return o, l_i * alpha, m_i


@gluon.jit
def _own_block(s, ok, m_i, l_i, o, qk_scale, v_half, bufs, bars, W: gl.constexpr, o_l: gl.constexpr):
    """This warpgroup's block (``S`` waited): softmax, this half's product with ``P`` from registers (issued first),
    then ``P``, the factor and the new max published for the other warpgroup."""
    p_smem, alpha_smem, m_smem, mass_smem = bufs
    kv_free, published, mass_done = bars
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    m_i, l_i, o, p, alpha = _softmax_block(s, ok, m_i, l_i, o, qk_scale, o_l)
    p16 = p.to(p_smem.dtype)
    o_tok = warpgroup_mma(gl.convert_layout(p16, a_l), v_half.index(W), o, is_async=True)
    p_smem.store(p16)
    alpha_smem.store(alpha)
    m_smem.store(m_i)
    fence_async_shared()
    mbarrier.arrive(published.index(W), count=1)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    mbarrier.arrive(kv_free.index(W), count=1)
    return m_i, l_i, _launder(o)


@gluon.jit
def _pp_consumer(W: gl.constexpr, idx_row, n_valid, SINK, OUT, LSE, q_bufs, kv_bufs, bufs, q_ready, kv_ready, bars,
                 t, h0, H, N, qk_scale, stride_ot, stride_oh, D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr,
                 BLOCK_N: gl.constexpr, GATHER: gl.constexpr):
    """Consumer warpgroup ``W``: output columns ``[W 256, (W + 1) 256)``, ``S`` of blocks ``j = W (mod 2)``.
    Steady state per own block: issue ``S_j``, take in block ``j - 1`` (the other's), softmax and publish block
    ``j``. Warpgroup 0 starts with block 0 alone; whoever does not own the last block takes it in after the loop."""
    q_lo, q_hi, q_tail = q_bufs
    kv_lo, kv_hi, kv_tail = kv_bufs
    p_smem, alpha_smem, m_smem, mass_smem = bufs
    kv_free, published, mass_done = bars
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    if W == 0:
        v_half = kv_lo
    else:
        v_half = kv_hi
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=row_s)
    h_ok = offs_h < H
    sink2 = gl.load(SINK + offs_h, mask=h_ok, other=0.0).to(gl.float32) * LOG2E
    m_i = gl.maximum(sink2, _NEG_BIG)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
    o = gl.zeros([BLOCK_H, HALF], gl.float32, o_l)
    n_blocks = gl.cdiv(n_valid, BLOCK_N)
    mbarrier.wait(q_ready, 0)
    if W == 0:
        if n_blocks > 0:
            _, ok = _rows(idx_row, 0, n_valid, N, BLOCK_N, col_s, GATHER)
            mbarrier.wait(kv_ready.index(0), 0)
            s = _issue_qk(q_lo, q_hi, q_tail, kv_lo.index(0), kv_hi.index(0), kv_tail.index(0),
                          gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l), D_TAIL)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            m_i, l_i, o = _own_block(s, ok, m_i, l_i, o, qk_scale, v_half, bufs, bars, W, o_l)
    for j in range(2 - W, n_blocks, 2):
        _, ok = _rows(idx_row, j * BLOCK_N, n_valid, N, BLOCK_N, col_s, GATHER)  # latency hidden by S_j
        mbarrier.wait(kv_ready.index(W), (j // 2) & 1)
        s = _issue_qk(q_lo, q_hi, q_tail, kv_lo.index(W), kv_hi.index(W), kv_tail.index(W),
                      gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l), D_TAIL)
        o, l_i, m_i = _consume_other(j - 1, o, l_i, v_half, bufs, bars, W, s_l, o_l)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        m_i, l_i, o = _own_block(s, ok, m_i, l_i, o, qk_scale, v_half, bufs, bars, W, o_l)
    if (n_blocks > 0) & (n_blocks % 2 == W):  # the last block is the other's
        o, l_i, m_i = _consume_other(n_blocks - 1, o, l_i, v_half, bufs, bars, W, s_l, o_l)

    mass_smem.slice(W * BLOCK_H, BLOCK_H).store(l_i)
    mbarrier.arrive(mass_done, count=1)
    mbarrier.wait(mass_done, 0)
    l_i = l_i + mass_smem.slice((1 - W) * BLOCK_H, BLOCK_H).load(row_s) + gl.exp2(sink2 - m_i)
    has_mass = l_i > 0.0
    l_safe = gl.where(has_mass, l_i, 1.0)
    if W == 0:
        lse = gl.where(has_mass, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        gl.store(LSE + t * H + offs_h, lse, mask=h_ok)
    _store_half(OUT, o, gl.convert_layout(l_safe, gl.SliceLayout(1, o_l)), t, h0, W * HALF, H, stride_ot, stride_oh,
                o_l, BLOCK_H)


@gluon.jit
def _sparse_attn_fwd_pp_kernel(
    Q, KV, IDX, TOPK_LEN, SINK, OUT, LSE,
    H, N, K, S, q_offset, qk_scale,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
    DENSE: gl.constexpr, GATHER_REGS: gl.constexpr, RIGHT_REGS: gl.constexpr,
):
    """One program per (query row, 64 heads); the grid and arguments of ``kernel_fwd_ws._sparse_attn_fwd_ws_kernel``
    (sparse over the index slots, or dense causal), two stage buffers."""
    h0 = gl.program_id(1) * BLOCK_H
    if DENSE:
        t = (gl.num_programs(0) - 1 - gl.program_id(0)).to(gl.int64)
        seq_b = t // S
        n_valid = gl.minimum(q_offset + (t - seq_b * S) + 1, N).to(gl.int32)
        kv_base = KV + seq_b * N * stride_kvn
    else:
        t = gl.program_id(0).to(gl.int64)
        n_valid = K
        if HAS_TOPK_LEN:
            n_valid = gl.minimum(gl.maximum(gl.load(TOPK_LEN + t).to(gl.int32), 0), K)
        kv_base = KV
    idx_row = IDX + t * stride_it
    dtype: gl.constexpr = Q.dtype.element_ty
    half_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], dtype)
    qh_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], dtype)
    TAIL: gl.constexpr = D_TAIL if D_TAIL > 0 else 64
    tail_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, TAIL], dtype)
    qt_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, TAIL], dtype)
    p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    TAIL_ROWS_Q: gl.constexpr = BLOCK_H if D_TAIL > 0 else 16  # no tail: a small unused placeholder
    TAIL_ROWS_KV: gl.constexpr = BLOCK_N if D_TAIL > 0 else 16
    TAIL_STAGES: gl.constexpr = 2 if D_TAIL > 0 else 1

    q_lo = gl.allocate_shared_memory(dtype, [BLOCK_H, HALF], qh_l)
    q_hi = gl.allocate_shared_memory(dtype, [BLOCK_H, HALF], qh_l)
    q_tail = gl.allocate_shared_memory(dtype, [TAIL_ROWS_Q, TAIL], qt_l)
    kv_lo = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], half_l)
    kv_hi = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HALF], half_l)
    kv_tail = gl.allocate_shared_memory(dtype, [TAIL_STAGES, TAIL_ROWS_KV, TAIL], tail_l)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_l)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_l)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_l)
    mass_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], vec_l)  # each consumer's mass

    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    published = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    mass_done = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    mbarrier.init(q_ready, count=128)
    for s in gl.static_range(2):
        mbarrier.init(kv_ready.index(s), count=128)
        mbarrier.init(kv_free.index(s), count=2)
        mbarrier.init(published.index(s), count=1)
    mbarrier.init(mass_done, count=2)

    q_bufs = (q_lo, q_hi, q_tail)
    kv_bufs = (kv_lo, kv_hi, kv_tail)
    bufs = (p_smem, alpha_smem, m_smem, mass_smem)
    bars = (kv_free, published, mass_done)
    # the gather's view: its tuples carry buffers and barriers it does not touch (the hand-over ones of the
    # other kernel) in the same places
    gather_bufs = (q_lo, q_hi, q_tail, kv_lo, kv_hi, kv_tail, p_smem, alpha_smem, m_smem)
    gather_bars = (q_ready, kv_ready, kv_free, mass_done, mass_done, mass_done)
    gl.warp_specialize([
        (_pp_consumer, (0, idx_row, n_valid, SINK, OUT, LSE, q_bufs, kv_bufs, bufs, q_ready, kv_ready, bars, t, h0, H,
                        N, qk_scale, stride_ot, stride_oh, D_TAIL, BLOCK_H, BLOCK_N, not DENSE)),
        (_pp_consumer, (1, idx_row, n_valid, SINK, OUT, LSE, q_bufs, kv_bufs, bufs, q_ready, kv_ready, bars, t, h0, H,
                        N, qk_scale, stride_ot, stride_oh, D_TAIL, BLOCK_H, BLOCK_N, not DENSE)),
        (_gather_partition, (Q + t * stride_qt, kv_base, idx_row, n_valid, gather_bufs, gather_bars, h0, H, N,
                             stride_qh, stride_kvn, D_TAIL, BLOCK_H, BLOCK_N, 2, not DENSE)),
    ], [4, 4], [RIGHT_REGS, GATHER_REGS])
