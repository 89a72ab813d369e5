"""Time the fused mHC kernels (``use_fused_mhc``) on a GPU against eager torch and ``torch.compile`` of it.

Run on the H200 (torch + Triton, no Paddle), from the repository root:

    python scripts/bench/bench_mhc.py [--out DIR] [--no-sweep] [--pick] [--no-baselines] [--no-table] [--probe]
        [--dx-probe]
    python scripts/bench/bench_mhc.py --warm-compile   # only compile the torch.compile baselines (fills the cache)

Shape (issue 16 §3): T = 16384 tokens x n = 4 streams x D = 4096, bf16 streams, fp32 mHC parameters and maths,
20 Sinkhorn iterations. ``eager`` is the Paddle reference's op sequence in torch (``tests/helpers/torch_mhc.py``,
the GPU tests' mirror), forward and forward + backward (torch autograd); ``compile`` is ``torch.compile`` of the
same function (its backward through AOTAutograd); ``fused`` calls the kernels' launchers (``kernel.py``), as the
Paddle PyLayers do. Times are medians of ``triton.testing.do_bench`` (L2 flushed before each call; the table also
prints ``steady``: 20 back-to-back calls between two events, as ops run in a training step), bandwidth is compared
with a device-to-device copy measured in the same run. Each row prints two traffic figures:

- ``floor``: the op's minimum HBM traffic (each tensor it needs read once, each result written once);
- ``kernel``: what the fused kernels must move by construction. The pre op reads the streams twice (the collapse
  needs the gates, which need the whole row's projection) and its backward twice more (the gate gradients before
  the streams' gradient, which carries the parameter gradients' split sums), plus the splits' partial sums; the
  combine's kernel traffic is its floor.

Goals (issue 16 §3), printed met / missed per row: the fused path >= 1.5 x ``torch.compile``; the memory-bound
kernels >= 85 % of copy bandwidth (on the kernel traffic, and on the floor). In order: unless ``--no-sweep``, the
pre forward, the pre backward and the combine backward under one changed geometry (``kernel.TUNE``) at a time,
with each variant's largest difference from the defaults' outputs; with ``--pick``, the fastest variant of each
kernel that beats the defaults by more than 2 % is kept for what follows (printed); then each fused kernel's time
inside the pre and combine forward + backward (torch profiler) with its own traffic, and the idle time between
them; then the table. ``--probe`` first runs the accuracy probe of the bf16x3 projection's two accumulations at
K = 16384 (why run 3's bf16 tests failed). Also usable as a case module of ``bench_fusions.py`` (``--modules
bench_mhc``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _path in (HERE, ROOT, os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench_fusions import copy_bandwidth_gbs, peak_mib, steady_ms  # noqa: E402
from bench_fusions import median_ms as _median_ms  # noqa: E402
from helpers import torch_mhc  # noqa: E402

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

import triton.language as tl  # noqa: E402

from fleet_ext.ops.mhc import kernel  # noqa: E402
from fleet_ext.ops.split_dot import _bf16_pieces, _dot3, _dot_split  # noqa: E402


def median_ms(fn, fast: bool = False) -> float:
    """bench_fusions' median (warm-up 50 ms, 300 ms of repeats), or a shorter one for the sweep's many variants."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") if fast else _median_ms(fn)

T, N, D, ITERS, EPS = 16384, 4, 4096, 20, 1e-6
NOUT = (2 + N) * N


def _inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    return {
        "x": torch.randn(T, N, D, device=dev).to(bf16), "f": torch.randn(T, D, device=dev).to(bf16),
        "fn": 0.02 * torch.randn(NOUT, N * D, device=dev), "base": 0.5 * torch.randn(NOUT, device=dev),
        "scale": torch.tensor([0.7, 1.3, 2.0], device=dev),
        "head_fn": 0.02 * torch.randn(N, N * D, device=dev), "head_base": 0.5 * torch.randn(N, device=dev),
        "head_scale": torch.tensor([1.7], device=dev),
        "g_post": torch.randn(T, N, device=dev), "g_comb": torch.randn(T, N, N, device=dev),
        "g_y": torch.randn(T, D, device=dev).to(bf16), "g_out": torch.randn(T, N, D, device=dev).to(bf16),
    }


def _eager_pre(x, fn, base, scale):
    return torch_mhc.mhc_pre(x, fn, base, scale, ITERS, EPS, EPS)


