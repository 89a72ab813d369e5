"""Triton MoE permute / unpermute: tokens to expert-contiguous rows and back, deterministic, no atomics.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this
module imports neither Paddle nor torch. The arithmetic is the reference's (``reference.py``) op for op:

- **Routing** (``route``, four small launches): a stable counting sort of the flattened (token, slot)
  pairs by expert. ``_route_hist`` counts each block of tokens' pairs per expert; ``_route_scan`` turns the
  counts into per-(block, expert) starts and the tokens per expert, ``_route_offsets`` into each expert's
  first row; ``_route_rows`` gives each pair its row ``offset[e] + start[block, e] + (earlier pairs of the
  block with expert e)`` -- the row the reference's stable argsort gives it -- and writes, per token, its k
  rows in ascending order (``token_rows``) with the flat (token, slot) index of each (``token_srcs``).
  Integer counting: exact, order-free.
- **Permute** copies each token's row to its k rows (read once, written k times); its **backward** adds a
  token's k row gradients in ascending row order from zero, as the gather's gradient (a scatter-add in row
  order) does.
- **Unpermute** computes ``fp32(y) * w`` rounded to the output dtype and adds a token's k products in
  ascending row order from zero, rounding to the output dtype after every add (``index_add`` in that dtype);
  its **backward** writes ``d_y = fp32(d_out) * w`` (in y's dtype) and ``d_w = sum_d fp32(d_out) * fp32(y)``.
  The ``d_w`` sum runs in blocks of ``BLOCK_D`` columns: with ``BLOCK_D = 1`` (the interpreter) it is the
  sequential left-to-right fp32 sum Paddle's CPU multiply-gradient does, bitwise; on a GPU it is a blocked
  sum (deterministic, not bitwise to eager).

Every sum is a gather over a token's own rows in a fixed order: no atomics, byte-identical run to run. On a
GPU the fp32 product ``y * w`` is an inline-PTX ``mul.rn`` so it is never contracted into an FMA with the
add that follows (eager rounds the product first).
"""

from __future__ import annotations

import sys
from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import detached, dtype_name, empty_like, launch, shape_of, strides_of
from fleet_ext.ops.rounding import _mul_rn

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
INT_DTYPES = ("int32", "int64")


@triton.jit
def _round_to(v, dtype: tl.constexpr, ROUND: tl.constexpr):
    """fp32 ``v`` rounded to ``dtype`` (nearest even) and widened back; identity when ``dtype`` is fp32."""
    if ROUND:
        v = v.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    return v


@triton.jit
def _route_hist(idx_ptr, hist_ptr, T, E, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                E_PAD: tl.constexpr):
    """hist[b, e] = pairs of tokens [b*BLOCK_T, (b+1)*BLOCK_T) routed to expert e."""
    b = tl.program_id(0)
    m = tl.arange(0, BLOCK_T * K_PAD)
    t = b * BLOCK_T + m // K_PAD
    j = m % K_PAD
    valid = (t < T) & (j < K)
    e = tl.load(idx_ptr + t.to(tl.int64) * K + j, mask=valid, other=0).to(tl.int32)
    hits = tl.histogram(e, E_PAD, mask=valid)
    ex = tl.arange(0, E_PAD)
    tl.store(hist_ptr + b.to(tl.int64) * E + ex, hits, mask=ex < E)


