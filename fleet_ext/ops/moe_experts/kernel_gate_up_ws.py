"""Warp-specialised grouped gate+up GEMM for Hopper (Gluon): ``_grouped_gate_up``'s maths, ping-pong scheduled.

Why a second kernel: on sm90 Triton 3.6 runs a tile's loads, its MMA and its epilogue in one instruction stream
(``tl.range(..., warp_specialize=True)`` compiles to the same code there), so every tile's epilogue (the
``gate_up`` and ``h`` stores) and pipeline fill leave the tensor cores idle. Here a persistent program (one per
multiprocessor) is split into three partitions that run concurrently:

- **loader** (1 warp): for every K step of every tile the program owns, TMA loads of the rows ``x[row0:row0+BM,
  k:k+BK]`` and of ``W1[e]``'s gate and up columns into a ring of ``STAGES`` shared-memory stages
  (``ready[s]`` completes on the bytes landing; it waits on ``empty[s]`` before reusing a stage);
- **two MMA warpgroups** taking the program's tiles in turn (the even and the odd ones): each runs its tile's
  K loop on async wgmma (the gate and up accumulators, ``BM x BN`` fp32 each) and then its own epilogue, so one
  warpgroup's epilogue runs while the other's K loop keeps the tensor cores busy (CUTLASS calls this ping-pong).

The tile map (``_segment_lanes``, ``_row_tile``) and the epilogue (``_gate_up_epilogue``) are
``kernel_tiles``' functions, shared with the Triton kernels; the epilogue is ``_grouped_gate_up``'s, op for
op. ``W1`` is read through a 2-D ``[E * D, 2I]`` view, so ``D`` must be a multiple of ``BK`` (a K step never
crosses into the next expert); rows past an expert's segment are read and zeroed in the epilogue, as in the
Triton TMA path. Device code only: sm90, bf16/fp16 (``kernel.gate_up_ws_fits`` decides when it runs).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from fleet_ext.ops.moe_experts.kernel_tiles import _gate_up_epilogue, _row_tile, _segment_lanes


@gluon.jit
def _tiles(counts_ptr, N, E, INTER, BM: gl.constexpr, BN: gl.constexpr, E_PAD: gl.constexpr, WARPS: gl.constexpr):
    """The tile map's expert lanes (in a layout for ``WARPS`` warps) and the launch's tile counts."""
    lane_l: gl.constexpr = gl.BlockedLayout([E_PAD // (32 * WARPS)], [32], [WARPS], [0])
    ex = gl.arange(0, E_PAD, layout=lane_l)
    c = gl.load(counts_ptr + ex, mask=ex < E, other=0).to(gl.int32)
    lanes = _segment_lanes(ex, c, N, BM)
    return lanes, lanes[7], gl.cdiv(INTER, BN)


@gluon.jit
def _loader(x_desc, w_desc, counts_ptr, bufs, bars, N, K, INTER, E, BM: gl.constexpr, BN: gl.constexpr,
            BK: gl.constexpr, E_PAD: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    a_s, g_s, u_s = bufs
    ready, empty, _turn = bars
    lanes, m_tiles, n_tiles = _tiles(counts_ptr, N, E, INTER, BM, BN, E_PAD, 1)
    k_steps = gl.cdiv(K, BK)
    nbytes: gl.constexpr = (BM * BK + 2 * BK * BN) * x_desc.dtype.primitive_bitwidth // 8
    pos = 0
    for tile_id in range(gl.program_id(0), m_tiles * n_tiles, gl.num_programs(0)):
        _, we, row0, _, _, tile_n = _row_tile(tile_id, lanes, m_tiles, n_tiles, N, E, BM, GROUP_M)
        w_row = we * K  # a zero tile (e == E) reads the last expert's weight; its rows are zeroed
        for kk in range(k_steps):
            s = pos % STAGES
            mbarrier.wait(empty.index(s), ((pos // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(x_desc, [row0, kk * BK], ready.index(s), a_s.index(s))
            tma.async_copy_global_to_shared(w_desc, [w_row + kk * BK, tile_n * BN], ready.index(s), g_s.index(s))
            tma.async_copy_global_to_shared(w_desc, [w_row + kk * BK, INTER + tile_n * BN], ready.index(s),
                                            u_s.index(s))
            pos += 1


@gluon.jit
def _k_loop(a_s, g_s, u_s, ready, empty, pos0, k_steps, acc_g, acc_u, STAGES: gl.constexpr, A_ROW0: gl.constexpr,
            WM: gl.constexpr):
    """One tile's K loop: each step's two async wgmma are waited one step later (so a step's MMA overlaps the next
    step's issue), and the step before is handed back to the loader then."""
    for kk in range(k_steps):
        pos = pos0 + kk
        s = pos % STAGES
        mbarrier.wait(ready.index(s), (pos // STAGES) & 1)
        a = a_s.index(s).slice(A_ROW0, WM)
        acc_g = warpgroup_mma(a, g_s.index(s), acc_g, is_async=True)
        acc_u = warpgroup_mma(a, u_s.index(s), acc_u, is_async=True)
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
        mbarrier.arrive(empty.index((pos + STAGES - 1) % STAGES), count=1, pred=kk > 0)
    acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
    mbarrier.arrive(empty.index((pos0 + k_steps - 1) % STAGES), count=1)
    return acc_g, acc_u


@gluon.jit
def _mma_partition(counts_ptr, gu_ptr, h_ptr, bufs, bars, N, K, INTER, E, limit, s_gu, s_h, HAS_LIMIT: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, E_PAD: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, COOP: gl.constexpr, PARITY: gl.constexpr):
    """The program's tiles of parity ``PARITY`` (its 0th, 2nd, ... or 1st, 3rd, ...): K loop, then the epilogue.

    The two warpgroups run their K loops in turn (``turn[PARITY]``, handed over when a K loop ends): a warpgroup
    that waited on a stage's ``ready`` more than one fill ahead would take an earlier fill for its own (an mbarrier
    wait only tells the parity of the last completed phase), and in turn each K loop starts at most one fill ahead."""
    a_s, g_s, u_s = bufs
    ready, empty, turn = bars
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    lanes, m_tiles, n_tiles = _tiles(counts_ptr, N, E, INTER, BM, BN, E_PAD, 4)
    k_steps = gl.cdiv(K, BK)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    WM: gl.constexpr = BM // 2 if COOP else BM  # this warpgroup's rows of a tile
    A_ROW0: gl.constexpr = PARITY * WM if COOP else 0
    mine = 0
    for tile_id in range(pid + (0 if COOP else PARITY) * programs, m_tiles * n_tiles, programs * (1 if COOP else 2)):
        _, _, row0, read_end, write_end, tile_n = _row_tile(tile_id, lanes, m_tiles, n_tiles, N, E, BM, GROUP_M)
        zero = gl.zeros([WM, BN], gl.float32, acc_l)
        if COOP:
            acc_g, acc_u = _k_loop(a_s, g_s, u_s, ready, empty, mine * k_steps, k_steps, zero, zero, STAGES, A_ROW0,
                                   WM)
        else:
            mbarrier.wait(turn.index(PARITY), (mine & 1) ^ (1 - PARITY))
            acc_g, acc_u = _k_loop(a_s, g_s, u_s, ready, empty, (2 * mine + PARITY) * k_steps, k_steps, zero, zero,
                                   STAGES, 0, WM)
            mbarrier.arrive(turn.index(1 - PARITY), count=1)
        mine += 1
        rows = row0 + A_ROW0 + gl.arange(0, WM, layout=gl.SliceLayout(1, acc_l))
        cols = tile_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_l))
        _gate_up_epilogue(acc_g, acc_u, rows, cols, read_end, write_end, gu_ptr, h_ptr, INTER, s_gu, s_h, limit,
                          HAS_LIMIT)


@gluon.jit
def _gate_up_ws_kernel(x_desc, w_desc, counts_ptr, gu_ptr, h_ptr, N, K, INTER, E, limit, s_gu, s_h,
                       HAS_LIMIT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       E_PAD: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, COOP: gl.constexpr,
                       MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """Persistent: program ``p`` owns tiles ``p, p + P, p + 2P, ...`` of ``_grouped_gate_up``'s tile order."""
    dtype: gl.constexpr = x_desc.dtype
    a_s = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], x_desc.layout)
    g_s = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], w_desc.layout)
    u_s = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], w_desc.layout)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2 if COOP else 1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    bufs = (a_s, g_s, u_s)
    bars = (ready, empty, turn)
    gl.warp_specialize([
        (_mma_partition, (counts_ptr, gu_ptr, h_ptr, bufs, bars, N, K, INTER, E, limit, s_gu, s_h, HAS_LIMIT, BM, BN,
                          BK, E_PAD, GROUP_M, STAGES, COOP, 0)),
        (_mma_partition, (counts_ptr, gu_ptr, h_ptr, bufs, bars, N, K, INTER, E, limit, s_gu, s_h, HAS_LIMIT, BM, BN,
                          BK, E_PAD, GROUP_M, STAGES, COOP, 1)),
        (_loader, (x_desc, w_desc, counts_ptr, bufs, bars, N, K, INTER, E, BM, BN, BK, E_PAD, GROUP_M, STAGES)),
    ], [4, 1], [MMA_REGS, LOADER_REGS])
