"""The streams' gradient of the mHC pre op on Hopper (Gluon), several streams' channel tile per program.

``kernel_dx_gluon._mhc_dx_gluon`` gives each program one stream's channel tile, so every token tile of ``g_y`` is
read by four programs and every tile of ``G``'s pieces by all 4 D / BD of a split's programs, from L2: at
V4-Flash's shape about 1.9 GB of L2 reads next to 1.2 GB of HBM traffic (by byte count). Here a program takes the
same channels of ``SPP`` streams (2, the default, or 4): ``g_y``, ``G``'s pieces and ``coef`` come into shared memory
once per token tile for all of them, and each stream's products run as in ``_mhc_dx_gluon`` (``fn``'s two pieces per
stream in registers, ``x^T`` of each stream read from shared memory once, ``g_x`` out through shared memory as
16-byte rows), so every element is computed by the same operations in the same order: byte-identical results.
Costs: ``SPP`` accumulators and 2 ``SPP`` ``fn`` pieces in registers (SPP 2: 210 registers, 168 without spilling
in the sm90 compile; SPP 4: 255 and a spill) and 1 / ``SPP`` as many programs. H200, T 16384 x 4 x 4096 bf16:
318 us against the one-stream kernel's 338-344 (``benchmarks/RESULTS.md``, fused mHC, run 16). Device code only,
sm90, n = 4; ``kernel.pre_backward`` runs it under ``GPU_CONFIG["dx_gluon"]["SPP"]`` 2 or 4.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma_wait

from fleet_ext.ops.mhc.kernel_dx_gluon import _issue_g_pieces, _products
from fleet_ext.ops.mhc.kernel_proj_gluon import _piece_rings


@gluon.jit
def _issue(src, bufs, slot, t0, t_end, T, j0, d, d_ok, N: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
           NO: gl.constexpr, BT: gl.constexpr, SPP: gl.constexpr, tile_l: gl.constexpr, g_l: gl.constexpr,
           sc_l: gl.constexpr):
    """``cp.async`` of one token tile into ring slot ``slot``: ``x`` [BT, BD] of streams ``j0 .. j0 + SPP - 1``,
    ``g_y`` [BT, BD], ``G``'s three pieces [BT, NO], those streams' pre gates and ``coef`` (rows past ``t_end``
    zero-filled); one commit group."""
    x_ptr, dy_ptr, g_ptr, pre_ptr, coef_ptr = src
    x_s, dy_s, g_hi_s, g_mid_s, g_lo_s, sc_s = bufs
    t = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, tile_l))
    m = (t < t_end)[:, None] & d_ok[None, :]
    rows = t.to(gl.int64)[:, None]
    for jj in gl.static_range(SPP):
        async_copy.async_copy_global_to_shared(x_s.index(SPP * slot + jj),
                                               x_ptr + rows * (N * D) + ((j0 + jj) * D + d)[None, :], mask=m)
    async_copy.async_copy_global_to_shared(dy_s.index(slot), dy_ptr + rows * D + d[None, :], mask=m)
    _issue_g_pieces(g_ptr, (g_hi_s, g_mid_s, g_lo_s), slot, t0, t_end, T, NO, BT, g_l)
    ts = t0 + gl.arange(0, BT, layout=sc_l)  # 4-byte copies, replicated over the warps (the same values)
    for jj in gl.static_range(SPP):
        async_copy.async_copy_global_to_shared(sc_s.index((SPP + 1) * slot + jj), pre_ptr + ts * P + j0 + jj,
                                               mask=ts < t_end)
    async_copy.async_copy_global_to_shared(sc_s.index((SPP + 1) * slot + SPP), coef_ptr + ts, mask=ts < t_end)
    async_copy.commit_group()


@gluon.jit
def _stream(jj: gl.constexpr, slot, acc, w_hi, w_mid, g_hi, g_mid, g_lo, dyv, coef, x_s, sc_s, dx_s,
            gx_l: gl.constexpr, xg_l: gl.constexpr, BD: gl.constexpr, BT: gl.constexpr, NO: gl.constexpr,
            SPP: gl.constexpr, dtype: gl.constexpr):
    """The program's stream ``jj`` in the tile in ``slot``: its ``g_x^T`` into staging buffer ``jj``, its ``x^T G``
    added to ``acc`` (returned); ``kernel_dx_gluon._tile_step``'s products in its order."""
    pre = sc_s.index((SPP + 1) * slot + jj).load(gl.SliceLayout(0, gx_l))
    x_a = x_s.index(SPP * slot + jj).permute((1, 0)).load(
        gl.DotOperandLayout(operand_index=0, parent=xg_l, k_width=2))
    gx, xg = _products(w_hi, w_mid, x_a, g_hi, g_mid, g_lo, gx_l, xg_l, BD, BT, NO)
    xv = gl.convert_layout(x_a, gx_l).to(gl.float32)  # the same elements per thread at BT = NO: no data moves
    gx = warpgroup_mma_wait(num_outstanding=3, deps=(gx,))
    dx_s.index(jj).permute((1, 0)).store((pre[None, :] * dyv + gx + coef[None, :] * xv).to(dtype))
    xg = warpgroup_mma_wait(num_outstanding=0, deps=(xg,))
    return acc + xg


