"""Warp-specialised sparse-attention forward for Hopper (Gluon): the same maths as ``kernel_fwd.py``.

Why a second forward: on sm90 the Triton kernel runs the gather, the QK MMA, the softmax and the PV MMA in
one instruction stream per warp, so they serialise (about 310 TFLOP/s on the H200). Here one program (one
query, 64 heads) is split into three warpgroups that run concurrently and hand work over through shared
memory and mbarriers:

- **gather** (worker, 4 warps, few registers): copies the query tile once, then for each block of
  ``BLOCK_N`` index slots gathers the KV rows with ``cp.async`` into one of two stage buffers (invalid slots
  are zero-filled), signals ``kv_ready[stage]`` when its copies land, and loads the next block's row numbers;
- **softmax** (default partition, 4 warps): ``S = Q K^T`` (the value part in two 256-wide halves plus the
  64-wide tail), mask, online softmax in base 2 from the sink logit, ``O[:, :256] += P V[:, :256]`` (``V`` is
  the first 512 channels of the same gathered rows) and hands ``P`` (bf16) and the rescale factor over
  through shared memory;
- **right half** (worker, 4 warps): waits for ``P``, rescales and accumulates ``O[:, 256:] += P V[:, 256:]``.

So the right half's PV of one block runs while the softmax warpgroup computes the next block's ``S``, and
the gather fills the other stage a block ahead. Barriers (``count`` = arrivals per phase): ``kv_ready[s]`` (the gather
warpgroup's 128 threads, each after its own copies land), ``kv_free[s]`` (both consumers, done with
stage s), ``p_ready`` / ``p_free`` (the P and rescale hand-over), ``q_ready`` and ``done`` (the final row
sums for the right half). Accumulation order per head row is the Triton kernel's (same blocks, same
online-softmax recurrence), but the MMA instruction shapes differ, so results agree to rounding, not
bitwise (GPU tests: within the Triton kernel's tolerances of the fp32 reference, byte-identical run to run).
The same kernel has a dense causal mode (``DENSE``: contiguous keys up to each row's causal bound, for
``causal.py``). Device code only; sm90 with bf16/fp16 inputs, ``d_v = 512`` and a tail of 0 or 64 channels
(``kernel_config.ws_forward_fits`` decides when it runs; timings and what limits it: ``benchmarks/RESULTS.md``,
"warp-specialised forward"). ``PROBE`` (``kernel_config.WS_FWD_PROBE``, 0 but in that measurement) leaves a part out
to time the rest.
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

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
_NEG_BIG = gl.constexpr(-1.0e30)
HALF = gl.constexpr(256)  # output columns per consumer warpgroup


_WIDE = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))  # 16 x 256 per 4 warps, 16 B per copy
_NARROW = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # 16 x 64
_WIDE_ROWS = gl.constexpr(gl.SliceLayout(1, _WIDE))
_NARROW_ROWS = gl.constexpr(gl.SliceLayout(1, _NARROW))


@gluon.jit
def _rows(idx_row, first, count, N, ROWS: gl.constexpr, layout: gl.constexpr, GATHER: gl.constexpr):
    """Rows ``first .. first + ROWS`` of a block (a 1-D ``layout``) and which hold a key: gathered (``idx_row``,
    valid when ``0 <= id < N`` and the slot ``< count``) or contiguous (valid when ``< count``; the dense causal
    bound); invalid rows read row 0, masked."""
    r = first + gl.arange(0, ROWS, layout=layout)
    if GATHER:
        ids = gl.load(idx_row + r, mask=r < count, other=-1)
        ok = (ids >= 0) & (ids < N)
        row = gl.where(ok, ids, 0)
    else:
        ok = r < count
        row = r
    return row, ok


@gluon.jit
def _copy_cols(dst, BASE, row, ok, stride_row, col0, WIDTH: gl.constexpr, layout: gl.constexpr):
    """cp.async of ``WIDTH`` channels from column ``col0`` of the rows ``row`` into ``dst`` (16 bytes a copy); rows
    with ``ok`` False are zero-filled."""
    cols = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    ptrs = BASE + row.to(gl.int64)[:, None] * stride_row + cols[None, :]
    async_copy.async_copy_global_to_shared(dst, ptrs, mask=ok[:, None])


@gluon.jit
def _q_tiles(dtype: gl.constexpr, BLOCK_H: gl.constexpr, D_TAIL: gl.constexpr):
    """A query-shaped tile in shared memory: channels 0-255, 256-511 and the key-only tail (a small unused
    placeholder when there is none). The dq kernel allocates ``dO`` with the same layout right after."""
    TAIL: gl.constexpr = D_TAIL if D_TAIL > 0 else 64
    TAIL_ROWS: gl.constexpr = BLOCK_H if D_TAIL > 0 else 16
    half_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, HALF], dtype)
    tail_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, TAIL], dtype)
    return (gl.allocate_shared_memory(dtype, [BLOCK_H, HALF], half_l),
            gl.allocate_shared_memory(dtype, [BLOCK_H, HALF], half_l),
            gl.allocate_shared_memory(dtype, [TAIL_ROWS, TAIL], tail_l))


@gluon.jit
def _kv_stages(dtype: gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D_TAIL: gl.constexpr):
    """The gathered KV rows' stage buffers, split as ``_q_tiles`` (one tail stage as placeholder when none)."""
    TAIL: gl.constexpr = D_TAIL if D_TAIL > 0 else 64
    TAIL_ROWS: gl.constexpr = BLOCK_N if D_TAIL > 0 else 16
    TAIL_STAGES: gl.constexpr = NUM_STAGES if D_TAIL > 0 else 1
    half_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], dtype)
    tail_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, TAIL], dtype)
    return (gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HALF], half_l),
            gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HALF], half_l),
            gl.allocate_shared_memory(dtype, [TAIL_STAGES, TAIL_ROWS, TAIL], tail_l))


