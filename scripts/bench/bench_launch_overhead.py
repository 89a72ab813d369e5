"""Host cost per call of every fused op on a tiny input, against a bare Triton launch (issue 16 §4).

Run on the H200 (torch + Triton, no Paddle):  python scripts/bench/bench_launch_overhead.py [--out DIR]
[--no-compile] [--tiny-ab] [--production]. Prints one table (again last, after the optional parts) and writes
bench_launch_overhead.json (after each part).

Host wall µs per call: N calls back to back, timed without a sync inside the loop (the device is idle long
before the host finishes: a tiny kernel takes a few µs), then one synchronize outside the timed span; the
median of 5 such runs. Also with a synchronize after every call ("sync"). The ratio to the bare launch pairs
them: five alternating rounds of the op and the bare launch, median of each (the host's speed drifts run to run).
``--profile`` also writes where each op's host time goes (cProfile, profile.txt). Rows:

- torch eager add and a bare Triton launch of a trivial kernel (3 arguments): the baselines of the same run;
  a bare launch of a 24-argument kernel shows what Triton's own ``kernel[grid]`` costs per argument; that
  kernel's C launcher called directly with its two pointers as tensors and as ints shows what the launcher's
  per-pointer check costs (the bound launch passes ints);
- each fused op with its plan cached and the bound launch (``fleet_ext.ops.launch.BOUND_LAUNCH``, the default;
  an op of k launches against k bare launches: the mHC rows, ``cases_launch_mhc.py``), and with the bound launch
  off (the plan cached, Triton's ``kernel[grid]`` path): the ratio to the bare launch and the goal (≤ 1.3x,
  met/missed) use the default; "same" says both give byte-identical outputs;
- device µs of eager torch, ``torch.compile`` of it, and the fused op at the same tiny shape
  (``triton.testing.do_bench`` medians), with torch.compile's host µs per call beside it; and the fused op's and
  torch.compile's GPU µs per call replayed from a CUDA graph of 100 back-to-back calls (``graph_us``: no host,
  no launch gaps, stable at µs scale where ``do_bench`` is not): the goal (never slower than torch.compile:
  fused / compile ≤ 1) is judged on these.

``--tiny-ab``: each op's tiny-shape launch settings (the default, the one before it, a few neighbours:
``AB_SETTINGS``) and its ``torch.compile``, ``graph_us`` in alternating rounds (medians), outputs compared with the
default's. ``--production``: the RoPE at the production shapes (``do_bench``), beside a device copy.

The q norm and prologue rows time the training path: the forward with ``keep_r=False`` (one output; the backward
recomputes ``r``). ``--recompute`` also prints the device µs, at the production shapes, of those forwards with
and without ``r`` and of their backwards reading ``r`` or recomputing it (what the one output costs the device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from cases_launch_mhc import mhc_cases  # noqa: E402
from helpers.torch_rope import eager_rope  # noqa: E402

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

from fleet_ext.ops import launch  # noqa: E402
from fleet_ext.ops.inv_rope_postmix import kernel_fast as postmix  # noqa: E402
from fleet_ext.ops.kv_idx_remap import kernel as remap  # noqa: E402
from fleet_ext.ops.q_rms_norm import kernel as q_norm  # noqa: E402
from fleet_ext.ops.qkv_prologue import kernel as prologue  # noqa: E402
from fleet_ext.ops.rope import kernel as rope  # noqa: E402
from fleet_ext.ops.sink_grad import kernel as sink  # noqa: E402

GOAL = 1.3
EPS = 1e-6
B, S, H, D, HALF = 1, 4, 8, 512, 32  # tiny: 32 KiB of bf16 q
SEQLEN_KV = 4096


@triton.jit
def _bare_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@triton.jit
def _bare_wide_kernel(x_ptr, y_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17,
                      a18, a19, a20, a21, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + a0 + a21)


def host_us(fn, calls: int = 2000, repeats: int = 5, sync: bool = False) -> float:
    """Median over ``repeats`` of the host wall time per call of ``calls`` back-to-back calls."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
            if sync:
                torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()  # outside the timed span
    return statistics.median(runs)


