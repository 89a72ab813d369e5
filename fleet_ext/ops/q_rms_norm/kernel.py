"""Triton weightless per-head RMS norm of the DSv4 query: ``y = x * (1 / sqrt(mean(x^2) + eps))``, and its gradient.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this
module imports neither Paddle nor torch. Everything is computed in fp32 (inputs widened exactly), the
output is rounded once to the input dtype (round to nearest even), and no product is contracted into an
FMA (kernels are built with ``enable_fp_fusion=False``), so every rounding is one of eager's.

**Summation order is a parameter** (:class:`Order`), because a bitwise match with an eager framework means
summing ``x^2`` (forward) and ``dy * x`` (backward) in that framework's order:

- :func:`paddle_cpu_order` — Paddle CPU's mean / multiply_grad reductions: one sequential fp32 sum over
  the row, ``sum / d`` (measured on Paddle 3.3.1 CPU: the mean for widths up to 20000, forward and
  backward of the whole norm byte-equal for 139 widths up to 2048; ``test_fusion_q_rms_norm`` pins widths
  1 .. 512, so a Paddle upgrade that changes the order fails there);
- :func:`torch_cuda_order` — torch's CUDA reduction (``Reduce.cuh``: ``setReduceConfig`` /
  ``input_vectorized_thread_reduce_impl`` / ``thread_reduce_impl`` / ``block_x_reduce``) for a contiguous
  fp32 ``[rows, d]`` reduced over ``d``: ``LANES`` threads share a row; for ``d >= 128`` each loads 4-wide
  vectors at a ``LANES``-vector stride into four accumulators indexed by the position in the vector, else
  single elements at a ``LANES`` stride into four accumulators indexed by the step; the four are combined
  left to right, then lanes above 32 are folded in halves (shared memory) and the last 32 by the warp's
  ``shfl_down`` tree. ``mean`` multiplies by ``factor = rows / (rows * d)`` (fp32). Two details changed
  across torch releases and are parameters: the vectorisation threshold (``dim0 >= 128`` now, ``> 128``
  before) and the shuffle offsets (16, 8, .., 1 since pytorch#164790, Oct 2025: lane t adds lane t + 16,
  then t + 8, .., i.e. halving all the way; 1, 2, .., 16 before: adjacent pairs). The defaults are torch
  2.11's (the H200 image), found by ``scripts/bench/cases_index_norm_sink.py --probe`` on the H200: zero rows
  differ from eager ``mean`` over 11 shapes, while each other combination differs on hundreds of rows.

In general form a row is read in chunks of ``C = LANES * NACC`` consecutive elements, summed chunk after
chunk into ``C`` fp32 accumulators (sequentially: this is the per-thread loop), then the ``NACC``
accumulators of a lane are combined left to right and the lanes by the tree above. Paddle CPU's order is
``LANES = NACC = 1``.

**Where ``1 / sqrt`` comes from.** ``r = fl(1 / fl(sqrt(ms + eps)))``, two correctly rounded fp32 operations,
everywhere: the references' ``inv_sqrt`` (``reference.py``; Paddle CPU's ``rsqrt`` is not used: Eigen's packet
path is the hardware ``rsqrtps`` estimate plus a Newton step while the scalar tail of the same tensor is
``1/sqrt``, so its bits depend on an element's position, and a context-parallel rank's shorter statistics got
other bits), the kernels' ``div_rn(1, sqrt_rn(v))`` (``kernel_common._inv_sqrt``; NumPy's IEEE ops in the
interpreter) and torch's eager ``1 / torch.sqrt`` on CUDA. On a GPU one kernel does it all (``fused`` phase). The
CPU path runs the ``stats`` phase (write ``mean(x^2)``), applies the reference's own ``inv_sqrt(ms + eps)`` to the
``[b, s, h, 1]`` tensor (the same bits a kernel would give), and runs the ``apply`` phase (``x * r``). Every
backward sums ``x^2`` again (in registers on the one-pass path, one more pass over the row on the streamed one):
the gradient of ``1 / sqrt(v)`` divides by ``sqrt(v)``, which ``r`` does not determine, so a backward needs the
forward's ``eps`` even when it is given ``r``.

**Gradient flavours** (elementwise, after the row sum ``g_r = sum(dy * x)`` in the same order):

- Paddle CPU autograd of ``reciprocal(fp32(sqrt(fp64(v))))`` (``reference.inv_sqrt``), ``v = ms + eps``: the
  reciprocal's ``d_s = ((g_r * -1) * r) * r`` (fp32), the fp64 square root's ``(0.5 * d_s) / sqrt(v)`` in fp64,
  rounded to fp32 (found by experiment on Paddle 3.3.1 CPU, pinned by ``test_inv_sqrt.py``); ``d_ms`` that
  ``+ 0``; ``d_sq = d_ms / d``; ``dx = dy * r + (d_sq * 2) * x``;
- torch autograd of ``1 / torch.sqrt(v)``: the reciprocal's ``-g_r * (r * r)``, the square root's
  ``d / (2 * sqrt(v))``; ``d_sq = d_ms * fl(1/d)`` (mean_backward divides by a CPU scalar, which CUDA turns into a
  multiply by its reciprocal); ``dx = dy * r + d_sq * (2 * x)`` (pow_backward).

Layout: ``x`` is [b, s, h, d] with any strides; ``y``/``dx`` are new contiguous tensors like ``x``;
``r``/``ms`` are contiguous fp32 [b, s, h, 1]. One program handles ``BLOCK_R`` rows.

**One pass on the GPU.** With the torch order and at most ``MAX_TILES`` chunks of ``LANES * 4`` columns
per row (d <= 1024 at 32 lanes), the fused forward and the backward keep each row's chunks in registers:
every input byte is read once (the streamed path re-reads the row for the elementwise pass), which is
what lets a memory-bound norm run at the copy rate. Rows whose offsets are uniformly strided (contiguous
q, any row stride) skip the per-row index divisions. The launch defaults (4 rows and 2 warps per program:
64 threads, four 16-byte loads per tensor each; no cache hints) came from a sweep on the H200 at the
production shape; its timings are in ``benchmarks/RESULTS.md`` ("q_rms_norm one-pass tuning").

**r recomputed, not kept, on the one-pass path.** The backward reads every x chunk anyway, so it can recompute
``r`` with the forward's own code (``kernel_common._one_pass_v``: same chunks, same accumulators and tree, same
``* mean_factor + eps`` and ``1 / sqrt``, no FMA) instead of reading it: ``q_rms_norm_fused(.., keep_r=False)`` then
allocates and writes one output, not two (a small tensor's host cost is mostly allocations, issue 16 §4), and
``q_rms_norm_bwd(.., r=None, eps=eps)`` recomputes. The interpreter tests and the H200 tests check the
recomputed ``r`` against the forward's byte for byte (``r_out``). The Paddle CPU order keeps ``r`` (the
reference's own ``inv_sqrt``, see above), and so do the streamed kernels.

Files, by role: this module (orders re-exported, launch configuration, host launchers),
``kernel_order.py`` (the :class:`Order` model, host side), ``kernel_common.py`` (device summation tree
and row I/O), ``kernel_fwd.py`` / ``kernel_bwd.py`` (the kernels). None imports Paddle or torch.
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
    is_paddle,
    is_standard,
    layout_key,
    plan_cache,
    shape_of,
    strides_of,
)
from fleet_ext.ops.multiprocessors import H200_SMS, multiprocessor_count
from fleet_ext.ops.q_rms_norm import kernel_order
from fleet_ext.ops.q_rms_norm.kernel_bwd import _q_rms_norm_bwd_kernel
from fleet_ext.ops.q_rms_norm.kernel_fwd import _q_rms_norm_fwd_kernel
from fleet_ext.ops.q_rms_norm.kernel_order import (
    FLAVOR_PADDLE,
    FLAVOR_TORCH,
    Order,
    paddle_cpu_order,
    torch_cuda_order,
)
from fleet_ext.ops.strides import uniform_row_step

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
PHASE_STATS, PHASE_APPLY, PHASE_FUSED = 0, 1, 2
MAX_TILES = 8  # the one-pass kernels unroll up to 8 chunks of LANES * 4 columns of each row (kernel_fwd/_bwd)


def _float32_of(t: Any) -> Any:
    """fp32 in the framework of ``t`` (imported lazily: this module imports no framework)."""
    if is_paddle(t):
        import paddle

        return paddle.float32
    import torch

    return torch.float32


def is_interpreted() -> bool:
    return type(_q_rms_norm_fwd_kernel).__name__ == "InterpretedFunction"


def check_q(q: Any, name: str = "q", fn: str = "q_rms_norm") -> None:
    if q.ndim != 4:
        raise ValueError(f"{fn}: `{name}` must be [b, s, h, d] float, got shape {shape_of(q)}")
    if dtype_name(q) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `{name}` must be [b, s, h, d] float ({', '.join(FLOAT_DTYPES)}), "
                         f"got {dtype_name(q)}")


def default_order(q: Any) -> Order:
    """The order of the eager path this platform replaces: Paddle CPU when interpreted, torch CUDA else."""
    if is_interpreted():
        return paddle_cpu_order()
    b, s, h, d = shape_of(q)
    return torch_cuda_order(b * s * h, d)


# One-pass GPU geometry: rows per program for a 128-column chunk (scaled for other chunk widths) and warps.
# Chosen by the sweep of ``scripts/bench/cases_index_norm_sink.py --sweep`` on the H200 (timings in
# benchmarks/RESULTS.md); TUNE overrides them (the benchmark's sweep) without editing the module.
FWD_ROWS, FWD_WARPS = 4, 2
BWD_ROWS, BWD_WARPS = 4, 2
STREAM = False  # evict-first loads / streaming stores in the one-pass kernels
TUNE: dict = {}
# A one-pass forward with fewer row blocks than SMs (a tiny input, latency-bound) takes FWD_TINY_ROWS rows (per
# 128-column chunk) a program instead of FWD_ROWS, at the same warps: more programs, each with less dependent work
# (q [1, 4, 8, 512] on the H200: 1.30 us per call in a CUDA graph against 1.36 with 4 rows and 1.38 with 1 row in
# 1 warp; torch.compile 1.33). The result does not depend on the tiling (the summation order is the Order's).
# benchmarks/RESULTS.md, "Tiny shapes against torch.compile".
FWD_TINY = True
FWD_TINY_ROWS = 2
# fewer row blocks than the GPU's SMs leave SMs idle (the threshold, not a launch limit); the interpreter takes the
# H200's count (tests/single_card_tests/test_fusion_q_rms_norm.py plays the GPU geometry there)


def _one_pass(d: int, order: Order, phase: int = PHASE_FUSED) -> bool:
    return phase == PHASE_FUSED and order.nacc == 4 and -(-d // (order.lanes * 4)) <= MAX_TILES


def _config(d: int, order: Order, backward: bool = False, phase: int = PHASE_FUSED, rows: int | None = None) -> dict:
    chunk = order.lanes * order.nacc
    one_pass = _one_pass(d, order, PHASE_FUSED if backward else phase)
    if is_interpreted():  # numpy per op: few, large programs
        block_r = 64
        block_d = triton.next_power_of_2(d)
        warps = 4
    elif one_pass:  # the row lives in registers: BLOCK_R * d values per program
        rows_128 = int(TUNE.get("bwd_rows" if backward else "fwd_rows", BWD_ROWS if backward else FWD_ROWS))
        warps = int(TUNE.get("bwd_warps" if backward else "fwd_warps", BWD_WARPS if backward else FWD_WARPS))
        block_r = max(1, min(64, rows_128 * 128 // chunk))
        if FWD_TINY and not backward and rows is not None and triton.cdiv(rows, block_r) < multiprocessor_count(
                _q_rms_norm_fwd_kernel, H200_SMS):
            block_r = max(1, min(64, FWD_TINY_ROWS * 128 // chunk))
        block_d = min(triton.next_power_of_2(d), 256)
    else:  # ~2048 fp32 accumulators per program (16 per thread at 4 warps), 16-byte loads
        block_r = max(1, min(64, 2048 // chunk))
        block_d = min(triton.next_power_of_2(d), 256)
        warps = 4
    return dict(BLOCK_R=block_r, BLOCK_D=block_d, LANES=order.lanes, NACC=order.nacc, ACC_INNER=order.acc_inner,
                HALVING=order.halving, ONE_PASS=one_pass, STREAM=bool(TUNE.get("stream", STREAM)), num_warps=warps)


# Plans per (layouts, phase, order, eps, launch defaults): checks, the default order and the launch
# configuration run once per key (``fleet_ext.ops.launch``: host cost); a repeat call allocates and launches.
_FWD_PLANS = plan_cache("q_rms_norm")
_BWD_PLANS = plan_cache("q_rms_norm (backward)")


def _tuning() -> tuple:
    """The module-level defaults a plan depends on (the benchmark's sweep and probe change them between calls)."""
    return (FWD_ROWS, FWD_WARPS, BWD_ROWS, BWD_WARPS, STREAM, tuple(TUNE.items()) if TUNE else (), MAX_TILES,
            kernel_order.TORCH_VEC_MIN_D, kernel_order.TORCH_WARP_HALVING, is_interpreted(), FWD_TINY, FWD_TINY_ROWS)


def recomputes_r(d: int, order: Order) -> bool:
    """The backward can recompute ``r`` from ``x`` bit for bit (the one-pass kernels, torch order), so the fused
    forward need not write it: the forward's ``_one_pass_v`` runs again in the backward on the same chunks."""
    return _one_pass(d, order, PHASE_FUSED)


def _prepare_fwd(key: tuple, q: Any, r: Any, phase: int, order: Order | None, eps: float,
                 keep_r: bool = True) -> Plan:
    """Check, resolve the order, plan the forward launch. ``info``: (the [b, s, h, 1] stats shape, fp32 dtype,
    whether the launch writes the statistics: always but for a fused forward without ``keep_r`` whose backward
    recomputes ``r``)."""
    check_q(q)
    b, s, h, d = shape_of(q)
    if phase == PHASE_APPLY and (shape_of(r) != [b, s, h, 1] or dtype_name(r) != "float32"):
        raise ValueError(f"q_rms_norm: `r` must be float32 [{b}, {s}, {h}, 1], got {dtype_name(r)} {shape_of(r)}")
    order = paddle_cpu_order() if phase == PHASE_APPLY else (order or default_order(q))
    store = keep_r or phase != PHASE_FUSED or not recomputes_r(d, order)
    info = ((b, s, h, 1), _float32_of(q), store)
    rows = b * s * h
    if rows == 0 or d == 0:
        return _FWD_PLANS.add(key, Plan(None, info=info))
    cfg = _config(d, order, phase=phase, rows=rows)
    s_b, s_s, s_h, s_d = strides_of(q)
    step = uniform_row_step(shape_of(q), strides_of(q))
    meta = dict(D=d, PHASE=phase, FLAVOR=order.flavor, DOWNCAST=dtype_name(q) != "float32",
                FLAT_ROWS=step is not None, STORE_R=store, enable_fp_fusion=False, **cfg)
    scalars = (rows, s, h, s_b, s_s, s_h if step is None else step, s_d, float(order.mean_factor), float(eps))
    return _FWD_PLANS.add(key, Plan((triton.cdiv(rows, cfg["BLOCK_R"]),), scalars, meta, info, is_standard(q)))


def _fwd_plan(q: Any, r: Any, phase: int, order: Order | None, eps: float) -> Plan:
    key = (layout_key(q), None if r is None else layout_key(r), phase, order, eps, True, _tuning())
    return _FWD_PLANS.get(key) or _prepare_fwd(key, q, r, phase, order, eps)


def _fwd(plan: Plan, q: Any, y: Any, stat: Any) -> None:
    fire(_q_rms_norm_fwd_kernel, plan, q, y, stat)


def q_rms_norm_stats(q: Any, order: Order | None = None) -> Any:
    """``mean(q^2, -1)`` as a new contiguous fp32 [b, s, h, 1] tensor, summed in ``order``."""
    plan = _fwd_plan(q, None, PHASE_STATS, order, 0.0)
    ms = empty_like(q, shape=plan.info[0], dtype=plan.info[1])
    _fwd(plan, q, q, ms)
    return ms


def q_rms_norm_apply(q: Any, r: Any) -> Any:
    """``q * r`` (r fp32 [b, s, h, 1], contiguous) rounded to q's dtype, as a new contiguous tensor."""
    plan = _fwd_plan(q, r, PHASE_APPLY, None, 0.0)
    y = empty_same(q, plan.standard)
    _fwd(plan, q, y, _contiguous(r))
    return y


def q_rms_norm_fused(q: Any, eps: float, order: Order | None = None, keep_r: bool = True) -> tuple[Any, Any]:
    """One kernel: ``(y, r)`` with ``r = 1 / sqrt(mean(q^2) + eps)`` fp32 [b, s, h, 1] and ``y = q * r``.

    ``keep_r=False`` (the training path): ``r`` is None, neither allocated nor written, where the backward
    recomputes it (:func:`recomputes_r`; pass ``r=None`` and ``eps`` to :func:`q_rms_norm_bwd`); one output is one
    allocation less per call (host cost, issue 16 §4). Elsewhere ``r`` is returned as ever."""
    key = (layout_key(q), None, PHASE_FUSED, order, eps, keep_r, _tuning())  # _fwd_plan's key, inlined (hot path)
    plan = _FWD_PLANS.get(key) or _prepare_fwd(key, q, None, PHASE_FUSED, order, eps, keep_r)
    y = empty_same(q, plan.standard)
    if not plan.info[2]:
        fire(_q_rms_norm_fwd_kernel, plan, q, y, q)  # stat_ptr untouched (STORE_R false): q stands in
        return y, None
    r = empty_like(q, shape=plan.info[0], dtype=plan.info[1])
    fire(_q_rms_norm_fwd_kernel, plan, q, y, r)
    return y, r


def _check_stats(t: Any, name: str, b: int, s: int, h: int) -> None:
    if shape_of(t) != [b, s, h, 1] or dtype_name(t) != "float32":
        raise ValueError(f"q_rms_norm (backward): `{name}` must be float32 [{b}, {s}, {h}, 1], "
                         f"got {dtype_name(t)} {shape_of(t)}")


def check_recompute(r: Any, eps: Any, r_out: Any, recomputable: bool, fn: str,
                    readers: str = "the streamed kernels") -> None:
    """A backward needs the forward's ``eps`` whatever ``r`` is: it recomputes ``v = mean(x^2) + eps`` from x, since
    the gradient of ``r = 1 / sqrt(v)`` divides by ``sqrt(v)``, which ``r`` does not determine. Given ``r=None`` it
    recomputes ``r`` too, which needs a plan that can (``recomputable``; else ``readers`` read ``r``); ``r_out``
    (where the recomputed ``r`` is written, for tests) only goes with ``r=None``."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        why = "so r is recomputed from x and" if r is None else "and the gradient of 1 / sqrt(mean(x^2) + eps)"
        raise ValueError(f"{fn}: `r` is {'None' if r is None else 'given'}, {why} needs the forward's `eps` (a "
                         f"float >= 0), got {eps!r}")
    if r is not None:
        if r_out is not None:
            raise ValueError(f"{fn}: `r_out` receives a recomputed r: pass it with r=None, not with the forward's r")
        return
    if not recomputable:
        raise ValueError(f"{fn}: `r` is None, but this shape, order and plan take {readers}, which read the "
                         "forward's r: keep it (the forward's keep_r=True) and pass it")


def _prepare_bwd(key: tuple, dy: Any, q: Any, r: Any, order: Order | None, eps: float | None = None,
                 r_out: Any = None) -> Plan:
    """Check (same order and messages as ever), resolve the order and plan the backward launch (``r`` None:
    recomputed from ``q`` with ``eps``, and written to ``r_out`` when given)."""
    check_q(q)
    check_q(dy, "dy", "q_rms_norm (backward)")
    b, s, h, d = shape_of(q)
    if shape_of(dy) != [b, s, h, d]:
        raise ValueError(f"q_rms_norm (backward): `dy` must have q's shape {[b, s, h, d]}, got {shape_of(dy)}")
    if r is not None:
        _check_stats(r, "r", b, s, h)
    order = order or default_order(q)
    check_recompute(r, eps, r_out, recomputes_r(d, order), "q_rms_norm (backward)")
    if r_out is not None:
        _check_stats(r_out, "r_out", b, s, h)
        if not r_out.is_contiguous():
            raise ValueError("q_rms_norm (backward): `r_out` must be contiguous")
    rows = b * s * h
    if rows == 0 or d == 0:
        return _BWD_PLANS.add(key, Plan(None))
    cfg = _config(d, order, backward=True)
    x_strides, g_strides = strides_of(q), strides_of(dy)
    x_step, g_step = uniform_row_step(shape_of(q), x_strides), uniform_row_step(shape_of(dy), g_strides)
    flat = x_step is not None and g_step is not None
    if flat:
        x_strides[2], g_strides[2] = x_step, g_step
    meta = dict(D=d, FLAVOR=order.flavor, DOWNCAST=dtype_name(q) != "float32", FLAT_ROWS=flat,
                RECOMPUTE_R=r is None, STORE_R=r_out is not None, enable_fp_fusion=False, **cfg)
    scalars = (rows, s, h, *x_strides, *g_strides, float(order.inv_d), float(order.mean_factor), float(eps))
    return _BWD_PLANS.add(key, Plan((triton.cdiv(rows, cfg["BLOCK_R"]),), scalars, meta, standard=is_standard(q)))


def q_rms_norm_bwd(dy: Any, q: Any, r: Any, order: Order | None = None, eps: float | None = None,
                   r_out: Any = None) -> Any:
    """The gradient for ``q`` given ``dy`` (like q, any strides), the forward's ``r`` and ``eps``; a new contiguous
    tensor. ``eps`` is required (``v = mean(q^2) + eps`` is recomputed from ``q``: see :func:`check_recompute`).

    ``r=None`` (after ``q_rms_norm_fused(.., keep_r=False)``): ``r`` is recomputed from ``q`` with the forward's
    ``eps`` by the forward's own code (bitwise the forward's ``r``); ``r_out`` (fp32 [b, s, h, 1], contiguous)
    then receives it (tests compare it with the forward's)."""
    key = (layout_key(dy), layout_key(q), None if r is None else layout_key(r), order, eps,
           None if r_out is None else layout_key(r_out), _tuning())
    plan = _BWD_PLANS.get(key) or _prepare_bwd(key, dy, q, r, order, eps, r_out)
    dx = empty_same(q, plan.standard)
    if plan.grid is not None:
        stats = _contiguous(r) if r is not None else (r_out if r_out is not None else q)  # q: untouched stand-in
        fire(_q_rms_norm_bwd_kernel, plan, q, dy, stats, dx)
    return dx


def _contiguous(t: Any) -> Any:
    return t if t.is_contiguous() else t.contiguous()


__all__ = [
    "FLAVOR_PADDLE", "FLAVOR_TORCH", "FLOAT_DTYPES", "MAX_TILES", "Order", "check_q", "default_order", "is_interpreted",
    "paddle_cpu_order", "q_rms_norm_apply", "q_rms_norm_bwd", "q_rms_norm_fused", "q_rms_norm_stats",
    "recomputes_r", "torch_cuda_order",
]
