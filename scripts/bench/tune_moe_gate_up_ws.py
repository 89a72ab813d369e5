"""Sweep the warp-specialised MoE kernels beside the Triton kernels in one process (issue 14; GPU only): the gate+up
GEMM (``kernel_gate_up_ws.py``; also against ``torch._grouped_mm`` and a dense GEMM of the same FLOPs) and the
weight gradients (``kernel_d_weight_ws.py``; also against ``torch._grouped_mm`` over K groups). ``--smoke`` runs
only a small case of each against the Triton kernel.

Every Gluon variant's results are compared with the Triton kernel's (byte equality and the largest difference)
before it is timed. Shapes: ``cases_moe_experts`` (T 8192, top-6, D 4096, 2I 4096, bf16, random
routing; E 256 and 32). Prints a table last and writes ``tune_moe_gate_up_ws.json`` under ``--out``.

    python scripts/bench/tune_moe_gate_up_ws.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cases_moe_experts as cme  # noqa: E402

from fleet_ext.ops.moe_experts import kernel as ek  # noqa: E402
from fleet_ext.ops.moe_experts import kernel_bwd as ekb  # noqa: E402

# (BM, BN, BK, GROUP_M, STAGES, COOP, MMA_REGS, LOADER_REGS); COOP: both warpgroups on one BM-row tile (BM / 2
# rows each), else ping-pong (a BM-row tile each, taking turns)
VARIANTS = [
    (64, 128, 64, 8, 4, False, 232, 40),
    (64, 128, 64, 8, 3, False, 232, 40),
    (128, 64, 64, 8, 4, False, 232, 40),
    (128, 128, 64, 8, 4, True, 232, 40),
    (128, 128, 64, 8, 3, True, 232, 40),
    (128, 128, 64, 16, 4, True, 232, 40),
    (128, 128, 64, 4, 3, True, 232, 40),
]
KEYS = ("BM", "BN", "BK", "GROUP_M", "STAGES", "COOP", "MMA_REGS", "LOADER_REGS")


def run_case(experts: int) -> dict:
    idx, counts = cme.routing(cme.T, experts, seed=experts)
    n = cme.T * cme.K
    gen = torch.Generator(device=cme.DEVICE).manual_seed(1)
    x = torch.randn(n, cme.D, generator=gen, device=cme.DEVICE).bfloat16()
    w1, _ = cme.weights(experts, seed=2)
    offs = cme.offsets32(counts)
    dense = torch.randn(cme.D, 2 * cme.INTER, generator=gen, device=cme.DEVICE).bfloat16()
    flops = 2 * n * cme.D * 2 * cme.INTER

    def tflops(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    row = {"experts": experts, "rows_min": int(counts.min()), "rows_max": int(counts.max())}
    row["grouped_mm"] = tflops(cme.median_ms(lambda: torch._grouped_mm(x, w1, offs=offs)))
    row["dense"] = tflops(cme.median_ms(lambda: x @ dense))
    ek.GATE_UP_KERNEL = "triton"
    gu_t, h_t = ek.gate_up(x, counts, w1, cme.LIMIT)
    row["triton"] = tflops(cme.median_ms(lambda: ek.gate_up(x, counts, w1, cme.LIMIT)))
    row["grouped_mm_vs_triton_gu_equal"] = bool(torch.equal(torch._grouped_mm(x, w1, offs=offs), gu_t))
    ek.GATE_UP_KERNEL = "gluon"
    gu_w, h_w = ek.gate_up(x, counts, w1, cme.LIMIT)
    row["default_equal"] = bool(torch.equal(gu_w, gu_t) and torch.equal(h_w, h_t))
    row["default_run_to_run"] = all(torch.equal(a, b) for a, b in zip(ek.gate_up(x, counts, w1, cme.LIMIT),
                                                                      (gu_w, h_w)))
    del gu_w, h_w
    saved = dict(ek.WS_GATE_UP)
    row["variants"] = []
    for v in VARIANTS:
        ek.WS_GATE_UP.update(zip(KEYS, v))
        entry = {"cfg": v}
        try:
            gu, h = ek.gate_up(x, counts, w1, cme.LIMIT)
            torch.cuda.synchronize()
            entry["gu_equal"] = bool(torch.equal(gu, gu_t))
            entry["h_equal"] = bool(torch.equal(h, h_t))
            entry["gu_max_diff"] = float((gu.float() - gu_t.float()).abs().max())
            entry["rel"] = cme.rel_norm(gu, gu_t)
            entry["tflops"] = tflops(cme.median_ms(lambda: ek.gate_up(x, counts, w1, cme.LIMIT), rep=100))
        except Exception as exc:  # report and go on (e.g. out of shared memory)
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(experts, entry, flush=True)
        row["variants"].append(entry)
    ek.WS_GATE_UP.clear()
    ek.WS_GATE_UP.update(saved)
    ek.GATE_UP_KERNEL = "auto"
    return row


# weight gradient: (BM, BN, BK, STAGES)
D_WEIGHT_VARIANTS = [(128, 256, 64, 3), (128, 256, 64, 2), (128, 128, 64, 4), (128, 128, 64, 6)]
D_WEIGHT_KEYS = ("BM", "BN", "BK", "STAGES")


def run_d_weight_case(experts: int) -> dict:
    """d_weight1 = x_e^T d_gate_up_e and d_weight2 = h_e^T d_out_e (both in one timing, as in the backward):
    Triton vs the Gluon variants (bytes compared with Triton's first), ``torch._grouped_mm`` over K groups."""
    _, counts = cme.routing(cme.T, experts, seed=experts)
    n = cme.T * cme.K
    gen = torch.Generator(device=cme.DEVICE).manual_seed(5)
    x = torch.randn(n, cme.D, generator=gen, device=cme.DEVICE).bfloat16()
    dgu = torch.randn(n, 2 * cme.INTER, generator=gen, device=cme.DEVICE).bfloat16()
    h = torch.randn(n, cme.INTER, generator=gen, device=cme.DEVICE).bfloat16()
    dy = torch.randn(n, cme.D, generator=gen, device=cme.DEVICE).bfloat16()
    dw1 = torch.empty(experts, cme.D, 2 * cme.INTER, device=cme.DEVICE, dtype=torch.bfloat16)
    dw2 = torch.empty(experts, cme.INTER, cme.D, device=cme.DEVICE, dtype=torch.bfloat16)
    flops = 2 * n * (cme.D * 2 * cme.INTER + cme.INTER * cme.D)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        ekb.weight_grad(x, dgu, counts, dw1)
        ekb.weight_grad(h, dy, counts, dw2)
        return dw1, dw2

    def tflops(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    row = {"experts": experts}
    offs = cme.offsets32(counts)
    try:
        row["grouped_mm"] = tflops(cme.median_ms(lambda: (torch._grouped_mm(x.t(), dgu, offs=offs),
                                                          torch._grouped_mm(h.t(), dy, offs=offs))))
    except Exception as exc:  # noqa: BLE001 - a baseline that does not run is reported, not fatal
        row["grouped_mm"], row["grouped_mm_error"] = float("nan"), f"{type(exc).__name__}: {str(exc)[:200]}"
    ekb.D_WEIGHT_KERNEL = "triton"
    want = [t.clone() for t in both()]
    row["triton"] = tflops(cme.median_ms(both))
    ekb.D_WEIGHT_KERNEL = "gluon"
    saved = dict(ekb.WS_D_WEIGHT)
    row["variants"] = []
    for v in D_WEIGHT_VARIANTS:
        ekb.WS_D_WEIGHT.update(zip(D_WEIGHT_KEYS, v))
        entry = {"cfg": v}
        try:
            got = both()
            torch.cuda.synchronize()
            entry["equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
            entry["max_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
            entry["rel"] = max(cme.rel_norm(a, b) for a, b in zip(got, want))
            again = [t.clone() for t in both()]
            entry["run_to_run"] = all(torch.equal(a, b) for a, b in zip(both(), again))
            entry["tflops"] = tflops(cme.median_ms(both, rep=100))
        except Exception as exc:  # noqa: BLE001 - report and go on
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print("d_weight", experts, entry, flush=True)
        row["variants"].append(entry)
    ekb.WS_D_WEIGHT.clear()
    ekb.WS_D_WEIGHT.update(saved)
    ekb.D_WEIGHT_KERNEL = "auto"
    return row


def smoke() -> None:
    """A small case (odd segments, an empty expert, rows past the counts) against the Triton kernel, bytes equal."""
    gen = torch.Generator(device=cme.DEVICE).manual_seed(3)
    counts = torch.tensor([70, 0, 300, 1, 129], device=cme.DEVICE)
    x = torch.randn(520, 256, generator=gen, device=cme.DEVICE).bfloat16()
    w1 = torch.randn(5, 256, 384, generator=gen, device=cme.DEVICE).bfloat16() / 16
    outs = {}
    saved = dict(ek.WS_GATE_UP)
    for coop in (False, True):
        ek.WS_GATE_UP.update(BM=128 if coop else 64, COOP=coop)
        for choice in ("triton", "gluon"):
            ek.GATE_UP_KERNEL = choice
            outs[choice] = ek.gate_up(x, counts, w1, cme.LIMIT)
            torch.cuda.synchronize()
        for name, a, b in zip(("gate_up", "h"), outs["triton"], outs["gluon"]):
            print(f"smoke coop={coop} {name}: equal {torch.equal(a, b)}, "
                  f"max diff {(a.float() - b.float()).abs().max().item():.3g}")
    ek.WS_GATE_UP.update(saved)
    ek.GATE_UP_KERNEL = "auto"
    b = torch.randn(520, 384, generator=gen, device=cme.DEVICE).bfloat16()
    for choice in ("triton", "gluon"):
        ekb.D_WEIGHT_KERNEL = choice
        outs[choice] = torch.full((5, 256, 384), 7.0, device=cme.DEVICE, dtype=torch.bfloat16)
        ekb.weight_grad(x, b, counts, outs[choice])
        torch.cuda.synchronize()
    ekb.D_WEIGHT_KERNEL = "auto"
    a, g = outs["triton"], outs["gluon"]
    print(f"smoke d_weight: equal {torch.equal(a, g)}, max diff {(a.float() - g.float()).abs().max().item():.3g}, "
          f"empty expert zero {not g[1].any()}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--experts", nargs="*", type=int, default=[256, 32])
    parser.add_argument("--smoke", action="store_true", help="only the small check")
    parser.add_argument("--kernels", nargs="*", default=["gate_up", "d_weight"])
    args = parser.parse_args()
    smoke()
    if args.smoke:
        return
    dw_rows = [run_d_weight_case(e) for e in args.experts] if "d_weight" in args.kernels else []
    rows = [run_case(e) for e in args.experts] if "gate_up" in args.kernels else []
    with open(os.path.join(args.out, "tune_moe_gate_up_ws.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                   "d_weight": dw_rows}, fh, indent=1)
    print("\n| E | weight gradients (dW1 + dW2), TFLOP/s | `_grouped_mm` | Triton | Gluon (BM, BN, BK, STAGES) | "
          "TFLOP/s | x Triton | x `_grouped_mm` | bytes equal to Triton / run to run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in dw_rows:
        for v in r["variants"]:
            t = v.get("tflops", float("nan"))
            print(f"| {r['experts']} | | {r['grouped_mm']:.0f} | {r['triton']:.0f} | {v['cfg']} | {t:.0f} | "
                  f"{t / r['triton']:.2f} | {t / r['grouped_mm']:.2f} | {v.get('equal')} / {v.get('run_to_run')} "
                  f"{v.get('error', '')} |")
    print("\n| E | _grouped_mm | dense | Triton | Gluon variant (BM, BN, BK, GROUP_M, STAGES, regs) | TFLOP/s | "
          "x _grouped_mm | x dense | gate_up / h equal to Triton |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for v in r["variants"]:
            t = v.get("tflops", float("nan"))
            print(f"| {r['experts']} | {r['grouped_mm']:.0f} | {r['dense']:.0f} | {r['triton']:.0f} | {v['cfg']} | "
                  f"{t:.0f} | {t / r['grouped_mm']:.2f} | {t / r['dense']:.2f} | "
                  f"{v.get('gu_equal')} / {v.get('h_equal')} {v.get('error', '')} |")


if __name__ == "__main__":
    main()