@gluon.jit
def _stage_barriers(NUM_STAGES: gl.constexpr):
    """``kv_ready`` / ``kv_free`` per stage (initialised by ``_init_stage_barriers``)."""
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    return (gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l),
            gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_l))


@gluon.jit
def _init_stage_barriers(kv_ready, kv_free, NUM_STAGES: gl.constexpr):
    """Ready: the gather warpgroup's 128 threads each arrive after their copies; free: both consumers arrive."""
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(s), count=128)
        mbarrier.init(kv_free.index(s), count=2)


@gluon.jit
def _gather_kv_blocks(kv_base, idx_row, n_valid, kv_lo, kv_hi, kv_tail, kv_ready, kv_free, N, stride_kvn,
                      D_TAIL: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, GATHER: gl.constexpr,
                      PROBE: gl.constexpr = 0):
    """Each block's KV rows into the next free stage (``kv_free`` / ``kv_ready`` per stage). The next block's row
    numbers are loaded right after a block's copies are issued, so their latency passes while the stage is in use.
    ``PROBE`` 1 (a measurement, wrong results): no copies, the barriers and row numbers as usual."""
    row, ok = _rows(idx_row, 0, n_valid, N, BLOCK_N, _WIDE_ROWS, GATHER)
    if D_TAIL > 0:
        row_t, ok_t = _rows(idx_row, 0, n_valid, N, BLOCK_N, _NARROW_ROWS, GATHER)
    for i in range(gl.cdiv(n_valid, BLOCK_N)):
        stage = i % NUM_STAGES
        mbarrier.wait(kv_free.index(stage), ((i // NUM_STAGES) & 1) ^ 1)
        if PROBE != 1:
            _copy_cols(kv_lo.index(stage), kv_base, row, ok, stride_kvn, 0, HALF, _WIDE)
            _copy_cols(kv_hi.index(stage), kv_base, row, ok, stride_kvn, HALF, HALF, _WIDE)
            if D_TAIL > 0:
                _copy_cols(kv_tail.index(stage), kv_base, row_t, ok_t, stride_kvn, 2 * HALF, D_TAIL, _NARROW)
        async_copy.mbarrier_arrive(kv_ready.index(stage), increment_count=False)
        row, ok = _rows(idx_row, (i + 1) * BLOCK_N, n_valid, N, BLOCK_N, _WIDE_ROWS, GATHER)
        if D_TAIL > 0:
            row_t, ok_t = _rows(idx_row, (i + 1) * BLOCK_N, n_valid, N, BLOCK_N, _NARROW_ROWS, GATHER)


@gluon.jit
def _gather_partition(q_base, kv_base, idx_row, n_valid, bufs, bars, h0, H, N, stride_qh, stride_kvn,
                      D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                      GATHER: gl.constexpr, PROBE: gl.constexpr):
    """The query tile once, then each block's rows (``_gather_kv_blocks``)."""
    q_lo, q_hi, q_tail, kv_lo, kv_hi, kv_tail, p_smem, alpha_smem, l_smem = bufs
    q_ready, kv_ready, kv_free, p_ready, p_free, done = bars
    for r in gl.static_range(0, BLOCK_H, 16):
        row, ok = _rows(idx_row, h0 + r, H, N, 16, _WIDE_ROWS, False)
        _copy_cols(q_lo.slice(r, 16), q_base, row, ok, stride_qh, 0, HALF, _WIDE)
        _copy_cols(q_hi.slice(r, 16), q_base, row, ok, stride_qh, HALF, HALF, _WIDE)
        if D_TAIL > 0:
            row_t, ok_t = _rows(idx_row, h0 + r, H, N, 16, _NARROW_ROWS, False)
            _copy_cols(q_tail.slice(r, 16), q_base, row_t, ok_t, stride_qh, 2 * HALF, D_TAIL, _NARROW)
    async_copy.mbarrier_arrive(q_ready, increment_count=False)

    _gather_kv_blocks(kv_base, idx_row, n_valid, kv_lo, kv_hi, kv_tail, kv_ready, kv_free, N, stride_kvn, D_TAIL,
                      BLOCK_N, NUM_STAGES, GATHER, PROBE)


@gluon.jit
def _issue_qk(q_lo, q_hi, q_tail, kv_lo, kv_hi, kv_tail, s, D_TAIL: gl.constexpr):
    """Issue ``S = Q K^T`` (value halves, then the tail) as async wgmma; the caller waits."""
    s = warpgroup_mma(q_lo, kv_lo.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(q_hi, kv_hi.permute((1, 0)), s, is_async=True)
    if D_TAIL > 0:
        s = warpgroup_mma(q_tail, kv_tail.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax_block(s, ok, m_i, l_i, o, qk_scale, o_l: gl.constexpr):
    """One block's online softmax (base 2, the scale folded into one multiply); rescales ``o``."""
    s = gl.where(ok[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
    return m_new, l_i, o, p, alpha


@gluon.jit
def _hand_over(p, alpha, p_smem, alpha_smem, p_ready, p_free, i):
    """``P`` and the rescale factor to the right-half warpgroup, once it is done with the previous block's."""
    mbarrier.wait(p_free, (i & 1) ^ 1)
    p_smem.store(p.to(p_smem.dtype))
    alpha_smem.store(alpha)
    fence_async_shared()
    mbarrier.arrive(p_ready, count=1)


@gluon.jit
def _blocks(idx_row, n_valid, N, qk_scale, m_i, l_i, o, bufs, bars, s_l: gl.constexpr, o_l: gl.constexpr,
            D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
            GATHER: gl.constexpr, P_IN_REGS: gl.constexpr, PROBE: gl.constexpr):
    """Per block: S_i, softmax, PV_i (left half), free the stage (a whole block before the gather needs it again).
    ``P_IN_REGS``: this warpgroup's PV takes P from registers and is issued before the hand-over, so waiting for the
    right half to finish the previous block is off this warpgroup's path to the tensor cores. Every async wgmma is
    waited in the iteration that issued it: a wgmma result carried around the loop makes ptxas serialise all of them
    (C7515). ``PROBE`` (a measurement, wrong results): 2 issues no MMA (the softmax and hand-overs on zeros), 3
    only waits for each stage and frees it."""
    q_lo, q_hi, q_tail, kv_lo, kv_hi, kv_tail, p_smem, alpha_smem, l_smem = bufs
    q_ready, kv_ready, kv_free, p_ready, p_free, done = bars
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    for i in range(gl.cdiv(n_valid, BLOCK_N)):
        stage = i % NUM_STAGES
        _, ok = _rows(idx_row, i * BLOCK_N, n_valid, N, BLOCK_N, col_s, GATHER)  # latency hidden by S_i
        mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
        if PROBE != 3:
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l)
            if PROBE != 2:
                s = _issue_qk(q_lo, q_hi, q_tail, kv_lo.index(stage), kv_hi.index(stage), kv_tail.index(stage), s,
                              D_TAIL)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            m_i, l_i, o, p, alpha = _softmax_block(s, ok, m_i, l_i, o, qk_scale, o_l)
            if PROBE == 2:
                _hand_over(p, alpha, p_smem, alpha_smem, p_ready, p_free, i)
            elif P_IN_REGS:
                o_tok = warpgroup_mma(gl.convert_layout(p.to(p_smem.dtype), a_l), kv_lo.index(stage), o,
                                      is_async=True)
                _hand_over(p, alpha, p_smem, alpha_smem, p_ready, p_free, i)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            else:
                _hand_over(p, alpha, p_smem, alpha_smem, p_ready, p_free, i)
                o_tok = warpgroup_mma(p_smem, kv_lo.index(stage), o, is_async=True)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        mbarrier.arrive(kv_free.index(stage), count=1)
    return m_i, l_i, o


@gluon.jit
def _softmax_partition(idx_row, n_valid, SINK, OUT, LSE, bufs, bars, t, h0, H, N, qk_scale, stride_ot, stride_oh,
                       D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                       P_IN_REGS: gl.constexpr, GATHER: gl.constexpr, PROBE: gl.constexpr):
    q_lo, q_hi, q_tail, kv_lo, kv_hi, kv_tail, p_smem, alpha_smem, l_smem = bufs
    q_ready, kv_ready, kv_free, p_ready, p_free, done = bars
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=row_s)
    h_ok = offs_h < H
    sink2 = gl.load(SINK + offs_h, mask=h_ok, other=0.0).to(gl.float32) * LOG2E
    m_i = gl.maximum(sink2, _NEG_BIG)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
    o = gl.zeros([BLOCK_H, HALF], gl.float32, o_l)
    mbarrier.wait(q_ready, 0)
    m_i, l_i, o = _blocks(idx_row, n_valid, N, qk_scale, m_i, l_i, o, bufs, bars, s_l, o_l, D_TAIL, BLOCK_H, BLOCK_N,
                          NUM_STAGES, GATHER, P_IN_REGS, PROBE)

    l_i = l_i + gl.exp2(sink2 - m_i)
    has_mass = l_i > 0.0
    l_safe = gl.where(has_mass, l_i, 1.0)
    l_smem.store(l_safe)
    mbarrier.arrive(done, count=1)
    lse = gl.where(has_mass, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    gl.store(LSE + t * H + offs_h, lse, mask=h_ok)
    _store_half(OUT, o, gl.convert_layout(l_safe, gl.SliceLayout(1, o_l)), t, h0, 0, H, stride_ot, stride_oh,
                o_l, BLOCK_H)


@gluon.jit
def _store_half(OUT, acc, l_row, t, h0, col0, H, stride_ot, stride_oh, o_l: gl.constexpr, BLOCK_H: gl.constexpr):
    out = acc / l_row[:, None]
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    ptrs = OUT + t * stride_ot + heads.to(gl.int64)[:, None] * stride_oh + cols[None, :]
    gl.store(ptrs, out.to(OUT.dtype.element_ty), mask=(heads < H)[:, None])


@gluon.jit
def _right_half_partition(n_valid, OUT, bufs, bars, t, h0, H, stride_ot, stride_oh,
                          BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                          PROBE: gl.constexpr):
    q_lo, q_hi, q_tail, kv_lo, kv_hi, kv_tail, p_smem, alpha_smem, l_smem = bufs
    q_ready, kv_ready, kv_free, p_ready, p_free, done = bars
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_l)
    for i in range(gl.cdiv(n_valid, BLOCK_N)):
        stage = i % NUM_STAGES
        if PROBE == 3:  # a measurement (_blocks): only the stage's turn
            mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
        else:
            mbarrier.wait(p_ready, i & 1)
            acc = acc * alpha_smem.load(rows_o)[:, None]
            if PROBE != 2:
                acc = warpgroup_mma(p_smem, kv_hi.index(stage), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(kv_free.index(stage), count=1)
    mbarrier.wait(done, 0)
    _store_half(OUT, acc, l_smem.load(rows_o), t, h0, HALF, H, stride_ot, stride_oh, o_l, BLOCK_H)


@gluon.jit
def _sparse_attn_fwd_ws_kernel(
    Q, KV, IDX, TOPK_LEN, SINK, OUT, LSE,
    H, N, K, S, q_offset, qk_scale,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    D_TAIL: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
    NUM_STAGES: gl.constexpr, P_IN_REGS: gl.constexpr, DENSE: gl.constexpr, GATHER_REGS: gl.constexpr,
    RIGHT_REGS: gl.constexpr, HEAD_BLOCKS: gl.constexpr, PROBE: gl.constexpr,
):
    """One program per (query row, 64 heads). Sparse (``DENSE`` False): the row's keys are its index slots, up to
    ``topk_length`` when given. Dense causal (``kernel_causal.py``'s contract; ``IDX``, ``TOPK_LEN``, ``K`` unused):
    query ``t = b * S + i`` sees keys ``b * N + 0 .. min(q_offset + i, N - 1)``, the longest rows launched first."""
    tile = gl.program_id(0)  # a query row's head blocks next to each other: they gather the same KV rows (L2)
    h0 = (tile % HEAD_BLOCKS) * BLOCK_H
    row = tile // HEAD_BLOCKS
    if DENSE:
        t = (gl.num_programs(0) // HEAD_BLOCKS - 1 - row).to(gl.int64)
        seq_b = t // S
        n_valid = gl.minimum(q_offset + (t - seq_b * S) + 1, N).to(gl.int32)
        kv_base = KV + seq_b * N * stride_kvn
    else:
        t = row.to(gl.int64)
        n_valid = K
        if HAS_TOPK_LEN:
            n_valid = gl.minimum(gl.maximum(gl.load(TOPK_LEN + t).to(gl.int32), 0), K)
        kv_base = KV
    idx_row = IDX + t * stride_it
    dtype: gl.constexpr = Q.dtype.element_ty
    p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    q_lo, q_hi, q_tail = _q_tiles(dtype, BLOCK_H, D_TAIL)
    kv_lo, kv_hi, kv_tail = _kv_stages(dtype, NUM_STAGES, BLOCK_N, D_TAIL)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], p_l)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_l)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_l)

    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    kv_ready, kv_free = _stage_barriers(NUM_STAGES)
    p_ready = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    p_free = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    done = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    mbarrier.init(q_ready, count=128)
    _init_stage_barriers(kv_ready, kv_free, NUM_STAGES)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(done, count=1)

    bufs = (q_lo, q_hi, q_tail, kv_lo, kv_hi, kv_tail, p_smem, alpha_smem, l_smem)
    bars = (q_ready, kv_ready, kv_free, p_ready, p_free, done)
    gl.warp_specialize([
        (_softmax_partition, (idx_row, n_valid, SINK, OUT, LSE, bufs, bars, t, h0, H, N, qk_scale, stride_ot,
                              stride_oh, D_TAIL, BLOCK_H, BLOCK_N, NUM_STAGES, P_IN_REGS, not DENSE, PROBE)),
        (_right_half_partition, (n_valid, OUT, bufs, bars, t, h0, H, stride_ot, stride_oh, BLOCK_H, BLOCK_N,
                                 NUM_STAGES, PROBE)),
        (_gather_partition, (Q + t * stride_qt, kv_base, idx_row, n_valid, bufs, bars, h0, H, N, stride_qh,
                             stride_kvn, D_TAIL, BLOCK_H, BLOCK_N, NUM_STAGES, not DENSE, PROBE)),
    ], [4, 4], [RIGHT_REGS, GATHER_REGS])
