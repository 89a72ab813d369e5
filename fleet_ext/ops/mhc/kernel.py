"""Triton mHC: the pre op (projection, RMS statistics, gates, Sinkhorn, collapse) and the post combine.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this module
imports neither Paddle nor torch. Device code: ``kernel_fwd.py``, ``kernel_bwd.py``.

**Kernel boundaries, and why.** mHC is memory bound on the streams X [T, n, D] (n D = 16384 values per token
in V4-Flash); everything else per token is tiny (24 mixing logits, an n x n matrix).

- *pre forward*, two kernels. ``_mhc_proj_fwd``: the projection ``x @ fn^T`` and ``sum(x^2)`` in one pass over
  the streams, split over K = n D as well as over tokens (``SPLITS`` partial sums per token: a grid of many more
  programs than token blocks, each reading its part of the rows once, ``fn`` staying in L2). ``_mhc_pre_fwd``: per
  token block, the splits summed in a fixed order, the RMS factor, the gates and the 20 Sinkhorn iterations in
  registers, then the collapse ``sum_j pre_j X_j``, the second pass over the streams (the collapse needs the
  gates, which need the whole row's projection). The fp32 and normalised copies of X that the unfused path
  materialises never exist. The head (``mhc_head``) runs the same two kernels without post / Sinkhorn.
- *combine forward* (``_mhc_combine_fwd``): ``X'_k = post_k f + sum_j comb[j, k] X_j`` on [tokens, D] tiles:
  one read of X and f, one write of X'. It cannot join the pre kernels: the attention or MLP block runs between.
- *pre backward*, four kernels (three with ``gates`` SPLIT 0, the interpreter's default). ``_mhc_gates_bwd``: in
  one grid, ``g_pre`` (a pass over X and ``g_y``, bandwidth-bound) and the post gate's and Sinkhorn's backward
  (latency-bound; its 2 ITERS - 1 states kept in registers, ``STATES`` 2; stored once to a scratch buffer, 1; or
  recomputed per step, 0), so that each kind of program runs beside the other. ``_mhc_pre_bwd`` per token block:
  the pre gate's backward, then per token what the streams' gradient needs (``G = g_mix r``, a scalar, the pre
  gate) and the block's sums for ``g_base`` / ``g_scale`` (with SPLIT 0 it runs the pass and the Sinkhorn's
  backward first).
  ``_mhc_dx_bwd``: one channel tile of one stream (``fn``'s slab loaded once) over a run of tokens, in order: the
  streams' gradient (the second pass over X) and that run's share of ``g_fn = G^T X`` (``SPLITS`` runs), accumulated
  as ``X^T G`` so that both products are Hopper warp-group MMAs. ``_mhc_params_bwd``: the shares of ``g_fn`` and the
  blocks' sums added in a fixed order.
- *combine backward* (``_mhc_combine_bwd``): BT tokens per program (1 on a GPU) over all their channels: one
  read of X, the output gradient and f, one write of ``g_x`` and ``g_f``; ``g_post`` and ``g_comb`` (sums over
  D) are summed inside each thread across the channel tiles and across threads once at the end, in order.
- *On Hopper* (``GLUON``, bf16 streams, n = 4) the projection and the streams' gradient run as Gluon kernels
  (``kernel_proj_gluon.py`` after ``_mhc_fn_pieces`` has split ``fn`` once; ``kernel_dx_streams.py``, two streams'
  channel tile per program, or ``kernel_dx_gluon.py``, one, as ``GPU_CONFIG["dx_gluon"]["SPP"]`` says): the same
  boundaries and products as warp-group MMAs, their operands staged by ``cp.async``, each tile's A operand read
  from shared memory once into registers (the reasons and the H200 timings are in those modules).

Deterministic: every sum has one fixed order for a given launch geometry (no atomics), so results are
byte-identical run to run.

**Accuracy.** All maths in fp32; the outputs round once to the streams' dtype. The tile products keep fp32
accuracy (``split_dot._dot``): the interpreter multiplies in fp32 (numpy); on a GPU, products with the bf16
streams run as three bf16 tensor-core products of the other operand's bf16 pieces (the streams are exact in
bf16), other products as three TF32 products (``tf32x3``), each tile's products in a fresh accumulator added to
the running sum in fp32. The streams' gradient's ``G @ fn`` with bf16 streams takes the three largest bf16
products of both operands' pieces (~2^-16 relative, far under the bf16 rounding of that gradient); fp32 streams
keep ``tf32x3``. Not bitwise equal to the Paddle reference (other summation orders, the norm applied after the
projection: ``(x @ fn^T) * r`` instead of ``(x * r) @ fn^T``, numpy's / the GPU's ``exp``): the tolerance is the
registry's, held by ``tests/single_card_tests/test_fusion_mhc.py`` and ``tests/gpu/test_mhc_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import triton

from fleet_ext import capability
from fleet_ext.ops.buffers import Scratch, device_key, maker
from fleet_ext.ops.launch import Plan, dtype_name, empty_like, fire, is_paddle, layout_key, plan_cache, shape_of
from fleet_ext.ops.mhc.kernel_bwd import _mhc_combine_bwd, _mhc_dx_bwd, _mhc_gates_bwd, _mhc_params_bwd, _mhc_pre_bwd
from fleet_ext.ops.mhc.kernel_dx_gluon import _mhc_dx_gluon
from fleet_ext.ops.mhc.kernel_dx_streams import _mhc_dx_streams
from fleet_ext.ops.mhc.kernel_fwd import _mhc_combine_fwd, _mhc_fn_pieces, _mhc_pre_fwd, _mhc_proj_fwd
from fleet_ext.ops.mhc.kernel_proj_gluon import _mhc_proj_gluon
from fleet_ext.ops.split_dot import DOT_BF16X3, DOT_BF16X3_ROUNDED, DOT_BF16X6, DOT_IEEE, DOT_TF32X3

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("_mhc_proj_fwd", "_mhc_fn_pieces", "_mhc_proj_gluon", "_mhc_pre_fwd", "_mhc_combine_fwd", "_mhc_gates_bwd",
           "_mhc_pre_bwd", "_mhc_dx_bwd", "_mhc_dx_gluon", "_mhc_dx_streams", "_mhc_params_bwd", "_mhc_combine_bwd")

# GPU launch geometry per kernel (tokens per program BT, channel tiles BK / BD, the number of splits of K or of
# the tokens SPLITS, warps, software-pipelining stages; STATES / PIECES: kernel_bwd) and the product modes; TUNE
# overrides any key without editing the module (the benchmark's sweep). Each value is the fastest of the H200
# sweeps of 2026-12-01 (benchmarks/RESULTS.md, fused mHC). Forward: 391 us at the first run's defaults, 373 with
# proj BT 256, 373 with pre_fwd (4, 512, 8 warps). Pre backward (the op, three kernels): 1054 us with pre_bwd
# (8, 256, 4 warps), 985 with (32, 256, 8 warps); then 852 with dx on G's pre-split pieces (PIECES; 1037 without),
# dx's other geometries 864-1394, pre_bwd's 870-947 (STATES 0, the recomputed Sinkhorn states: 947); run 6: dx BT
# 32, 4 stages, at most 128 registers (43 KB of shared memory: four programs per SM, not three) 851 -> 803 us; run 7:
# dx PREFETCH (g_y a tile ahead) with 3 stages 826 -> 778 (with 4 stages it spills: 1008); run 8: the Gluon dx
# (``dx_gluon``, Hopper, bf16, n = 4) 777 -> 684, its 2 / 4 stages 689 / 707, 128 channels on 8 warps 704; run 9:
# the Gluon projection (``proj_gluon``) makes the forward 354 -> 342 us, 333 with 4 splits (3 / 6 stages 344 / 369,
# 64 tokens on 4 warps 347, 16 splits 353); run 10: the pre backward's pass and Sinkhorn backward in one grid
# (``gates`` SPLIT, 16-token Sinkhorn blocks) and its tail in 128-token blocks: 236 + 25 -> 210 + 5 + 9 us of kernels
# (the pass alone 155, the Sinkhorn backward alone 78; states loaded three steps ahead: no gain; the Sinkhorn
# programs interleaved with the pass's, INTERLEAVE: 1.3 %, under the margin); run 12: dx_gluon's A operands in
# registers and pre / coef on its cp.async ring, 414 -> 349 us (ncu), proj_gluon's tile as a register A operand
# 162 -> 150 us (ncu); the Sinkhorn backward's tiles within a warp (kernel_bwd._logit_grads) 210 -> 189 us (ncu);
# one token's Sinkhorn per thread in the gates grid (SINKHORN_BT 256, 80 registers) 210 -> 228 us, the pass on 4
# warps (BT 1 or 2) no gain; run 13: the Sinkhorn states in registers (``pre_bwd`` STATES 2, gates maxnreg 80)
# 187.5 -> 168.8 us of the gates kernel, the pre backward op 555-584 -> 540-569 us (STATES 1; 0: 596-609); run 16:
# the streams' gradient two streams per program (``kernel_dx_streams.py``, SPP 2 at 168 registers: g_y and G's
# pieces read from L2 half as often), the pre backward op 542.0 / 583.5 / 561.3 -> 517.2 / 528.5 / 532.1 us in three
# paired rounds (4 streams on 2 stages 562-563, 2 streams on 2 stages 562-563, with 16 splits 537-548). Combine
# backward: 449 us at one token and 4 warps per program, its variants 452-497; its BD is a multiple of
# 32 x num_warps x the 16-byte vector, which its layout needs (``kernel_bwd._mhc_combine_bwd``).
GPU_CONFIG: dict[str, dict[str, int]] = {
    "proj": {"BT": 256, "BK": 64, "SPLITS": 8, "num_warps": 8},
    "proj_gluon": {"BT": 128, "BK": 64, "SPLITS": 4, "STAGES": 4, "num_warps": 8},
    "pre_fwd": {"BT": 4, "BD": 512, "num_warps": 8},
    "pre_bwd": {"BT": 128, "BD": 256, "num_warps": 8, "STATES": 2},
    # maxnreg: with the Sinkhorn states in registers its branch would take 162 (one program per SM); at 80 it spills
    # 32 bytes there (sm90 compile) and the pass keeps its 74, three programs per SM
    "gates": {"SPLIT": 1, "BT": 4, "BD": 512, "num_warps": 8, "PREFETCH": 1, "LANES": 1, "SINKHORN_BT": 16,
              "INTERLEAVE": 0, "maxnreg": 80},
    "dx": {"BT": 32, "BD": 64, "SPLITS": 8, "num_warps": 4, "num_stages": 3, "maxnreg": 128, "PIECES": 1,
           "PREFETCH": 1},
    # SPP: streams per program (1: kernel_dx_gluon; 2 or 4: kernel_dx_streams, whose SPP 2 takes 210 registers
    # unbounded and 168 without spilling: two programs per SM either way, bounded by shared memory)
    "dx_gluon": {"BT": 32, "BD": 64, "SPLITS": 8, "STAGES": 3, "num_warps": 4, "SPP": 2, "maxnreg": 168},
    "params": {"BLOCK": 1024, "BB": 64, "num_warps": 4},
    "combine_fwd": {"BT": 4, "BD": 512, "num_warps": 8},
    "combine_bwd": {"BT": 1, "VECS": 1, "num_warps": 4},
}
# Launch geometries the H200 sweep times against the defaults (scripts/bench/bench_mhc.py, one kernel changed at a
# time) and the GPU tests hold to the defaults' tolerances (tests/gpu/test_mhc_gpu.py), so that any of them can
# become a default on the sweep's word. ``pre_bwd`` STATES 1 stores the Sinkhorn states to a scratch buffer, 0
# recomputes them (the same bytes as keeping them in registers).
GEOMETRY_VARIANTS: tuple[dict[str, dict[str, int]], ...] = (
    {"proj": {}},  # the Triton projection at its defaults (a "proj" entry selects it)
    *({"proj_gluon": c} for c in ({"STAGES": 3}, {"STAGES": 6}, {"BT": 64, "num_warps": 4}, {"SPLITS": 8},
                                  {"SPLITS": 2})),
    *({"dx": c} for c in ({"PIECES": 0}, {"PREFETCH": 0}, {"num_stages": 2}, {"num_stages": 4},
                          {"SPLITS": 4}, {"SPLITS": 16}, {"BD": 128, "num_warps": 8, "num_stages": 2},
                          {"BT": 128, "num_warps": 8, "num_stages": 2},
                          # register caps (``maxnreg``): 128 fits four programs per SM, 168 three; BT 64 puts G @ fn
                          # on warp-group MMAs too
                          {"maxnreg": 168}, {"maxnreg": 168, "PREFETCH": 0},
                          {"BT": 64, "maxnreg": 168},
                          {})),  # {}: the Triton kernel at its defaults (a "dx" entry selects it)
    # one stream per program (``kernel_dx_gluon.py``, run 8-15's default) and its best variant; four streams (255
    # registers, 56 bytes of spill in the sm90 compile; at the default's 168 it spills far more: 1012 us, run 16); the
    # default's register cap lifted (210), 2 stages, 4 and 16 splits
    *({"dx_gluon": c} for c in ({"SPP": 1}, {"SPP": 1, "SPLITS": 4}, {"SPP": 4, "STAGES": 2, "maxnreg": 255},
                                {"maxnreg": 232}, {"STAGES": 2}, {"SPLITS": 4}, {"SPLITS": 16})),
    # pre_bwd: with gates SPLIT (the default) only its tail (the pre gate's part, G, coef, the blocks' sums)
    *({"pre_bwd": c} for c in ({"STATES": 1}, {"STATES": 0}, {"BT": 32}, {"BT": 64, "num_warps": 4})),
    # gates: the first pass and the Sinkhorn backward in one grid (``kernel_bwd._mhc_gates_bwd``); SPLIT 0: both in
    # _mhc_pre_bwd, one after the other per token block (its own run-9 geometry)
    *({"gates": c} for c in ({"INTERLEAVE": 1}, {"INTERLEAVE": 1, "SINKHORN_BT": 32}, {"SINKHORN_BT": 32},
                             {"SINKHORN_BT": 8}, {"BT": 2, "BD": 1024}, {"LANES": 0},
                             {"PREFETCH": 0}, {"BT": 8, "BD": 256, "num_warps": 4})),
    {"gates": {"SPLIT": 0}, "pre_bwd": {"BT": 32, "STATES": 1}},
    *({"combine_bwd": c} for c in ({"num_warps": 8}, {"BT": 2})),
)
# Tile products (``split_dot._dot``): with one bf16-exact operand, the streams ("dot": "bf16x3" or "tf32x3"),
# and with two fp32 operands, the streams' gradient's G @ fn ("gx": "tf32x3" or "bf16x6", fp32 accuracy, or
# "bf16x3", ~2^-16 relative, taken only where that gradient is rounded to bf16: fp32 streams get "tf32x3").
PRODUCTS = {"dot": "bf16x3", "gx": "bf16x3"}
TUNE: dict[str, Any] = {}  # e.g. {"proj": {"SPLITS": 4}, "dot": "tf32x3"}
# The projection and the streams' gradient: "auto" runs the Gluon kernels (``kernel_proj_gluon.py``,
# ``kernel_dx_gluon.py``) where ``gluon_fits`` says they can, else the Triton ones (``kernel_fwd._mhc_proj_fwd``,
# ``kernel_bwd._mhc_dx_bwd``); "triton" / "gluon" force one kind ("gluon" raises where it cannot run). Under "auto" a
# ``TUNE["proj"]`` / ``TUNE["dx"]`` entry (a geometry of the Triton kernel, the sweep's) selects that Triton kernel.
GLUON = "auto"
# launch-geometry keys the host uses (not kernel meta-parameters)
HOST_KEYS = ("SPLITS", "VECS", "PIECES", "SPLIT", "INTERLEAVE", "SPP")
COMPILER_KEYS = ("num_warps", "num_stages", "maxnreg")  # what the interpreter has no use for


def is_interpreted() -> bool:
    return type(_mhc_pre_fwd).__name__ == "InterpretedFunction"


def _float32_of(t: Any) -> Any:
    """fp32 in the framework of ``t`` (imported lazily: this module imports no framework)."""
    if is_paddle(t):
        import paddle

        return paddle.float32
    import torch

    return torch.float32


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def _config(kind: str, n: int, d: int) -> dict[str, int]:
    """The launch geometry of ``kind`` for n streams of width d (the interpreter: large tiles, numpy pays per op)."""
    if is_interpreted():
        width = min(_pow2(d), 256)
        cfg = {"proj": {"BT": 128, "BK": min(_pow2(n * d), 1024), "SPLITS": 1},
               "pre_fwd": {"BT": 128, "BD": width}, "pre_bwd": {"BT": 128, "BD": width, "STATES": 2},
               "gates": {"SPLIT": 0, "BT": 128, "BD": width, "PREFETCH": 0, "LANES": 0, "SINKHORN_BT": 128,
                         "INTERLEAVE": 0},
               "dx": {"BT": 128, "BD": width, "SPLITS": 1, "PIECES": 1, "PREFETCH": 1},
               "params": {"BLOCK": 4096, "BB": 64},
               "combine_fwd": {"BT": 64, "BD": width}, "combine_bwd": {"BT": 64, "BD": width, "V": 4}}[kind]
        return {**cfg, **{k: v for k, v in TUNE.get(kind, {}).items() if k not in COMPILER_KEYS}}
    cfg = {**GPU_CONFIG[kind], **TUNE.get(kind, {})}
    for key in ("BK", "BD"):  # never wider than the row (masks cover the rest); tl.dot wants >= 16
        if key in cfg:
            cfg[key] = min(cfg[key], _pow2(n * d if key == "BK" else d))
    return cfg


def _meta(cfg: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in cfg.items() if k not in HOST_KEYS}


def gluon_fits(tensors: tuple, no: int, exact_products: bool, width: int, tile: int) -> str | None:
    """None when a Gluon kernel of this module can run this call, else why not: a Hopper GPU, bf16 streams with the
    bf16-piece products, a mix width padded to 32 (n = 4), whole tiles of ``width`` and 16-byte aligned rows."""
    cap = capability.detect()
    if cap.interpreter or not cap.gpu or cap.sm is None or cap.sm[0] != 9:
        return "not a Hopper GPU (sm90)"
    if dtype_name(tensors[0]) != "bfloat16" or not exact_products:
        return "not bf16 streams with bf16-piece products"
    if no != 32:
        return f"mix width padded to {no} (needs 32: n = 4)"
    if width % tile:
        return f"width {width} not a multiple of the tile {tile}"
    if not all(map(_aligned, tensors)):
        return "rows not 16-byte aligned (cp.async copies 16 bytes)"
    return None


def _use_gluon(kind: str, fn: str, tensors: tuple, no: int, exact_products: bool, width: int) -> bool:
    """Whether ``kind`` ("proj" / "dx") runs its Gluon kernel (``GLUON``); "gluon" raises naming why it cannot."""
    if GLUON == "triton" or (GLUON == "auto" and kind in TUNE):
        return False
    if is_interpreted():
        why_not = "the Triton interpreter"
    else:
        tile = _config(f"{kind}_gluon", 1, width)["BK" if kind == "proj" else "BD"]
        why_not = gluon_fits(tensors, no, exact_products, width, tile)
    if GLUON == "gluon" and why_not is not None:
        raise ValueError(f"{fn}: GLUON = 'gluon' cannot run here: {why_not}")
    return why_not is None


def _split(total: int, splits: int, tile: int) -> tuple[int, int]:
    """``(per, count)``: ``total`` cut into ``count`` <= ``splits`` runs of ``per`` (a multiple of ``tile``)."""
    per = triton.cdiv(triton.cdiv(total, max(1, splits)), tile) * tile
    return per, triton.cdiv(total, per)


def _products(x: Any) -> tuple[int, int]:
    """``(DOT, GX)``: how tile products keep fp32 accuracy here (``split_dot._dot``)."""
    if is_interpreted():
        return DOT_IEEE, DOT_IEEE
    modes = {**PRODUCTS, **{k: TUNE[k] for k in PRODUCTS if k in TUNE}}
    if modes["dot"] not in ("tf32x3", "bf16x3") or modes["gx"] not in ("tf32x3", "bf16x6", "bf16x3"):
        raise ValueError(f"mhc: TUNE['dot'] must be 'tf32x3' or 'bf16x3' and TUNE['gx'] 'tf32x3', 'bf16x6' or "
                         f"'bf16x3', got {modes['dot']!r} / {modes['gx']!r}")
    exact = dtype_name(x) == "bfloat16"  # the streams are one operand: exact in bf16, and g_x is rounded to bf16
    dot = DOT_BF16X3 if modes["dot"] == "bf16x3" and exact else DOT_TF32X3
    gx = {"tf32x3": DOT_TF32X3, "bf16x6": DOT_BF16X6, "bf16x3": DOT_BF16X3_ROUNDED if exact else DOT_TF32X3}
    return dot, gx[modes["gx"]]


def _check(t: Any, name: str, shape: list[int], dtypes: tuple[str, ...], fn: str) -> None:
    if shape_of(t) != shape or dtype_name(t) not in dtypes:
        raise ValueError(f"{fn}: `{name}` must be {'/'.join(dtypes)} {shape} (contiguous), got {dtype_name(t)} "
                         f"{shape_of(t)}")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: `{name}` must be contiguous")


def _check_streams(x: Any, fn: str) -> tuple[int, int, int]:
    if len(shape_of(x)) != 3 or dtype_name(x) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `streams` must be [T, n, D] float ({', '.join(FLOAT_DTYPES)}), got "
                         f"{dtype_name(x)} {shape_of(x)}")
    t, n, d = shape_of(x)
    _check(x, "streams", [t, n, d], FLOAT_DTYPES, fn)
    return t, n, d


def _check_params(fn_w: Any, base: Any, scale: Any, n: int, d: int, head: bool, fn: str) -> int:
    nout = n if head else (2 + n) * n
    _check(fn_w, "fn", [nout, n * d], ("float32",), fn)
    _check(base, "base", [nout], ("float32",), fn)
    _check(scale, "scale", [1 if head else 3], ("float32",), fn)
    return nout


def _common(n: int, d: int, nout: int, head: bool, iterations: int) -> dict[str, Any]:
    """Shape constants; ``NO`` (the padded mix width) keeps a spare column past NOUT (the projection's squares)."""
    return {"N": n, "P": triton.next_power_of_2(n), "D": d, "NOUT": nout, "NO": _pow2(nout + 1),
            "ITERS": int(iterations), "HEAD": bool(head)}


def _fn_pieces_plan(nout: int, k: int, no: int) -> Plan:
    return Plan((no, triton.cdiv(k, 1024)), (k,), dict(NOUT=nout, NO=no, BLOCK=1024))


def fn_pieces(fn_w: Any, no: int, like: Any) -> Any:
    """``fn`` [NOUT, K] fp32 as its three bf16 pieces [3, no, K] (hi, mid, lo; rows past NOUT zero), in the dtype of
    ``like`` (the streams): the Gluon projection's operand, made once per call."""
    nout, k = shape_of(fn_w)
    pieces = empty_like(like, shape=[3, no, k])
    fire(_mhc_fn_pieces, _fn_pieces_plan(nout, k, no), fn_w, pieces)
    return pieces


# Launch plans per layout (``fleet_ext.ops.launch``, issue 16 §4): a call checks its arguments and decides kernels,
# geometry and buffers once per key; a repeat call looks the plan up, makes its outputs and its scratch (one
# allocation per dtype, ``fleet_ext.ops.buffers``) and fires the bound launches. The key holds every tensor's
# layout, the device, the scalars, ``GLUON``, ``TUNE`` and whether the rows the Gluon kernels copy are 16-byte
# aligned; after changing ``GPU_CONFIG`` or ``PRODUCTS`` by hand call ``launch.clear_plans()``.
_FWD_PLANS = plan_cache("mhc pre")
_BWD_PLANS = plan_cache("mhc pre (backward)")
_COMBINE_PLANS = plan_cache("mhc combine")


def _tuning() -> tuple:
    return GLUON, repr(TUNE) if TUNE else ""


def _aligned(t: Any) -> bool:
    return int(t.data_ptr()) % 16 == 0


class _PrePlan:
    """The pre forward's launches and the makers of its outputs and scratch for one key."""

    __slots__ = ("splits", "gluon", "fn_pieces", "proj", "pre", "new_mix", "new_r", "new_post", "new_comb", "new_y",
                 "new_part", "new_fn_pieces")


def _plan_pre_forward(key: tuple, x: Any, fn_w: Any, base: Any, scale: Any, iterations: int, eps: float,
                      norm_eps: float, head: bool) -> _PrePlan:
    t, n, d = _check_streams(x, "mhc_pre")
    nout = _check_params(fn_w, base, scale, n, d, head, "mhc_pre")
    plan = _PrePlan()
    f32 = _float32_of(x)
    common = _common(n, d, nout, head, iterations)
    no = common["NO"]
    dot, _ = _products(x)
    plan.gluon = _use_gluon("proj", "mhc_pre", (x,), no, dot == DOT_BF16X3, n * d) if t > 0 else False
    cfg = _config("proj_gluon" if plan.gluon else "proj", n, d)
    per, plan.splits = _split(n * d, cfg["SPLITS"], cfg["BK"])
    grid = (triton.cdiv(t, cfg["BT"]), plan.splits) if t > 0 else None
    meta = dict(N=n, D=d, NOUT=nout, NO=no, **_meta(cfg), **({} if plan.gluon else {"DOT": dot}))
    plan.fn_pieces = _fn_pieces_plan(nout, n * d, no) if plan.gluon else None
    plan.proj = Plan(grid, (t, per), meta)
    plan.new_mix, plan.new_r, plan.new_y = maker(x, [t, nout], f32), maker(x, [t], f32), maker(x, [t, d])
    plan.new_post = None if head else maker(x, [t, n], f32)
    plan.new_comb = None if head else maker(x, [t, n, n], f32)
    plan.new_part = maker(x, [plan.splits, t, no], f32)
    plan.new_fn_pieces = maker(x, [3, no, n * d]) if plan.gluon else None
    cfg = _config("pre_fwd", n, d)
    plan.pre = Plan((triton.cdiv(t, cfg["BT"]),) if t > 0 else None, (t, plan.splits, float(eps), float(norm_eps)),
                    dict(**common, DOWNCAST=dtype_name(x) != "float32", **_meta(cfg)))
    return _FWD_PLANS.add(key, plan)


def pre_forward(x: Any, fn_w: Any, base: Any, scale: Any, iterations: int, eps: float, norm_eps: float,
                head: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    """``(post [T, n], comb [T, n, n], y [T, D], mix [T, NOUT], r [T])`` for streams ``x`` [T, n, D]; fp32 except
    ``y`` (x's dtype). With ``head``: the final collapse (``post``, ``comb`` are None; fn [n, nD], scale [1])."""
    key = (layout_key(x), layout_key(fn_w), layout_key(base), layout_key(scale), iterations, eps, norm_eps, head,
           device_key(x), _aligned(x), _tuning())
    plan = _FWD_PLANS.get(key) or _plan_pre_forward(key, x, fn_w, base, scale, iterations, eps, norm_eps, head)
    mix, r, y = plan.new_mix(), plan.new_r(), plan.new_y()
    post, comb = (None, None) if head else (plan.new_post(), plan.new_comb())
    if plan.pre.grid is None:  # no tokens
        return post, comb, y, mix, r
    part = plan.new_part()
    if plan.gluon:  # fn's bf16 pieces once, then the projection on warp-group MMAs
        pieces = plan.new_fn_pieces()
        fire(_mhc_fn_pieces, plan.fn_pieces, fn_w, pieces)
        fire(_mhc_proj_gluon, plan.proj, x, pieces, part)
    else:
        fire(_mhc_proj_fwd, plan.proj, x, fn_w, part)
    fire(_mhc_pre_fwd, plan.pre, x, part, base, scale, mix, r, mix if head else post, mix if head else comb, y)
    return post, comb, y, mix, r


class _PreBwdPlan:
    """The pre backward's launches and the makers of its gradients and scratch for one key."""

    __slots__ = ("splits", "states", "split", "pieces", "gluon", "gates", "pre", "dx", "params", "new_g_x", "new_g_fn",
                 "new_g_base", "new_g_scale", "scratch", "new_g_pieces", "dx_kernel")


def _plan_pre_backward(key: tuple, x: Any, fn_w: Any, base: Any, scale: Any, mix: Any, r: Any, d_post: Any,
                       d_comb: Any, d_y: Any, iterations: int, eps: float, head: bool) -> _PreBwdPlan:
    fn = "mhc_pre (backward)"
    t, n, d = _check_streams(x, fn)
    nout = _check_params(fn_w, base, scale, n, d, head, fn)
    _check(d_y, "d_y", [t, d], (dtype_name(x),), fn)
    _check(mix, "mix", [t, nout], ("float32",), fn)
    _check(r, "r", [t], ("float32",), fn)
    if not head:
        _check(d_post, "d_post", [t, n], ("float32",), fn)
        _check(d_comb, "d_comb", [t, n, n], ("float32",), fn)
    plan = _PreBwdPlan()
    common = _common(n, d, nout, head, iterations)
    f32, no, p = _float32_of(x), common["NO"], common["P"]
    cfg = _config("pre_bwd", n, d)
    blocks = triton.cdiv(t, cfg["BT"])
    dot, gx = _products(x)
    plan.gluon = t > 0 and _use_gluon("dx", fn, (x, d_y), no, dot == DOT_BF16X3 and gx == DOT_BF16X3_ROUNDED, d)
    cfg_dx = _config("dx_gluon" if plan.gluon else "dx", n, d)
    per, plan.splits = _split(t, cfg_dx["SPLITS"], cfg_dx["BT"]) if t > 0 else (1, 0)
    plan.pieces = plan.gluon or (dot == DOT_BF16X3 and gx in (DOT_BF16X6, DOT_BF16X3_ROUNDED)
                                 and bool(cfg_dx["PIECES"]))
    plan.states = int(cfg["STATES"]) if not head and iterations > 1 else 0  # kernel_bwd: 2 registers, 1 scratch
    cfg_gates = _config("gates", n, d)
    plan.split = bool(cfg_gates["SPLIT"])
    plan.new_g_x, plan.new_g_fn = maker(x, [t, n, d]), maker(x, [nout, n * d], f32)
    plan.new_g_base, plan.new_g_scale = maker(x, [nout], f32), maker(x, [1 if head else 3], f32)
    # fp32 scratch, in the order pre_backward unpacks it: the blocks' sums, the shares of g_fn, then per token dz,
    # coef, pre, d_pre (SPLIT), G (unless in bf16 pieces) and the Sinkhorn states (STATES 1); an unused one is a
    # 16-byte stand-in the kernels never touch, last so that the default's buffers keep the larger alignments
    states = t * (2 * iterations - 1) * p * p if plan.states == 1 else 0
    plan.scratch = Scratch(x, [max(blocks, 1) * 2 * no, max(plan.splits, 1) * no * n * d, t * nout, t, t * p,
                               t * p if plan.split else 0, 0 if plan.pieces else t * no, states], f32)
    plan.new_g_pieces = maker(x, [3, t, no]) if plan.pieces and t > 0 else None
    plan.gates = plan.pre = plan.dx = None
    if t > 0:
        if plan.split:
            sinkhorn_blocks = 0 if head else triton.cdiv(t, cfg_gates["SINKHORN_BT"])
            programs = sinkhorn_blocks + triton.cdiv(t, cfg_gates["BT"])
            every = programs // sinkhorn_blocks if cfg_gates["INTERLEAVE"] and sinkhorn_blocks else 1
            plan.gates = Plan((programs,), (t, float(eps), sinkhorn_blocks),
                              dict(N=n, P=p, D=d, NOUT=nout, ITERS=iterations, HEAD=bool(head), STATES=plan.states,
                                   EVERY=every, **_meta(cfg_gates)))
        plan.pre = Plan((blocks,), (t, float(eps)), dict(**common, **_meta({**cfg, "STATES": plan.states}),
                                                         PIECES=plan.pieces, SPLIT=plan.split))
        meta = dict(N=n, P=p, D=d, NOUT=nout, NO=no, **_meta(cfg_dx))
        if not plan.gluon:
            meta.update(GX=gx, DOT=dot, DOWNCAST=dtype_name(x) != "float32", PIECES=plan.pieces)
        spp = int(cfg_dx.get("SPP", 1)) if plan.gluon else 1  # streams per program: 2 or 4 take kernel_dx_streams
        plan.dx_kernel = _mhc_dx_streams if spp > 1 else _mhc_dx_gluon if plan.gluon else _mhc_dx_bwd
        if spp > 1:
            meta["SPP"] = spp
        plan.dx = Plan((n // spp * triton.cdiv(d, cfg_dx["BD"]), plan.splits), (t, per), meta)
    cfg = _config("params", n, d)
    plan.params = Plan((triton.cdiv(nout * n * d, cfg["BLOCK"]) + 1,), (plan.splits, blocks if t > 0 else 0),
                       dict(N=n, D=d, NOUT=nout, NO=no, HEAD=bool(head), GROUPS=1 if head else 3, **_meta(cfg)))
    return _BWD_PLANS.add(key, plan)


def pre_backward(x: Any, fn_w: Any, base: Any, scale: Any, mix: Any, r: Any, d_post: Any, d_comb: Any, d_y: Any,
                 iterations: int, eps: float, head: bool = False) -> tuple[Any, Any, Any, Any]:
    """``(g_x [T, n, D] in x's dtype, g_fn, g_base, g_scale)`` (fp32) of :func:`pre_forward` given the gradients
    of its outputs (``d_post``/``d_comb`` fp32, ignored with ``head``; ``d_y`` [T, D] in x's dtype)."""
    key = (layout_key(x), layout_key(fn_w), layout_key(base), layout_key(scale), layout_key(mix), layout_key(r),
           None if head else layout_key(d_post), None if head else layout_key(d_comb), layout_key(d_y), iterations,
           eps, head, device_key(x), _aligned(x) and _aligned(d_y), _tuning())
    plan = _BWD_PLANS.get(key) or _plan_pre_backward(key, x, fn_w, base, scale, mix, r, d_post, d_comb, d_y,
                                                      iterations, eps, head)
    g_x, g_fn, g_base, g_scale = plan.new_g_x(), plan.new_g_fn(), plan.new_g_base(), plan.new_g_scale()
    sums, part, dz, coef, pre, d_pre, g, states = plan.scratch()
    if plan.pre is not None:  # some tokens
        if plan.pieces:
            g = plan.new_g_pieces()
        d_post, d_comb = (d_y, d_y) if head else (d_post, d_comb)
        if plan.split:
            fire(_mhc_gates_bwd, plan.gates, x, d_y, d_pre, base, scale, mix, d_post, d_comb, dz, states)
        fire(_mhc_pre_bwd, plan.pre, x, base, scale, mix, r, d_post, d_comb, d_y, dz, g, coef, pre, sums, states,
             d_pre)
        fire(plan.dx_kernel, plan.dx, x, fn_w, g, pre, coef, d_y, g_x, part)
    fire(_mhc_params_bwd, plan.params, part, sums, g_fn, g_base, g_scale)
    return g_x, g_fn, g_base, g_scale


def _check_combine(x: Any, f: Any, post: Any, comb: Any, fn: str) -> tuple[int, int, int]:
    t, n, d = _check_streams(x, fn)
    _check(f, "block_out", [t, d], FLOAT_DTYPES, fn)
    _check(post, "post", [t, n], ("float32",), fn)
    _check(comb, "comb", [t, n, n], ("float32",), fn)
    return t, n, d


def _combine_bwd_config(x: Any, n: int, d: int) -> dict[str, int]:
    """The combine backward's geometry: on a GPU its channel tile is ``VECS`` 16-byte vectors per thread of every
    thread of the program (``BD = VECS x 32 x num_warps x V``, V channels per vector), the layout its kernel needs
    (``kernel_bwd._mhc_combine_bwd``), but no wider than the row needs."""
    cfg = _config("combine_bwd", n, d)
    if is_interpreted():
        return cfg
    vec = 16 // (4 if dtype_name(x) == "float32" else 2)
    width = 32 * cfg["num_warps"] * vec
    return {**cfg, "V": vec, "BD": width * max(1, min(cfg["VECS"], triton.cdiv(d, width)))}


def _plan_combine(key: tuple, x: Any, f: Any, post: Any, comb: Any, backward: bool, d_out: Any) -> Plan:
    """The combine's launch, its ``info`` the makers of its outputs (forward: X'; backward: g_x, g_f, g_post,
    g_comb)."""
    fn = "mhc_combine (backward)" if backward else "mhc_combine"
    t, n, d = _check_combine(x, f, post, comb, fn)
    f32 = _float32_of(x)
    makers = ((maker(x, [t, n, d]), maker(f, [t, d]), maker(x, [t, n], f32), maker(x, [t, n, n], f32)) if backward
              else (maker(x, [t, n, d]),))
    if t == 0:
        return _COMBINE_PLANS.add(key, Plan(None, info=makers))
    p = triton.next_power_of_2(n)
    if backward:
        _check(d_out, "d_out", [t, n, d], (dtype_name(x),), fn)
        cfg = _combine_bwd_config(x, n, d)
        meta = dict(N=n, P=p, D=d, DOWNCAST_X=dtype_name(x) != "float32", DOWNCAST_F=dtype_name(f) != "float32",
                    **_meta(cfg))
        return _COMBINE_PLANS.add(key, Plan((triton.cdiv(t, cfg["BT"]),), (t,), meta, makers))
    cfg = _config("combine_fwd", n, d)
    return _COMBINE_PLANS.add(key, Plan((triton.cdiv(t, cfg["BT"]), triton.cdiv(d, cfg["BD"])), (t,),
                                        dict(N=n, P=p, D=d, DOWNCAST=dtype_name(x) != "float32", **cfg), makers))


def combine_forward(x: Any, f: Any, post: Any, comb: Any) -> Any:
    """``X'_k = post_k f + sum_j comb[j, k] X_j`` for streams ``x`` [T, n, D], ``f`` [T, D]; in x's dtype."""
    key = (layout_key(x), layout_key(f), layout_key(post), layout_key(comb), False, device_key(x), _tuning())
    plan = _COMBINE_PLANS.get(key) or _plan_combine(key, x, f, post, comb, False, None)
    out = plan.info[0]()
    fire(_mhc_combine_fwd, plan, x, f, post, comb, out)
    return out


def combine_backward(x: Any, f: Any, post: Any, comb: Any, d_out: Any) -> tuple[Any, Any, Any, Any]:
    """``(g_x, g_f, g_post, g_comb)`` of :func:`combine_forward` given ``d_out`` (like x)."""
    key = (layout_key(x), layout_key(f), layout_key(post), layout_key(comb), layout_key(d_out), device_key(x),
           _tuning())
    plan = _COMBINE_PLANS.get(key) or _plan_combine(key, x, f, post, comb, True, d_out)
    new_g_x, new_g_f, new_g_post, new_g_comb = plan.info
    g_x, g_f, g_post, g_comb = new_g_x(), new_g_f(), new_g_post(), new_g_comb()
    fire(_mhc_combine_bwd, plan, x, f, post, comb, d_out, g_x, g_f, g_post, g_comb)
    return g_x, g_f, g_post, g_comb


__all__ = ["FLOAT_DTYPES", "GEOMETRY_VARIANTS", "GPU_CONFIG", "KERNELS", "PRODUCTS", "TUNE", "combine_backward",
           "combine_forward", "is_interpreted", "pre_backward", "pre_forward"]
