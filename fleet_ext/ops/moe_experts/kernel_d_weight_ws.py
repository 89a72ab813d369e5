"""Warp-specialised expert weight gradient for Hopper (Gluon): ``_grouped_d_weight``'s sums, stores overlapped.

``out[e] = a_e^T @ b_e`` over the rows of expert ``e`` (``d_weight1 = x_e^T d_gate_up_e``, ``d_weight2 = h_e^T
d_out_e``). At 256 experts each expert holds ~200 rows, so an output tile is only 3-4 K steps of MMA and then a
64 KB store: the Triton kernel spends as long storing as multiplying. Here a persistent program (one per
multiprocessor) is split into:

- **loader** (1 warp): for every K step of every tile the program owns, TMA loads of ``a[rows, m0:m0+BM]`` and
  ``b[rows, n0:n0+BN]`` through the ragged descriptors of ``kernel_tiles`` (rows past the expert's segment read as
  zeros) into a ring of ``STAGES`` stages, running ahead across tiles;
- **two MMA warpgroups** on each tile together, one per half of its columns: the K loop on async wgmma (``a^T``
  straight from shared memory, transposed in the descriptor), then the tile goes to a shared-memory staging buffer
  and out by an asynchronous TMA store, which drains while the next tile's K loop runs (the staging buffer is
  reused only after ``store_wait``).

The rows are summed in ascending order, ``BK`` a step, as in the Triton kernel (fixed order: deterministic; the
same bytes as the Triton kernel where the wgmma shapes agree, checked on the H200). Device code only: sm90,
bf16/fp16, ``M`` a multiple of ``BM`` (``kernel_bwd.d_weight_ws_fits`` decides).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fleet_ext.ops.moe_experts.kernel_tiles import RAGGED_ROWS, _segment_lanes, _weight_tile


@gluon.jit
def _lanes(counts_ptr, N, E, BM: gl.constexpr, E_PAD: gl.constexpr, WARPS: gl.constexpr):
    """(expert lane ids, first row, rows) of every expert, in a layout for ``WARPS`` warps."""
    lane_l: gl.constexpr = gl.BlockedLayout([E_PAD // (32 * WARPS)], [32], [WARPS], [0])
    ex = gl.arange(0, E_PAD, layout=lane_l)
    c = gl.load(counts_ptr + ex, mask=ex < E, other=0).to(gl.int32)
    lanes = _segment_lanes(ex, c, N, BM)
    return lanes[0], lanes[1], lanes[2]


@gluon.jit
def _loader(a_desc, b_desc, counts_ptr, bufs, bars, N, M, NN, E, BM: gl.constexpr, BN: gl.constexpr,
            BK: gl.constexpr, E_PAD: gl.constexpr, STAGES: gl.constexpr):
    a_s, b_s, _stage = bufs
    ready, empty = bars
    ex, start_e, rows_e = _lanes(counts_ptr, N, E, BM, E_PAD, 1)
    tiles_n = gl.cdiv(NN, BN)
    per_expert = gl.cdiv(M, BM) * tiles_n
    nbytes: gl.constexpr = (BK * BM + BK * BN) * a_desc.dtype.primitive_bitwidth // 8
    pos = 0
    for tile_id in range(gl.program_id(0), E * per_expert, gl.num_programs(0)):
        e, m0, n0, start, count = _weight_tile(tile_id, ex, start_e, rows_e, per_expert, tiles_n, BM, BN)
        for r in range(0, count, BK):
            s = pos % STAGES
            mbarrier.wait(empty.index(s), ((pos // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            end, row = start + count, RAGGED_ROWS - count + r  # kernel_tiles.ragged_descriptor's coordinates
            tma.async_copy_global_to_shared(a_desc, [RAGGED_ROWS, end, row, m0], ready.index(s), a_s.index(s))
            tma.async_copy_global_to_shared(b_desc, [RAGGED_ROWS, end, row, n0], ready.index(s), b_s.index(s))
            pos += 1


@gluon.jit
def _mma_partition(counts_ptr, out_desc, bufs, bars, N, M, NN, E, BM: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, E_PAD: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr):
    """Columns ``[HALF * BN / 2, (HALF + 1) * BN / 2)`` of every tile of the program."""
    a_s, b_s, stage = bufs
    ready, empty = bars
    WN: gl.constexpr = BN // 2
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WN, 16])
    ex, start_e, rows_e = _lanes(counts_ptr, N, E, BM, E_PAD, 4)
    tiles_n = gl.cdiv(NN, BN)
    per_expert = gl.cdiv(M, BM) * tiles_n
    my_stage = stage.index(HALF)
    pos = 0
    for tile_id in range(gl.program_id(0), E * per_expert, gl.num_programs(0)):
        e, m0, n0, start, count = _weight_tile(tile_id, ex, start_e, rows_e, per_expert, tiles_n, BM, BN)
        steps = gl.cdiv(count, BK)
        acc = gl.zeros([BM, WN], gl.float32, acc_l)
        for kk in range(steps):
            s = (pos + kk) % STAGES
            mbarrier.wait(ready.index(s), ((pos + kk) // STAGES) & 1)
            a_t = a_s.index(s).reshape([BK, BM]).permute((1, 0))
            b = b_s.index(s).reshape([BK, BN]).slice(HALF * WN, WN, dim=1)
            acc = warpgroup_mma(a_t, b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((pos + kk + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((pos + steps + STAGES - 1) % STAGES), count=1, pred=steps > 0)
        pos += steps
        tma.store_wait(0)  # this warpgroup's previous tile has left the staging buffer
        my_stage.store(acc.to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [e * M + m0, n0 + HALF * WN], my_stage)
    tma.store_wait(0)


@gluon.jit
def _d_weight_ws_kernel(a_desc, b_desc, out_desc, counts_ptr, N, M, NN, E, BM: gl.constexpr, BN: gl.constexpr,
                        BK: gl.constexpr, E_PAD: gl.constexpr, STAGES: gl.constexpr, MMA_REGS: gl.constexpr,
                        LOADER_REGS: gl.constexpr):
    """Persistent: program ``p`` owns tiles ``p, p + P, ...`` of ``_grouped_d_weight``'s tile order; ``out_desc``
    views the [E, M, NN] output as [E * M, NN]."""
    dtype: gl.constexpr = a_desc.dtype
    a_s = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BK, BM], a_desc.layout)
    b_s = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BK, BN], b_desc.layout)
    stage = gl.allocate_shared_memory(dtype, [2, BM, BN // 2], out_desc.layout)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both MMA warpgroups read every stage
    bufs = (a_s, b_s, stage)
    bars = (ready, empty)
    gl.warp_specialize([
        (_mma_partition, (counts_ptr, out_desc, bufs, bars, N, M, NN, E, BM, BN, BK, E_PAD, STAGES, 0)),
        (_mma_partition, (counts_ptr, out_desc, bufs, bars, N, M, NN, E, BM, BN, BK, E_PAD, STAGES, 1)),
        (_loader, (a_desc, b_desc, counts_ptr, bufs, bars, N, M, NN, E, BM, BN, BK, E_PAD, STAGES)),
    ], [4, 1], [MMA_REGS, LOADER_REGS])