def device_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_us(fn, calls: int = 100, repeats: int = 20) -> float:
    """GPU µs per call with the host out of the picture: ``calls`` calls captured in one CUDA graph, the graph
    replayed ``repeats`` times between two events; the median replay over ``calls``. At a tiny shape ``do_bench``
    (one launch per timed call, L2 flushed before each) swings several-fold between runs; back-to-back replays do
    not (and are how a captured training step runs these ops)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: compile / plan on this stream before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(S, dtype=torch.float64, device="cuda")[:, None]
    angles = pos / (10000.0 ** (torch.arange(HALF, dtype=torch.float64, device="cuda") / HALF))
    return torch.cos(angles).float(), torch.sin(angles).float()


def _eager_norm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    xf = x.float()
    normed = xf * (1 / torch.sqrt(xf.square().mean(-1, keepdim=True) + EPS))
    return (normed if w is None else w * normed).to(x.dtype)


def cases() -> list[dict]:
    """name, fused, eager (the unfused torch op sequence it replaces)."""
    cos, sin = _tables()
    q = torch.randn(B, S, H, D, device="cuda").to(torch.bfloat16)
    q_work = q.clone()
    kv = torch.randn(B, S, D, device="cuda").to(torch.bfloat16)
    w = torch.rand(D, device="cuda") + 0.5
    idx = torch.randint(-1, SEQLEN_KV, (B, S, 640), device="cuda", dtype=torch.int32)
    out, d_out = q.clone(), torch.randn_like(q)
    sink_t = torch.randn(H, device="cuda")
    lse = sink_t + torch.rand(B, S, H, device="cuda") * 3
    mix = torch.eye(H, device="cuda") + 0.1 * torch.randn(H, H, device="cuda")
    nope = D - 2 * HALF

    def eager_remap():
        offsets = (torch.arange(B, dtype=idx.dtype, device="cuda") * SEQLEN_KV).view(B, 1, 1)
        return torch.where(idx >= 0, idx + offsets, idx).reshape(B * S, -1)

    def eager_rope_inplace():
        q_work[..., nope:] = eager_rope(q_work[..., nope:], cos, sin)
        return q_work

    def eager_sink():
        delta = (d_out.float() * out.float()).sum(-1)
        return -(torch.exp(sink_t - lse) * delta).sum((0, 1))

    return [
        dict(name="rope out of place", fused=lambda: rope.rope(q, cos, sin), eager=lambda: eager_rope(q, cos, sin)),
        dict(name="rope in place", fused=lambda: rope.rope_(q_work, cos, sin), eager=eager_rope_inplace,
             reset=lambda: q_work.copy_(q)),
        dict(name="kv remap", fused=lambda: remap.local_to_global_flat(idx, SEQLEN_KV), eager=eager_remap),
        dict(name="q rms norm fwd", fused=lambda: q_norm.q_rms_norm_fused(q, EPS, keep_r=False),
             eager=lambda: _eager_norm(q, None)),
        dict(name="sink grad", fused=lambda: sink.sink_grad(d_out, out, lse, sink_t), eager=eager_sink),
        dict(name="qkv prologue q fwd", fused=lambda: prologue.norm_rope_fused(q, EPS, cos, sin, keep_r=False),
             eager=lambda: eager_rope(_eager_norm(q, None), cos, sin)),
        dict(name="qkv prologue kv fwd", fused=lambda: prologue.norm_rope_fused(kv, EPS, cos, sin, w, keep_r=False),
             eager=lambda: eager_rope(_eager_norm(kv, w), cos, sin)),
        dict(name="inv-rope-postmix fast fwd", fused=lambda: postmix.forward(out, cos, sin, mix),
             eager=lambda: torch.matmul(mix.to(out.dtype), eager_rope(out, cos, sin, inverse=True))),
        *mhc_cases(S, D, EPS),
    ]


def _outputs(result) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else [result]
    return [t.clone() for t in items if t is not None]


def _bound_off(fn):
    def run():
        launch.BOUND_LAUNCH = False
        try:
            return fn()
        finally:
            launch.BOUND_LAUNCH = True
    return run


def bare_launch() -> None:
    _bare_kernel[(1,)](_BARE_X[0], 16, BLOCK=16)


_BARE_X: list[torch.Tensor] = []  # the bare launch's tensor, made on first use (after CUDA is up)


def paired_host_us(fn, rounds: int = 5) -> tuple[float, float]:
    """(fused, bare) host µs per call, measured in alternating rounds so both see the same host load."""
    fused, bare = [], []
    for _ in range(rounds):
        fused.append(host_us(fn, repeats=1))
        bare.append(host_us(bare_launch, repeats=1))
    return statistics.median(fused), statistics.median(bare)


def profile_case(case: dict, calls: int = 2000, top: int = 12) -> str:
    """cProfile of ``calls`` calls of the fused op (bound launch on): where its host time goes, by own time."""
    import cProfile
    import io
    import pstats

    fused = case["fused"]
    for _ in range(50):
        fused()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fused()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return f"== {case['name']} ({calls} calls)\n" + text.getvalue()


def run_case(case: dict, compile_on: bool) -> dict:
    fused = case["fused"]
    row = {"name": case["name"]}
    reset = case.get("reset", lambda: None)  # an in-place op starts both calls from the same input
    reset()
    on = _outputs(fused())
    reset()
    off = _outputs(_bound_off(fused)())
    torch.cuda.synchronize()
    row["same"] = all(torch.equal(a, b) for a, b in zip(on, off))
    row["host_us"], row["bare_us"] = paired_host_us(fused)
    launch.BOUND_LAUNCH = False
    try:
        row["host_unbound_us"] = host_us(fused)
    finally:
        launch.BOUND_LAUNCH = True
    row["host_sync_us"] = host_us(fused, calls=500, sync=True)
    row["launches"] = case.get("launches", 1)  # an op of k launches is held to k bare launches
    row["ratio"] = row["host_us"] / (row["bare_us"] * row["launches"])
    row["goal"] = f"{'met' if row['ratio'] <= GOAL else 'missed'} ({row['ratio']:.2f}x <= {GOAL}x bare)"
    row["fused_dev_us"] = device_us(fused)
    row["eager_dev_us"] = device_us(case["eager"])
    row["fused_graph_us"] = _guarded(graph_us, fused, row, "fused_graph_error")
    row["compile_dev_us"] = row["compile_host_us"] = row["compile_graph_us"] = None
    if compile_on:
        try:
            compiled = torch.compile(case["eager"])
            compiled(), compiled()
            case["compiled"] = compiled  # the tiny-shape A/B rounds (--tiny-ab) time it again
            row["compile_dev_us"] = device_us(compiled)
            row["compile_host_us"] = host_us(compiled)
            row["compile_graph_us"] = _guarded(graph_us, compiled, row, "compile_graph_error")
        except Exception as exc:  # report, do not hide: the table shows the failure
            row["compile_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if row["compile_graph_us"] and row["fused_graph_us"]:
        vs = row["fused_graph_us"] / row["compile_graph_us"]
        row["vs_compile"] = f"{'met' if vs <= 1.0 else 'missed'} ({vs:.2f}x compile's graph-replay device time)"
    return row


def _guarded(measure_fn, fn, row: dict, error_key: str) -> float | None:
    """``measure_fn(fn)``, or None with the error kept in ``row`` (a capture that fails is reported, not hidden)."""
    try:
        return measure_fn(fn)
    except Exception as exc:  # noqa: BLE001
        row[error_key] = f"{type(exc).__name__}: {exc}"[:200]
        torch.cuda.synchronize()
        return None


def c_launcher_us(x: torch.Tensor, y: torch.Tensor, wide_args: list[int]) -> dict:
    """Triton's C launcher of the compiled 24-argument kernel called directly, its two pointers given as tensors
    (it calls ``data_ptr()`` and asks the driver about each) or as ints (the bound launch's fast path): what one
    pointer costs the launcher. Empty where this Triton's compiled kernel lacks the attributes."""
    compiled = _bare_wide_kernel[(1,)](x, y, *wide_args, BLOCK=16)
    raw = getattr(compiled.run, "launch", None)
    if not callable(raw) or getattr(compiled.run, "global_scratch_size", 1):
        return {}
    stream = torch.cuda.current_stream().cuda_stream
    head = (1, 1, 1, stream, compiled.function, compiled.run.launch_cooperative_grid, compiled.run.launch_pdl, None,
            None, compiled.packed_metadata, None, None, None)
    px, py = x.data_ptr(), y.data_ptr()
    return {
        "C launcher, 2 pointers as tensors": host_us(lambda: raw(*head, x, y, *wide_args, 16)),
        "C launcher, 2 pointers as ints": host_us(lambda: raw(*head, px, py, *wide_args, 16)),
    }


def baselines() -> dict:
    a, b = torch.randn(16, device="cuda"), torch.randn(16, device="cuda")
    x, y = torch.zeros(16, device="cuda"), torch.zeros(16, device="cuda")
    wide_args = list(range(1, 23))
    return {
        "torch eager add": host_us(lambda: a + b),
        "bare Triton launch": host_us(lambda: _bare_kernel[(1,)](x, 16, BLOCK=16)),
        "bare Triton launch, 24 args": host_us(lambda: _bare_wide_kernel[(1,)](x, y, *wide_args, BLOCK=16)),
        **c_launcher_us(x, y, wide_args),
    }


def measure(compile_on: bool = True, profile_dir: str | None = None,
            keep: list | None = None) -> tuple[dict, list[dict]]:
    """(baselines, one row per op) with the bound launch on; also used by bench_fusions.py (one run, every row).
    ``keep`` (a list): receives the cases, their ``torch.compile`` included (for :func:`tiny_ab`)."""
    launch.BOUND_LAUNCH = True  # the library default; set again in case a caller turned it off
    base = baselines()
    if not _BARE_X:
        _BARE_X.append(torch.zeros(16, device="cuda"))
    if profile_dir is not None:
        with open(os.path.join(profile_dir, "profile.txt"), "w") as fh:
            fh.write("\n".join(profile_case(case) for case in cases()))
    ops = cases()
    rows = [run_case(case, compile_on) for case in ops]
    if keep is not None:
        keep.extend(ops)
    return base, rows


def _setting(module, **values):
    """A launch setting of the A/B: module attributes (TUNE entries when the name is TUNE), then fresh plans."""
    def apply() -> dict:
        old = {}
        for name, value in values.items():
            if name == "TUNE":
                old[name] = dict(module.TUNE)
                module.TUNE.clear()
                module.TUNE.update(value)
            else:
                old[name] = getattr(module, name)
                setattr(module, name, value)
        launch.clear_plans()
        return old
    return apply


def _restore(module, old: dict) -> None:
    for name, value in old.items():
        if name == "TUNE":
            module.TUNE.clear()
            module.TUNE.update(value)
        else:
            setattr(module, name, value)
    launch.clear_plans()


# The tiny-shape launch settings (issue 16 §4: never slower than torch.compile), each op's new default first, then
# the settings before it ("old") and a few neighbours: (op, label, module, attributes).
AB_SETTINGS = [
    ("rope out of place", "split (default)", rope, {}),
    ("rope out of place", "old: no split", rope, {"TINY_SPLIT": False}),
    ("rope out of place", "split, 2 warps", rope, {"TUNE": {"split_warps": 2}}),
    ("rope out of place", "split, 4 rows, 2 warps", rope, {"TUNE": {"split_rows": 4, "split_warps": 2}}),
    ("rope out of place", "split, 16 rows", rope, {"TUNE": {"split_rows": 16}}),
    ("sink grad", "heads split, one step (default)", sink, {}),
    ("sink grad", "run 6: one step", sink, {"TINY_SPLIT_HEADS": False}),
    ("sink grad", "heads split, one token a step", sink, {"TINY_ONE_STEP": False}),
    ("sink grad", "old: one token a step", sink, {"TINY_SPLIT_HEADS": False, "TINY_ONE_STEP": False}),
    ("q rms norm fwd", "2 rows, 2 warps (default)", q_norm, {}),
    ("q rms norm fwd", "old: 4 rows, 2 warps", q_norm, {"FWD_TINY": False}),
    ("q rms norm fwd", "1 row, 1 warp", q_norm, {"FWD_TINY": False, "TUNE": {"fwd_rows": 1, "fwd_warps": 1}}),
    ("kv remap", "4 KiB a program (default)", remap, {}),
    ("kv remap", "2 KiB a program", remap, {"TUNE": {"flat_block_bytes": 2048}}),
    ("kv remap", "1 KiB a program", remap, {"TUNE": {"flat_block_bytes": 1024}}),
    ("kv remap", "512 B a program", remap, {"TUNE": {"flat_block_bytes": 512}}),
    ("kv remap", "1 KiB, 2 warps", remap, {"TUNE": {"flat_block_bytes": 1024, "flat_num_warps": 2}}),
]


def tiny_ab(by_name: dict, rounds: int = 5) -> list[dict]:
    """Graph-replay GPU µs per call (:func:`graph_us`) of each setting of ``AB_SETTINGS`` and of the op's
    ``torch.compile``, in ``rounds`` alternating rounds (every setting once a round: the device's drift is shared);
    the median per setting, its outputs byte-compared with the default's."""
    times: dict[tuple[str, str], list[float]] = {}
    same: dict[tuple[str, str], bool] = {}
    errors: dict[tuple[str, str], str] = {}
    for _ in range(rounds):
        for op, label, module, values in AB_SETTINGS:
            case = by_name[op]
            old = _setting(module, **values)()
            try:
                case.get("reset", lambda: None)()
                out = _outputs(case["fused"]())
                us = graph_us(case["fused"])
                times.setdefault((op, label), []).append(us)
            except Exception as exc:  # noqa: BLE001  report, do not hide; the other settings still run
                errors[(op, label)] = f"{type(exc).__name__}: {exc}"[:200]
                torch.cuda.synchronize()
                continue
            finally:
                _restore(module, old)
            case.get("reset", lambda: None)()
            ref = _outputs(case["fused"]())
            same[(op, label)] = same.get((op, label), True) and all(torch.equal(a, b) for a, b in zip(out, ref))
        for op in dict.fromkeys(a[0] for a in AB_SETTINGS):
            if by_name[op].get("compiled") is not None:
                times.setdefault((op, "torch.compile"), []).append(graph_us(by_name[op]["compiled"]))
    rows = []
    for (op, label), values in times.items():
        rows.append(dict(op=op, setting=label, graph_us=statistics.median(values), rounds=values,
                         same=same.get((op, label))))
    rows += [dict(op=op, setting=label, graph_us=float("nan"), rounds=[], same=None, error=error)
             for (op, label), error in errors.items() if (op, label) not in times]
    for row in rows:
        compile_us = next((r["graph_us"] for r in rows if r["op"] == row["op"] and r["setting"] == "torch.compile"),
                          None)
        row["vs_compile"] = None if compile_us is None else row["graph_us"] / compile_us
    return rows


def print_ab(rows: list[dict]) -> None:
    print(f"{'tiny-shape A/B (graph us, median)':34} {'setting':28} {'graph us':>8} {'x compile':>9} same  rounds")
    for r in rows:
        ratio = "n/a" if r["vs_compile"] is None else f"{r['vs_compile']:.3f}"
        print(f"{r['op']:34} {r['setting']:28} {r['graph_us']:8.3f} {ratio:>9} {str(r['same']):5} "
              + " ".join(f"{v:.3f}" for v in r["rounds"]) + (f" ERROR {r['error']}" if r.get("error") else ""))


def production_rope_us() -> list[dict]:
    """``do_bench`` medians of the RoPE at the production shapes (q [1, 16384, 64, 512], kv [1, 16384, 512], bf16,
    pe 64; large inputs: never the tiny launch) and of a device copy of q: the large-input path after a change to
    the kernel's index arithmetic (compare with benchmarks/RESULTS.md's table of fused ops)."""
    seq = 16384
    pos = torch.arange(seq, dtype=torch.float64, device="cuda")[:, None]
    angles = pos / (10000.0 ** (torch.arange(HALF, dtype=torch.float64, device="cuda") / HALF))
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    q = torch.randn(1, seq, 64, D, device="cuda").to(torch.bfloat16)
    kv = torch.randn(1, seq, D, device="cuda").to(torch.bfloat16)
    q_work, kv_work = q.clone(), kv.clone()
    rows = [dict(name="device copy of q", us=device_us(lambda: q.clone()))]
    for name, fn, want in (("rope q out of place", lambda: rope.rope(q, cos, sin), lambda: eager_rope(q, cos, sin)),
                           ("rope q in place", lambda: rope.rope_(q_work, cos, sin), None),
                           ("rope kv out of place", lambda: rope.rope(kv, cos, sin),
                            lambda: eager_rope(kv, cos, sin)),
                           ("rope kv in place", lambda: rope.rope_(kv_work, cos, sin), None)):
        same = None if want is None else torch.equal(fn(), want())
        rows.append(dict(name=name, us=device_us(fn), same=same))
    return rows


def recompute_device_us(seq: int = 16384) -> list[dict]:
    """Device µs (``do_bench`` medians) at the production shapes (q [1, seq, 64, 512], kv [1, seq, 512], bf16, pe
    64) of the q norm and prologue forwards writing ``r`` or not, and of their backwards reading ``r`` or
    recomputing it from x (the backward's extra sum of squares and its registers)."""
    pos = torch.arange(seq, dtype=torch.float64, device="cuda")[:, None]
    angles = pos / (10000.0 ** (torch.arange(HALF, dtype=torch.float64, device="cuda") / HALF))
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    q, dq = (torch.randn(1, seq, 64, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    kv, dkv = (torch.randn(1, seq, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    w = torch.rand(D, device="cuda") + 0.5
    ops = [
        ("q rms norm", lambda keep: q_norm.q_rms_norm_fused(q, EPS, keep_r=keep),
         lambda r: q_norm.q_rms_norm_bwd(dq, q, r, eps=EPS)),
        ("qkv prologue q", lambda keep: prologue.norm_rope_fused(q, EPS, cos, sin, keep_r=keep),
         lambda r: prologue.norm_rope_bwd(dq, q, r, cos, sin, eps=EPS)),
        ("qkv prologue kv", lambda keep: prologue.norm_rope_fused(kv, EPS, cos, sin, w, keep_r=keep),
         lambda r: prologue.norm_rope_bwd(dkv, kv, r, cos, sin, w, eps=EPS)),
    ]
    rows = []
    for name, fwd, bwd in ops:
        r = fwd(True)[1]
        same = all(torch.equal(a, b) for a, b in zip(_outputs(bwd(r)), _outputs(bwd(None))))
        rows.append(dict(name=name, fwd_r_us=device_us(lambda f=fwd: f(True)),
                         fwd_no_r_us=device_us(lambda f=fwd: f(False)), bwd_read_us=device_us(lambda b=bwd, r=r: b(r)),
                         bwd_recompute_us=device_us(lambda b=bwd: b(None)), same=same))
    return rows


def print_recompute(rows: list[dict]) -> None:
    print(f"{'production shape, device us':28} {'fwd r':>8} {'fwd no r':>8} {'bwd read':>8} {'bwd recompute':>13} same")
    for r in rows:
        print(f"{r['name']:28} {r['fwd_r_us']:8.1f} {r['fwd_no_r_us']:8.1f} {r['bwd_read_us']:8.1f} "
              f"{r['bwd_recompute_us']:13.1f} {r['same']}")


def print_table(base: dict, rows: list[dict]) -> None:
    print(f"{'baseline':34} {'host us':>8}")
    for name, us in base.items():
        print(f"{name:34} {us:8.1f}")
    print(f"{'op':27} {'host us':>7} {'bare':>5} {'unbound':>7} {'sync':>6} {'x bare':>6} {'same':>5} {'dev us':>6} "
          f"{'eager':>6} {'compile':>7} {'cmp host':>8} {'graph':>6} {'cmp graph':>9}  goals")

    def fmt(v: float | None, width: int, digits: int = 1) -> str:
        return f"{'n/a':>{width}}" if v is None else f"{v:{width}.{digits}f}"

    for r in rows:
        print(f"{r['name']:27} {r['host_us']:7.1f} {r['bare_us']:5.1f} {r['host_unbound_us']:7.1f} "
              f"{r['host_sync_us']:6.1f} "
              f"{r['ratio']:6.2f} {str(r['same']):>5} {r['fused_dev_us']:6.1f} {r['eager_dev_us']:6.1f} "
              f"{fmt(r['compile_dev_us'], 7)} {fmt(r['compile_host_us'], 8)} {fmt(r.get('fused_graph_us'), 6, 2)} "
              f"{fmt(r.get('compile_graph_us'), 9, 2)}  host: {r['goal']}; "
              f"device: {r.get('vs_compile', r.get('compile_error', r.get('compile_graph_error', 'n/a')))}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--profile", action="store_true", help="also write a cProfile of each op (profile.txt)")
    parser.add_argument("--recompute", action="store_true",
                        help="also time the norms' forwards with / without r and backwards reading / recomputing it")
    parser.add_argument("--tiny-ab", action="store_true",
                        help="also time each tiny-shape launch setting (new default, the one before, neighbours) "
                             "against torch.compile by CUDA-graph replay, in alternating rounds")
    parser.add_argument("--production", action="store_true",
                        help="also time the RoPE at the production shapes (do_bench) and a device copy of q")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}; tiny shapes: q [{B},{S},{H},{D}] "
          f"bf16, pe {2 * HALF}, kv [{B},{S},{D}], remap [{B},{S},640] int32")
    ops: list[dict] = []
    base, rows = measure(not args.no_compile, args.out if args.profile else None, ops)
    result = {"gpu": props.name, "baselines_us": base, "rows": rows, "recompute_device_us": [], "tiny_ab": [],
              "production_rope_us": []}

    def save() -> None:  # after each part: a run cut short keeps what it measured
        with open(os.path.join(args.out, "bench_launch_overhead.json"), "w") as fh:
            json.dump(result, fh, indent=1)

    save()
    print_table(base, rows)
    extras = [("tiny_ab", args.tiny_ab, lambda: tiny_ab({case["name"]: case for case in ops})),
              ("production_rope_us", args.production, production_rope_us),
              ("recompute_device_us", args.recompute, recompute_device_us)]
    for key, wanted, run in extras:
        if wanted:
            try:
                result[key] = run()
            except Exception as exc:  # report, do not hide; the main table still prints
                print(f"{key} failed: {type(exc).__name__}: {exc}")
            save()
    if result["recompute_device_us"]:
        print_recompute(result["recompute_device_us"])
    for r in result["production_rope_us"]:
        print(f"production {r['name']:28} {r['us']:9.1f} us  same as eager: {r.get('same')}")
    if result["tiny_ab"]:
        print_ab(result["tiny_ab"])
    print_table(base, rows)  # again, last


if __name__ == "__main__":
    main()
