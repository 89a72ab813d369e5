"""The streams' gradient of the mHC pre op on Hopper (Gluon): ``kernel_bwd._mhc_dx_bwd``'s maths, other layouts.

Why a second kernel: the Triton one (ncu on the H200, ``benchmarks/RESULTS.md``, fused mHC) moves every token tile
between layouts through shared memory (eight CTA barriers per tile: ``G @ fn`` runs as mma.sync in one layout,
``x^T G`` as a warp-group MMA on a transposed copy of ``x``, the sum ``g_x`` in a third), keeps L1 80 % busy and
spills three loop values at its 128-register cap. Here everything is computed transposed, channels as rows:

- ``g_x^T = fn^T G^T`` and ``(x^T G)`` are both warp-group MMAs of M = BD channels. Their A operands sit in
  registers: ``fn``'s two pieces for the whole program, and each tile's ``x^T``, read from shared memory once for its
  three products and the ``coef x`` term. Only the B operands, ``G``'s bf16 pieces, are read from shared memory
  by the MMAs, where ``cp.async`` put them (transposed views, no copies). With the A operands in shared memory as
  well, the tensor-core products read 2.5x the bytes, and shared memory was the busiest unit (ncu: 64 % of its
  wavefronts, 414 us; with them in registers 46 %, 358 us);
- ``pre`` and ``coef`` ride the ``cp.async`` ring with the tile (a load from L2 per tile otherwise: ncu's top
  long-scoreboard stalls, 358 -> 349 us);
- the sum ``g_x^T = pre g_y^T + fn^T G^T + coef x^T`` is formed in the MMA result's own layout, written transposed
  to shared memory and stored as 16-byte rows (stores straight from the MMA layout are 2-byte scatters: that form
  was 1.2x slower on the H200);
- two CTA barriers per tile of its own (the ``cp.async`` ring, each stage refilled once every thread is done with
  it; the staged output); Triton's barrier analysis adds more between ring slots it cannot tell apart (unrolling
  the ring by slot did not remove them and doubled the registers, offline).

H200, T 16384 x 4 x 4096 bf16 (ncu, ``benchmarks/RESULTS.md``): 349 us against the Triton kernel's 510.

Products as the Triton kernel's with bf16 streams and ``G``'s pieces (``PIECES``): ``G @ fn`` the three largest
bf16 products of both operands' pieces, smallest first, in a fresh accumulator (``DOT_BF16X3_ROUNDED``); ``x^T G``
the three products with ``G``'s pieces, smallest first, fresh per tile and added to the running sum in fp32.
Other MMA instruction shapes than the Triton kernel's: equal to rounding, not bitwise; deterministic (one order).
Device code only, sm90; ``kernel.pre_backward`` chooses it (``kernel.GLUON``) under ``GPU_CONFIG["dx_gluon"]["SPP"]``
1; the default since run 16 is ``kernel_dx_streams.py``, the same maths on two streams' channel tile per program.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from fleet_ext.ops.mhc.kernel_proj_gluon import _piece_rings


@gluon.jit
def _issue_g_pieces(g_ptr, rings, slot, t0, t_end, T, NO: gl.constexpr, BT: gl.constexpr, g_l: gl.constexpr):
    """``cp.async`` of ``G``'s three bf16 pieces [BT, NO] of tokens ``t0 ..`` (past ``t_end`` zero-filled) into ring
    slot ``slot`` of ``rings`` (hi, mid, lo)."""
    g_hi_s, g_mid_s, g_lo_s = rings
    tg = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, g_l))
    c = gl.arange(0, NO, layout=gl.SliceLayout(0, g_l))
    mg = (tg < t_end)[:, None]
    g_rows = g_ptr + tg.to(gl.int64)[:, None] * NO + c[None, :]
    async_copy.async_copy_global_to_shared(g_hi_s.index(slot), g_rows, mask=mg)
    async_copy.async_copy_global_to_shared(g_mid_s.index(slot), g_rows + T * NO, mask=mg)
    async_copy.async_copy_global_to_shared(g_lo_s.index(slot), g_rows + 2 * T * NO, mask=mg)


@gluon.jit
def _products(w_hi, w_mid, x_a, g_hi, g_mid, g_lo, gx_l: gl.constexpr, xg_l: gl.constexpr, BD: gl.constexpr,
              BT: gl.constexpr, NO: gl.constexpr):
    """One stream's token tile, async (the caller waits): ``g_x^T = fn^T G^T`` from the pieces, smallest first
    (G_mid fn_hi, G_hi fn_mid, G_hi fn_hi), and ``x^T G`` from ``G``'s pieces, smallest first, fresh for this tile."""
    gx = warpgroup_mma(w_hi, g_mid.permute((1, 0)), gl.zeros([BD, BT], gl.float32, gx_l), use_acc=False,
                       is_async=True)
    gx = warpgroup_mma(w_mid, g_hi.permute((1, 0)), gx, is_async=True)
    gx = warpgroup_mma(w_hi, g_hi.permute((1, 0)), gx, is_async=True)
    xg = warpgroup_mma(x_a, g_lo, gl.zeros([BD, NO], gl.float32, xg_l), use_acc=False, is_async=True)
    xg = warpgroup_mma(x_a, g_mid, xg, is_async=True)
    xg = warpgroup_mma(x_a, g_hi, xg, is_async=True)
    return gx, xg


