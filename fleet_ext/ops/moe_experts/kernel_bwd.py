"""Backward of the Triton grouped expert GEMMs (``kernel.py``): four launches, no atomics, no host read.

Given ``d_out`` [N, D] and the forward's saved ``gate_up`` [N, 2I] (the pre-activation; ``h`` is not kept):

1. ``_grouped_d_gate_up``: ``d_h = d_out_e @ W2[e]^T`` per row tile, and in the epilogue the clamped SwiGLU's
   backward from the saved ``gate_up``: ``d_gate = d_h * up_c * silu'(gate_c) * [gate <= limit]``,
   ``d_up = d_h * silu(gate_c) * [|up| <= limit]`` (``gate_c``, ``up_c`` clamped; the bounds pass the gradient,
   as Paddle's and torch's clip do). The same epilogue writes ``h`` again (recomputed from ``gate_up`` with the
   forward's code, so it equals the forward's ``h``) for step 4: the activation is always recomputed, never kept.
2. ``_grouped_rows_mm``: ``d_rows = d_gate_up_e @ W1[e]^T``.
3. ``_grouped_d_weight``: ``d_W1[e] = rows_e^T @ d_gate_up_e``, 4. the same kernel: ``d_W2[e] = h_e^T @ d_out_e``.
   One program owns one output tile of one expert and adds the expert's rows in ascending order, ``BK`` rows a
   step, into one fp32 accumulator: a fixed order, so the weight gradients are byte-identical run to run
   (deterministic; an expert with no rows gets zeros).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import detached, dtype_name, empty_like, launch, shape_of, strides_of
from fleet_ext.ops.moe_experts.kernel import (
    _row_loop,
    _swiglu,
    _tile,
    check_args,
    dot_precision,
    experts_pad,
    launch_config,
    rows_gemm,
)


@triton.jit
def _grouped_d_gate_up(dy_ptr, w_ptr, counts_ptr, gu_ptr, dgu_ptr, h_ptr, N, K, INTER, E, limit, s_dy, sw_e, sw_k, sw_n,
                       s_gu, s_h, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       E_PAD: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                       PREC: tl.constexpr):
    """d_gate_up of the rows of expert e from d_h = d_out @ W2[e]^T (columns n of I), and h recomputed."""
    e, row0, read_end, write_end, n0 = _tile(counts_ptr, N, INTER, E, BM, BN, E_PAD, GROUP_M)
    if row0 >= write_end:
        return
    rows = row0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    w = w_ptr + tl.minimum(e, E - 1).to(tl.int64) * sw_e
    zero = tl.zeros([BM, BN], dtype=tl.float32)
    d_h, _ = _row_loop(dy_ptr, w, rows, read_end, cols, K, INTER, s_dy, sw_k, sw_n, zero, zero, 0, False, BK, EVEN_K,
                       EVEN_N, PREC)
    r64 = rows.to(tl.int64)[:, None]
    mask = (rows < write_end)[:, None] & (cols < INTER)[None, :]
    g = tl.load(gu_ptr + r64 * s_gu + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r64 * s_gu + INTER + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = _swiglu(g, u, limit, HAS_LIMIT)
    gc, uc = g, u
    if HAS_LIMIT:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
    sig = tl.sigmoid(gc)
    silu = gc * sig
    d_gate = d_h * uc * (sig * (1.0 + gc * (1.0 - sig)))
    d_up = d_h * silu
    if HAS_LIMIT:
        d_gate = tl.where(g <= limit, d_gate, 0.0)
        d_up = tl.where((u >= -limit) & (u <= limit), d_up, 0.0)
    dtype = dgu_ptr.dtype.element_ty
    tl.store(dgu_ptr + r64 * s_gu + cols[None, :], d_gate.to(dtype), mask=mask)
    tl.store(dgu_ptr + r64 * s_gu + INTER + cols[None, :], d_up.to(dtype), mask=mask)
    tl.store(h_ptr + r64 * s_h + cols[None, :], h.to(dtype), mask=mask)


@triton.jit
def _grouped_d_weight(a_ptr, b_ptr, counts_ptr, out_ptr, N, M, NN, E, sa, sb, s_oe, s_om,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr,
                      EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr):
    """out[e] = a_e^T @ b_e over the rows of expert e, in ascending row order (one program per output tile)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(NN, BN)
    per_expert = tl.cdiv(M, BM) * tiles_n
    e = pid // per_expert
    tile_m = (pid % per_expert) // tiles_n
    tile_n = pid % tiles_n
    ex = tl.arange(0, E_PAD)
    c = tl.load(counts_ptr + ex, mask=ex < E, other=0).to(tl.int32)
    start = tl.minimum(tl.sum(tl.where(ex < e, c, 0), axis=0), N)
    end = tl.minimum(start + tl.sum(tl.where(ex == e, c, 0), axis=0), N)
    ms = tile_m * BM + tl.arange(0, BM)
    ns = tile_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = ms < M
    n_ok = ns < NN
    acc = tl.zeros([BM, BN], dtype=tl.float32)
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
    out = out_ptr + e.to(tl.int64) * s_oe + ms[:, None] * s_om + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gate_up_backward(d_out: Any, counts: Any, weight2: Any, gate_up: Any, limit: float) -> tuple[Any, Any]:
    """(d_gate_up [N, 2I], h [N, I]) from ``d_out`` [N, D] and the saved ``gate_up``: ``_grouped_d_gate_up`` alone."""
    n_rows, dim = shape_of(d_out)
    experts, inter = shape_of(weight2)[0], shape_of(weight2)[1]
    d_gate_up = empty_like(gate_up)
    h = empty_like(gate_up, shape=[n_rows, inter])
    bm, bn, bk, group_m, warps, stages = launch_config("d_gate_up", n_rows, experts, dtype_name(d_out))
    grid = ((triton.cdiv(n_rows, bm) + experts) * triton.cdiv(inter, bn),)
    s2 = strides_of(weight2)  # W2[e]^T [D, I]: k = d (stride 1), n = i (stride D)
    launch(_grouped_d_gate_up, grid, d_out, weight2, counts, gate_up, d_gate_up, h, n_rows, dim, inter, experts,
           float(limit), dim, s2[0], 1, s2[1], 2 * inter, inter, HAS_LIMIT=float(limit) > 0, BM=bm, BN=bn, BK=bk,
           E_PAD=experts_pad(experts), GROUP_M=group_m, EVEN_K=dim % bk == 0, EVEN_N=inter % bn == 0,
           PREC=dot_precision(d_out), num_warps=warps, num_stages=stages)
    return d_gate_up, h


def weight_grad(a: Any, b: Any, counts: Any, out: Any) -> None:
    """``out[e] = a_e^T @ b_e`` (``_grouped_d_weight``): a [N, M], b [N, NN], out [E, M, NN] contiguous."""
    n_rows, m = shape_of(a)
    nn, experts = shape_of(b)[1], shape_of(counts)[0]
    bm, bn, bk, _, warps, stages = launch_config("d_weight", n_rows, experts, dtype_name(a))
    grid = (experts * triton.cdiv(m, bm) * triton.cdiv(nn, bn),)
    launch(_grouped_d_weight, grid, a, b, counts, out, n_rows, m, nn, experts, strides_of(a)[0], strides_of(b)[0],
           m * nn, nn, BM=bm, BN=bn, BK=bk, E_PAD=experts_pad(experts), EVEN_M=m % bm == 0, EVEN_N=nn % bn == 0,
           PREC=dot_precision(a), num_warps=warps, num_stages=stages)


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