@triton.jit
def _route_scan(hist_ptr, start_ptr, counts_ptr, NB, E, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """start[b, e] = sum_{b' < b} hist[b', e]; counts[e] = sum_b hist[b, e] (experts in blocks of BLOCK_E)."""
    ex = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = ex < E
    running = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        bb = b0 + tl.arange(0, BLOCK_B)
        mask = (bb < NB)[:, None] & e_mask[None, :]
        at = bb[:, None].to(tl.int64) * E + ex[None, :]
        h = tl.load(hist_ptr + at, mask=mask, other=0)
        tl.store(start_ptr + at, running[None, :] + tl.cumsum(h, axis=0) - h, mask=mask)
        running += tl.sum(h, axis=0)
    tl.store(counts_ptr + ex, running.to(tl.int64), mask=e_mask)


@triton.jit
def _route_offsets(counts_ptr, offsets_ptr, E, E_PAD: tl.constexpr):
    """offsets = [0, counts[0], counts[0] + counts[1], ...] (E + 1 entries): each expert's first row."""
    ex = tl.arange(0, E_PAD)
    c = tl.load(counts_ptr + ex, mask=ex < E, other=0)
    tl.store(offsets_ptr + 1 + ex, tl.cumsum(c, axis=0), mask=ex < E)
    tl.store(offsets_ptr + tl.arange(0, 1), tl.zeros([1], dtype=tl.int64))


@triton.jit
def _route_rows(idx_ptr, start_ptr, offsets_ptr, rows_ptr, srcs_ptr, T, E,
                K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Each pair's row (the stable sort's position); per token its rows ascending, with their flat sources."""
    b = tl.program_id(0)
    m = tl.arange(0, BLOCK_T * K_PAD)
    t = b * BLOCK_T + m // K_PAD
    j = m % K_PAD
    valid = (t < T) & (j < K)
    src = t.to(tl.int64) * K + j
    e = tl.load(idx_ptr + src, mask=valid, other=0).to(tl.int32)
    row = tl.load(offsets_ptr + e, mask=valid, other=0).to(tl.int32)
    row += tl.load(start_ptr + b.to(tl.int64) * E + e, mask=valid, other=0)
    # Stable: earlier pairs of this block with the same expert come first.
    earlier = (e[None, :] == e[:, None]) & (m[None, :] < m[:, None]) & valid[None, :]
    row += tl.sum(earlier.to(tl.int32), axis=1)
    # This pair's place among its token's rows (ascending row = ascending expert, then slot).
    below = (t[None, :] == t[:, None]) & (row[None, :] < row[:, None]) & valid[None, :]
    place = t.to(tl.int64) * K + tl.sum(below.to(tl.int32), axis=1)
    tl.store(rows_ptr + place, row, mask=valid)
    tl.store(srcs_ptr + place, src.to(tl.int32), mask=valid)


@triton.jit
def _permute_fwd(x_ptr, out_ptr, rows_ptr, T, D, x_st, o_st,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[rows[t, i]] = x[t] for each of the token's k rows."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = t_mask[:, None] & (cols < D)[None, :]
        v = tl.load(x_ptr + t64[:, None] * x_st + cols[None, :], mask=mask)
        for i in tl.static_range(K):
            r = tl.load(rows_ptr + t64 * K + i, mask=t_mask, other=0).to(tl.int64)
            tl.store(out_ptr + r[:, None] * o_st + cols[None, :], v, mask=mask)


@triton.jit
def _permute_bwd(g_ptr, dx_ptr, rows_ptr, T, D, g_st, dx_st,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ROUND: tl.constexpr):
    """dx[t] = ((0 + g[r_0]) + g[r_1]) + ... over the token's rows ascending, rounded like the gather's grad."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    out_dtype = dx_ptr.dtype.element_ty
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = t_mask[:, None] & (cols < D)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(K):
            r = tl.load(rows_ptr + t64 * K + i, mask=t_mask, other=0).to(tl.int64)
            g = tl.load(g_ptr + r[:, None] * g_st + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc = _round_to(acc + g, out_dtype, ROUND)
        tl.store(dx_ptr + t64[:, None] * dx_st + cols[None, :], acc.to(out_dtype), mask=mask)


@triton.jit
def _unpermute_fwd(y_ptr, w_ptr, out_ptr, rows_ptr, srcs_ptr, T, D, y_st, o_st,
                   K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ROUND: tl.constexpr,
                   USE_PTX: tl.constexpr):
    """out[t] = sum over the token's rows r ascending of round(fp32(y[r]) * w[src(r)]), from zero."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    out_dtype = out_ptr.dtype.element_ty
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = t_mask[:, None] & (cols < D)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(K):
            r = tl.load(rows_ptr + t64 * K + i, mask=t_mask, other=0).to(tl.int64)
            s = tl.load(srcs_ptr + t64 * K + i, mask=t_mask, other=0).to(tl.int64)
            w = tl.load(w_ptr + s, mask=t_mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + r[:, None] * y_st + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            p = _round_to(_mul_rn(y, w[:, None], USE_PTX), out_dtype, ROUND)
            acc = _round_to(acc + p, out_dtype, ROUND)
        tl.store(out_ptr + t64[:, None] * o_st + cols[None, :], acc.to(out_dtype), mask=mask)


@triton.jit
def _unpermute_bwd(g_ptr, y_ptr, w_ptr, dy_ptr, dw_ptr, rows_ptr, srcs_ptr, T, D, g_st, y_st, dy_st,
                   K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                   USE_PTX: tl.constexpr):
    """dy[r] = fp32(g[t]) * w (in y's dtype); dw[src] = 0 + sum_d fp32(g[t, d]) * fp32(y[r, d]), BLOCK_D at a time."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    slots = tl.arange(0, K_PAD)
    dw = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = t_mask[:, None] & (cols < D)[None, :]
        g = tl.load(g_ptr + t64[:, None] * g_st + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        for i in tl.static_range(K):
            r = tl.load(rows_ptr + t64 * K + i, mask=t_mask, other=0).to(tl.int64)
            s = tl.load(srcs_ptr + t64 * K + i, mask=t_mask, other=0).to(tl.int64)
            w = tl.load(w_ptr + s, mask=t_mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + r[:, None] * y_st + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = _mul_rn(g, w[:, None], USE_PTX)
            tl.store(dy_ptr + r[:, None] * dy_st + cols[None, :], dy.to(dy_ptr.dtype.element_ty), mask=mask)
            part = tl.sum(_mul_rn(g, y, USE_PTX), axis=1)
            dw = tl.where(slots[None, :] == i, dw + part[:, None], dw)
    k_mask = t_mask[:, None] & (slots < K)[None, :]
    s2 = tl.load(srcs_ptr + t64[:, None] * K + slots[None, :], mask=k_mask, other=0).to(tl.int64)
    tl.store(dw_ptr + s2, dw.to(dw_ptr.dtype.element_ty), mask=k_mask)


def is_interpreted() -> bool:
    return type(_permute_fwd).__name__ == "InterpretedFunction"


# The interpreter runs numpy (one rounding per op, no contraction, no inline asm); a compiled kernel takes
# the PTX route for the fp32 products. Decided by how Triton built the kernels (TRITON_INTERPRET at import).
USE_PTX = not is_interpreted()

# Launch configuration (no autotuning). GPU values: the fastest of scripts/bench/bench_moe.py's sweep on the H200
# (T = 8192, D = 4096, k = 6, bf16; benchmarks/RESULTS.md, MoE section).
TUNE: dict[str, int] = {
    "route_block_t": 8,  # tokens per routing program: [8 * K_PAD]^2 pairwise comparisons (16: same time)
    "route_warps": 4,
    "scan_block_b": 256,
    "scan_block_e": 16,
    "copy_block_t": 1,  # tokens per permute / unpermute / permute-backward program
    "copy_block_d": 2048,
    "copy_warps": 8,
    "bwd_block_t": 2,  # the unpermute backward (d_y and the d_w sums)
    "bwd_block_d": 1024,
    "bwd_warps": 4,
}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _framework_dtype(tensor: Any, name: str) -> Any:
    """The dtype ``name`` of ``tensor``'s framework (already imported: the tensor exists)."""
    return getattr(sys.modules[type(tensor).__module__.split(".")[0]], name)


def _row_stride(tensor: Any, name: str, fn: str) -> int:
    """Row stride of a [rows, D] tensor whose last dim is contiguous."""
    strides = strides_of(tensor)
    if shape_of(tensor)[1] > 1 and strides[1] != 1:
        raise ValueError(f"{fn}: `{name}` must have a contiguous last dim (stride 1), got strides {strides}")
    return strides[0]


def check_route_args(hidden: Any, indices: Any, num_experts: int, fn: str = "moe_permute") -> tuple[int, int, int]:
    """(T, D, k) of ``hidden`` [T, D] float and ``indices`` [T, k] int32/int64; errors name the tensor."""
    if hidden.ndim != 2 or dtype_name(hidden) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `hidden_states` must be [T, D] float, got {dtype_name(hidden)} {shape_of(hidden)}")
    tokens, dim = shape_of(hidden)
    if indices.ndim != 2 or dtype_name(indices) not in INT_DTYPES or shape_of(indices)[0] != tokens:
        raise ValueError(f"{fn}: `indices` must be [{tokens}, k] int32/int64, got {dtype_name(indices)} "
                         f"{shape_of(indices)}")
    topk = shape_of(indices)[1]
    if tokens == 0 or topk == 0:
        raise ValueError(f"{fn}: `indices` must hold at least one token and one slot, got {shape_of(indices)}")
    if tokens * topk >= 2**31:
        raise ValueError(f"{fn}: T * k = {tokens * topk} rows must stay below 2**31 (int32 row ids)")
    if int(num_experts) < 1:
        raise ValueError(f"{fn}: `num_experts` must be >= 1, got {num_experts}")
    return tokens, dim, topk


def route(indices: Any, num_experts: int) -> tuple[Any, Any, Any, Any]:
    """``indices`` [T, k] -> (token_rows [T, k] int32, token_srcs [T, k] int32, counts [E] int64, offsets [E+1]).

    ``indices`` must be contiguous with values in [0, num_experts) (the caller checks the range: a value
    outside it gets no row). ``token_rows[t]`` ascending; ``token_srcs[t, i]`` = t * k + slot of that row.
    """
    tokens, topk = shape_of(indices)
    if strides_of(indices) != [topk, 1]:
        raise ValueError(f"moe_permute: `indices` must be contiguous, got strides {strides_of(indices)}")
    experts = int(num_experts)
    block_t = min(TUNE["route_block_t"] if not is_interpreted() else 64, _pow2(tokens))
    k_pad, e_pad = _pow2(topk), _pow2(experts)
    n_blocks = triton.cdiv(tokens, block_t)
    int32, int64 = _framework_dtype(indices, "int32"), _framework_dtype(indices, "int64")
    scratch = empty_like(indices, shape=[2, n_blocks, experts], dtype=int32)  # per-block counts, their prefix
    hist, start = scratch[0], scratch[1]
    table = empty_like(indices, shape=[2 * experts + 1], dtype=int64)
    counts, offsets = table[:experts], table[experts:]
    maps = empty_like(indices, shape=[2, tokens, topk], dtype=int32)
    rows, srcs = maps[0], maps[1]
    idx = detached(indices)
    warps = TUNE["route_warps"]
    launch(_route_hist, (n_blocks,), idx, hist, tokens, experts, K=topk, K_PAD=k_pad, BLOCK_T=block_t, E_PAD=e_pad,
           num_warps=warps)
    scan_e = min(TUNE["scan_block_e"], e_pad)
    launch(_route_scan, (triton.cdiv(experts, scan_e),), hist, start, counts, n_blocks, experts,
           BLOCK_B=min(TUNE["scan_block_b"], _pow2(n_blocks)), BLOCK_E=scan_e, num_warps=4)
    launch(_route_offsets, (1,), counts, offsets, experts, E_PAD=e_pad, num_warps=4)
    launch(_route_rows, (n_blocks,), idx, start, offsets, rows, srcs, tokens, experts, K=topk, K_PAD=k_pad,
           BLOCK_T=block_t, num_warps=warps)
    return rows, srcs, counts, offsets


def _copy_config(tokens: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) of the token-major copy kernels."""
    if is_interpreted():  # numpy per op: few programs
        return min(64, _pow2(tokens)), _pow2(dim), 4
    return TUNE["copy_block_t"], min(TUNE["copy_block_d"], _pow2(dim)), TUNE["copy_warps"]


def permute(hidden: Any, rows: Any) -> Any:
    """[T, D] -> [T*k, D]: token t's row copied to ``rows[t, :]``."""
    tokens, dim = shape_of(hidden)
    topk = shape_of(rows)[1]
    out = empty_like(hidden, shape=[tokens * topk, dim])
    block_t, block_d, warps = _copy_config(tokens, dim)
    launch(_permute_fwd, (triton.cdiv(tokens, block_t),), detached(hidden), out, rows, tokens, dim,
           _row_stride(hidden, "hidden_states", "moe_permute"), dim, K=topk, BLOCK_T=block_t, BLOCK_D=block_d,
           num_warps=warps)
    return out


def permute_backward(grad: Any, rows: Any, dtype: Any = None) -> Any:
    """[T*k, D] row gradients -> [T, D]: each token's rows summed in ascending row order."""
    tokens, topk = shape_of(rows)
    dim = shape_of(grad)[1]
    d_x = empty_like(grad, shape=[tokens, dim], dtype=dtype)
    block_t, block_d, warps = _copy_config(tokens, dim)
    launch(_permute_bwd, (triton.cdiv(tokens, block_t),), detached(grad), d_x, rows, tokens, dim,
           _row_stride(grad, "grad", "moe_permute backward"), dim, K=topk, BLOCK_T=block_t, BLOCK_D=block_d,
           ROUND=dtype_name(d_x) != "float32", num_warps=warps)
    return d_x


def check_unpermute_args(y: Any, weights: Any, rows: Any, fn: str = "moe_unpermute") -> None:
    tokens, topk = shape_of(rows)
    if y.ndim != 2 or shape_of(y)[0] != tokens * topk or dtype_name(y) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `y` must be [{tokens * topk}, D] float, got {dtype_name(y)} {shape_of(y)}")
    if shape_of(weights) != [tokens, topk] or dtype_name(weights) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `weights` must be [{tokens}, {topk}] float, got {dtype_name(weights)} "
                         f"{shape_of(weights)}")
    if strides_of(weights) != [topk, 1]:
        raise ValueError(f"{fn}: `weights` must be contiguous, got strides {strides_of(weights)}")


def unpermute(y: Any, weights: Any, rows: Any, srcs: Any, out_dtype: Any = None) -> Any:
    """[T*k, D] rows and [T, k] weights -> [T, D] (``out_dtype``, default y's): each token's weighted sum."""
    check_unpermute_args(y, weights, rows)
    tokens, topk = shape_of(rows)
    dim = shape_of(y)[1]
    out = empty_like(y, shape=[tokens, dim], dtype=out_dtype)
    block_t, block_d, warps = _copy_config(tokens, dim)
    launch(_unpermute_fwd, (triton.cdiv(tokens, block_t),), detached(y), detached(weights), out, rows, srcs,
           tokens, dim, _row_stride(y, "y", "moe_unpermute"), dim, K=topk, BLOCK_T=block_t, BLOCK_D=block_d,
           ROUND=dtype_name(out) != "float32", USE_PTX=USE_PTX, num_warps=warps)
    return out


def unpermute_backward(grad: Any, y: Any, weights: Any, rows: Any, srcs: Any) -> tuple[Any, Any]:
    """``d_out`` [T, D] -> (d_y [T*k, D] in y's dtype, d_weights [T, k] in the weights' dtype)."""
    tokens, topk = shape_of(rows)
    dim = shape_of(y)[1]
    d_y = empty_like(y)
    d_w = empty_like(weights)
    block_t, block_d, warps = _copy_config(tokens, dim)
    if is_interpreted():
        block_d = 1  # the sequential fp32 sum over D of Paddle's CPU multiply-gradient, bitwise
    else:
        block_t, block_d, warps = TUNE["bwd_block_t"], min(TUNE["bwd_block_d"], _pow2(dim)), TUNE["bwd_warps"]
    launch(_unpermute_bwd, (triton.cdiv(tokens, block_t),), detached(grad), detached(y), detached(weights), d_y, d_w,
           rows, srcs, tokens, dim, _row_stride(grad, "grad", "moe_unpermute backward"),
           _row_stride(y, "y", "moe_unpermute backward"), dim, K=topk, K_PAD=_pow2(topk), BLOCK_T=block_t,
           BLOCK_D=block_d, USE_PTX=USE_PTX, num_warps=warps)
    return d_y, d_w