def _eager_head(x, fn, base, scale):
    return torch_mhc.mhc_head(x, fn, base, scale, EPS, EPS)


def with_backward(forward, inputs: list[torch.Tensor], cotangents: list[torch.Tensor]):
    """A callable running ``forward`` on leaves that require grad, then torch autograd's backward."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]

    def step():
        outs = forward(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return torch.autograd.grad(outs, leaves, cotangents)

    return step


def _fused_pre(a, head=False):
    keys = ("head_fn", "head_base", "head_scale") if head else ("fn", "base", "scale")
    return kernel.pre_forward(a["x"], *(a[k] for k in keys), ITERS, EPS, EPS, head=head)


def _fused_pre_step(a, head=False):
    keys = ("head_fn", "head_base", "head_scale") if head else ("fn", "base", "scale")
    post, comb, _, mix, r = _fused_pre(a, head)
    grads = (None, None) if head else (a["g_post"], a["g_comb"])
    return kernel.pre_backward(a["x"], *(a[k] for k in keys), mix, r, *grads, a["g_y"], ITERS, EPS, head=head)


def _gluon_kind(kind: str, head: bool = False) -> str:
    """The config the launcher uses at this shape: the Gluon kernel's on the H200 (bf16, n = 4, not the head)."""
    return kind if head or kernel.GLUON == "triton" or kind in kernel.TUNE else f"{kind}_gluon"


def _part_bytes(head: bool = False) -> int:
    """The split projection's partial sums, written and read once: [SPLITS, T, NO] fp32; with the Gluon projection
    also fn read once and its three bf16 pieces written once."""
    cfg = kernel._config(_gluon_kind("proj", head), N, D)
    splits = kernel._split(N * D, cfg["SPLITS"], cfg["BK"])[1]
    pieces = 0 if head or _gluon_kind("proj") == "proj" else NOUT * N * D * 4 + 3 * 32 * N * D * 2
    return 2 * splits * T * (16 if head else 32) * 4 + pieces


def _dfn_part_bytes() -> int:
    """The streams-gradient kernel's splits of g_fn, written and read once: [SPLITS, NO, N D] fp32."""
    cfg = kernel._config(_gluon_kind("dx"), N, D)
    return 2 * kernel._split(T, cfg["SPLITS"], cfg["BT"])[1] * 32 * N * D * 4


def cases() -> list[dict]:
    """The rows: (name, eager, fused, floor bytes, kernel bytes)."""
    a = _inputs()
    xb, yb = a["x"].numel() * 2, a["f"].numel() * 2  # streams and one [T, D] bf16 tensor
    small = T * (NOUT + 2 * N * N + 2 * N + 1) * 4  # mix, r, post, comb (and their gradients): fp32 [T, ...]
    post, comb = _fused_pre(a)[:2]
    pre_args = [a["x"], a["fn"], a["base"], a["scale"]]
    head_args = [a["x"], a["head_fn"], a["head_base"], a["head_scale"]]
    comb_args = [a["x"], a["f"], post, comb]
    shape = f"X [{T},{N},{D}] bf16, fp32 mHC, {ITERS} Sinkhorn iterations"
    fwd_kernel = 2 * xb + yb + small + _part_bytes()
    # backward: the gate pass reads X and g_y, the streams' pass X and g_y (the N streams of a channel tile side
    # by side: g_y from memory once) and writes g_x; the parameter splits and per-token values on top.
    bwd_kernel = 3 * xb + 2 * yb + 2 * small + _dfn_part_bytes()
    return [
        {"name": "mhc pre fwd", "shape": shape, "eager": lambda: _eager_pre(*pre_args),
         "fused": lambda: _fused_pre(a), "bytes_moved": xb + yb + small, "kernel_bytes": fwd_kernel},
        {"name": "mhc head fwd", "shape": shape, "eager": lambda: _eager_head(*head_args),
         "fused": lambda: _fused_pre(a, head=True), "bytes_moved": xb + yb,
         "kernel_bytes": 2 * xb + yb + _part_bytes(head=True)},
        {"name": "mhc combine fwd", "shape": shape, "eager": lambda: torch_mhc.mhc_combine(*comb_args),
         "fused": lambda: kernel.combine_forward(*comb_args), "bytes_moved": 2 * xb + yb, "kernel_bytes": 2 * xb + yb},
        {"name": "mhc pre fwd+bwd", "shape": shape,
         "eager": with_backward(_eager_pre, pre_args, [a["g_post"], a["g_comb"], a["g_y"]]),
         "fused": lambda: _fused_pre_step(a), "bytes_moved": 3 * xb + 2 * yb + 3 * small,
         "kernel_bytes": fwd_kernel + bwd_kernel},
        {"name": "mhc combine fwd+bwd", "shape": shape,
         "eager": with_backward(torch_mhc.mhc_combine, comb_args, [a["g_out"]]),
         "fused": lambda: kernel.combine_backward(*comb_args, kernel.combine_forward(*comb_args)),
         "bytes_moved": 5 * xb + 3 * yb, "kernel_bytes": 5 * xb + 3 * yb},
    ]