@gluon.jit
def _fn_pieces(fn_ptr, j, jj: gl.constexpr, d0, K, D: gl.constexpr, NOUT: gl.constexpr, NO: gl.constexpr,
               BD: gl.constexpr, w_s, dtype: gl.constexpr, w_l: gl.constexpr):
    """``fn``'s hi and mid bf16 pieces of stream ``j``'s channels, [NO, BD], into ``w_s[2 jj]``, ``w_s[2 jj + 1]``."""
    c_w = gl.arange(0, NO, layout=gl.SliceLayout(1, w_l))
    d_w = d0 + gl.arange(0, BD, layout=gl.SliceLayout(0, w_l))
    w = gl.load(fn_ptr + c_w[:, None] * K + (j * D + d_w)[None, :], mask=(c_w < NOUT)[:, None] & (d_w < D)[None, :],
                other=0.0)
    w_hi = w.to(dtype)
    w_s.index(2 * jj).store(w_hi)
    w_s.index(2 * jj + 1).store((w - w_hi.to(gl.float32)).to(dtype))  # G @ fn never uses the lowest piece


@gluon.jit
def _store_streams(dx_ptr, dx_s, rows_t, t_end, j0, d, d_ok, K, D: gl.constexpr, SPP: gl.constexpr,
                   tile_l: gl.constexpr):
    """The staged ``g_x`` tiles of the program's streams to memory as 16-byte rows (tokens past ``t_end`` not)."""
    m = (rows_t < t_end)[:, None] & d_ok[None, :]
    for jj in gl.static_range(SPP):
        gl.store(dx_ptr + rows_t[:, None] * K + ((j0 + jj) * D + d)[None, :], dx_s.index(jj).load(tile_l), mask=m)


@gluon.jit
def _fn_operands(fn_ptr, j0, d0, K, D: gl.constexpr, NOUT: gl.constexpr, NO: gl.constexpr, BD: gl.constexpr,
                 SPP: gl.constexpr, dtype: gl.constexpr, gx_l: gl.constexpr, w_l: gl.constexpr):
    """``fn^T``'s hi and mid pieces [BD, NO] of the program's streams, in registers as the A operands of ``G @ fn``
    for the whole program: a (hi, mid) pair per stream."""
    w_s = gl.allocate_shared_memory(dtype, [2 * SPP, NO, BD], gl.NVMMASharedLayout.get_default_for([NO, BD], dtype))
    for jj in gl.static_range(SPP):
        _fn_pieces(fn_ptr, j0 + jj, jj, d0, K, D, NOUT, NO, BD, w_s, dtype, w_l)
    gl.thread_barrier()
    w_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=gx_l, k_width=2)
    ws = ()
    for jj in gl.static_range(SPP):
        ws = ws + ((w_s.index(2 * jj).permute((1, 0)).load(w_a), w_s.index(2 * jj + 1).permute((1, 0)).load(w_a)),)
    return ws


@gluon.jit
def _tile(slot, accs, ws, bufs, dx_s, gx_l: gl.constexpr, xg_l: gl.constexpr, BD: gl.constexpr, BT: gl.constexpr,
          NO: gl.constexpr, SPP: gl.constexpr, dtype: gl.constexpr):
    """The token tile in ``slot`` for each of the program's streams: ``accs`` (one per stream) with its ``x^T G``
    added."""
    x_s, dy_s, g_hi_s, g_mid_s, g_lo_s, sc_s = bufs
    g_hi = g_hi_s.index(slot)
    g_mid = g_mid_s.index(slot)
    g_lo = g_lo_s.index(slot)
    coef = sc_s.index((SPP + 1) * slot + SPP).load(gl.SliceLayout(0, gx_l))
    dyv = dy_s.index(slot).permute((1, 0)).load(gx_l).to(gl.float32)  # g_y once for the SPP streams
    out = ()
    for jj in gl.static_range(SPP):
        out = out + (_stream(jj, slot, accs[jj], ws[jj][0], ws[jj][1], g_hi, g_mid, g_lo, dyv, coef, x_s, sc_s, dx_s,
                             gx_l, xg_l, BD, BT, NO, SPP, dtype),)
    return out


