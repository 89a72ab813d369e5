"""Triton grouped expert GEMMs over expert-sorted rows: gate+up with the clamped SwiGLU epilogue, then down.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this module
imports neither Paddle nor torch. The rows of expert ``e`` are the contiguous segment
``[sum(counts[:e]), sum(counts[:e + 1]))`` of ``rows``; ``counts`` stays on the device (no host read):

- **Tile map, on the device.** A launch has ``cdiv(N, BM) + E`` row tiles (an upper bound on the tiles of the
  segments, each cut into ``BM``-row tiles, none padded to a capacity: a segment's last tile is masked).
  Every program finds its own (expert, first row) from ``counts`` (``_locate``: a prefix sum over the experts
  and a comparison, no search, no table in memory); programs past the last segment's tiles return at once, or
  (when ``sum(counts) < N``) write zeros into the rows that belong to no expert.
- **Forward.** ``_grouped_gate_up``: ``gate_up = x_e @ W1[e]`` (one program computes the gate columns
  ``[n, n + BN)`` and the matching up columns ``I + n`` together) and, in the epilogue,
  ``h = silu(min(gate, limit)) * clip(up, -limit, limit)`` from the rounded ``gate_up`` (as the reference
  computes the activation from the stored pre-activation); both are written: ``gate_up`` for the backward,
  ``h`` for the down GEMM. ``_grouped_rows_mm``: ``y_e = h_e @ W2[e]``.
- fp32 accumulation; bf16 / fp16 / fp32 operands (fp32 dots in IEEE fp32, not tf32). The backward is in
  ``kernel_bwd.py``. Launch settings: ``TUNE`` (per GEMM, by the mean rows per expert, a host-side shape fact).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import detached, dtype_name, empty_like, launch, shape_of, strides_of

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@triton.jit
def _locate(counts_ptr, N, E, tile, BM: tl.constexpr, E_PAD: tl.constexpr):
    """(expert, first row of the tile, end of the rows to read, end of the rows to write) of row tile ``tile``.

    Tiles are numbered expert by expert (``cdiv(counts[e], BM)`` each). Past the last expert's tiles the expert
    is ``E`` (no weight), nothing is read and the tile's rows up to ``N`` are written (zeros).
    """
    ex = tl.arange(0, E_PAD)
    c = tl.load(counts_ptr + ex, mask=ex < E, other=0).to(tl.int32)
    tile_end = tl.cumsum((c + BM - 1) // BM, axis=0)
    before = (tile_end <= tile) & (ex < E)  # experts whose tiles all come before this one
    e = tl.sum(before.to(tl.int32), axis=0)
    seg_start = tl.sum(tl.where(before, c, 0), axis=0)
    first_tile = tl.max(tl.where(before, tile_end, 0), axis=0)
    seg_end = seg_start + tl.sum(tl.where(ex == e, c, 0), axis=0)
    row0 = seg_start + (tile - first_tile) * BM
    read_end = tl.minimum(seg_end, N)
    write_end = tl.where(e < E, read_end, N)
    return e, row0, read_end, write_end


@triton.jit
def _tile(counts_ptr, N, NO, E, BM: tl.constexpr, BN: tl.constexpr, E_PAD: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (expert, first row, read end, write end, first column): ``GROUP_M`` row tiles at a time
    sweep the output columns, so the weight columns of an expert are read by its row tiles together."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(NO, BN)
    m_tiles = tl.cdiv(N, BM) + E
    in_group = GROUP_M * n_tiles
    first = (pid // in_group) * GROUP_M
    size = tl.minimum(m_tiles - first, GROUP_M)
    tile_m = first + (pid % in_group) % size
    tile_n = (pid % in_group) // size
    e, row0, read_end, write_end = _locate(counts_ptr, N, E, tile_m, BM, E_PAD)
    return e, row0, read_end, write_end, tile_n * BN


@triton.jit
def _swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
    """``silu(min(g, limit)) * clip(u, -limit, limit)`` in fp32 (no clamp without a limit)."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def _row_loop(a_ptr, b_ptr, rows, read_end, cols, K, NO, sa, sb_k, sb_n, acc, acc2, b2_off,
              TWO: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
              PREC: tl.constexpr):
    """``acc += A[rows, :] @ B[:, cols]`` (and ``acc2 += A[rows, :] @ B[:, cols + b2_off]`` when ``TWO``) over K."""
    ks = tl.arange(0, BK)
    row_ok = rows < read_end
    col_ok = cols < NO
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * sa + ks[None, :]
    b_ptrs = b_ptr + ks[:, None] * sb_k + cols[None, :] * sb_n  # inside one expert's weight: < 2**31
    for k0 in range(0, K, BK):
        if EVEN_K:
            a_mask = row_ok[:, None]
            b_mask = col_ok[None, :]
        else:
            k_ok = (k0 + ks) < K
            a_mask = row_ok[:, None] & k_ok[None, :]
            b_mask = k_ok[:, None] & col_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if EVEN_N and EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        if TWO:
            if EVEN_N and EVEN_K:
                b2 = tl.load(b_ptrs + b2_off)
            else:
                b2 = tl.load(b_ptrs + b2_off, mask=b_mask, other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=PREC)
        a_ptrs += BK
        b_ptrs += BK * sb_k
    return acc, acc2


