"""Sweep the MoE backward's first GEMM, ``d_gate_up`` (``kernel_bwd._grouped_d_gate_up``: ``d_h = d_out @ W2[e]^T``
with the clamped SwiGLU's backward and ``h`` in its epilogue), over launch settings, in one process (issue 14; GPU
only).

Every variant's ``d_gate_up`` and ``h`` are compared byte for byte with the first variant's (run 2's setting) before
it is timed. Baselines on the same inputs: ``torch._grouped_mm`` of the GEMM alone
(``d_out @ W2[e]^T``, no epilogue) and a dense GEMM of the same FLOPs. Shapes: ``cases_moe_experts`` (T 8192,
top-6, D 4096, I 2048, bf16, random routing; E 256 and 32). Prints a table last, writes
``tune_moe_d_gate_up.json`` under ``--out``. ``--layer-tokens``: then the whole MoE layer (``cases_moe_experts.
layer_rows``: eager and ``_grouped_mm`` mirrors, all fused) at the committed launch settings.

    python scripts/bench/tune_moe_d_gate_up.py --out $OUT [--layer-tokens 8192 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases_moe_experts as cme  # noqa: E402

from fleet_ext.ops.moe_experts import kernel as ek  # noqa: E402
from fleet_ext.ops.moe_experts import kernel_bwd as ekb  # noqa: E402

# ek.Launch(BM, BN, BK, GROUP_M, warps, stages, tma, persistent)
LAUNCHES = [
    (64, 128, 64, 8, 4, 4, True, 0),
    (128, 128, 64, 8, 8, 4, True, 0),
    (128, 128, 64, 8, 8, 3, True, 0),
    (128, 128, 64, 8, 8, 4, True, 1),
    (128, 128, 64, 16, 8, 4, True, 0),
    (64, 128, 64, 8, 4, 3, True, 0),
    (128, 256, 64, 8, 8, 3, True, 0),
    (128, 256, 64, 8, 8, 4, True, 0),
    (128, 256, 64, 8, 8, 3, True, 1),
    (128, 256, 64, 8, 8, 4, True, 1),
    (128, 256, 64, 16, 8, 3, True, 1),
    (128, 256, 64, 4, 8, 3, True, 1),
]


def run_case(experts: int, log) -> dict:
    _, counts = cme.routing(cme.T, experts, seed=experts)
    n = cme.T * cme.K
    gen = torch.Generator(device=cme.DEVICE).manual_seed(1)
    x = torch.randn(n, cme.D, generator=gen, device=cme.DEVICE).bfloat16()
    d_out = torch.randn(n, cme.D, generator=gen, device=cme.DEVICE).bfloat16()
    w1, w2 = cme.weights(experts, seed=2)
    gate_up, _ = ek.gate_up(x, counts, w1, cme.LIMIT)
    offs = cme.offsets32(counts)
    w2t = w2.transpose(1, 2)  # [E, D, I] view: the GEMM of the op, as _grouped_mm takes it
    dense = torch.randn(cme.D, cme.INTER, generator=gen, device=cme.DEVICE).bfloat16()
    flops = 2 * n * cme.D * cme.INTER

    def tflops(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    row = {"experts": experts, "rows_min": int(counts.min()), "rows_max": int(counts.max())}
    row["grouped_mm"] = tflops(cme.median_ms(lambda: torch._grouped_mm(d_out, w2t, offs=offs)))
    row["dense"] = tflops(cme.median_ms(lambda: d_out @ dense))
    regime = "small" if n < ek.SMALL_GROUP_ROWS * experts else "large"
    saved = ek.TUNE["d_gate_up"][regime]
    ref, runs = None, []
    try:
        for cfg in map(ek.Launch._make, LAUNCHES):
            ek.TUNE["d_gate_up"][regime] = cfg
            got = ekb.gate_up_backward(d_out, counts, w2, gate_up, cme.LIMIT)
            ref = got if ref is None else ref
            same = all(torch.equal(a, b) for a, b in zip(got, ref))
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref))
            ms = cme.median_ms(lambda: ekb.gate_up_backward(d_out, counts, w2, gate_up, cme.LIMIT))
            runs.append({"cfg": list(cfg), "same_bytes_as_first": same, "max_diff": diff, "ms": ms,
                         "tflops": tflops(ms)})
            log(f"E {experts} {tuple(cfg)}: {tflops(ms):.0f} TFLOP/s, same bytes {same}")
    finally:
        ek.TUNE["d_gate_up"][regime] = saved
    row["runs"] = runs
    return row


def layer(experts: int, tokens: list[int], log) -> list[dict]:
    """The whole layer at ``tokens`` at the committed launch settings."""
    out = []
    for t in tokens:
        regime = "small" if t * cme.K < ek.SMALL_GROUP_ROWS * experts else "large"
        out.append({**cme.layer_rows(t, experts, log), "d_gate_up": list(ek.TUNE["d_gate_up"][regime])})
        torch.cuda.empty_cache()
    return out


def profile_layer(tokens: int, experts: int) -> None:
    """GPU time per kernel name of one fused layer forward + backward (the committed defaults), largest first."""
    x, wr, bias, w1, w2, g = cme.layer_inputs(tokens, experts)
    run = lambda: cme.layer_fused_fwd_bwd(x, wr, bias, w1, w2, g, experts)  # noqa: E731
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name[:60]] = times.get(ev.name[:60], 0.0) + ev.device_time / 5
    total = sum(times.values())
    print(f"\nprofile T={tokens} E={experts}: {total / 1e3:.2f} ms of kernels per layer fwd+bwd")
    for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {us:9.1f} us  {100 * us / total:5.1f} %  {name}")
    _idle_gaps(prof, 5)
    host = []
    for _ in range(5):  # the host's enqueue time of one layer (no sync inside) against its GPU time
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t0)))
    print("  host enqueue / wall ms per layer: " + ", ".join(f"{a:.2f} / {b:.2f}" for a, b in host))


def _idle_gaps(prof: Any, runs: int) -> None:
    """Where the GPU waits: the idle time between consecutive kernels of the profiled runs, the largest gaps and
    the kernel each one precedes."""
    events = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                    for e in prof.profiler.kineto_results.events()
                    if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0)
    gaps = [(b[0] - a[1], b[2][:60]) for a, b in zip(events, events[1:]) if b[0] > a[1]]
    busy = sum(e[1] - e[0] for e in events)
    span = events[-1][1] - events[0][0]
    print(f"  GPU busy {busy / 1e6 / runs:.2f} ms of a {span / 1e6 / runs:.2f} ms span per layer; idle gaps > 5 us "
          f"per layer {sum(g for g, _ in gaps if g > 5e3) / 1e6 / runs:.2f} ms; largest (us, next kernel):")
    for g, name in sorted(gaps, reverse=True)[:12]:
        print(f"    {g / 1e3:8.1f}  {name}")


def table(rows: list[dict]) -> str:
    lines = ["| E | launch (BM, BN, BK, GROUP_M, warps, stages, tma, persistent) | TFLOP/s | vs `_grouped_mm` (GEMM "
             "only) | vs dense | same bytes as the first |", "|---|---|---|---|---|---|"]
    for row in rows:
        for run in row["runs"]:
            lines.append(f"| {row['experts']} | {tuple(run['cfg'])} | {run['tflops']:.0f} | "
                         f"{run['tflops'] / row['grouped_mm']:.2f} | {run['tflops'] / row['dense']:.2f} | "
                         f"{run['same_bytes_as_first']} |")
        lines.append(f"| {row['experts']} | `_grouped_mm` {row['grouped_mm']:.0f}, dense {row['dense']:.0f} "
                     f"(rows per expert {row['rows_min']}-{row['rows_max']}) | | | | |")
    return "\n".join(lines)


def layer_table(rows: list[dict]) -> str:
    lines = ["| whole MoE layer fwd+bwd | d_gate_up launch | eager mirror, ms | `_grouped_mm` mirror, ms | "
             "all fused, ms | fused vs `_grouped_mm` (goal 1.5x) | peak GB `_grouped_mm` / fused |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| T={r['tokens']}, E={r['experts']} | {tuple(r['d_gate_up'])} | "
                     f"{r['eager_ms']:.2f} | {r['grouped_mm_ms']:.2f} | {r['fused_ms']:.2f} | "
                     f"{r['grouped_mm_ms'] / r['fused_ms']:.2f}x | {r['grouped_mm_peak_gb']:.1f} / "
                     f"{r['fused_peak_gb']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--experts", nargs="*", type=int, default=[256, 32])
    parser.add_argument("--layer-tokens", nargs="*", type=int, default=[])
    parser.add_argument("--profile-tokens", nargs="*", type=int, default=[],
                        help="per-kernel GPU time of the fused layer's forward + backward (torch profiler)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the d_gate_up sweep (layer rows, profiles)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    rows = [] if args.no_sweep else [run_case(e, log) for e in args.experts]
    layers = [r for e in args.experts for r in layer(e, args.layer_tokens, log)]
    for tokens in args.profile_tokens:
        for e in args.experts:
            profile_layer(tokens, e)
    with open(os.path.join(args.out, "tune_moe_d_gate_up.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                   "layer": layers}, fh, indent=1)
    print("\n" + table(rows))
    if layers:
        print("\n" + layer_table(layers))


if __name__ == "__main__":
    main()
