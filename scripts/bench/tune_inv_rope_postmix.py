"""Tile sweep for the fast inverse-RoPE + postmix kernels (``kernel_fast``) on the GPU: checks, then times.

Run on the H200 (torch + Triton, no Paddle), repo root as the cwd:
    PYTHONPATH=. python3 scripts/bench/tune_inv_rope_postmix.py [--quick] [--out DIR]

Production shape: O [1, 16384, 64, 512] bf16, pe 64, M [64, 64] fp32 (what the layer hands the op). For every
launch configuration (ROWS per program, BLOCK_D, num_warps, STAGES) it checks the result against eager torch
(relative Frobenius error of y, d_out and d_M below 1e-2: a wrong tile is O(1)) and, for the backward, that two
runs give the same bytes; then times it with ``triton.testing.do_bench`` (median). Baselines of the same run:
the bare postmix GEMM, the eager forward, the eager backward (autograd of the unfused path). A configuration
that fails to compile or check is listed with the reason. Prints one table last (sorted by time per kind) and
writes tune_inv_rope_postmix.json; the best rows are what ``kernel_fast.plan`` should return on this GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # repo root, for fleet_ext
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))  # helpers.torch_rope

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

from helpers.torch_rope import eager_rope  # noqa: E402

from fleet_ext.ops.inv_rope_postmix import kernel_fast  # noqa: E402

SEQ, HEADS, DIM, PE = 16384, 64, 512, 64


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _grid(quick: bool, backward: bool) -> list[dict]:
    if backward:
        rows, blocks, warps, stages = ([32, 64], [64, 128], [4, 8], [1, 2]) if quick else \
            ([16, 32, 64, 128], [32, 64, 128], [4, 8], [1, 2, 3])
    else:
        rows, blocks, warps, stages = ([16, 32], [128, 256], [4, 8], [2, 3]) if quick else \
            ([4, 8, 16, 32], [64, 128, 256, 512], [4, 8], [2, 3, 4])
    return [{"ROWS": r, "BLOCK_D": b, "BLOCK_H": HEADS, "STAGES": s, "num_warps": w}
            for r, b, w, s in itertools.product(rows, blocks, warps, stages)]


def _problem() -> dict:
    torch.manual_seed(0)
    positions = torch.arange(SEQ, dtype=torch.float64, device="cuda")[:, None]
    angles = positions / (160000.0 ** (torch.arange(PE // 2, dtype=torch.float64, device="cuda") / (PE // 2)))
    u, v = 0.1 * torch.randn(HEADS, HEADS // 4, device="cuda"), 0.1 * torch.randn(HEADS, HEADS // 4, device="cuda")
    return {
        "out": torch.randn(1, SEQ, HEADS, DIM, device="cuda", dtype=torch.bfloat16),
        "grad": torch.randn(1, SEQ, HEADS, DIM, device="cuda", dtype=torch.bfloat16),
        "cos": torch.cos(angles).float(), "sin": torch.sin(angles).float(),
        "mix": torch.eye(HEADS, device="cuda") + v @ u.T,
    }


def _eager(p: dict) -> dict:
    """Eager results (for the checks) and the eager timings (baselines)."""
    out_leaf, mix_leaf = p["out"].clone().requires_grad_(True), p["mix"].clone().requires_grad_(True)
    y = torch.matmul(mix_leaf.to(torch.bfloat16), eager_rope(out_leaf, p["cos"], p["sin"], inverse=True))
    d_out, d_mix = torch.autograd.grad(y, [out_leaf, mix_leaf], p["grad"], retain_graph=True)
    mix16 = p["mix"].to(torch.bfloat16)
    times = {
        "bare_gemm": _ms(lambda: torch.matmul(mix16, p["out"])),
        "eager_fwd": _ms(lambda: torch.matmul(mix16, eager_rope(p["out"], p["cos"], p["sin"], inverse=True))),
        "eager_bwd": _ms(lambda: torch.autograd.grad(y, [out_leaf, mix_leaf], p["grad"], retain_graph=True)),
    }
    return {"y": y.detach(), "d_out": d_out, "d_mix": d_mix, "times": times}


def _try(kind: str, meta: dict, p: dict, want: dict) -> dict:
    row = {"kind": kind, **meta}
    args = (p["out"], p["cos"], p["sin"], p["mix"])
    try:
        if kind == "fwd":
            errors = [_rel(kernel_fast.forward(*args, meta=meta), want["y"])]
            fn = lambda: kernel_fast.forward(*args, meta=meta)  # noqa: E731
        else:
            first = kernel_fast.backward(*args, p["grad"], meta=meta)
            second = kernel_fast.backward(*args, p["grad"], meta=meta)
            if not all(torch.equal(a, b) for a, b in zip(first, second)):
                raise AssertionError("two runs differ (not deterministic)")
            errors = [_rel(first[0], want["d_out"]), _rel(first[1], want["d_mix"])]
            fn = lambda: kernel_fast.backward(*args, p["grad"], meta=meta)  # noqa: E731
        row["rel_err"] = max(errors)
        if not row["rel_err"] < 1e-2:
            raise AssertionError(f"relative error {row['rel_err']:.2e} vs eager")
        row["us"] = 1e3 * _ms(fn)
    except Exception as exc:  # noqa: BLE001 - a config that does not build or check is reported, not fatal
        row["error"] = f"{type(exc).__name__}: {exc}"[:160]
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a small grid (16 configurations per kernel)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    p = _problem()
    want = _eager(p)
    base = {k: 1e3 * v for k, v in want["times"].items()}
    rows = [_try(kind, meta, p, want) for kind in ("fwd", "bwd") for meta in _grid(args.quick, kind == "bwd")]
    defaults = {kind: kernel_fast.plan(SEQ, HEADS, DIM, backward=kind == "bwd") for kind in ("fwd", "bwd")}
    with open(os.path.join(args.out, "tune_inv_rope_postmix.json"), "w") as fh:
        json.dump({"gpu": props.name, "baselines_us": base, "defaults": defaults, "rows": rows}, fh, indent=1)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}; O [1,{SEQ},{HEADS},{DIM}] bf16")
    print("baselines (us): " + ", ".join(f"{k} {v:.1f}" for k, v in base.items()))
    print(f"defaults (kernel_fast.plan): fwd {defaults['fwd']}, bwd {defaults['bwd']}")
    print(f"{'kind':4} {'ROWS':>5} {'BLOCK_D':>7} {'warps':>5} {'stages':>6} {'us':>9} {'ratio':>14} {'rel err':>8}")
    for kind in ("fwd", "bwd"):
        ok = sorted((r for r in rows if r["kind"] == kind and "us" in r), key=lambda r: r["us"])
        for r in ok:
            ratio = (f"{r['us'] / base['bare_gemm']:.2f}x bare GEMM" if kind == "fwd"
                     else f"{base['eager_bwd'] / r['us']:.2f}x eager")
            print(f"{kind:4} {r['ROWS']:5} {r['BLOCK_D']:7} {r['num_warps']:5} {r['STAGES']:6} {r['us']:9.1f} "
                  f"{ratio:>14} {r['rel_err']:8.1e}")
        for r in (r for r in rows if r["kind"] == kind and "error" in r):
            print(f"{kind:4} {r['ROWS']:5} {r['BLOCK_D']:7} {r['num_warps']:5} {r['STAGES']:6}   failed: {r['error']}")


if __name__ == "__main__":
    main()