@triton.jit
def _grouped_gate_up(x_ptr, w_ptr, counts_ptr, gu_ptr, h_ptr, N, K, INTER, E, limit, sx, sw_e, sw_k, sw_n, s_gu, s_h,
                     HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     E_PAD: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                     PREC: tl.constexpr):
    """gate_up[r] = x[r] @ W1[e] (gate columns n and up columns I + n together); h = clamped SwiGLU of it."""
    e, row0, read_end, write_end, n0 = _tile(counts_ptr, N, INTER, E, BM, BN, E_PAD, GROUP_M)
    if row0 >= write_end:
        return
    rows = row0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    w = w_ptr + tl.minimum(e, E - 1).to(tl.int64) * sw_e
    zero = tl.zeros([BM, BN], dtype=tl.float32)
    acc_g, acc_u = _row_loop(x_ptr, w, rows, read_end, cols, K, INTER, sx, sw_k, sw_n, zero, zero, INTER * sw_n,
                             True, BK, EVEN_K, EVEN_N, PREC)
    dtype = gu_ptr.dtype.element_ty
    g, u = acc_g.to(dtype), acc_u.to(dtype)
    r64 = rows.to(tl.int64)[:, None]
    mask = (rows < write_end)[:, None] & (cols < INTER)[None, :]
    tl.store(gu_ptr + r64 * s_gu + cols[None, :], g, mask=mask)
    tl.store(gu_ptr + r64 * s_gu + INTER + cols[None, :], u, mask=mask)
    h = _swiglu(g.to(tl.float32), u.to(tl.float32), limit, HAS_LIMIT)
    tl.store(h_ptr + r64 * s_h + cols[None, :], h.to(dtype), mask=mask)


@triton.jit
def _grouped_rows_mm(a_ptr, b_ptr, counts_ptr, out_ptr, N, K, NO, E, sa, sb_e, sb_k, sb_n, s_out,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr, GROUP_M: tl.constexpr,
                EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr):
    """out[r] = a[r] @ B[e] for the rows r of expert e (B[e] addressed by strides: a weight or its transpose)."""
    e, row0, read_end, write_end, n0 = _tile(counts_ptr, N, NO, E, BM, BN, E_PAD, GROUP_M)
    if row0 >= write_end:
        return
    rows = row0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    b = b_ptr + tl.minimum(e, E - 1).to(tl.int64) * sb_e
    zero = tl.zeros([BM, BN], dtype=tl.float32)
    acc, _ = _row_loop(a_ptr, b, rows, read_end, cols, K, NO, sa, sb_k, sb_n, zero, zero, 0, False, BK, EVEN_K,
                       EVEN_N, PREC)
    mask = (rows < write_end)[:, None] & (cols < NO)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def is_interpreted() -> bool:
    return type(_grouped_rows_mm).__name__ == "InterpretedFunction"


