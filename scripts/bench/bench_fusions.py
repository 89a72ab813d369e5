"""Time every fusion on a GPU: unfused eager torch, torch.compile of it, the fused kernel.

Run on the H200 (torch + Triton, no Paddle):  python scripts/bench/bench_fusions.py [--out DIR]
Prints the host cost per call of every fused op on tiny inputs (``bench_launch_overhead.py``'s table, skipped
with ``--no-host``), then the main table (last), and writes bench_fusions.json with both. Each case module beside
this file (``cases_index_norm_sink.py``: KV index remap, q RMS norm, sink gradient; ``cases_rope_postmix.py``: RoPE and
inverse RoPE + VHA postmix; ``cases_qkv_prologue.py``: q/kv norm + RoPE in one pass) returns dicts with
``name``, ``shape``, ``eager``, ``fused``, ``bytes_moved`` and optionally ``flops`` and ``extra`` (more
callables to time, e.g. the bare GEMM). Times are medians of ``triton.testing.do_bench``; bandwidth is
compared with a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # repo root, for fleet_ext


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def steady_ms(fn, calls: int = 10) -> float:
    """Mean ms per call of ``calls`` back-to-back calls between two events (after two warm-up calls): no L2 flush
    and no gap between calls, as layers run in a training step (``do_bench`` flushes L2 before each call)."""
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def copy_bandwidth_gbs(n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def peak_mib(fn) -> float:
    """Peak allocated memory above the baseline while running fn once."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_case(case: dict, copy_gbs: float) -> dict:
    row = {"name": case["name"], "shape": case["shape"], "bytes_moved": case["bytes_moved"]}
    row["eager_us"] = 1e3 * median_ms(case["eager"])
    try:
        compiled = torch.compile(case["eager"])
        compiled()
        row["compile_us"] = 1e3 * median_ms(compiled)
    except Exception as exc:  # report, do not hide: the table shows the failure
        row["compile_us"] = None
        row["compile_error"] = f"{type(exc).__name__}: {exc}"[:200]
    row["fused_us"] = 1e3 * median_ms(case["fused"])
    for label, fn in (case.get("extra") or {}).items():
        row[f"{label}_us"] = 1e3 * median_ms(fn)
    row["fused_gbs"] = case["bytes_moved"] / (row["fused_us"] * 1e-6) / 1e9
    row["pct_copy"] = 100 * row["fused_gbs"] / copy_gbs
    if case.get("flops"):
        row["fused_tflops"] = case["flops"] / (row["fused_us"] * 1e-6) / 1e12
    row["eager_peak_mib"] = peak_mib(case["eager"])
    row["fused_peak_mib"] = peak_mib(case["fused"])
    if case.get("goal"):  # the target for this row: "met: ..." / "missed: ..." with the measured ratio
        row["goal"] = case["goal"](row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--modules", nargs="*", default=["cases_index_norm_sink", "cases_rope_postmix",
                                                         "cases_qkv_prologue"])
    parser.add_argument("--no-host", action="store_true",
                        help="skip the host cost per call (bench_launch_overhead.py's rows, in the same run)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{props.name}, sm{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)")
    rows = []
    for module in args.modules:
        for case in importlib.import_module(module).cases():
            rows.append(run_case(case, copy_gbs))
            print(f"  {rows[-1]['name']}: fused {rows[-1]['fused_us']:.1f} us", flush=True)  # progress
            torch.cuda.empty_cache()
    host = None
    if not args.no_host:  # issue 16's host µs per call and tiny-shape device rows, from this same run
        import bench_launch_overhead

        host = bench_launch_overhead.measure()
    with open(os.path.join(args.out, "bench_fusions.json"), "w") as fh:
        json.dump({"gpu": props.name, "copy_gbs": copy_gbs, "rows": rows,
                   "host": None if host is None else {"baselines_us": host[0], "rows": host[1]}}, fh, indent=1)
    if host is not None:
        bench_launch_overhead.print_table(*host)
    header = f"{'case':34} {'eager us':>9} {'compile us':>10} {'fused us':>9} {'GB/s':>6} {'%copy':>6} " \
             f"{'x eager':>7} {'x compile':>9} {'peak MiB e/f':>14}"
    print(header)
    for r in rows:
        comp = r["compile_us"]
        comp_text = "failed" if comp is None else f"{comp:.1f}"
        vs_compile = "n/a" if comp is None else f"{comp / r['fused_us']:.2f}"
        skip = ("eager_us", "compile_us", "fused_us")
        extra = "  ".join(f"{k[:-3]}={v:.1f}us" for k, v in r.items() if k.endswith("_us") and k not in skip)
        print(
            f"{r['name'][:34]:34} {r['eager_us']:9.1f} {comp_text:>10} {r['fused_us']:9.1f} {r['fused_gbs']:6.0f} "
            f"{r['pct_copy']:6.1f} {r['eager_us'] / r['fused_us']:7.2f} {vs_compile:>9} "
            f"{r['eager_peak_mib']:6.0f}/{r['fused_peak_mib']:<6.0f} {extra}"
        )
    for r in rows:
        if r.get("goal"):
            print(f"goal {r['name']}: {r['goal']}")

if __name__ == "__main__":
    main()