@gluon.jit
def _issue_tile(src, bufs, slot, t0, t_end, T, j, k, d, d_ok, K, D: gl.constexpr, P: gl.constexpr, NO: gl.constexpr,
                BT: gl.constexpr, tile_l: gl.constexpr, g_l: gl.constexpr, sc_l: gl.constexpr):
    """``cp.async`` of one token tile: ``x`` [BT, BD] of this stream's channels, ``g_y`` [BT, BD], ``G``'s three
    bf16 pieces [BT, NO], the tokens' pre gate of stream ``j`` and their ``coef`` (rows past ``t_end``
    zero-filled), into ring slot ``slot``; one commit group."""
    x_ptr, dy_ptr, g_ptr, pre_ptr, coef_ptr = src
    x_s, dy_s, g_hi_s, g_mid_s, g_lo_s, sc_s = bufs
    t = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, tile_l))
    m = (t < t_end)[:, None] & d_ok[None, :]
    rows = t.to(gl.int64)[:, None]
    async_copy.async_copy_global_to_shared(x_s.index(slot), x_ptr + rows * K + k[None, :], mask=m)
    async_copy.async_copy_global_to_shared(dy_s.index(slot), dy_ptr + rows * D + d[None, :], mask=m)
    _issue_g_pieces(g_ptr, (g_hi_s, g_mid_s, g_lo_s), slot, t0, t_end, T, NO, BT, g_l)
    ts = t0 + gl.arange(0, BT, layout=sc_l)  # 4-byte copies, replicated over the warps (the same values)
    async_copy.async_copy_global_to_shared(sc_s.index(2 * slot), pre_ptr + ts * P + j, mask=ts < t_end)
    async_copy.async_copy_global_to_shared(sc_s.index(2 * slot + 1), coef_ptr + ts, mask=ts < t_end)
    async_copy.commit_group()


@gluon.jit
def _tile_step(i, acc, src, bufs, w_hi, w_mid, dx_s, dx_ptr, t_start, t_end, T, j, k, d, d_ok, t_rows, K,
               D: gl.constexpr, P: gl.constexpr, NO: gl.constexpr, BT: gl.constexpr, BD: gl.constexpr,
               STAGES: gl.constexpr, gx_l: gl.constexpr, xg_l: gl.constexpr, tile_l: gl.constexpr, g_l: gl.constexpr,
               sc_l: gl.constexpr):
    """Token tile ``i`` (ring slot ``i % STAGES``): its ``g_x`` stored, its ``x^T G`` added to ``acc`` (returned)."""
    x_s, dy_s, g_hi_s, g_mid_s, g_lo_s, sc_s = bufs
    slot = i % STAGES
    async_copy.wait_group(STAGES - 2)  # this thread's copies of tile i have landed
    fence_async_shared()  # ... and are visible to the MMAs
    gl.thread_barrier()  # everyone's are, and everyone is done with tile i - 1's slot
    _issue_tile(src, bufs, (i + STAGES - 1) % STAGES, t_start + (i + STAGES - 1) * BT, t_end, T, j, k, d, d_ok, K,
                D, P, NO, BT, tile_l, g_l, sc_l)
    pre = sc_s.index(2 * slot).load(gl.SliceLayout(0, gx_l))
    coef = sc_s.index(2 * slot + 1).load(gl.SliceLayout(0, gx_l))
    g_hi = g_hi_s.index(slot)
    g_mid = g_mid_s.index(slot)
    g_lo = g_lo_s.index(slot)
    # x^T [BD, BT], read from shared memory once: the A operand of its three products, and coef x below
    x_a = x_s.index(slot).permute((1, 0)).load(gl.DotOperandLayout(operand_index=0, parent=xg_l, k_width=2))
    gx, xg = _products(w_hi, w_mid, x_a, g_hi, g_mid, g_lo, gx_l, xg_l, BD, BT, NO)
    xv = gl.convert_layout(x_a, gx_l).to(gl.float32)  # the same elements per thread at BT = NO: no data moves
    dyv = dy_s.index(slot).permute((1, 0)).load(gx_l).to(gl.float32)
    gx = warpgroup_mma_wait(num_outstanding=3, deps=(gx,))
    dx = (pre[None, :] * dyv + gx + coef[None, :] * xv).to(dx_ptr.dtype.element_ty)
    # out through shared memory: 16-byte row stores (2-byte ones straight from the MMA layout: 1.2x slower)
    dx_s.permute((1, 0)).store(dx)
    gl.thread_barrier()
    rows_t = (t_start + i * BT + t_rows).to(gl.int64)
    m = (rows_t < t_end)[:, None] & d_ok[None, :]
    gl.store(dx_ptr + rows_t[:, None] * K + k[None, :], dx_s.load(tile_l), mask=m)
    xg = warpgroup_mma_wait(num_outstanding=0, deps=(xg,))
    acc += xg
    return acc