@gluon.jit
def _mhc_dx_streams(
    x_ptr, fn_ptr, g_ptr, pre_ptr, coef_ptr, dy_ptr, dx_ptr, part_ptr, T, TS,
    N: gl.constexpr, P: gl.constexpr, D: gl.constexpr, NOUT: gl.constexpr, NO: gl.constexpr, BT: gl.constexpr,
    BD: gl.constexpr, STAGES: gl.constexpr, SPP: gl.constexpr,
):
    """Program (i, s): channels ``[b BD, (b + 1) BD)`` of streams ``j0 .. j0 + SPP - 1`` (``i = b N / SPP + j0 /
    SPP``) over the tokens ``[s TS, (s + 1) TS)``: ``g_x`` for them and their columns of ``part[s] = G^T x``
    (``_mhc_params_bwd`` adds the splits). ``SPP``: 2 or 4 streams per program."""
    gl.static_assert(SPP == 2 or SPP == 4, "two or four streams per program")
    K: gl.constexpr = N * D
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    split = gl.program_id(1)
    j0 = (gl.program_id(0) % (N // SPP)) * SPP
    d0 = (gl.program_id(0) // (N // SPP)) * BD
    t_start = split * TS
    t_end = gl.minimum(t_start + TS, T)

    W: gl.constexpr = gl.num_warps()
    gl.static_assert(BD == 16 * W, "BD must be 16 x num_warps")
    gx_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BT, 16])
    xg_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, NO, 16])
    tile_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BD, BD // 8], [W, 1], [1, 0])  # 16 B per copy
    VG: gl.constexpr = 8 if BT * NO >= 256 * W else BT * NO // (32 * W)
    g_l: gl.constexpr = gl.BlockedLayout([1, VG], [32 * VG // NO, NO // VG], [W, 1], [1, 0])
    w_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // BD, BD // 4], [W, 1], [1, 0])
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BD], dtype)
    x_s = gl.allocate_shared_memory(dtype, [SPP * STAGES, BT, BD], x_sl)
    dy_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BD], x_sl)
    g_hi_s, g_mid_s, g_lo_s = _piece_rings(dtype, STAGES, BT, NO)
    dx_s = gl.allocate_shared_memory(dtype, [SPP, BT, BD], x_sl)  # each stream's g_x^T, read row-major
    sc_l: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    sc_s = gl.allocate_shared_memory(gl.float32, [(SPP + 1) * STAGES, BT],
                                     gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    src = (x_ptr, dy_ptr, g_ptr, pre_ptr, coef_ptr)
    bufs = (x_s, dy_s, g_hi_s, g_mid_s, g_lo_s, sc_s)

    d = d0 + gl.arange(0, BD, layout=gl.SliceLayout(0, tile_l))
    d_ok = d < D
    n_tiles = gl.cdiv(t_end - t_start, BT)
    for p in gl.static_range(STAGES - 1):  # the ring's first tiles in flight while fn's pieces are made
        _issue(src, bufs, p, t_start + p * BT, t_end, T, j0, d, d_ok, N, D, P, NO, BT, SPP, tile_l, g_l, sc_l)
    ws = _fn_operands(fn_ptr, j0, d0, K, D, NOUT, NO, BD, SPP, dtype, gx_l, w_l)
    accs = ()
    for _ in gl.static_range(SPP):
        accs = accs + (gl.zeros([BD, NO], gl.float32, xg_l),)
    t_rows = gl.arange(0, BT, layout=gl.SliceLayout(1, tile_l))
    for i in range(n_tiles):
        slot = i % STAGES
        async_copy.wait_group(STAGES - 2)  # this thread's copies of tile i have landed
        fence_async_shared()
        gl.thread_barrier()  # everyone's have, and everyone is done with tile i - 1's slot and staging
        _issue(src, bufs, (i + STAGES - 1) % STAGES, t_start + (i + STAGES - 1) * BT, t_end, T, j0, d, d_ok, N, D, P,
               NO, BT, SPP, tile_l, g_l, sc_l)
        accs = _tile(slot, accs, ws, bufs, dx_s, gx_l, xg_l, BD, BT, NO, SPP, dtype)
        gl.thread_barrier()  # the streams' g_x^T tiles are staged
        _store_streams(dx_ptr, dx_s, (t_start + i * BT + t_rows).to(gl.int64), t_end, j0, d, d_ok, K, D, SPP,
                       tile_l)
    async_copy.wait_group(0)
    c = gl.arange(0, NO, layout=gl.SliceLayout(0, xg_l))
    ch = d0 + gl.arange(0, BD, layout=gl.SliceLayout(1, xg_l))
    part = part_ptr + (split.to(gl.int64) * NO + c[None, :]) * K + (j0 * D + ch)[:, None]
    mask = (ch < D)[:, None]
    for jj in gl.static_range(SPP):
        gl.store(part + jj * D, accs[jj], mask=mask)