def run(case: dict, copy_gbs: float, baselines: bool = True) -> dict:
    row = {k: case[k] for k in ("name", "shape", "bytes_moved", "kernel_bytes")}
    row["eager_us"] = 1e3 * median_ms(case["eager"]) if baselines else None
    row["compile_us"], row["compile_error"] = None, "not run (--no-baselines)"
    try:
        if baselines:
            compiled = torch.compile(case["eager"])
            compiled()
            row["compile_us"], row["compile_error"] = 1e3 * median_ms(compiled), None
    except Exception as exc:  # reported, not hidden
        row["compile_us"], row["compile_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
    row["fused_us"] = 1e3 * median_ms(case["fused"])
    row["fused_steady_us"] = 1e3 * steady_ms(case["fused"], calls=20)
    seconds = row["fused_us"] * 1e-6
    row["floor_pct_copy"] = 100 * case["bytes_moved"] / seconds / 1e9 / copy_gbs
    row["kernel_pct_copy"] = 100 * case["kernel_bytes"] / seconds / 1e9 / copy_gbs
    row["kernel_pct_copy_steady"] = 100 * case["kernel_bytes"] / (row["fused_steady_us"] * 1e-6) / 1e9 / copy_gbs
    row["eager_peak_mib"] = peak_mib(case["eager"]) if baselines else float("nan")
    row["fused_peak_mib"] = peak_mib(case["fused"])
    return row


def goals(row: dict) -> list[str]:
    out = []
    if row["compile_us"] is not None:
        ratio = row["compile_us"] / row["fused_us"]
        out.append(f"{'met' if ratio >= 1.5 else 'missed'}: {ratio:.2f}x torch.compile (goal >= 1.5x)")
    else:
        out.append(f"n/a: torch.compile failed ({row['compile_error']})")
    for label in ("kernel", "floor"):
        pct = row[f"{label}_pct_copy"]
        out.append(f"{'met' if pct >= 85 else 'missed'}: {pct:.1f}% of copy on the {label} traffic (goal >= 85%)")
    return out


# One kernel's geometry changed at a time from the defaults (kernel.GPU_CONFIG): kernel.GEOMETRY_VARIANTS, which
# the GPU tests hold to the defaults' tolerances; each timed through the op it belongs to (the pre forward, the pre
# backward or the combine backward) and checked against the defaults' outputs (a variant that computes something
# else shows a large "diff").
OP_OF = {"proj": "fwd", "proj_gluon": "fwd", "pre_fwd": "fwd", "pre_bwd": "bwd", "gates": "bwd", "dx": "bwd",
         "dx_gluon": "bwd", "params": "bwd", "combine_bwd": "cbwd"}
SWEEP: list[tuple[str, str, dict]] = [
    (OP_OF[next(iter(tune))], " + ".join(f"{key} {value}" for key, value in tune.items()), tune)
    for tune in kernel.GEOMETRY_VARIANTS]


def _rel_diff(got: tuple, want: tuple) -> float:
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for g, w in zip(got, want))


