"""Triton attention prologue: RMS norm and partial interleaved RoPE of q (per head) or kv (one head) in one pass.

What it replaces, op for op (so the result is bitwise the separate ops' on the platforms the tests name):

- q [b, s, h, d]: ``fleet_ext.ops.q_rms_norm`` (weightless, per head) then ``fleet_ext.ops.rope``;
- kv [b, s, d]: the weighted RMSNorm (``reference.rms_norm``: ``w * (x * r)``, fp32 gain) then the RoPE.

Forward: the norm's output is rounded to the tensor dtype (the separate path stores it), the pe channels
(the trailing ``2 * cos.shape[-1]``) are rotated from it in fp32 and rounded once more; ``r = 1 / sqrt(mean(x^2)
+ eps)`` (fp32, per row) is kept for the backward, or, on the one-pass path with ``keep_r=False`` (the
training path), not written at all: the backward recomputes it from ``x`` with the forward's own code
(:func:`recomputes_r`, ``q_rms_norm.kernel_common._one_pass_v``), so the forward allocates one output, not two
(host cost, issue 16 §4); y, r and dx are the same bits either way, kv's ``dw`` (tolerance, deterministic) may
differ in the last bits (each compiled variant sums a block's rows in its own layout's order). Backward: the
RoPE gradient of ``dy`` (the opposite
rotation rounded to the dtype, every channel ``+ 0.0``: ``fleet_ext.ops.rope.kernel.rope_grad``) is formed
in registers and fed to the norm's gradient (``fleet_ext.ops.q_rms_norm.kernel_bwd``, times the gain for kv);
kv's gain gradient ``dw = sum over rows of g * (x * r)`` comes from the same launch (``kernel_bwd.py``), plus a
small reduce launch on a GPU (below).

**Orders.** The row sums follow an :class:`~fleet_ext.ops.q_rms_norm.kernel_order.Order`, as in the q norm:
Paddle CPU's (sequential) in the interpreter, torch CUDA's on a GPU. ``r = 1 / sqrt(mean(x^2) + eps)`` from two
correctly rounded ops everywhere (``fleet_ext.ops.q_rms_norm.kernel``, "Where 1 / sqrt comes from"); on the CPU
the forward is the q norm's statistics launch, the reference's ``inv_sqrt`` on the ``[.., 1]`` tensor, and this
op's apply launch (norm output and rotation together); the backward is one launch, which sums ``x^2`` again
(the gradient needs ``sqrt(mean(x^2) + eps)``, so it takes the forward's ``eps`` even when given ``r``). On a GPU
the forward is one launch. ``dw``: Paddle CPU's order (one sequential sum from 0 over all rows) in the interpreter;
on a GPU a fixed blocked order (deterministic, not torch's; ``tolerance`` in the registry): each backward row program
also sums its rows' ``g * (x * r)`` into a partial (``DW_FUSED``: dy and x read once for both gradients; the
dedicated gain programs where the one-pass kernel does not apply), and a second, small launch
(``_dw_reduce_kernel``) adds the partials in order when there is more than one.

Framework-agnostic (Paddle or torch tensors through :mod:`fleet_ext.ops.launch`); imports neither.
"""

from __future__ import annotations

from typing import Any

import triton

