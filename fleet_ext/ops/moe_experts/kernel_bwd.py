"""Backward of the Triton grouped expert GEMMs (``kernel.py``): four launches, no atomics, no host read.

Given ``d_out`` [N, D] and the forward's saved ``gate_up`` [N, 2I] (the pre-activation; ``h`` is not kept):

1. ``_grouped_d_gate_up``: ``d_h = d_out_e @ W2[e]^T`` per row tile, and in the epilogue (column halves, quarters
   from 256 columns, to keep the registers in bounds) the clamped SwiGLU's backward from the saved ``gate_up``:
   ``d_gate = d_h * up_c * silu'(gate_c) * [gate <= limit]``, ``d_up = d_h * silu(gate_c) * [|up| <= limit]``
   (``gate_c``, ``up_c`` clamped; the bounds pass the gradient, as Paddle's and torch's clip do). The same
   epilogue writes ``h`` again (recomputed from ``gate_up`` with the forward's code, so it equals the forward's
   ``h``) for step 4: the activation is always recomputed, never kept.
2. ``_grouped_rows_mm``: ``d_rows = d_gate_up_e @ W1[e]^T``.
3. ``_grouped_d_weight``: ``d_W1[e] = rows_e^T @ d_gate_up_e``, 4. the same kernel: ``d_W2[e] = h_e^T @ d_out_e``.
   Each output tile of each expert is one loop step of one program (one program per tile, or a persistent
   grid), which adds the expert's rows in ascending order, ``BK`` rows a step, into one fp32 accumulator: a
   fixed order, so the weight gradients are byte-identical run to run (deterministic; an expert with no rows
   gets zeros). The rows are the K dimension here, so the TMA path reads them through ragged descriptors
   (rows outside the expert's segment read as zero) and writes the tile with a TMA store.

Load paths and grid kinds as in ``kernel.py`` (``Launch``); the pointer and TMA paths give the same bytes.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import detached, dtype_name, empty_like, launch, shape_of, strides_of, torch_view
from fleet_ext.ops.moe_experts.kernel import (
    check_args,
    dot_precision,
    experts_pad,
    hopper_16bit,
    launch_config,
    row_grid,
    rows_gemm,
    ws_choice,
)
from fleet_ext.ops.moe_experts.kernel_tiles import (
    _load_ragged,
    _row_loop,
    _row_loop_tma,
    _row_tile,
    _segments,
    _swiglu,
    _weight_tile,
    count_path,
    descriptor,
    grid_size,
    ragged_descriptor,
    tma_route,
)


@triton.jit
def _swiglu_backward(d_h, g, u, limit, HAS_LIMIT: tl.constexpr):
    """(d_gate, d_up, h) of the clamped SwiGLU at the pre-activation (g, u), fp32."""
    h = _swiglu(g, u, limit, HAS_LIMIT)
    gc, uc = g, u
    if HAS_LIMIT:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
    sig = tl.sigmoid(gc)
    d_gate = d_h * uc * (sig * (1.0 + gc * (1.0 - sig)))
    d_up = d_h * (gc * sig)
    if HAS_LIMIT:
        d_gate = tl.where(g <= limit, d_gate, 0.0)
        d_up = tl.where((u >= -limit) & (u <= limit), d_up, 0.0)
    return d_gate, d_up, h


@triton.jit
def _grouped_d_gate_up(dy_ptr, dy_desc, w_ptr, w_desc, counts_ptr, gu_ptr, dgu_ptr, h_ptr, N, K, INTER, E, limit,
                       s_dy, sw_e, sw_k, sw_n, s_gu, s_h, HAS_LIMIT: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr, GROUP_M: tl.constexpr,
                       EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
                       FLATTEN: tl.constexpr):
    """d_gate_up of the rows of expert e from d_h = d_out @ W2[e]^T (columns n of I), and h recomputed."""
    lanes = _segments(counts_ptr, N, E, BM, E_PAD)
    m_tiles, n_tiles = lanes[7], tl.cdiv(INTER, BN)
    for tile_id in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0), flatten=FLATTEN):
        _, we, row0, read_end, write_end, tile_n = _row_tile(tile_id, lanes, m_tiles, n_tiles, N, E, BM, GROUP_M)
        rows = row0 + tl.arange(0, BM)
        cols = tile_n * BN + tl.arange(0, BN)
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        if TMA:  # W2[e]^T through W2's [E, I, D] descriptor, transposed
            d_h, _ = _row_loop_tma(dy_desc, w_desc, row0, we, tile_n * BN, K, zero, zero, 0, False, True, BN, BK, PREC)
        else:
            d_h, _ = _row_loop(dy_ptr, w_ptr + we.to(tl.int64) * sw_e, rows, read_end, cols, K, INTER, s_dy, sw_k,
                               sw_n, zero, zero, 0, False, BK, EVEN_K, EVEN_N, PREC)
        # the epilogue in column halves (quarters from 256 columns): fewer live registers
        d_h0, d_h1 = _halves(tl.where((rows < read_end)[:, None], d_h, 0.0), BM, BN)
        col0 = tile_n * BN
        if BN >= 256:
            part0, part1 = _halves(d_h0, BM, BN // 2)
            _d_gate_up_store(part0, rows, col0 + tl.arange(0, BN // 4), read_end, write_end, gu_ptr, dgu_ptr, h_ptr,
                             INTER, s_gu, s_h, limit, HAS_LIMIT)
            _d_gate_up_store(part1, rows, col0 + BN // 4 + tl.arange(0, BN // 4), read_end, write_end, gu_ptr,
                             dgu_ptr, h_ptr, INTER, s_gu, s_h, limit, HAS_LIMIT)
            part0, part1 = _halves(d_h1, BM, BN // 2)
            _d_gate_up_store(part0, rows, col0 + BN // 2 + tl.arange(0, BN // 4), read_end, write_end, gu_ptr,
                             dgu_ptr, h_ptr, INTER, s_gu, s_h, limit, HAS_LIMIT)
            _d_gate_up_store(part1, rows, col0 + 3 * BN // 4 + tl.arange(0, BN // 4), read_end, write_end, gu_ptr,
                             dgu_ptr, h_ptr, INTER, s_gu, s_h, limit, HAS_LIMIT)
        else:
            _d_gate_up_store(d_h0, rows, col0 + tl.arange(0, BN // 2), read_end, write_end, gu_ptr, dgu_ptr, h_ptr,
                             INTER, s_gu, s_h, limit, HAS_LIMIT)
            _d_gate_up_store(d_h1, rows, col0 + BN // 2 + tl.arange(0, BN // 2), read_end, write_end, gu_ptr,
                             dgu_ptr, h_ptr, INTER, s_gu, s_h, limit, HAS_LIMIT)


@triton.jit
def _halves(t, BM: tl.constexpr, W: tl.constexpr):
    """The column halves ``[0, W / 2)`` and ``[W / 2, W)`` of ``t`` [BM, W] (a register split, no data movement)."""
    return tl.split(tl.permute(tl.reshape(t, [BM, 2, W // 2]), [0, 2, 1]))


@triton.jit
def _d_gate_up_store(d_h, rows, cols, read_end, write_end, gu_ptr, dgu_ptr, h_ptr, INTER, s_gu, s_h, limit,
                     HAS_LIMIT: tl.constexpr):
    """d_gate_up and h of the columns ``cols`` of a row tile from its ``d_h`` and the saved ``gate_up`` (int32
    offsets from the tile's first row: one [BM, BN] offset tensor serves the four gate_up-shaped accesses)."""
    row0 = tl.min(rows, axis=0)
    live = (rows < read_end)[:, None] & (cols < INTER)[None, :]
    mask = (rows < write_end)[:, None] & (cols < INTER)[None, :]
    off = (rows - row0)[:, None] * s_gu + cols[None, :]
    gu = gu_ptr + row0.to(tl.int64) * s_gu
    dgu = dgu_ptr + row0.to(tl.int64) * s_gu
    g = tl.load(gu + off, mask=live, other=0.0).to(tl.float32)
    u = tl.load(gu + INTER + off, mask=live, other=0.0).to(tl.float32)
    d_gate, d_up, h = _swiglu_backward(d_h, g, u, limit, HAS_LIMIT)
    dtype = dgu_ptr.dtype.element_ty
    tl.store(dgu + off, d_gate.to(dtype), mask=mask)
    tl.store(dgu + INTER + off, d_up.to(dtype), mask=mask)
    tl.store(h_ptr + row0.to(tl.int64) * s_h + (rows - row0)[:, None] * s_h + cols[None, :], h.to(dtype), mask=mask)


@triton.jit
def _grouped_d_weight(a_ptr, a_desc, b_ptr, b_desc, counts_ptr, out_ptr, out_desc, N, M, NN, E, sa, sb, s_oe, s_om,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr,
                      EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
                      FLATTEN: tl.constexpr):
    """out[e] = a_e^T @ b_e over the rows of expert e, in ascending row order, BK rows a step (one output tile per
    loop step; an expert without rows gets zeros). TMA: rows outside the segment read as zero (ragged loads)."""
    ex, start_e, rows_e, _, _, _, _, _ = _segments(counts_ptr, N, E, BM, E_PAD)
    tiles_n = tl.cdiv(NN, BN)
    per_expert = tl.cdiv(M, BM) * tiles_n
    for tile_id in tl.range(tl.program_id(0), E * per_expert, tl.num_programs(0), flatten=FLATTEN):
        e, m0, n0, start, count = _weight_tile(tile_id, ex, start_e, rows_e, per_expert, tiles_n, BM, BN)
        ms = m0 + tl.arange(0, BM)
        ns = n0 + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if TMA:
            for r in range(0, count, BK):
                a = _load_ragged(a_desc, start, count, r, m0, BK, BM)
                b = _load_ragged(b_desc, start, count, r, n0, BK, BN)
                acc = tl.dot(tl.trans(a), b, acc, input_precision=PREC)
            out_desc.store([e, m0, n0], tl.reshape(acc.to(out_desc.dtype), [1, BM, BN]))
        else:
            acc = _d_weight_loop(a_ptr, b_ptr, start, start + count, ms, ns, M, NN, sa, sb, acc, BK, EVEN_M, EVEN_N,
                                 PREC)
            out = out_ptr + e.to(tl.int64) * s_oe + ms[:, None] * s_om + ns[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(ms < M)[:, None] & (ns < NN)[None, :])


@triton.jit
def _d_weight_loop(a_ptr, b_ptr, start, end, ms, ns, M, NN, sa, sb, acc, BK: tl.constexpr, EVEN_M: tl.constexpr,
                   EVEN_N: tl.constexpr, PREC: tl.constexpr):
    """Pointer path of ``_grouped_d_weight``: ``acc += a[start:end, ms]^T @ b[start:end, ns]``, BK rows a step."""
    rk = tl.arange(0, BK)
    m_ok = ms < M
    n_ok = ns < NN
    for r0 in range(start, end, BK):
        r = r0 + rk
        r_ok = r < end
        r64 = r.to(tl.int64)
        if EVEN_M:
            a = tl.load(a_ptr + r64[None, :] * sa + ms[:, None], mask=r_ok[None, :], other=0.0)
        else:
            a = tl.load(a_ptr + r64[None, :] * sa + ms[:, None], mask=r_ok[None, :] & m_ok[:, None], other=0.0)
        if EVEN_N:
            b = tl.load(b_ptr + r64[:, None] * sb + ns[None, :], mask=r_ok[:, None], other=0.0)
        else:
            b = tl.load(b_ptr + r64[:, None] * sb + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


def gate_up_backward(d_out: Any, counts: Any, weight2: Any, gate_up: Any, limit: float) -> tuple[Any, Any]:
    """(d_gate_up [N, 2I], h [N, I]) from ``d_out`` [N, D] and the saved ``gate_up``: ``_grouped_d_gate_up`` alone."""
    n_rows, dim = shape_of(d_out)
    experts, inter = shape_of(weight2)[0], shape_of(weight2)[1]
    d_gate_up = empty_like(gate_up)
    h = empty_like(gate_up, shape=[n_rows, inter])
    cfg = launch_config("d_gate_up", n_rows, experts, dtype_name(d_out))
    s2 = strides_of(weight2)  # W2[e]^T [D, I]: k = d (stride 1), n = i (stride D)
    dy_desc = w_desc = None
    if cfg.tma and n_rows > 0 and tma_route(_grouped_d_gate_up, d_out, weight2):
        dy_desc, w_desc = descriptor(d_out, [cfg.bm, cfg.bk]), descriptor(weight2, [1, cfg.bn, cfg.bk])
    count_path(_grouped_d_gate_up, dy_desc is not None, cfg.persistent)
    launch(_grouped_d_gate_up, row_grid(cfg, _grouped_d_gate_up, n_rows, experts, inter), d_out, dy_desc, weight2,
           w_desc, counts, gate_up, d_gate_up, h, n_rows, dim, inter, experts, float(limit), dim, s2[0], 1, s2[1],
           2 * inter, inter, HAS_LIMIT=float(limit) > 0, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
           E_PAD=experts_pad(experts), GROUP_M=cfg.group_m, EVEN_K=dim % cfg.bk == 0, EVEN_N=inter % cfg.bn == 0,
           PREC=dot_precision(d_out), TMA=dy_desc is not None, FLATTEN=cfg.persistent == 2, num_warps=cfg.warps,
           num_stages=cfg.stages)
    return d_gate_up, h


# The warp-specialised weight gradient (``kernel_d_weight_ws.py``) on Hopper: "auto" where it fits and measured
# faster (small groups: dW1 + dW2 at 396 vs the Triton kernel's 315 TFLOP/s at 256 experts; at 32 experts Triton's
# 616 beat its 586, H200, benchmarks/RESULTS.md), "triton" never, "gluon" always (an error names why it cannot run).
# Its launch setting: output tile rows / columns (each MMA warpgroup takes half the columns), rows per K step,
# pipeline stages, registers of the MMA warpgroups / loader.
D_WEIGHT_KERNEL = "auto"
WS_D_WEIGHT = {"BM": 128, "BN": 256, "BK": 64, "STAGES": 3, "MMA_REGS": 232, "LOADER_REGS": 40}


def d_weight_ws_fits(a: Any, b: Any, out: Any) -> str | None:
    """None when the warp-specialised weight gradient can run this call, else why not (the Triton kernel's reason)."""
    why_not = hopper_16bit(a)
    if why_not is not None:
        return why_not
    if shape_of(a)[1] % WS_D_WEIGHT["BM"]:
        return f"M {shape_of(a)[1]} not a multiple of {WS_D_WEIGHT['BM']} (output tiles of one expert)"
    if not tma_route(_grouped_d_weight, a, b, out):
        return "tensors TMA cannot address (16-byte aligned torch tensors needed)"
    return None


def use_ws_d_weight(a: Any, b: Any, out: Any) -> bool:
    """Whether ``weight_grad`` runs the warp-specialised kernel on these tensors (``D_WEIGHT_KERNEL``)."""
    why_not = d_weight_ws_fits(a, b, out) if D_WEIGHT_KERNEL != "triton" else None
    return ws_choice(D_WEIGHT_KERNEL, "kernel_bwd.D_WEIGHT_KERNEL", why_not, shape_of(a)[0], shape_of(out)[0])


def _launch_ws_d_weight(a: Any, b: Any, counts: Any, out: Any) -> None:
    from fleet_ext.ops.moe_experts.kernel_d_weight_ws import _d_weight_ws_kernel

    n_rows, m = shape_of(a)
    nn, experts = shape_of(b)[1], shape_of(counts)[0]
    cfg = WS_D_WEIGHT
    a_desc = ragged_descriptor(a, cfg["BK"], cfg["BM"], gluon=True)
    b_desc = ragged_descriptor(b, cfg["BK"], cfg["BN"], gluon=True)
    out_desc = descriptor(torch_view(out).reshape(experts * m, nn), [cfg["BM"], cfg["BN"] // 2], gluon=True)
    tiles = experts * (m // cfg["BM"]) * triton.cdiv(nn, cfg["BN"])
    count_path(_d_weight_ws_kernel, True, 1)
    launch(_d_weight_ws_kernel, (grid_size(True, _grouped_d_weight, tiles),), a_desc, b_desc, out_desc, counts,
           n_rows, m, nn, experts, E_PAD=experts_pad(experts), num_warps=4, **cfg)


def weight_grad(a: Any, b: Any, counts: Any, out: Any) -> None:
    """``out[e] = a_e^T @ b_e`` (``_grouped_d_weight``, or its warp-specialised form on Hopper): a [N, M], b [N, NN],
    out [E, M, NN] contiguous."""
    if use_ws_d_weight(a, b, out):
        _launch_ws_d_weight(a, b, counts, out)
        return
    n_rows, m = shape_of(a)
    nn, experts = shape_of(b)[1], shape_of(counts)[0]
    cfg = launch_config("d_weight", n_rows, experts, dtype_name(a))
    a_desc = b_desc = o_desc = None
    if cfg.tma and n_rows > 0 and tma_route(_grouped_d_weight, a, b, out):
        a_desc, b_desc = ragged_descriptor(a, cfg.bk, cfg.bm), ragged_descriptor(b, cfg.bk, cfg.bn)
        o_desc = descriptor(out, [1, cfg.bm, cfg.bn])
    count_path(_grouped_d_weight, a_desc is not None, cfg.persistent)
    tiles = experts * triton.cdiv(m, cfg.bm) * triton.cdiv(nn, cfg.bn)
    launch(_grouped_d_weight, (grid_size(cfg.persistent > 0, _grouped_d_weight, tiles),), a, a_desc, b, b_desc,
           counts, out, o_desc, n_rows, m, nn, experts, strides_of(a)[0], strides_of(b)[0], m * nn, nn, BM=cfg.bm,
           BN=cfg.bn, BK=cfg.bk, E_PAD=experts_pad(experts), EVEN_M=m % cfg.bm == 0, EVEN_N=nn % cfg.bn == 0,
           PREC=dot_precision(a), TMA=a_desc is not None, FLATTEN=cfg.persistent == 2, num_warps=cfg.warps,
           num_stages=cfg.stages)


def experts_backward(d_out: Any, rows: Any, counts: Any, weight1: Any, weight2: Any, gate_up: Any, limit: float,
                     needs: tuple[bool, bool, bool] = (True, True, True)) -> tuple[Any, Any, Any]:
    """``d_out`` [N, D] -> (d_rows [N, D], d_weight1 [E, D, 2I], d_weight2 [E, I, D]); 4 launches (3 kernels).

    ``gate_up`` is the forward's saved pre-activation; ``h`` is recomputed from it. Gradients in the dtype of
    the tensor they belong to; ``needs`` says which of the three to compute (None for the others).
    """
    n_rows, dim, inter, experts = check_args(rows, counts, weight1, weight2, "moe_experts backward")
    if shape_of(d_out) != [n_rows, dim] or strides_of(d_out) != [dim, 1]:
        raise ValueError(f"moe_experts backward: `d_out` must be contiguous [{n_rows}, {dim}], got {shape_of(d_out)} "
                         f"strides {strides_of(d_out)}")
    if shape_of(gate_up) != [n_rows, 2 * inter]:
        raise ValueError(f"moe_experts backward: `gate_up` must be [{n_rows}, {2 * inter}], got {shape_of(gate_up)}")
    dy, x, w1, w2 = detached(d_out), detached(rows), detached(weight1), detached(weight2)
    d_rows, d_w1, d_w2 = (empty_like(t) if need else None for t, need in zip((rows, weight1, weight2), needs))
    d_gate_up, h = gate_up_backward(dy, counts, w2, gate_up, limit)
    s1 = strides_of(w1)  # W1[e]^T [2I, D]: k = j (stride 1), n = d (stride 2I)
    if d_rows is not None:
        rows_gemm(d_gate_up, w1, counts, d_rows, 2 * inter, dim, (s1[0], 1, s1[1]), "d_rows")
    if d_w1 is not None:
        weight_grad(x, d_gate_up, counts, d_w1)
    if d_w2 is not None:
        weight_grad(h, dy, counts, d_w2)
    return d_rows, d_w1, d_w2