def sweep(only: list[str] | None = None) -> list[tuple[str, str, float, float]]:
    """(op, variant, µs, max relative difference from the defaults' outputs), defaults first; ``only``: just the
    variants of those kernels (``kernel.GPU_CONFIG`` keys)."""
    a = _inputs()
    post, comb, _, mix, r = _fused_pre(a)

    def fwd():
        return _fused_pre(a)[:3]

    def bwd():
        return kernel.pre_backward(a["x"], a["fn"], a["base"], a["scale"], mix, r, a["g_post"], a["g_comb"],
                                   a["g_y"], ITERS, EPS)[:2]

    def cbwd():
        return kernel.combine_backward(a["x"], a["f"], post, comb, a["g_out"])

    calls = {"fwd": fwd, "bwd": bwd, "cbwd": cbwd}
    kernel.TUNE.clear()
    base = {op: call() for op, call in calls.items()}
    rows = [(op, "defaults", 1e3 * median_ms(call, fast=True), 0.0) for op, call in calls.items()]
    for op, label, tune in SWEEP:
        if only and not set(tune) & set(only):
            continue
        kernel.TUNE.clear()
        kernel.TUNE.update(tune)
        try:
            diff = _rel_diff(calls[op](), base[op])
            rows.append((op, label, 1e3 * median_ms(calls[op], fast=True), diff))
        except Exception as exc:  # a geometry that does not compile is reported
            rows.append((op, f"{label}: {type(exc).__name__}: {str(exc)[:120]}", float("nan"), float("nan")))
        print(f"  ({op} {rows[-1][2]:8.1f} us  diff {rows[-1][3]:.1e}  {rows[-1][1]})", flush=True)
    kernel.TUNE.clear()
    return rows


def pick(rows: list[tuple[str, str, float, float]], margin: float = 0.02) -> dict:
    """``kernel.TUNE`` from the sweep: per kernel, its fastest variant if it beats the defaults' op time by more than
    ``margin`` and computes the same outputs (relative difference < 1e-2: summation order and bf16 roundings only).
    Variants that change two kernels at once are timed, never picked. With several rounds each variant (and the
    defaults) counts at its median over the rounds."""
    rounds: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for op, label, us, diff in rows:
        rounds.setdefault((op, label), []).append((us, diff))
    rows = [(op, label, statistics.median(us for us, _ in runs), max(diff for _, diff in runs))
            for (op, label), runs in rounds.items()]
    default = {op: us for op, label, us, _ in rows if label == "defaults"}
    tunes = {label: tune for _, label, tune in SWEEP}
    best: dict[str, tuple[float, dict]] = {}
    for op, label, us, diff in rows:
        if label not in tunes or len(tunes[label]) != 1 or not us == us or not diff < 1e-2 or \
                us > (1 - margin) * default[op]:
            continue
        (key, value), = tunes[label].items()
        if key not in best or us < best[key][0]:
            best[key] = (us, value)
    return {key: value for key, (_, value) in best.items()}


def _kernel_bytes() -> dict[str, float]:
    """What each fused kernel moves by construction (bytes; its partial sums included). With ``gates`` SPLIT the
    pre backward's pass over the streams is ``_mhc_gates_bwd``'s, and ``_mhc_pre_bwd`` moves per token the logits'
    gradient, ``mix``, ``r`` and ``g_pre`` (read), ``G``'s pieces, ``coef`` and the pre gate (written): ~0.5 KB."""
    xb, yb = T * N * D * 2, T * D * 2
    part = _part_bytes() / 2
    nout = (2 + N) * N
    no = kernel._common(N, D, nout, False, ITERS)["NO"]  # the padded mix width
    split = kernel._config("gates", N, D)["SPLIT"]
    return {"_mhc_proj_fwd": xb + part, "_mhc_proj_gluon": xb + part, "_mhc_pre_fwd": xb + yb + part,
            "_mhc_pre_bwd": T * (4 * (3 * nout + 2 + 2 * N) + 2 * 3 * no) if split else xb + yb,
            "_mhc_gates_bwd": xb + yb,
            "_mhc_dx_bwd": 2 * xb + yb + _dfn_part_bytes() / 2, "_mhc_dx_gluon": 2 * xb + yb + _dfn_part_bytes() / 2,
            "_mhc_dx_streams": 2 * xb + yb + _dfn_part_bytes() / 2,
            "_mhc_params_bwd": _dfn_part_bytes() / 2,
            "_mhc_combine_fwd": 2 * xb + yb, "_mhc_combine_bwd": 3 * xb + 2 * yb}


def _steps(a: dict) -> dict:
    post, comb = _fused_pre(a)[:2]
    return {"pre fwd+bwd": lambda: _fused_pre_step(a),
            "combine fwd+bwd": lambda: kernel.combine_backward(a["x"], a["f"], post, comb,
                                                               kernel.combine_forward(a["x"], a["f"], post, comb))}


