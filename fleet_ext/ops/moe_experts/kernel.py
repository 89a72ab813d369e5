"""Triton grouped expert GEMMs over expert-sorted rows: gate+up with the clamped SwiGLU epilogue, then down.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this module
imports neither Paddle nor torch. The rows of expert ``e`` are the contiguous segment
``[sum(counts[:e]), sum(counts[:e + 1]))`` of ``rows``; ``counts`` stays on the device (no host read). The tile
map (device-built from ``counts``), the K loops and the TMA descriptors are in ``kernel_tiles.py``:

- **Launch shapes.** One program per output tile (the grid an upper bound on the tiles: ``cdiv(N, BM) + E`` row
  tiles; programs past the real tiles do nothing), or a *persistent* grid (one program per multiprocessor, each
  looping over the tiles, the loop over tiles optionally flattened with the K loop so that the next tile's loads
  overlap this tile's epilogue). Either way every output element is computed by one program in one fixed order,
  so results do not depend on the launch shape's program count.
- **Loads.** TMA tensor descriptors where the tensors allow it (16-byte aligned, see
  ``kernel_tiles.tma_route``), else pointer loads; ``Launch.tma`` chooses. Both paths sum the same products in
  the same order (a K step of ``BK`` at a time, fp32 accumulation).
- **Forward.** ``_grouped_gate_up``: ``gate_up = x_e @ W1[e]`` (one program computes the gate columns
  ``[n, n + BN)`` and the matching up columns ``I + n`` together) and, in the epilogue,
  ``h = silu(min(gate, limit)) * clip(up, -limit, limit)`` from the rounded ``gate_up`` (as the reference
  computes the activation from the stored pre-activation); both are written: ``gate_up`` for the backward,
  ``h`` for the down GEMM. ``_grouped_rows_mm``: ``y_e = h_e @ W2[e]``.
- **Hopper.** For small expert groups the gate+up runs the warp-specialised Gluon kernel of
  ``kernel_gate_up_ws.py`` instead (a TMA loader warp and two MMA warpgroups; same K order, same epilogue: its
  results equal ``_grouped_gate_up``'s byte for byte on the H200), see ``GATE_UP_KERNEL``.
- fp32 accumulation; bf16 / fp16 / fp32 operands (fp32 dots in IEEE fp32, not tf32). The backward is in
  ``kernel_bwd.py``. Launch settings: ``TUNE`` (per GEMM, by the mean rows per expert, a host-side shape fact).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, NamedTuple

import triton
import triton.language as tl

from fleet_ext import capability
from fleet_ext.ops.launch import detached, dtype_name, empty_like, launch, shape_of, strides_of, torch_view
from fleet_ext.ops.moe_experts.kernel_tiles import (
    _gate_up_epilogue,
    _row_loop,
    _row_loop_tma,
    _row_tile,
    _segments,
    count_path,
    descriptor,
    grid_size,
    tma_route,
)

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@triton.jit
def _grouped_gate_up(x_ptr, x_desc, w_ptr, w_desc, counts_ptr, gu_ptr, h_ptr, N, K, INTER, E, limit, sx, sw_e, sw_k,
                     sw_n, s_gu, s_h, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     E_PAD: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                     PREC: tl.constexpr, TMA: tl.constexpr, FLATTEN: tl.constexpr):
    """gate_up[r] = x[r] @ W1[e] (gate columns n and up columns I + n together); h = clamped SwiGLU of it."""
    lanes = _segments(counts_ptr, N, E, BM, E_PAD)
    m_tiles, n_tiles = lanes[7], tl.cdiv(INTER, BN)
    for tile_id in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0), flatten=FLATTEN):
        _, we, row0, read_end, write_end, tile_n = _row_tile(tile_id, lanes, m_tiles, n_tiles, N, E, BM, GROUP_M)
        rows = row0 + tl.arange(0, BM)
        cols = tile_n * BN + tl.arange(0, BN)
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        if TMA:
            acc_g, acc_u = _row_loop_tma(x_desc, w_desc, row0, we, tile_n * BN, K, zero, zero, INTER, True, False,
                                         BN, BK, PREC)
        else:
            acc_g, acc_u = _row_loop(x_ptr, w_ptr + we.to(tl.int64) * sw_e, rows, read_end, cols, K, INTER, sx, sw_k,
                                     sw_n, zero, zero, INTER * sw_n, True, BK, EVEN_K, EVEN_N, PREC)
        _gate_up_epilogue(acc_g, acc_u, rows, cols, read_end, write_end, gu_ptr, h_ptr, INTER, s_gu, s_h, limit,
                          HAS_LIMIT)


@triton.jit
def _grouped_rows_mm(a_ptr, a_desc, b_ptr, b_desc, counts_ptr, out_ptr, N, K, NO, E, sa, sb_e, sb_k, sb_n, s_out,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_PAD: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PREC: tl.constexpr,
                     TMA: tl.constexpr, B_NK: tl.constexpr, FLATTEN: tl.constexpr):
    """out[r] = a[r] @ B[e] for the rows r of expert e (pointers: B[e] by strides; TMA: ``B_NK`` says the
    descriptor holds B[e] transposed, [E, NO, K])."""
    lanes = _segments(counts_ptr, N, E, BM, E_PAD)
    m_tiles, n_tiles = lanes[7], tl.cdiv(NO, BN)
    for tile_id in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0), flatten=FLATTEN):
        _, we, row0, read_end, write_end, tile_n = _row_tile(tile_id, lanes, m_tiles, n_tiles, N, E, BM, GROUP_M)
        rows = row0 + tl.arange(0, BM)
        cols = tile_n * BN + tl.arange(0, BN)
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        if TMA:
            acc, _ = _row_loop_tma(a_desc, b_desc, row0, we, tile_n * BN, K, zero, zero, 0, False, B_NK, BN, BK, PREC)
        else:
            acc, _ = _row_loop(a_ptr, b_ptr + we.to(tl.int64) * sb_e, rows, read_end, cols, K, NO, sa, sb_k, sb_n, zero,
                               zero, 0, False, BK, EVEN_K, EVEN_N, PREC)
        acc = tl.where((rows < read_end)[:, None], acc, 0.0)
        mask = (rows < write_end)[:, None] & (cols < NO)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


def is_interpreted() -> bool:
    return type(_grouped_rows_mm).__name__ == "InterpretedFunction"


class Launch(NamedTuple):
    """One GEMM's launch setting: tile (``bm`` rows x ``bn`` columns, ``bk`` deep per step), ``group_m`` row tiles
    per column sweep, warps, pipeline stages; ``tma``: TMA descriptor loads where the tensors allow them (else
    pointer loads); ``persistent``: 0 one program per tile, 1 one program per multiprocessor looping over the
    tiles, 2 the same with the tile loop flattened into the K loop (the next tile's loads overlap this epilogue)."""

    bm: int
    bn: int
    bk: int
    group_m: int
    warps: int
    stages: int
    tma: bool = False
    persistent: int = 0


# Launch settings (no autotuning): per GEMM, for small expert groups ("small": mean rows per expert <
# SMALL_GROUP_ROWS, e.g. 256 experts x 192 rows) and large ones ("large": 32 experts x 1536 rows). GPU values:
# scripts/bench/bench_moe.py's sweep on the H200 (benchmarks/RESULTS.md, issue 14); d_gate_up's from
# scripts/bench/tune_moe_d_gate_up.py (run 7).
SMALL_GROUP_ROWS = 512
TUNE: dict[str, dict[str, Launch]] = {
    "gate_up": {"small": Launch(128, 128, 64, 8, 8, 4, True, 0), "large": Launch(128, 128, 64, 8, 8, 4, True, 0)},
    "down": {"small": Launch(128, 256, 64, 8, 8, 3, True, 2), "large": Launch(128, 256, 64, 8, 8, 3, True, 2)},
    "d_gate_up": {"small": Launch(128, 256, 64, 8, 8, 4, True, 0), "large": Launch(128, 256, 64, 8, 8, 3, True, 1)},
    "d_rows": {"small": Launch(128, 256, 64, 8, 8, 3, True, 2), "large": Launch(128, 256, 64, 8, 8, 3, True, 2)},
    "d_weight": {"small": Launch(128, 256, 64, 1, 8, 3, True, 2), "large": Launch(128, 256, 64, 1, 8, 3, True, 2)},
}
# fp32 operands (a test path on a GPU: IEEE dots on the FMA pipes) keep d_gate_up's earlier 64 x 128 tile: its
# 128 x 256 tile spills tens of KB per thread there (sm90 compile).
FP32_TUNE: dict[str, Launch] = {"d_gate_up": Launch(64, 128, 64, 8, 4, 4, True, 0)}
INTERPRETER_TILE = (16, 16, 16, 1, 4, 1)  # numpy per op: small tiles, few masked lanes


@contextlib.contextmanager
def launch_overrides(**fields: Any) -> Iterator[None]:
    """Inside the block every GEMM's launch setting (both regimes) has ``fields`` replaced (e.g. ``tma=False``,
    ``persistent=2``): the tests and the bench compare load paths and grid kinds on the same tiles."""
    saved, saved_fp32 = copy.deepcopy(TUNE), dict(FP32_TUNE)
    try:
        for role, regimes in TUNE.items():
            for regime, cfg in regimes.items():
                TUNE[role][regime] = cfg._replace(**fields)
        for role, cfg in saved_fp32.items():
            FP32_TUNE[role] = cfg._replace(**fields)
        yield
    finally:
        TUNE.clear()
        TUNE.update(saved)
        FP32_TUNE.clear()
        FP32_TUNE.update(saved_fp32)


def launch_config(role: str, rows: int, experts: int, dtype: str = "bfloat16") -> Launch:
    """The launch setting of GEMM ``role`` for ``rows`` rows over ``experts`` experts; fp32 operands take half the K
    depth per step (the same shared memory per pipeline stage as 16-bit ones), and the weight gradients' TMA store
    half the columns (its fp32 staging tile would not fit beside the pipeline: 245,776 bytes of shared memory
    asked on the H200 with the bf16 tile). The interpreter takes small tiles and the load path and grid kind of
    the GPU's small-group setting (so the CPU tests run the GPU's code path)."""
    cfg = TUNE[role]["small" if rows < SMALL_GROUP_ROWS * max(experts, 1) else "large"]
    if is_interpreted():
        return Launch(*INTERPRETER_TILE, tma=TUNE[role]["small"].tma, persistent=TUNE[role]["small"].persistent)
    if dtype != "float32":
        return cfg
    cfg = FP32_TUNE.get(role, cfg)
    return cfg._replace(bk=max(16, cfg.bk // 2), bn=cfg.bn // 2 if role == "d_weight" and cfg.tma else cfg.bn)


def row_grid(cfg: Launch, kernel: Any, n_rows: int, experts: int, n_cols: int) -> tuple[int]:
    """Programs of a row-GEMM launch: one per tile of the upper bound ``(cdiv(N, BM) + E) x cdiv(NO, BN)``, or a
    persistent grid."""
    tiles = (triton.cdiv(n_rows, cfg.bm) + experts) * triton.cdiv(n_cols, cfg.bn)
    return (grid_size(cfg.persistent > 0, kernel, tiles),)


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
    """``out[r] = a[r] @ B[e]`` for every segment (``_grouped_rows_mm``); ``B[e][k, n] = b[e*s0 + k*s1 + n*s2]``
    (``s2 == 1``: a weight as stored; ``s1 == 1``: a transposed one)."""
    n_rows, experts = shape_of(a)[0], shape_of(counts)[0]
    cfg = launch_config(role, n_rows, experts, dtype_name(a))
    b_nk = b_strides[2] != 1
    a_desc = b_desc = None
    if cfg.tma and n_rows > 0 and tma_route(_grouped_rows_mm, a, b):
        a_desc = descriptor(a, [cfg.bm, cfg.bk])
        b_desc = descriptor(b, [1, cfg.bn, cfg.bk] if b_nk else [1, cfg.bk, cfg.bn])
    count_path(_grouped_rows_mm, a_desc is not None, cfg.persistent)
    launch(_grouped_rows_mm, row_grid(cfg, _grouped_rows_mm, n_rows, experts, n_out), a, a_desc, b, b_desc, counts,
           out, n_rows, k, n_out, experts, strides_of(a)[0], *b_strides, strides_of(out)[0], BM=cfg.bm, BN=cfg.bn,
           BK=cfg.bk, E_PAD=experts_pad(experts), GROUP_M=cfg.group_m, EVEN_K=k % cfg.bk == 0,
           EVEN_N=n_out % cfg.bn == 0, PREC=dot_precision(a), TMA=a_desc is not None, B_NK=b_nk,
           FLATTEN=cfg.persistent == 2, num_warps=cfg.warps, num_stages=cfg.stages)


# The warp-specialised gate+up (``kernel_gate_up_ws.py``) on Hopper: "auto" where it fits and measured faster (small
# groups: 449 vs 431 TFLOP/s at 256 experts; at 32 experts the Triton kernel's 577 beat its 553-563, H200,
# benchmarks/RESULTS.md), "triton" never, "gluon" always (an error names why it cannot run). Its launch setting: tile
# rows / columns (gate and up each) / K step, row tiles per column sweep, pipeline stages, COOP (both MMA
# warpgroups on one tile, half its rows each; else ping-pong, one tile each, K loops in turn), registers of each
# MMA warpgroup and of the loader warp.
GATE_UP_KERNEL = "auto"
WS_GATE_UP = {"BM": 64, "BN": 128, "BK": 64, "GROUP_M": 8, "STAGES": 4, "COOP": False, "MMA_REGS": 232,
              "LOADER_REGS": 40}


def hopper_dtype(dtype: str) -> str | None:
    """None on a Hopper GPU for bf16/fp16 (what every warp-specialised kernel here needs), else why not."""
    cap = capability.detect()
    if cap.interpreter or not cap.gpu or cap.sm is None or cap.sm[0] != 9:
        return "not a Hopper GPU (sm90)"
    if dtype not in ("bfloat16", "float16"):
        return f"dtype {dtype} (needs bf16/fp16)"
    return None


def hopper_16bit(tensor: Any) -> str | None:
    """:func:`hopper_dtype` of ``tensor``'s dtype."""
    return hopper_dtype(dtype_name(tensor))


def ws_choice(switch: str, name: str, why_not: str | None, n_rows: int, experts: int) -> bool:
    """Whether a warp-specialised kernel runs: ``switch`` "triton" never, "gluon" always (raising with ``why_not``
    when it cannot), "auto" where it fits and the groups are small (where each measured faster than Triton)."""
    if switch == "triton" or n_rows == 0:
        return False
    if switch == "gluon" and why_not is not None:
        raise ValueError(f"moe_experts: {name} = 'gluon' cannot run here: {why_not}")
    return why_not is None and (switch == "gluon" or n_rows < SMALL_GROUP_ROWS * experts)


def gate_up_ws_fits(rows: Any, weight1: Any) -> str | None:
    """None when the warp-specialised gate+up can run this call, else why not (the Triton kernel's reason)."""
    dim, two_i = shape_of(weight1)[1], shape_of(weight1)[2]
    why_not = hopper_16bit(rows)
    if why_not is not None:
        return why_not
    if dim % WS_GATE_UP["BK"] or (two_i // 2) % 8:
        return f"D {dim} not a multiple of {WS_GATE_UP['BK']} or I {two_i // 2} of 8 (TMA tiles of one expert)"
    if not tma_route(_grouped_gate_up, rows, weight1):
        return "tensors TMA cannot address (16-byte aligned torch tensors needed)"
    return None


def use_ws_gate_up(rows: Any, weight1: Any) -> bool:
    """Whether ``gate_up`` runs the warp-specialised kernel on these tensors (``GATE_UP_KERNEL``)."""
    why_not = gate_up_ws_fits(rows, weight1) if GATE_UP_KERNEL != "triton" else None
    return ws_choice(GATE_UP_KERNEL, "kernel.GATE_UP_KERNEL", why_not, shape_of(rows)[0], shape_of(weight1)[0])


def _launch_ws_gate_up(rows: Any, counts: Any, weight1: Any, gate_up_out: Any, h: Any, limit: float) -> None:
    from fleet_ext.ops.moe_experts.kernel_gate_up_ws import _gate_up_ws_kernel

    n_rows, dim = shape_of(rows)
    experts, two_i = shape_of(weight1)[0], shape_of(weight1)[2]
    cfg = WS_GATE_UP
    x_desc = descriptor(rows, [cfg["BM"], cfg["BK"]], gluon=True)
    w_desc = descriptor(torch_view(weight1).reshape(experts * dim, two_i), [cfg["BK"], cfg["BN"]], gluon=True)
    tiles = (triton.cdiv(n_rows, cfg["BM"]) + experts) * triton.cdiv(two_i // 2, cfg["BN"])
    count_path(_gate_up_ws_kernel, True, 1)
    launch(_gate_up_ws_kernel, (grid_size(True, _grouped_gate_up, tiles),), x_desc, w_desc, counts, gate_up_out, h,
           n_rows, dim, two_i // 2, experts, float(limit), two_i, two_i // 2, HAS_LIMIT=float(limit) > 0,
           E_PAD=experts_pad(experts), num_warps=4, **cfg)


def gate_up(rows: Any, counts: Any, weight1: Any, limit: float) -> tuple[Any, Any]:
    """rows [N, D] -> (gate_up [N, 2I], h [N, I]): one launch, the warp-specialised kernel on Hopper
    (``GATE_UP_KERNEL``), else ``_grouped_gate_up``."""
    n_rows, dim = shape_of(rows)
    experts, inter = shape_of(weight1)[0], shape_of(weight1)[2] // 2
    gate_up_out = empty_like(rows, shape=[n_rows, 2 * inter])
    h = empty_like(rows, shape=[n_rows, inter])
    if use_ws_gate_up(rows, weight1):
        _launch_ws_gate_up(rows, counts, weight1, gate_up_out, h, limit)
        return gate_up_out, h
    cfg = launch_config("gate_up", n_rows, experts, dtype_name(rows))
    s1 = strides_of(weight1)
    x_desc = w_desc = None  # the up columns start at I: TMA wants I * element size a multiple of 16 bytes too
    if cfg.tma and n_rows > 0 and inter * rows.element_size() % 16 == 0 and tma_route(_grouped_gate_up, rows,
                                                                                       weight1):
        x_desc, w_desc = descriptor(rows, [cfg.bm, cfg.bk]), descriptor(weight1, [1, cfg.bk, cfg.bn])
    count_path(_grouped_gate_up, x_desc is not None, cfg.persistent)
    launch(_grouped_gate_up, row_grid(cfg, _grouped_gate_up, n_rows, experts, inter), rows, x_desc, weight1, w_desc,
           counts, gate_up_out, h, n_rows, dim, inter, experts, float(limit), dim, s1[0], s1[1], s1[2], 2 * inter,
           inter, HAS_LIMIT=float(limit) > 0, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, E_PAD=experts_pad(experts),
           GROUP_M=cfg.group_m, EVEN_K=dim % cfg.bk == 0, EVEN_N=inter % cfg.bn == 0, PREC=dot_precision(rows),
           TMA=x_desc is not None, FLATTEN=cfg.persistent == 2, num_warps=cfg.warps, num_stages=cfg.stages)
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