from fleet_ext.ops.launch import (
    Plan,
    dtype_name,
    empty_like,
    empty_same,
    fire,
    is_standard,
    layout_key,
    plan_cache,
    shape_of,
    strides_of,
)
from fleet_ext.ops.q_rms_norm import kernel as q_kernel
from fleet_ext.ops.q_rms_norm import kernel_order
from fleet_ext.ops.q_rms_norm.kernel_order import Order, paddle_cpu_order, torch_cuda_order
from fleet_ext.ops.qkv_prologue.kernel_bwd import _dw_reduce_kernel, _norm_rope_bwd_kernel
from fleet_ext.ops.qkv_prologue.kernel_fwd import _norm_rope_fwd_kernel
from fleet_ext.ops.rope import kernel as rope_kernel
from fleet_ext.ops.strides import uniform_row_step

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
PHASE_APPLY, PHASE_FUSED = 1, 2
# Launch geometry of the GPU path's one-pass kernels, per tensor and direction: (rows per program for a
# 128-column chunk, warps), from the sweep ``scripts/bench/cases_qkv_prologue.py --sweep`` on the H200
# (benchmarks/RESULTS.md; TUNE keys ``q_fwd_rows``, ``kv_bwd_warps``, ..., ``q_stream`` / ``kv_stream`` override).
# q backward: 2 rows / 2 warps (771 us at [1, 16384, 64, 512] against 836 for the q norm's 4 / 2). kv has one head
# of 512 per token, so its rows are its tokens (16384 at most): its backward runs 4 rows on one warp (34 us of
# device time at 16384 against 49 for 4 / 2: the rows' gain partial is summed inside the warp); its forward keeps
# 4 / 2 (every setting within 1 us of device time there).
GEOMETRY = {"q_fwd": (4, 2), "q_bwd": (2, 2), "kv_fwd": (4, 2), "kv_bwd": (4, 1)}
TUNE: dict = {}
# The kv gain gradient on a GPU. Fused (``DW_FUSED``, the one-pass backward with at most 4 chunks a row): each row
# program also writes its rows' partial (so the kv backward geometry sets the partials' count, rows / BLOCK_R).
# Else dedicated programs: BLOCK_C columns, DW_ROWS rows a step (a small tile: the kernel's register budget is
# the larger of its two program kinds'), about DW_PROGRAMS programs in all (row segments x column blocks). The
# partials' reduction: REDUCE_BLOCK_C columns a program, up to REDUCE_SEGMENTS partials a step
# (DW_REDUCE_SEGMENTS for the dedicated programs' partials), REDUCE_WARPS warps.
DW_FUSED = True
DW_BLOCK_C, DW_ROWS, DW_PROGRAMS, DW_REDUCE_SEGMENTS = 64, 8, 1024, 32
REDUCE_BLOCK_C, REDUCE_SEGMENTS, REDUCE_WARPS = 8, 1024, 8  # 4 steps for the 4096 partials of 16384 kv rows


def is_interpreted() -> bool:
    return type(_norm_rope_fwd_kernel).__name__ == "InterpretedFunction"


def default_order(x: Any) -> Order:
    """The order of the eager path replaced here: Paddle CPU when interpreted, torch CUDA over the rows else."""
    if is_interpreted():
        return paddle_cpu_order()
    shape = shape_of(x)
    rows = 1
    for n in shape[:-1]:
        rows *= n
    return torch_cuda_order(rows, shape[-1])


def _geometry(x: Any) -> tuple[list[int], list[int]]:
    """[b, s, h, d] and its strides; kv [b, s, d] as one head (h = 1)."""
    shape, strides = shape_of(x), strides_of(x)
    if len(shape) == 3:
        return [shape[0], shape[1], 1, shape[2]], [strides[0], strides[1], 0, strides[2]]
    return shape, strides


def check_args(x: Any, cos: Any, sin: Any, weight: Any = None, fn: str = "q_norm_rope") -> int:
    """x [b, s, h, d] (q) or [b, s, d] with a gain [d] (kv), a float dtype; the RoPE's table checks. Returns rd/2."""
    want = 3 if weight is not None else 4
    layout = "[b, s, d]" if weight is not None else "[b, s, h, d]"
    if x.ndim != want or dtype_name(x) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `x` must be {layout} float ({', '.join(FLOAT_DTYPES)}), got {dtype_name(x)} "
                         f"{shape_of(x)}")
    if weight is not None and (shape_of(weight) != [shape_of(x)[-1]] or dtype_name(weight) != "float32"):
        raise ValueError(f"{fn}: `weight` must be float32 [{shape_of(x)[-1]}] (the gain of the last axis), "
                         f"got {dtype_name(weight)} {shape_of(weight)}")
    return rope_kernel.check_args(x, cos, sin, fn)


def _tables(cos: Any, sin: Any, batch: int) -> list[int]:
    return [*rope_kernel._table_strides(cos, batch), *rope_kernel._table_strides(sin, batch)]