def timeline(step, reps: int = 10) -> dict:
    """Where a step's GPU time goes between its kernels: ``reps`` back-to-back steps under the torch profiler, each
    kernel's start and end from the trace; per position in the step the kernel, its mean duration and the mean idle
    time before it (from the previous kernel's end, the previous step's last one for the first), in µs."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps + 1):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        with open(os.path.join(tmp, "trace.json")) as fh:
            events = json.load(fh)["traceEvents"]
    spans = sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "kernel")
    per = len(spans) // (reps + 1)
    rows = []
    for i in range(per):  # the first step is left out (nothing before it in the trace)
        at = [per * s + i for s in range(1, reps + 1)]
        idle = [spans[j][0] - (spans[j - 1][0] + spans[j - 1][1]) for j in at]
        rows.append({"kernel": spans[at[0]][2][:48], "us": statistics.mean(spans[j][1] for j in at),
                     "idle_before_us": statistics.mean(idle)})
    busy, idle = sum(r["us"] for r in rows), sum(r["idle_before_us"] for r in rows)
    for r in rows:
        print(f"    idle {r['idle_before_us']:6.1f}  run {r['us']:7.1f}  {r['kernel']}", flush=True)
    print(f"    per step: {busy + idle:.1f} us = {busy:.1f} running + {idle:.1f} idle between kernels", flush=True)
    return {"kernels": rows, "busy_us": busy, "idle_us": idle}


def profile_kernels(copy_gbs: float, reps: int = 10) -> dict[str, dict]:
    """Each kernel's device time (µs per call, torch profiler) inside the fused pre and combine forward + backward,
    then the op's :func:`timeline` (under ``"<op> timeline"``)."""
    from torch.profiler import ProfilerActivity, profile

    steps = _steps(_inputs())
    out, nbytes = {}, _kernel_bytes()
    for name, step in steps.items():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                step()
            torch.cuda.synchronize()
        times: dict[str, float] = {}
        for evt in prof.key_averages():
            us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
            if us > 0 and not evt.key.startswith(("cuda", "Memcpy", "Memset")):
                times[evt.key] = times.get(evt.key, 0.0) + us / reps
        out[name] = times
        print(f"  {name}: {sum(times.values()):.1f} us of kernels", flush=True)
        for key, us in sorted(times.items(), key=lambda kv: -kv[1]):
            pct = f"{100 * nbytes[key] / (us * 1e-6) / 1e9 / copy_gbs:5.1f} % of copy" if key in nbytes else ""
            print(f"    {us:8.1f} us  {pct}  {key[:60]}", flush=True)
    for name, step in steps.items():
        print(f"  {name}, kernel by kernel (back to back, {reps} steps):", flush=True)
        out[f"{name} timeline"] = timeline(step, reps)
    return out