# Launch settings (no autotuning): per GEMM, (BM, BN, BK, GROUP_M, num_warps, num_stages) for small expert groups
# ("small": mean rows per expert < SMALL_GROUP_ROWS, e.g. 256 experts x 192 rows) and large ones ("large": 32
# experts x 1536 rows). GPU values: scripts/bench/bench_moe.py's sweep on the H200 (benchmarks/RESULTS.md, issue 14).
SMALL_GROUP_ROWS = 512
TUNE: dict[str, dict[str, tuple[int, int, int, int, int, int]]] = {
    "gate_up": {"small": (128, 128, 64, 8, 8, 4), "large": (128, 128, 64, 8, 8, 4)},
    "down": {"small": (128, 256, 64, 8, 8, 3), "large": (128, 256, 64, 8, 8, 3)},
    "d_gate_up": {"small": (64, 128, 64, 8, 4, 4), "large": (64, 128, 64, 8, 4, 4)},
    "d_rows": {"small": (128, 256, 64, 8, 8, 3), "large": (128, 256, 64, 8, 8, 3)},
    "d_weight": {"small": (128, 128, 32, 1, 4, 4), "large": (128, 256, 64, 1, 8, 3)},
}
INTERPRETER_TILE = (16, 16, 16, 1, 4, 1)  # numpy per op: small tiles, few masked lanes