def _config(d: int, order: Order, phase: int, backward: bool, kv: bool = False) -> dict:
    one_pass = q_kernel._one_pass(d, order, phase)
    chunk = order.lanes * order.nacc
    key = ("kv_" if kv else "q_") + ("bwd" if backward else "fwd")
    if is_interpreted():  # numpy per op: few, large programs
        block_r, warps = 64, 4
    elif one_pass:
        rows_128 = int(TUNE.get(f"{key}_rows", GEOMETRY[key][0]))
        warps = int(TUNE.get(f"{key}_warps", GEOMETRY[key][1]))
        block_r = max(1, min(64, rows_128 * 128 // chunk))
    else:
        block_r, warps = max(1, min(64, 2048 // chunk)), 4
    block_d = triton.next_power_of_2(d) if is_interpreted() else min(triton.next_power_of_2(d), 256)
    stream = bool(TUNE.get(f"{key.split('_')[0]}_stream", q_kernel.STREAM))
    return dict(BLOCK_R=block_r, BLOCK_D=block_d, LANES=order.lanes, NACC=order.nacc, ACC_INNER=order.acc_inner,
                HALVING=order.halving, ONE_PASS=one_pass, STREAM=stream, num_warps=warps)


# Plans per (layouts, phase, eps, order, launch defaults): checks, order and configuration run once per key
# (``fleet_ext.ops.launch``: host cost); a repeat call allocates and launches.
_FWD_PLANS = plan_cache("qkv_prologue")
_BWD_PLANS = plan_cache("qkv_prologue (backward)")


def _key(t: Any) -> Any:
    return None if t is None else layout_key(t)


def _tuning() -> tuple:
    """The module-level launch defaults a plan depends on (the benchmark's sweep changes them)."""
    return (tuple(TUNE.items()) if TUNE else (), tuple(GEOMETRY.values()), DW_FUSED, DW_BLOCK_C,
            DW_ROWS, DW_PROGRAMS, DW_REDUCE_SEGMENTS, REDUCE_BLOCK_C, REDUCE_SEGMENTS, REDUCE_WARPS,
            q_kernel._tuning(), is_interpreted())


def _fwd_tuning() -> tuple:
    """What a forward plan depends on beyond its arguments: the part of :func:`_tuning` the forward reads (the
    key is built per call, so the rest of the backward's knobs stay out of it; ``DW_FUSED`` decides whether the
    kv backward can recompute ``r``)."""
    return (tuple(TUNE.items()) if TUNE else (), GEOMETRY["q_fwd"], GEOMETRY["kv_fwd"], q_kernel.STREAM,
            q_kernel.MAX_TILES, kernel_order.TORCH_VEC_MIN_D, kernel_order.TORCH_WARP_HALVING, is_interpreted(),
            rope_kernel.USE_PTX, DW_FUSED)


def recomputes_r(d: int, order: Order, kv: bool) -> bool:
    """The backward can recompute ``r`` from ``x`` bit for bit, so the fused forward need not write it: a one-pass
    row program (torch order) runs the forward's ``_one_pass_v`` and ``_inv_sqrt`` on the same chunks; for kv only
    with the gain gradient inside the row programs (``DW_FUSED``: the dedicated gain programs read ``r``)."""
    if not q_kernel._one_pass(d, order, PHASE_FUSED):
        return False
    return not kv or _dw_fused(d, order, _config(d, order, PHASE_FUSED, backward=True, kv=True))


def _prepare_fwd(key: tuple, x: Any, r: Any, cos: Any, sin: Any, weight: Any, phase: int, eps: float,
                 order: Order | None, keep_r: bool = True) -> Plan:
    """Check (the same checks, order and messages as an uncached call) and plan the forward launch.
    ``info``: (the row statistics' shape, fp32 in x's framework, whether the launch writes ``r``: always but for
    a fused forward without ``keep_r`` whose backward recomputes it)."""
    if phase == PHASE_APPLY:
        _check_r(x, r, "norm_rope_apply")
    half = check_args(x, cos, sin, weight, "kv_norm_rope" if weight is not None else "q_norm_rope")
    order = paddle_cpu_order() if phase == PHASE_APPLY else (order or default_order(x))
    shape, strides = _geometry(x)
    b, s, h, d = shape
    rows = b * s * h
    store = keep_r or phase != PHASE_FUSED or not recomputes_r(d, order, weight is not None)
    info = (tuple(_rows_shape(x)), q_kernel._float32_of(x), store)
    if rows == 0 or d == 0:
        return _FWD_PLANS.add(key, Plan(None, info=info))
    cfg = _config(d, order, phase, backward=False, kv=weight is not None)
    step = uniform_row_step(shape, strides)
    if step is not None:
        strides[2] = step
    meta = dict(D=d, NOPE=d - 2 * half, PHASE=phase, FLAVOR=order.flavor, HAS_W=weight is not None,
                DOWNCAST=dtype_name(x) != "float32", FLAT_ROWS=step is not None, USE_PTX=rope_kernel.USE_PTX,
                STORE_R=store, enable_fp_fusion=False, **cfg)
    scalars = (rows, s, h, *strides, *_tables(cos, sin, b), float(order.mean_factor), float(eps))
    return _FWD_PLANS.add(key, Plan((triton.cdiv(rows, cfg["BLOCK_R"]),), scalars, meta, info, is_standard(x)))


def _forward_plan(x: Any, r: Any, cos: Any, sin: Any, weight: Any, phase: int, eps: float,
                  order: Order | None) -> Plan:
    key = (layout_key(x), _key(r), layout_key(cos), layout_key(sin), _key(weight), phase, eps, order, True,
           _fwd_tuning())
    return _FWD_PLANS.get(key) or _prepare_fwd(key, x, r, cos, sin, weight, phase, eps, order)


def _forward(plan: Plan, x: Any, r: Any, cos: Any, sin: Any, weight: Any) -> Any:
    y = empty_same(x, plan.standard)
    fire(_norm_rope_fwd_kernel, plan, x, y, r, weight if weight is not None else x, cos, sin)
    return y


def _rows_shape(x: Any) -> list[int]:
    """The per-row statistics' shape: [b, s, h, 1] (q) or [b, s, 1] (kv), as the reference's keepdim mean."""
    return shape_of(x)[:-1] + [1]


def _check_r(x: Any, r: Any, fn: str, name: str = "r") -> None:
    if shape_of(r) != _rows_shape(x) or dtype_name(r) != "float32" or not r.is_contiguous():
        raise ValueError(f"{fn}: `{name}` must be a contiguous float32 {_rows_shape(x)}, got {dtype_name(r)} "
                         f"{shape_of(r)}")


def norm_rope_apply(x: Any, r: Any, cos: Any, sin: Any, weight: Any = None) -> Any:
    """``rope(norm(x))`` given the norm's ``r = 1 / sqrt(mean(x^2) + eps)`` (the CPU path); a new contiguous tensor."""
    return _forward(_forward_plan(x, r, cos, sin, weight, PHASE_APPLY, 0.0, None), x, r, cos, sin, weight)


def norm_rope_fused(x: Any, eps: float, cos: Any, sin: Any, weight: Any = None,
                    order: Order | None = None, keep_r: bool = True) -> tuple[Any, Any]:
    """One launch: ``(y, r)`` with ``r = 1 / sqrt(mean(x^2) + eps)`` summed in ``order`` and ``y = rope(norm(x))``.

    ``keep_r=False`` (the training path): ``r`` is None, neither allocated nor written, where the backward
    recomputes it (:func:`recomputes_r`; pass ``r=None`` and ``eps`` to :func:`norm_rope_bwd`): one output, one
    allocation less per call (host cost, issue 16 §4). Elsewhere ``r`` is returned as ever."""
    key = (layout_key(x), None, layout_key(cos), layout_key(sin), None if weight is None else layout_key(weight),
           PHASE_FUSED, eps, order, keep_r, _fwd_tuning())  # _forward_plan's key, inlined: the hot path
    plan = _FWD_PLANS.get(key) or _prepare_fwd(key, x, None, cos, sin, weight, PHASE_FUSED, eps, order, keep_r)
    y = empty_same(x, plan.standard)
    r = empty_like(x, shape=plan.info[0], dtype=plan.info[1]) if plan.info[2] else None
    # without r (STORE_R false) the kernel never touches r_ptr: x stands in, as it does for a missing gain
    fire(_norm_rope_fwd_kernel, plan, x, y, x if r is None else r, weight if weight is not None else x, cos, sin)
    return y, r


def _dw_plan(rows: int, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_C, DW_ROWS, segments, rows per segment) of the gain programs: one sequential segment when
    interpreted (Paddle CPU's order), else enough segments for about ``DW_PROGRAMS`` programs."""
    if is_interpreted():  # DW_ROWS rows a step, each one sequential scan (kernel_bwd._dw_program)
        return triton.next_power_of_2(d), 64, 1, max(rows, 1)
    block_c = min(int(TUNE.get("dw_block_c", DW_BLOCK_C)), triton.next_power_of_2(d))
    step = int(TUNE.get("dw_rows", DW_ROWS))
    ncol = triton.cdiv(d, block_c)
    seg_rows = max(step, triton.cdiv(triton.cdiv(rows, max(1, int(TUNE.get("dw_programs", DW_PROGRAMS)) // ncol)),
                                     step) * step)
    return block_c, step, triton.cdiv(rows, seg_rows), seg_rows


def _prepare_bwd(key: tuple, dy: Any, x: Any, r: Any, cos: Any, sin: Any, weight: Any, order: Order | None,
                 eps: float | None = None, r_out: Any = None) -> Plan:
    """Check (same order and messages as an uncached call) and plan the backward launch and, for kv with more
    than one row segment, the gain's reduce. ``info``: (d, fp32 dtype, segments, the reduce's plan or None).
    ``r`` None: recomputed from ``x`` with ``eps`` (and written to ``r_out`` when given)."""
    check_args(x, cos, sin, weight, "norm_rope (backward)")
    if shape_of(dy) != shape_of(x) or dtype_name(dy) != dtype_name(x):
        raise ValueError(f"norm_rope (backward): `dy` must be {dtype_name(x)} {shape_of(x)} like x, "
                         f"got {dtype_name(dy)} {shape_of(dy)}")
    if r is not None:
        _check_r(x, r, "norm_rope (backward)")
    order = order or default_order(x)
    q_kernel.check_recompute(r, eps, r_out, recomputes_r(shape_of(x)[-1], order, weight is not None),
                             "norm_rope (backward)", "the streamed kernels or the kv gain's dedicated programs")
    if r_out is not None:
        _check_r(x, r_out, "norm_rope (backward)", "r_out")
    (b, s, h, d), x_strides = _geometry(x)
    _, g_strides = _geometry(dy)
    rows = b * s * h
    fp32 = q_kernel._float32_of(x)
    if rows == 0 or d == 0:
        return _BWD_PLANS.add(key, Plan(None, info=(d, fp32, 0, None)))
    cfg = _config(d, order, PHASE_FUSED, backward=True, kv=weight is not None)
    x_step, g_step = uniform_row_step([b, s, h, d], x_strides), uniform_row_step([b, s, h, d], g_strides)
    flat = x_step is not None and g_step is not None
    if flat:
        x_strides[2], g_strides[2] = x_step, g_step
    fused = weight is not None and _dw_fused(d, order, cfg)
    if fused:  # one program per row block: dx and the block's gain partial
        block_c, dw_rows, n_dw, seg_rows = 1, 1, 0, cfg["BLOCK_R"]
        n_seg = triton.cdiv(rows, seg_rows)
        grid = (n_seg,)
    else:
        block_c, dw_rows, n_seg, seg_rows = _dw_plan(rows, d) if weight is not None else (1, 1, 0, 1)
        n_dw = n_seg * triton.cdiv(d, block_c)
        grid = (n_dw + triton.cdiv(rows, cfg["BLOCK_R"]),)
    meta = dict(D=d, NOPE=d - 2 * int(cos.shape[-1]), FLAVOR=order.flavor, HAS_W=weight is not None,
                DOWNCAST=dtype_name(x) != "float32", FLAT_ROWS=flat, USE_PTX=rope_kernel.USE_PTX,
                BLOCK_C=block_c, DW_ROWS=dw_rows, DW_FUSED=fused, RECOMPUTE_R=r is None, STORE_R=r_out is not None,
                enable_fp_fusion=False, **cfg)
    scalars = (rows, seg_rows, n_dw, s, h, *x_strides, *g_strides, *_tables(cos, sin, b), float(order.inv_d),
               float(order.mean_factor), float(eps))
    reduce = _reduce_plan(n_seg, d, fused, block_c) if n_seg > 1 else None
    return _BWD_PLANS.add(key, Plan(grid, scalars, meta, (d, fp32, n_seg, reduce), is_standard(x)))


def _dw_fused(d: int, order: Order, cfg: dict) -> bool:
    """The gain gradient inside the row programs: a GPU plan of the one-pass backward with at most 4 chunks a row
    (the interpreter keeps Paddle CPU's sequential order in the dedicated programs)."""
    return (bool(TUNE.get("dw_fused", DW_FUSED)) and cfg["ONE_PASS"] and not is_interpreted()
            and triton.cdiv(d, cfg["LANES"] * 4) <= 4)


def _reduce_plan(n_seg: int, d: int, fused: bool, block_c: int) -> Plan:
    """The partials' reduction: the fused path's (narrow column blocks, all segments in one step where they fit:
    a short pass over a small buffer) or the dedicated programs' (their column blocks, DW_REDUCE_SEGMENTS a step)."""
    if fused:
        block_c = min(int(TUNE.get("reduce_block_c", REDUCE_BLOCK_C)), triton.next_power_of_2(d))
        cap, warps = int(TUNE.get("reduce_segments", REDUCE_SEGMENTS)), int(TUNE.get("reduce_warps", REDUCE_WARPS))
    else:
        cap, warps = int(TUNE.get("dw_reduce_segments", DW_REDUCE_SEGMENTS)), 4
    block_s = min(cap, triton.next_power_of_2(n_seg))
    return Plan((triton.cdiv(d, block_c),), (n_seg,), dict(D=d, BLOCK_C=block_c, BLOCK_S=block_s, num_warps=warps))


def norm_rope_bwd(dy: Any, x: Any, r: Any, cos: Any, sin: Any, weight: Any = None,
                  order: Order | None = None, eps: float | None = None, r_out: Any = None) -> tuple[Any, Any]:
    """``(dx, dw)``: the gradients for ``x`` (new contiguous, like x) and, with a gain, for it (fp32 [d]; else
    None), given ``dy`` (like x, any strides) and the forward's ``r`` and ``eps`` (required: ``v = mean(x^2) + eps``
    is recomputed from ``x``, the gradient of ``1 / sqrt(v)`` needs ``sqrt(v)``; ``q_kernel.check_recompute``).

    ``r=None`` (after ``norm_rope_fused(.., keep_r=False)``): ``r`` is recomputed from ``x`` with the forward's
    ``eps`` by the forward's own code (bitwise the forward's ``r``); ``r_out`` (a contiguous fp32 tensor of
    ``r``'s shape) then receives it (tests compare it with the forward's)."""
    key = (layout_key(dy), layout_key(x), _key(r), layout_key(cos), layout_key(sin), _key(weight), order, eps,
           _key(r_out), _tuning())
    plan = _BWD_PLANS.get(key) or _prepare_bwd(key, dy, x, r, cos, sin, weight, order, eps, r_out)
    d, fp32, n_seg, reduce = plan.info
    dx = empty_same(x, plan.standard)
    dw = empty_like(x, shape=(d,), dtype=fp32) if weight is not None else None
    if plan.grid is None:
        if dw is not None:
            dw.zero_()  # a sum over no rows
        return dx, dw
    part = dw if n_seg <= 1 else empty_like(dw, shape=[n_seg, d])
    stats = r if r is not None else (r_out if r_out is not None else x)  # x: an untouched stand-in (RECOMPUTE_R)
    fire(_norm_rope_bwd_kernel, plan, x, dy, stats, dx, weight if weight is not None else x,
         part if part is not None else stats, cos, sin)
    if reduce is not None:
        fire(_dw_reduce_kernel, reduce, part, dw)
    return dx, dw