@triton.jit
def _accumulation_probe(x_ptr, w_ptr, out_ptr, K: tl.constexpr, NO: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, FRESH: tl.constexpr):
    """x [T, K] bf16 @ w [NO, K]^T fp32 as three bf16 products per tile, accumulated either in the tensor cores'
    accumulator across all tiles (FRESH False) or per tile in a fresh one and then added in fp32 (FRESH True)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.arange(0, NO)
    acc = tl.zeros([BT, NO], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + t[:, None] * K + k[None, :])
        hi, mid, lo = _bf16_pieces(tl.load(w_ptr + c[None, :] * K + k[:, None]))
        if FRESH:
            acc += _dot3(x, hi, mid, lo)
        else:
            acc = tl.dot(x, lo, acc)
            acc = tl.dot(x, mid, acc)
            acc = tl.dot(x, hi, acc)
    tl.store(out_ptr + t[:, None] * NO + c[None, :], acc)


def accumulation_probe() -> dict[str, float]:
    """The projection's error vs float64 at K = n D = 16384 (bf16 x, fp32 fn as in V4), both accumulations:
    max |error| / max |x fn^T|, and the mean signed error over the mean |x fn^T| (a bias)."""
    torch.manual_seed(0)
    x = torch.randn(1024, N * D, device="cuda").to(torch.bfloat16)
    w = 0.1 * torch.randn(32, N * D, device="cuda")
    want = x.double() @ w.double().T
    out = {}
    for fresh in (False, True):
        got = torch.empty(1024, 32, device="cuda")
        _accumulation_probe[(1024 // 64,)](x, w, got, K=N * D, NO=32, BT=64, BK=64, FRESH=fresh, num_warps=4)
        err = got.double() - want
        tag = "fresh" if fresh else "running"
        out[f"{tag}_max_rel"] = float(err.abs().max() / want.abs().max())
        out[f"{tag}_bias_rel"] = float((err * want.sign()).mean() / want.abs().mean())
    return out


@triton.jit
def _dx_probe(x_ptr, fn_ptr, g_ptr, pre_ptr, coef_ptr, dy_ptr, dx_ptr, part_ptr, T, TS, N: tl.constexpr,
              D: tl.constexpr, NO: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, GX_MMA: tl.constexpr,
              ACC_MMA: tl.constexpr):
    """``kernel_bwd._mhc_dx_bwd`` at its defaults (bf16 pieces) with either product left out (GX_MMA: ``G @ fn``,
    ACC_MMA: the split ``x^T G``): the same loads and stores, to isolate what the products cost."""
    K: tl.constexpr = N * D
    split = tl.program_id(1)
    j = tl.program_id(0) % N
    d = (tl.program_id(0) // N) * BD + tl.arange(0, BD)
    k = j * D + d
    c = tl.arange(0, NO)
    w_hi, w_mid, _ = _bf16_pieces(tl.load(fn_ptr + c[:, None] * K + k[None, :]))
    acc = tl.zeros([BD, NO], dtype=tl.float32)
    for t0 in range(split * TS, split * TS + TS, BT):
        t = t0 + tl.arange(0, BT).to(tl.int64)
        g_ptrs = g_ptr + t[:, None] * NO + c[None, :]
        x = tl.load(x_ptr + t[:, None] * K + k[None, :])
        dy = tl.load(dy_ptr + t[:, None] * D + d[None, :]).to(tl.float32)
        pre = tl.load(pre_ptr + t * N + j)
        coef = tl.load(coef_ptr + t)
        g_hi = tl.load(g_ptrs)
        g_mid = tl.load(g_ptrs + T * NO)
        g_lo = tl.load(g_ptrs + 2 * T * NO)
        dx = pre[:, None] * dy + coef[:, None] * x.to(tl.float32)
        if GX_MMA:
            dx += _dot_split(g_hi, g_mid, g_lo, w_hi, w_mid, w_hi, 4)
        else:
            dx += (g_hi.to(tl.float32) + g_mid.to(tl.float32) + g_lo.to(tl.float32)).sum(axis=1)[:, None]
        if ACC_MMA:
            acc += _dot3(tl.trans(x.to(tl.bfloat16)), g_hi, g_mid, g_lo)
        tl.store(dx_ptr + t[:, None] * K + k[None, :], dx.to(tl.bfloat16))
    tl.store(part_ptr + (split.to(tl.int64) * NO + c[None, :]) * K + k[:, None], acc)


def dx_probe(copy_gbs: float) -> dict[str, float]:
    """``_dx_probe`` at the production shape and the dx defaults: µs per variant (do_bench median)."""
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    x, dy = torch.randn(T, N, D, device=dev).to(bf16), torch.randn(T, D, device=dev).to(bf16)
    fn, g = 0.02 * torch.randn(32, N * D, device=dev), torch.randn(3, T, 32, device=dev).to(bf16)
    pre, coef = torch.rand(T, N, device=dev), torch.randn(T, device=dev)
    cfg = kernel.GPU_CONFIG["dx"]
    per, splits = kernel._split(T, cfg["SPLITS"], cfg["BT"])
    dx, part = torch.empty_like(x), torch.empty(splits, 32, N * D, device=dev)
    nbytes = _kernel_bytes()["_mhc_dx_bwd"]
    out = {}
    for gx_mma, acc_mma in ((1, 1), (1, 0), (0, 1), (0, 0)):
        def call(gx_mma=gx_mma, acc_mma=acc_mma):
            _dx_probe[(N * D // cfg["BD"], splits)](x, fn, g, pre, coef, dy, dx, part, T, per, N=N, D=D, NO=32,
                                                     BT=cfg["BT"], BD=cfg["BD"], GX_MMA=gx_mma, ACC_MMA=acc_mma,
                                                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        label = f"dx probe: G @ fn {'on' if gx_mma else 'off'}, x^T G {'on' if acc_mma else 'off'}"
        out[label] = us = 1e3 * median_ms(call, fast=True)
        print(f"  {label}: {us:7.1f} us  {100 * nbytes / (us * 1e-6) / 1e9 / copy_gbs:5.1f} % of copy", flush=True)
    return out


def _print_row(r: dict) -> None:
    comp = "n/a" if r["compile_us"] is None else f"{r['compile_us']:.1f}"
    eager = "n/a" if r["eager_us"] is None else f"{r['eager_us']:.1f}"
    print(f"{r['name']:22} {eager:>9} {comp:>10} {r['fused_us']:9.1f} {r['kernel_pct_copy']:12.1f} "
          f"{r['floor_pct_copy']:11.1f} {r['eager_peak_mib']:6.0f}/{r['fused_peak_mib']:<6.0f} "
          f"{r['fused_steady_us']:9.1f} {r['kernel_pct_copy_steady']:12.1f}", flush=True)
    for line in goals(r):
        print(f"    {line}", flush=True)


def warm_compile() -> None:
    """Compile every ``torch.compile`` baseline once (no timing): fills the inductor cache for a later run, e.g.
    while the GPU tests run."""
    for case in cases():
        torch.compile(case["eager"])()
        torch.cuda.synchronize()
        print(f"compiled: {case['name']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--pick", action="store_true", help="keep the sweep's fastest geometries for the table")
    parser.add_argument("--no-baselines", action="store_true", help="time the fused kernels only")
    parser.add_argument("--no-table", action="store_true")
    parser.add_argument("--probe", action="store_true", help="the bf16x3 accumulation probe")
    parser.add_argument("--warm-compile", action="store_true", help="compile the baselines and exit")
    parser.add_argument("--dx-probe", action="store_true", help="the streams' gradient with either product left out")
    parser.add_argument("--only", nargs="+", choices=list(OP_OF), help="sweep only these kernels' variants")
    parser.add_argument("--rounds", type=int, default=1, help="run the sweep this many times (the spread)")
    args = parser.parse_args()
    if args.warm_compile:
        return warm_compile()
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{props.name}, sm{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write); T={T} n={N} D={D} bf16, {ITERS} Sinkhorn iterations")
    print(f"defaults: {kernel.GPU_CONFIG} {kernel.PRODUCTS}", flush=True)
    result = {"gpu": props.name, "copy_gbs": copy_gbs, "defaults": kernel.GPU_CONFIG, "products": kernel.PRODUCTS}
    path = os.path.join(args.out, "bench_mhc.json")
    if args.probe:
        result["accumulation_probe"] = probe = accumulation_probe()
        print("bf16x3 projection at K = 16384 vs float64 (max |err| / max |ref|; bias): tensor-core accumulator "
              f"across tiles {probe['running_max_rel']:.2e}; {probe['running_bias_rel']:+.2e}, fresh per tile + "
              f"fp32 add {probe['fresh_max_rel']:.2e}; {probe['fresh_bias_rel']:+.2e}", flush=True)
    if args.dx_probe:
        result["dx_probe"] = dx_probe(copy_gbs)
    result["sweep"] = [] if args.no_sweep else [row for _ in range(args.rounds) for row in sweep(args.only)]
    for op, label, us, diff in sorted(result["sweep"], key=lambda r: (r[0], r[2])):
        print(f"  sweep {op:4} {us:8.1f} us  diff {diff:.1e}  {label}")
    result["tune"] = pick(result["sweep"]) if args.pick else {}
    kernel.TUNE.update(result["tune"])
    print(f"geometry for what follows: defaults + TUNE {result['tune']}", flush=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    try:
        result["kernels_us"] = profile_kernels(copy_gbs)
    except Exception as exc:  # reported, not hidden; the table still runs
        result["kernels_us"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"profile failed: {result['kernels_us']}", flush=True)
    if not args.no_table:
        _table(result, copy_gbs, not args.no_baselines, path)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)


def _table(result: dict, copy_gbs: float, baselines: bool, path: str) -> None:
    print(f"{'case':22} {'eager us':>9} {'compile us':>10} {'fused us':>9} {'%copy kernel':>12} {'%copy floor':>11} "
          f"{'peak MiB e/f':>13} {'steady us':>9} {'%copy steady':>12}")
    result["rows"] = rows = []
    for case in cases():
        rows.append(run(case, copy_gbs, baselines=baselines))
        _print_row(rows[-1])
        torch.cuda.empty_cache()
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