@gluon.jit
def _mhc_dx_gluon(
    x_ptr, fn_ptr, g_ptr, pre_ptr, coef_ptr, dy_ptr, dx_ptr, part_ptr, T, TS,
    N: gl.constexpr, P: gl.constexpr, D: gl.constexpr, NOUT: gl.constexpr, NO: gl.constexpr, BT: gl.constexpr,
    BD: gl.constexpr, STAGES: gl.constexpr,
):
    """Program (i, s): channels ``[b BD, (b + 1) BD)`` of stream ``j`` (``i = b N + j``) over the tokens
    ``[s TS, (s + 1) TS)``: ``g_x`` for them and ``part[s] = G^T x`` (``_mhc_params_bwd`` adds the splits)."""
    K: gl.constexpr = N * D
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    split = gl.program_id(1)
    j = gl.program_id(0) % N
    d0 = (gl.program_id(0) // N) * BD
    t_start = split * TS
    t_end = gl.minimum(t_start + TS, T)

    W: gl.constexpr = gl.num_warps()  # BD = 16 W: one 16-row slice of the MMAs per warp (64 per warpgroup)
    gl.static_assert(BD == 16 * W, "BD must be 16 x num_warps")
    gx_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 16])
    xg_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, NO, 16])
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BD, BD // 8], [W, 1], [1, 0])  # 16 B per copy
    VG: gl.constexpr = 8 if BT * NO >= 256 * W else BT * NO // (32 * W)  # G's tile once over all threads
    g_l: gl.constexpr = gl.BlockedLayout([1, VG], [32 * VG // NO, NO // VG], [W, 1], [1, 0])
    w_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // BD, BD // 4], [W, 1], [1, 0])
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BD], dtype)
    w_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NO, BD], dtype)
    x_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BD], x_sl)
    dy_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BD], x_sl)
    g_hi_s, g_mid_s, g_lo_s = _piece_rings(dtype, STAGES, BT, NO)
    w_s = gl.allocate_shared_memory(dtype, [2, NO, BD], w_sl)
    dx_s = gl.allocate_shared_memory(dtype, [BT, BD], x_sl)  # g_x^T written transposed, read row-major
    sc_l: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    sc_s = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BT], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    src = (x_ptr, dy_ptr, g_ptr, pre_ptr, coef_ptr)
    bufs = (x_s, dy_s, g_hi_s, g_mid_s, g_lo_s, sc_s)

    d = d0 + gl.arange(0, BD, layout=gl.SliceLayout(0, tile_l))
    d_ok = d < D
    k = j * D + d
    n_tiles = gl.cdiv(t_end - t_start, BT)
    for p in gl.static_range(STAGES - 1):  # the ring's first tiles in flight while fn's pieces are made
        _issue_tile(src, bufs, p, t_start + p * BT, t_end, T, j, k, d, d_ok, K, D, P, NO, BT, tile_l, g_l, sc_l)

    c_w = gl.arange(0, NO, layout=gl.SliceLayout(1, w_l))
    d_w = d0 + gl.arange(0, BD, layout=gl.SliceLayout(0, w_l))
    w = gl.load(fn_ptr + c_w[:, None] * K + (j * D + d_w)[None, :], mask=(c_w < NOUT)[:, None] & (d_w < D)[None, :],
                other=0.0)
    w_hi = w.to(dtype)
    w_s.index(0).store(w_hi)
    w_s.index(1).store((w - w_hi.to(gl.float32)).to(dtype))  # the middle piece; G @ fn never uses the lowest
    gl.thread_barrier()
    # fn^T's pieces [BD, NO], the A operands of G @ fn, in registers for the whole program
    w_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=gx_l, k_width=2)
    w_hi = w_s.index(0).permute((1, 0)).load(w_a)
    w_mid = w_s.index(1).permute((1, 0)).load(w_a)

    acc = gl.zeros([BD, NO], gl.float32, xg_l)
    t_rows = gl.arange(0, BT, layout=gl.SliceLayout(1, tile_l))
    for i in range(n_tiles):
        acc = _tile_step(i, acc, src, bufs, w_hi, w_mid, dx_s, dx_ptr, t_start, t_end, T, j, k, d, d_ok, t_rows, K, D,
                         P, NO, BT, BD, STAGES, gx_l, xg_l, tile_l, g_l, sc_l)
    async_copy.wait_group(0)
    c = gl.arange(0, NO, layout=gl.SliceLayout(0, xg_l))
    ch = d0 + gl.arange(0, BD, layout=gl.SliceLayout(1, xg_l))
    part = part_ptr + (split.to(gl.int64) * NO + c[None, :]) * K + (j * D + ch)[:, None]
    gl.store(part, acc, mask=(ch < D)[:, None])
