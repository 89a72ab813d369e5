"""``bench_moe.py --sections router_gemm``: the router's fp32 logits GEMM and its backward, eager against fused.

Eager is what the layer's reference path runs (and the whole-layer mirrors): ``x.float() @ W^T`` with TF32 off
(fp32 on the CUDA cores), and autograd's backward of it: ``(d_logits @ W).to(x.dtype)`` and ``d_logits^T @
x.float()``. Fused is ``moe_router.kernel_gemm`` (``moe_router_logits_fusion``: for bf16 x, bf16 tensor-core
products of split operands; for fp32 x, as under bf16 O1 autocast where the residual stream stays fp32, TF32x3).
Each side's error is measured against float64 on the same values, per output: max |error| / max |reference|.
Launch settings of ``kernel_gemm.TUNE`` are swept (every candidate within the float64 bound before it may win).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import triton

from fleet_ext.ops.moe_router import kernel_gemm as kg

D = 4096
SWEEP = {  # (BM, BN, BK, warps, stages) per ``kernel_gemm.TUNE`` entry; the first is the committed default
    "logits": [(128, 128, 64, 8, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3)],
    "dx": [(64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3), (128, 64, 32, 4, 3)],
    "dw": [(64, 128, 32, 4, 4), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3), (64, 256, 32, 8, 3)],
    "logits_small": [(64, 64, 64, 4, 4), (64, 32, 128, 4, 4), (32, 64, 128, 4, 4), (128, 64, 64, 8, 3),
                     (64, 64, 128, 4, 3)],
    "dx_small": [(64, 128, 32, 4, 2), (64, 64, 32, 4, 2), (128, 128, 32, 8, 2), (32, 128, 32, 4, 2)],
    "dw_small": [(64, 128, 32, 4, 4), (32, 128, 32, 4, 4), (64, 256, 32, 8, 3), (32, 256, 32, 4, 4)],
}


def median_ms(fn: Callable, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300))


def inputs(tokens: int, experts: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(21)
    x = torch.randn(tokens, D, generator=gen, device="cuda").to(dtype)
    w = torch.randn(experts, D, generator=gen, device="cuda") * 0.02
    d_logits = torch.randn(tokens, experts, generator=gen, device="cuda") * 1e-3
    return x, w, d_logits


def eager_fwd(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.t()


def eager_bwd(d_logits: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (d_logits @ w).to(x.dtype), d_logits.t() @ x.float()


def kernel_us(fn: Callable, calls: int = 20) -> dict[str, float]:
    """GPU µs per call of each kernel ``fn`` launches (torch profiler over ``calls`` calls after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def _with(name: str, setting: tuple, fn: Callable) -> Any:
    saved = dict(kg.TUNE[name])
    kg.TUNE[name].update(zip(("BM", "BN", "BK", "warps", "stages"), setting))
    try:
        return fn()
    finally:
        kg.TUNE[name] = saved


def router_gemm_row(tokens: int, experts: int, log: Callable, dtype: torch.dtype = torch.bfloat16,
                    sweep: bool = True) -> dict[str, Any]:
    """One (T, E, x dtype) row: times and errors of eager and fused, forward and backward, and the sweep's."""
    x, w, d_logits = inputs(tokens, experts, dtype)
    want = {"logits": x.double() @ w.double().t(), "dx": d_logits.double() @ w.double(),
            "dw": d_logits.double().t() @ x.double()}
    torch.backends.cuda.matmul.allow_tf32 = False  # eager fp32 as the reference path runs it
    row: dict[str, Any] = {"tokens": tokens, "experts": experts, "dtype": str(dtype).replace("torch.", "")}
    got_eager = {"logits": eager_fwd(x, w), **dict(zip(("dx", "dw"), eager_bwd(d_logits, x, w)))}
    got_fused = {"logits": kg.logits(x, w), **dict(zip(("dx", "dw"), kg.logits_backward(d_logits, x, w)))}
    row["err_eager"] = {k: rel_max(v, want[k]) for k, v in got_eager.items()}
    row["err_fused"] = {k: rel_max(v, want[k]) for k, v in got_fused.items()}
    row["dw_deterministic"] = all(torch.equal(kg.logits_backward(d_logits, x, w)[1], got_fused["dw"])
                                  for _ in range(3))
    row["eager_fwd_ms"] = median_ms(lambda: eager_fwd(x, w))
    row["eager_bwd_ms"] = median_ms(lambda: eager_bwd(d_logits, x, w))
    row["fused_fwd_ms"] = median_ms(lambda: kg.logits(x, w))
    row["fused_bwd_ms"] = median_ms(lambda: kg.logits_backward(d_logits, x, w))
    row["sweep"] = {}
    runs = {"logits": lambda: kg.logits(x, w), "dx": lambda: kg.logits_backward(d_logits, x, w)[0],
            "dw": lambda: kg.logits_backward(d_logits, x, w)[1]}  # dx, dw: the whole backward, one setting moved
    small = "_small" if experts <= kg.SMALL_E else ""
    row["kernels_us"] = kernel_us(lambda: (kg.logits(x, w), kg.logits_backward(d_logits, x, w)))
    settings = itertools.chain.from_iterable(((n, s) for s in SWEEP[n + small]) for n in runs) if sweep else ()
    for base, setting in settings:
        name = base + small
        try:
            err = rel_max(_with(name, setting, runs[base]), want[base])
            ok = err <= 4 * max(row["err_fused"][base], row["err_eager"][base])
            ms = _with(name, setting, lambda run=runs[base]: median_ms(run)) if ok else None
            row["sweep"][f"{name} {setting}"] = {"ms": ms, "err": err, "ok": ok}
        except Exception as exc:  # a setting that does not compile (shared memory) is reported, not fatal
            row["sweep"][f"{name} {setting}"] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
    flops = 2 * tokens * experts * D
    row["tflops_fused_fwd"] = flops / row["fused_fwd_ms"] * 1e-9
    row["tflops_eager_fwd"] = flops / row["eager_fwd_ms"] * 1e-9
    log(f"router gemm T={tokens} E={experts} {row['dtype']}: {row}")
    return row


def markdown(rows: list[dict], header: str) -> str:
    lines = [f"{header}. Router logits GEMM at fp32 accuracy, D = {D}, fp32 W and d_logits; ms, medians of "
             "`do_bench`; error = max |error| / max |float64 result| (logits / d_x / d_w).", "",
             "| T, E, x | eager fwd | fused fwd | x | eager bwd | fused bwd | x | error eager | error fused | d_w "
             "byte-identical run to run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda e: " / ".join(f"{e[k]:.1e}" for k in ("logits", "dx", "dw"))  # noqa: E731
        cells = [f"{r['tokens']}, {r['experts']}, {r['dtype']}"]
        for side in ("fwd", "bwd"):
            eager, fused = r[f"eager_{side}_ms"], r[f"fused_{side}_ms"]
            cells += [f"{eager:.3f}", f"{fused:.3f}", f"{eager / fused:.2f}"]
        cells += [fmt(r["err_eager"]), fmt(r["err_fused"]), "yes" if r["dw_deterministic"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def sweep_lines(rows: list[dict]) -> str:
    out = []
    for r in rows:
        out.append(f"T={r['tokens']} E={r['experts']} {r['dtype']} kernels (us per call): "
                   + ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items()))
        for label, v in r["sweep"].items():
            out.append(f"T={r['tokens']} E={r['experts']} {label:32} " + (
                v.get("error") or f"{v['ms'] if v['ms'] is None else round(v['ms'], 4)!s:>8} ms err {v['err']:.1e}"))
    return "\n".join(out)