def launch_config(role: str, rows: int, experts: int, dtype: str = "bfloat16") -> tuple[int, int, int, int, int, int]:
    """(BM, BN, BK, GROUP_M, warps, stages) of GEMM ``role`` for ``rows`` rows over ``experts`` experts; fp32
    operands take half the K depth per step (the same shared memory per pipeline stage as 16-bit ones)."""
    if is_interpreted():
        return INTERPRETER_TILE
    bm, bn, bk, group_m, warps, stages = TUNE[role]["small" if rows < SMALL_GROUP_ROWS * max(experts, 1) else "large"]
    return bm, bn, (max(16, bk // 2) if dtype == "float32" else bk), group_m, warps, stages


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def experts_pad(experts: int) -> int:
    """The counts vector's padded length (a compile-time constant): at least 256 on a GPU, so 32 and 256 experts
    share one compiled kernel (the per-program prefix sum over 256 counts is negligible next to a GEMM tile)."""
    return _pow2(experts) if is_interpreted() else max(256, _pow2(experts))


def dot_precision(tensor: Any) -> str:
    """fp32 operands multiply in IEEE fp32 (not tf32): the reference's precision."""
    return "ieee" if dtype_name(tensor) == "float32" else "tf32"


def check_args(rows: Any, counts: Any, weight1: Any, weight2: Any,
               fn: str = "moe_experts") -> tuple[int, int, int, int]:
    """(N, D, I, E) of rows [N, D], counts [E] int64, weight1 [E, D, 2I], weight2 [E, I, D]; errors name the tensor."""
    if rows.ndim != 2 or dtype_name(rows) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `rows` must be [N, D] float, got {dtype_name(rows)} {shape_of(rows)}")
    n, d = shape_of(rows)
    if weight1.ndim != 3 or shape_of(weight1)[1] != d or shape_of(weight1)[2] % 2:
        raise ValueError(f"{fn}: `weight1` must be [E, {d}, 2I] (gate | up), got {shape_of(weight1)}")
    e, _, two_i = shape_of(weight1)
    if shape_of(weight2) != [e, two_i // 2, d]:
        raise ValueError(f"{fn}: `weight2` must be [{e}, {two_i // 2}, {d}], got {shape_of(weight2)}")
    for name, t in (("weight1", weight1), ("weight2", weight2)):
        if dtype_name(t) != dtype_name(rows):
            raise ValueError(f"{fn}: `{name}` must have the rows' dtype {dtype_name(rows)}, got {dtype_name(t)}")
    if shape_of(counts) != [e] or dtype_name(counts) != "int64":
        raise ValueError(f"{fn}: `counts` must be [{e}] int64 (rows per expert), got {dtype_name(counts)} "
                         f"{shape_of(counts)}")
    if e == 0 or d == 0 or two_i == 0:
        raise ValueError(f"{fn}: experts, D and 2I must be positive, got weight1 {shape_of(weight1)}")
    if n >= 2**31 or d * two_i >= 2**31:
        raise ValueError(f"{fn}: `rows` ({n}) and one expert's weight1 [{d}, {two_i}] must hold fewer than 2**31 "
                         "rows / elements (int32 indices)")
    for name, t in (("rows", rows), ("weight1", weight1), ("weight2", weight2), ("counts", counts)):
        if strides_of(t)[-1] != 1 or (t.ndim == 3 and strides_of(t)[1] != shape_of(t)[2]):
            raise ValueError(f"{fn}: `{name}` must be contiguous, got strides {strides_of(t)}")
    return n, d, two_i // 2, e


def rows_gemm(a: Any, b: Any, counts: Any, out: Any, k: int, n_out: int, b_strides: tuple[int, int, int],
              role: str) -> None:
    """``out[r] = a[r] @ B[e]`` for every segment (``_grouped_rows_mm``); ``B[e][k, n] = b[e*s0 + k*s1 + n*s2]``."""
    n_rows, experts = shape_of(a)[0], shape_of(counts)[0]
    bm, bn, bk, group_m, warps, stages = launch_config(role, n_rows, experts, dtype_name(a))
    grid = ((triton.cdiv(n_rows, bm) + experts) * triton.cdiv(n_out, bn),)
    launch(_grouped_rows_mm, grid, a, b, counts, out, n_rows, k, n_out, experts, strides_of(a)[0], *b_strides,
           strides_of(out)[0], BM=bm, BN=bn, BK=bk, E_PAD=experts_pad(experts), GROUP_M=group_m, EVEN_K=k % bk == 0,
           EVEN_N=n_out % bn == 0, PREC=dot_precision(a), num_warps=warps, num_stages=stages)


def gate_up(rows: Any, counts: Any, weight1: Any, limit: float) -> tuple[Any, Any]:
    """rows [N, D] -> (gate_up [N, 2I], h [N, I]): ``_grouped_gate_up`` alone (one launch)."""
    n_rows, dim = shape_of(rows)
    experts, inter = shape_of(weight1)[0], shape_of(weight1)[2] // 2
    gate_up_out = empty_like(rows, shape=[n_rows, 2 * inter])
    h = empty_like(rows, shape=[n_rows, inter])
    bm, bn, bk, group_m, warps, stages = launch_config("gate_up", n_rows, experts, dtype_name(rows))
    grid = ((triton.cdiv(n_rows, bm) + experts) * triton.cdiv(inter, bn),)
    s1 = strides_of(weight1)
    launch(_grouped_gate_up, grid, rows, weight1, counts, gate_up_out, h, n_rows, dim, inter, experts, float(limit),
           dim, s1[0], s1[1], s1[2], 2 * inter, inter, HAS_LIMIT=float(limit) > 0, BM=bm, BN=bn, BK=bk,
           E_PAD=experts_pad(experts), GROUP_M=group_m, EVEN_K=dim % bk == 0, EVEN_N=inter % bn == 0,
           PREC=dot_precision(rows), num_warps=warps, num_stages=stages)
    return gate_up_out, h


def experts_forward(rows: Any, counts: Any, weight1: Any, weight2: Any, limit: float) -> tuple[Any, Any, Any]:
    """rows [N, D] -> (out [N, D], gate_up [N, 2I], h [N, I]), all in the rows' dtype; 2 launches, no host read.

    ``counts`` [E] int64 on the device: rows per expert, in order (``sum(counts)`` should be N; rows past it
    get zeros, counts past N are cut at N). ``limit`` 0: no clamp.
    """
    n_rows, dim, inter, _ = check_args(rows, counts, weight1, weight2)
    x, w1, w2 = detached(rows), detached(weight1), detached(weight2)
    gate_up_out, h = gate_up(x, counts, w1, limit)
    out = empty_like(rows, shape=[n_rows, dim])
    rows_gemm(h, w2, counts, out, inter, dim, tuple(strides_of(w2)), "down")
    return out, gate_up_out, h
