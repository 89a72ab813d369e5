"""Grouped expert GEMMs and the whole MoE layer on a GPU (issue 14), for ``bench_moe.py --sections experts layer``.

Shapes: T tokens (8192; the layer also 16384), top-6, D = 4096, gate+up width 2I = 4096, bf16, clamped SwiGLU
(limit 10), random routing; E = 256 (EP 1) and 32 (EP 8) local experts. Medians of ``triton.testing.do_bench``.

- **Grouped GEMM** (gate+up, forward): a per-expert ``torch.matmul`` loop, ``torch._grouped_mm`` (weights as
  stored [E, D, 2I] and column-major, the faster reported), one dense GEMM of the same FLOPs, and the fused
  ``_grouped_gate_up`` (which also writes h, the SwiGLU, from its epilogue), after a launch-setting sweep; the
  fused result is checked against ``_grouped_mm`` first. Then each other GEMM of the op (down, d_gate_up, d_rows,
  d_weight) is swept alone and the winners installed in ``kernel.TUNE`` for what follows. The sweep's candidates
  (``CANDIDATES``: tiles, pointer or TMA-descriptor loads, one program per tile or a persistent grid) are each
  checked against the first one's result (run 1's pointer kernel) before they may win; ``sweep_table`` prints
  them all. ``warm`` compiles them (untimed, in parallel shards) so the timed run finds Triton's cache full.
- **Experts** forward and forward + backward: fused vs the ``_grouped_mm`` mirror (autograd) vs fleet_ext's padded
  reference (``padded_experts``); errors of
  both against an fp32 torch reference on the same bf16 operands (relative Frobenius norms).
- **Whole layer** (router + permute + experts + unpermute, forward + backward, router GEMM included): the eager
  mirror of fleet_ext's reference path (padded batched experts after one host read, ``index_add_``), a mirror on
  ``torch._grouped_mm`` (device offsets), all fused (the ``moe_router`` kernels and its logits GEMM
  ``moe_router.kernel_gemm``, + ``moe_permute`` + ``moe_experts`` kernels);
  peak memory of one forward + backward above what the inputs and weights hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import triton
from bench_fusions import steady_ms  # scripts/bench is on sys.path wherever this module is imported
from torch import Tensor

from fleet_ext.ops.moe_experts import kernel as ek
from fleet_ext.ops.moe_experts import kernel_bwd as ekb
from fleet_ext.ops.moe_permute import kernel as pk
from fleet_ext.ops.moe_router import kernel as rk
from fleet_ext.ops.moe_router import kernel_gemm as rg

T, D, K, INTER, LIMIT, SCALING = 8192, 4096, 6, 2048, 10.0, 2.5
DEVICE = "cuda"
# Launch settings swept per GEMM: ek.Launch(BM, BN, BK, GROUP_M, warps, stages, tma, persistent); the first of each
# list is the setting of the first run (2026-12-01: pointer loads, one program per tile), the reference every other
# candidate's result is checked against before it may win.
CANDIDATES: dict[str, list[tuple]] = {
    "gate_up": [(128, 128, 64, 8, 8, 4, False, 0), (128, 128, 64, 8, 8, 4, True, 0), (128, 128, 64, 8, 8, 4, True, 1),
                (128, 128, 64, 8, 8, 3, True, 2), (64, 128, 64, 8, 4, 3, True, 2), (64, 256, 64, 8, 8, 2, True, 2)],
    "down": [(128, 256, 64, 8, 8, 3, False, 0), (128, 256, 64, 8, 8, 4, True, 0), (128, 256, 64, 8, 8, 3, True, 2),
             (64, 256, 64, 8, 4, 4, True, 2)],
    "d_gate_up": [(64, 128, 64, 8, 4, 4, False, 0), (64, 128, 64, 8, 4, 4, True, 0), (64, 128, 64, 8, 4, 3, True, 2),
                  (128, 128, 64, 8, 8, 3, True, 2), (128, 256, 64, 8, 8, 4, True, 0), (128, 256, 64, 8, 8, 3, True, 1)],
    "d_rows": [(128, 256, 64, 8, 8, 3, False, 0), (128, 256, 64, 8, 8, 4, True, 0), (128, 256, 64, 8, 8, 3, True, 2)],
    "d_weight": [(128, 128, 32, 1, 4, 4, False, 0), (128, 256, 64, 1, 8, 3, False, 0), (128, 256, 64, 1, 8, 3, True, 0),
                 (128, 256, 64, 1, 8, 3, True, 2), (128, 128, 64, 1, 4, 4, True, 2)],
}
SWEEP_REP_MS = 100
LAYER_ROUNDS = 3  # whole-layer rows: median of this many alternating rounds (one round moved ~2-3 % call to call)


def median_ms(fn: Callable, rep: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rel_norm(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def routing(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [T, k] of random top-k routing, counts [E] int64)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=gen, device=DEVICE).topk(K, dim=-1).indices.contiguous()
    return idx, torch.bincount(idx.reshape(-1), minlength=experts)


def weights(experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w1 = (torch.randn(experts, D, 2 * INTER, generator=gen, device=DEVICE) * (3.0 / D**0.5)).bfloat16()
    w2 = (torch.randn(experts, INTER, D, generator=gen, device=DEVICE) / INTER**0.5).bfloat16()
    return w1, w2


def offsets32(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0).to(torch.int32)


# -- the experts alone ----------------------------------------------------------------------------------------
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)


def loop_experts(x: torch.Tensor, host_counts: list[int], w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The reference's per-expert loop (host counts) in eager torch."""
    outs, start = [], 0
    for e, n in enumerate(host_counts):
        if n:
            outs.append(swiglu(x[start:start + n] @ w1[e]) @ w2[e])
            start += n
    return torch.cat(outs)


def padded_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """fleet_ext's reference (``moe_experts/reference.py``): rows scattered into a zero [E, C, D] buffer,
    C = max(counts) rounded up to 16 (one host read), two batched GEMMs around the SwiGLU, rows gathered back."""
    experts, n = w1.shape[0], x.shape[0]
    capacity = max(-(-int(counts.max()) // 16), 1) * 16
    ends = counts.cumsum(0)
    rows = torch.arange(n, device=x.device)
    expert = torch.searchsorted(ends, rows, right=True)
    slots = expert * capacity + rows - (ends - counts)[expert]
    grouped = torch.zeros(experts * capacity, x.shape[1], dtype=x.dtype, device=x.device).index_copy(0, slots, x)
    h = swiglu(torch.bmm(grouped.view(experts, capacity, -1), w1))
    return torch.bmm(h, w2).view(experts * capacity, -1)[slots]


def grouped_experts(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same on ``torch._grouped_mm`` (device offsets, autograd through it)."""
    return torch._grouped_mm(swiglu(torch._grouped_mm(x, w1, offs=offs)), w2, offs=offs)


def fused_fwd_bwd(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, g: Tensor) -> tuple[Tensor, ...]:
    out, gate_up, _ = ek.experts_forward(x, counts, w1, w2, LIMIT)
    return (out, *ekb.experts_backward(g, x, counts, w1, w2, gate_up, LIMIT))


def autograd_fwd_bwd(fn: Callable, x: Tensor, w1: Tensor, w2: Tensor, g: Tensor, *args: Any) -> tuple[Tensor, ...]:
    leaves = [t.detach().requires_grad_(True) for t in (x, w1, w2)]
    out = fn(leaves[0], *args, leaves[1], leaves[2])
    return (out, *torch.autograd.grad(out, leaves, g))


def _as_list(result: Any) -> list[Tensor]:
    return [t for t in (result if isinstance(result, (tuple, list)) else [result]) if t is not None]


def sweep_role(role: str, regime: str, fn: Callable, log: Callable, timed: bool = True) -> dict[str, Any]:
    """Run ``fn`` under each candidate of ``role`` (installed in kernel.TUNE): its result checked against the first
    candidate's (relative norm, byte equality), then timed; the fastest correct one stays installed. ``timed``
    False: run each once (compiles it; ``--warm``)."""
    runs, ref = [], None
    for cfg in map(ek.Launch._make, CANDIDATES[role]):
        ek.TUNE[role][regime] = cfg
        try:
            got = _as_list(fn())
            ref = got if ref is None else ref
            rel = max(rel_norm(a, b) for a, b in zip(got, ref))
            same = all(torch.equal(a, b) for a, b in zip(got, ref))
            del got
            ms = median_ms(fn, rep=SWEEP_REP_MS) if timed else float("nan")
            runs.append({"cfg": cfg, "ms": ms, "rel_vs_first": rel, "same_bytes_as_first": same, "ok": rel < 1e-2})
        except Exception as exc:  # e.g. out of shared memory: report, go on
            log(f"sweep {role} {regime} {tuple(cfg)}: {type(exc).__name__}: {str(exc)[:200]}")
            runs.append({"cfg": cfg, "ms": float("nan"), "error": f"{type(exc).__name__}: {str(exc)[:200]}",
                         "ok": False})
    good = [r for r in runs if r["ok"] and r["ms"] == r["ms"]] or [runs[0]]
    best = min(good, key=lambda r: r["ms"])
    ek.TUNE[role][regime] = best["cfg"]
    log(f"sweep {role} {regime}: " + ", ".join(
        f"{tuple(r['cfg'])}: {r['ms'] * 1e3:.0f} us{'' if r['ok'] else ' FAILED CHECK'}"
        f"{' same bytes' if r.get('same_bytes_as_first') else ''}" for r in runs) + f" -> {tuple(best['cfg'])}")
    return {"best": best, "runs": runs}


def gemm_rows(experts: int, log: Callable) -> dict[str, Any]:
    """The grouped-GEMM table row of ``experts`` local experts, the other GEMMs' sweeps, the experts fwd/bwd rows."""
    idx, counts = routing(T, experts, seed=experts)
    n = T * K
    regime = "small" if n < ek.SMALL_GROUP_ROWS * experts else "large"
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(n, D, generator=gen, device=DEVICE).bfloat16()
    w1, w2 = weights(experts, seed=2)
    host, offs = counts.tolist(), offsets32(counts)
    flops = 2 * n * D * 2 * INTER
    row: dict[str, Any] = {"experts": experts, "regime": regime, "rows_min": min(host), "rows_max": max(host)}
    w1_cm = w1.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, column-major per expert
    dense = torch.randn(D, 2 * INTER, generator=gen, device=DEVICE).bfloat16()
    want = torch._grouped_mm(x, w1, offs=offs)
    row["check_gate_up_vs_grouped_mm"] = rel_norm(ek.gate_up(x, counts, w1, LIMIT)[0], want)
    segments = [(e, s - c, c) for e, (s, c) in enumerate(zip(torch.tensor(host).cumsum(0).tolist(), host)) if c]
    row["loop_ms"] = median_ms(lambda: [x[s:s + c] @ w1[e] for e, s, c in segments])
    row["grouped_ms"] = median_ms(lambda: torch._grouped_mm(x, w1, offs=offs))
    row["grouped_cm_ms"] = median_ms(lambda: torch._grouped_mm(x, w1_cm, offs=offs))
    row["dense_ms"] = median_ms(lambda: x @ dense)
    ek.GATE_UP_KERNEL = "triton"  # the sweep is over the Triton kernel's settings
    sweep = sweep_role("gate_up", regime, lambda: ek.gate_up(x, counts, w1, LIMIT), log)
    ek.GATE_UP_KERNEL = "auto"
    row["triton_ms"], row["triton_cfg"] = sweep["best"]["ms"], sweep["best"]["cfg"]
    row["fused_ms"], row["fused_cfg"] = row["triton_ms"], row["triton_cfg"]
    if ek.use_ws_gate_up(x, w1):  # the default on Hopper for small groups: the warp-specialised kernel
        row["fused_ms"], row["fused_cfg"] = median_ms(lambda: ek.gate_up(x, counts, w1, LIMIT)), dict(ek.WS_GATE_UP)
    row["sweep"] = {"gate_up": sweep["runs"]}
    for key in ("loop", "grouped", "grouped_cm", "dense", "fused", "triton"):
        row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
    row["grouped_best_tflops"] = max(row["grouped_tflops"], row["grouped_cm_tflops"])
    _sweep_rest(x, counts, w1, w2, regime, row, log)
    _experts_rows(x, counts, host, offs, w1, w2, row, log)
    return row


def rest_roles(x: Tensor, counts: Tensor, w1: Tensor, w2: Tensor) -> dict[str, tuple[Callable, int]]:
    """The op's other four GEMMs alone on realistic operands: role -> (run, FLOPs); each run returns its result."""
    n = x.shape[0]
    gate_up, h = ek.gate_up(x, counts, w1, LIMIT)
    g = torch.randn_like(x)
    out = torch.empty_like(x)
    d_gate_up, _ = ekb.gate_up_backward(g, counts, w2, gate_up, LIMIT)
    d_w1, d_w2 = torch.empty_like(w1), torch.empty_like(w2)
    s1 = w1.stride()

    def down():
        ek.rows_gemm(h, w2, counts, out, INTER, D, tuple(w2.stride()), "down")
        return out

    def d_rows():
        ek.rows_gemm(d_gate_up, w1, counts, out, 2 * INTER, D, (s1[0], 1, s1[1]), "d_rows")
        return out

    def d_weight():
        ekb.weight_grad(x, d_gate_up, counts, d_w1)
        ekb.weight_grad(h, g, counts, d_w2)
        return d_w1, d_w2

    return {"down": (down, 2 * n * INTER * D),
            "d_gate_up": (lambda: ekb.gate_up_backward(g, counts, w2, gate_up, LIMIT), 2 * n * D * INTER),
            "d_rows": (d_rows, 2 * n * 2 * INTER * D), "d_weight": (d_weight, 2 * n * D * 3 * INTER)}


def _sweep_rest(x, counts, w1, w2, regime, row, log) -> None:
    """Sweep the other four GEMMs of the op alone, on realistic operands."""
    for role, (fn, flops) in rest_roles(x, counts, w1, w2).items():
        sweep = sweep_role(role, regime, fn, log)
        ms, cfg = sweep["best"]["ms"], sweep["best"]["cfg"]
        row[f"{role}_ms"], row[f"{role}_cfg"], row[f"{role}_tflops"] = ms, cfg, flops / (ms * 1e-3) / 1e12
        row["sweep"][role] = [dict(r, tflops=flops / (r["ms"] * 1e-3) / 1e12) for r in sweep["runs"]]


def warm(shard: int, shards: int, log: Callable) -> None:
    """Compile every candidate of every role (``bench_moe.py --warm``): shard ``shard`` of ``shards`` runs each
    candidate once at the bench's shapes (32 experts: the same compiled kernels as 256), untimed; Triton's disk
    cache then serves the timed run."""
    idx, counts = routing(T, 32, seed=32)
    x = torch.randn(T * K, D, device=DEVICE).bfloat16()
    w1, w2 = weights(32, seed=2)
    roles = {"gate_up": (lambda: ek.gate_up(x, counts, w1, LIMIT), 0)}
    roles.update(rest_roles(x, counts, w1, w2))
    jobs = [(role, i) for role in CANDIDATES for i in range(len(CANDIDATES[role]))]
    for role, i in jobs[shard::shards]:
        saved = CANDIDATES[role]
        CANDIDATES[role] = [saved[i]]
        try:
            sweep_role(role, "large", roles[role][0], log, timed=False)
        finally:
            CANDIDATES[role] = saved
    torch.cuda.synchronize()


def _experts_rows(x, counts, host, offs, w1, w2, row, log) -> None:
    """Experts forward and forward + backward: fused, the _grouped_mm mirror, the padded reference; errors vs fp32
    (a per-expert fp32 loop on the same bf16 values)."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    g = torch.randn(x.shape, generator=gen, device=DEVICE).bfloat16()
    fused = fused_fwd_bwd(x, counts, w1, w2, g)
    mirror = autograd_fwd_bwd(grouped_experts, x, w1, w2, g, offs)
    with no_tf32():  # fp32 reference on the same bf16 values
        ref = autograd_fwd_bwd(loop_experts, x.float(), w1.float(), w2.float(), g.float(), host)
    names = ("out", "d_rows", "d_weight1", "d_weight2")
    row["err_fused"] = {k: rel_norm(a, b) for k, a, b in zip(names, fused, ref)}
    row["err_grouped_mm"] = {k: rel_norm(a, b) for k, a, b in zip(names, mirror, ref)}
    del ref
    torch.cuda.empty_cache()
    again = fused_fwd_bwd(x, counts, w1, w2, g)
    row["deterministic"] = all(torch.equal(a, b) for a, b in zip(fused, again))
    row["experts_fwd_fused_ms"] = median_ms(lambda: ek.experts_forward(x, counts, w1, w2, LIMIT))
    row["experts_fwd_grouped_ms"] = median_ms(lambda: grouped_experts(x, offs, w1, w2))
    row["experts_fb_fused_ms"] = median_ms(lambda: fused_fwd_bwd(x, counts, w1, w2, g))
    row["experts_fb_grouped_ms"] = median_ms(lambda: autograd_fwd_bwd(grouped_experts, x, w1, w2, g, offs))
    row["experts_fb_padded_ms"] = median_ms(lambda: autograd_fwd_bwd(padded_experts, x, w1, w2, g, counts))
    log(f"experts E={row['experts']}: errors fused {row['err_fused']}, grouped_mm {row['err_grouped_mm']}, "
        f"deterministic {row['deterministic']}")


# -- the whole layer ------------------------------------------------------------------------------------------
def router_eager(x: Tensor, wr: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    logits = x.float() @ wr.t()
    s = torch.sqrt(F.softplus(logits))
    idx = torch.topk(s + bias, K, dim=-1).indices
    w = torch.gather(s, 1, idx)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * SCALING, idx


def layer_mirror(x: Tensor, wr: Tensor, bias: Tensor, w1: Tensor, w2: Tensor, experts: int, grouped: bool) -> Tensor:
    """Router, stable-argsort permute, experts (fleet_ext's padded reference, or _grouped_mm), index_add_ combine."""
    w, idx = router_eager(x, wr, bias)
    order = torch.argsort(idx.reshape(-1), stable=True)
    token_of = order // K
    rows = x[token_of]
    counts = torch.bincount(idx.reshape(-1), minlength=experts)
    y = grouped_experts(rows, offsets32(counts), w1, w2) if grouped else padded_experts(rows, counts, w1, w2)
    scaled = (y.float() * w.reshape(-1)[order][:, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, scaled)


def layer_fused_fwd_bwd(x: Tensor, wr: Tensor, bias: Tensor, w1: Tensor, w2: Tensor, g: Tensor,
                        experts: int) -> tuple[Tensor, ...]:
    """All fused: router GEMM, router, permute, experts, unpermute kernels forward, then their backwards; x's two
    gradients added in x's dtype, as autograd adds them."""
    logits = rg.logits(x, wr)
    scores, w, idx, _ = rk.route(logits, bias, K, True, SCALING, score="sqrtsoftplus")
    rows_map, srcs, counts, _ = pk.route(idx, experts)
    rows = pk.permute(x, rows_map)
    y, gate_up, _ = ek.experts_forward(rows, counts, w1, w2, LIMIT)
    out = pk.unpermute(y, w, rows_map, srcs)
    d_y, d_w = pk.unpermute_backward(g, y, w, rows_map, srcs)
    d_rows, d_w1, d_w2 = ekb.experts_backward(d_y, rows, counts, w1, w2, gate_up, LIMIT)
    d_logits = rk.route_backward(d_w, scores, idx, True, SCALING, score="sqrtsoftplus", logits=logits)
    d_x_router, d_wr = rg.logits_backward(d_logits, x, wr)
    return out, pk.permute_backward(d_rows, rows_map, x.dtype) + d_x_router, d_wr, d_w1, d_w2


def layer_inputs(tokens: int, experts: int) -> tuple[Tensor, ...]:
    """(x, router weight, bias, W1, W2, output gradient) of the whole-layer rows, from fixed seeds."""
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    x = torch.randn(tokens, D, generator=gen, device=DEVICE).bfloat16()
    wr = torch.randn(experts, D, generator=gen, device=DEVICE) * 0.02
    bias = torch.randn(experts, generator=gen, device=DEVICE) * 0.01
    g = torch.randn(tokens, D, generator=gen, device=DEVICE).bfloat16()
    w1, w2 = weights(experts, seed=12)
    return x, wr, bias, w1, w2, g


def layer_rows(tokens: int, experts: int, log: Callable) -> dict[str, Any]:
    x, wr, bias, w1, w2, g = layer_inputs(tokens, experts)

    def mirror(grouped: bool):
        def run():
            leaves = [t.detach().requires_grad_(True) for t in (x, wr, w1, w2)]
            out = layer_mirror(leaves[0], leaves[1], bias, leaves[2], leaves[3], experts, grouped)
            return (out, *torch.autograd.grad(out, leaves, g))
        return run

    variants = {"eager": mirror(False), "grouped_mm": mirror(True),
                "fused": lambda: layer_fused_fwd_bwd(x, wr, bias, w1, w2, g, experts)}
    row: dict[str, Any] = {"tokens": tokens, "experts": experts}
    results = {}
    for name, fn in variants.items():  # peak above what is allocated before (inputs, weights, eager's results)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        results[name] = fn()
        torch.cuda.synchronize()
        row[f"{name}_peak_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        if name != "eager":
            row[f"err_{name}_vs_eager"] = {k: rel_norm(a, b) for k, a, b in zip(
                ("out", "d_x", "d_router", "d_w1", "d_w2"), results[name], results["eager"])}
            del results[name]
        torch.cuda.empty_cache()
    del results
    torch.cuda.empty_cache()
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    steady: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(LAYER_ROUNDS):  # the variants take turns, so a drift of the GPU's clock reaches all of them
        for name, fn in variants.items():
            rounds[name].append(median_ms(fn, rep=200))
            steady[name].append(steady_ms(fn))
            torch.cuda.empty_cache()
    for name, times in rounds.items():
        row[f"{name}_ms"] = sorted(times)[len(times) // 2]
        row[f"{name}_rounds_ms"] = times
        row[f"{name}_steady_ms"] = sorted(steady[name])[len(times) // 2]
        row[f"{name}_steady_rounds_ms"] = steady[name]
    log(f"layer T={tokens} E={experts}: {row}")
    return row


# -- the RESULTS.md tables ------------------------------------------------------------------------------------
def _verdict(ratio: float, goal: float) -> str:
    return f"**{'met' if ratio >= goal else 'missed'}** ({ratio:.2f}x, goal {goal}x)"


def goals(gemm: list[dict], layer: list[dict]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) of issue 14's grouped-GEMM and whole-layer goals."""
    out = []
    for r in gemm:
        if r["experts"] == 256:
            ratio = r["fused_tflops"] / r["grouped_best_tflops"]
            out.append(("grouped gate+up GEMM >= 1.0x `torch._grouped_mm`, 256 experts",
                        f"{r['fused_tflops']:.0f} vs {r['grouped_best_tflops']:.0f} TFLOP/s", _verdict(ratio, 1.0)))
        if r["experts"] == 32:
            ratio = r["fused_tflops"] / r["dense_tflops"]
            out.append(("grouped gate+up GEMM >= 0.95x the dense GEMM of the same FLOPs, 32 experts",
                        f"{r['fused_tflops']:.0f} vs {r['dense_tflops']:.0f} TFLOP/s", _verdict(ratio, 0.95)))
    for r in layer:
        ratio = r["grouped_mm_ms"] / r["fused_ms"]
        out.append((f"whole MoE layer fwd+bwd >= 1.5x the `_grouped_mm` mirror, T={r['tokens']}, E={r['experts']}",
                    f"{r['fused_ms']:.2f} vs {r['grouped_mm_ms']:.2f} ms", _verdict(ratio, 1.5)))
    return out


def sweep_table(gemm: list[dict]) -> str:
    """Every candidate of every GEMM, per expert count: TFLOP/s (gate+up also against ``_grouped_mm`` and the
    dense GEMM measured in the same run) and its check against the first candidate."""
    lines = []
    for r in gemm:
        flops = 2 * T * K * D * 2 * INTER
        lines.append(f"E={r['experts']} rows/expert {r['rows_min']}-{r['rows_max']}: _grouped_mm "
                     f"{r['grouped_best_tflops']:.0f} TFLOP/s, dense {r['dense_tflops']:.0f}, "
                     f"loop {r['loop_tflops']:.0f}")
        for role, runs in r["sweep"].items():
            for run in runs:
                tf = flops / (run["ms"] * 1e-3) / 1e12 if role == "gate_up" else run.get("tflops", float("nan"))
                extra = (f" {tf / r['grouped_best_tflops']:.2f}x gmm {tf / r['dense_tflops']:.2f}x dense"
                         if role == "gate_up" else "")
                check = "ok" if run["ok"] else "FAIL"
                same = " =bytes" if run.get("same_bytes_as_first") else ""
                lines.append(f"  {role:9} {str(tuple(run['cfg'])):40} {run['ms'] * 1e3:8.0f} us {tf:6.0f} TF"
                             f"{extra} {check}{same}")
    return "\n".join(lines) + "\n"


def _errors(e: dict) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in e.items())


def markdown(gemm: list[dict], layer: list[dict], header: str) -> str:
    """The issue-14 tables for benchmarks/RESULTS.md from one run's rows."""
    lines = [f"Device: {header}.", "",
             "| gate+up GEMM, TFLOP/s | rows per expert | per-expert `torch.matmul` loop | `torch._grouped_mm` "
             "(stored / column-major weights) | one dense GEMM, same FLOPs | fused (+ SwiGLU epilogue, writes "
             "gate_up and h) | fused / `_grouped_mm` | fused / dense | launch (BM, BN, BK, GROUP_M, warps, stages, "
             "TMA, persistent) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in gemm:
        lines.append(
            f"| {r['experts']} local experts | {r['rows_min']}–{r['rows_max']} | {r['loop_tflops']:.0f} | "
            f"{r['grouped_tflops']:.0f} / {r['grouped_cm_tflops']:.0f} | {r['dense_tflops']:.0f} | "
            f"{r['fused_tflops']:.0f} | {r['fused_tflops'] / r['grouped_best_tflops']:.2f} | "
            f"{r['fused_tflops'] / r['dense_tflops']:.2f} | {tuple(r['fused_cfg'])} |")
    lines += ["", "| the op's other GEMMs (fused, TFLOP/s; launch setting) | down | d_gate_up (+ SwiGLU bwd, h "
              "recomputed) | d_rows | d_weight1 + d_weight2 (deterministic) |", "|---|---|---|---|---|"]
    for r in gemm:
        lines.append(f"| {r['experts']} local experts | " + " | ".join(
            f"{r[f'{k}_tflops']:.0f} {tuple(r[f'{k}_cfg'])}" for k in ("down", "d_gate_up", "d_rows", "d_weight"))
            + " |")
    lines += ["", "| experts (gate+up, SwiGLU, down), ms | fwd fused | fwd `_grouped_mm` | fwd+bwd fused | "
              "fwd+bwd `_grouped_mm` (autograd) | fwd+bwd fleet_ext reference (padded bmm) | error vs fp32, fused | "
              "error vs fp32, "
              "`_grouped_mm` | fused byte-identical run to run |", "|---|---|---|---|---|---|---|---|---|"]
    for r in gemm:
        lines.append(
            f"| {r['experts']} local experts | {r['experts_fwd_fused_ms']:.2f} | {r['experts_fwd_grouped_ms']:.2f} | "
            f"{r['experts_fb_fused_ms']:.2f} | {r['experts_fb_grouped_ms']:.2f} | "
            f"{r['experts_fb_padded_ms']:.2f} | "
            f"{_errors(r['err_fused'])} | {_errors(r['err_grouped_mm'])} | {'yes' if r['deterministic'] else 'NO'} |")
    lines += ["", "| whole MoE layer fwd+bwd | eager mirror of the reference path, ms | `_grouped_mm` mirror, ms | "
              "all fused, ms | "
              "fused vs `_grouped_mm` | fused vs eager | peak GB eager / `_grouped_mm` / fused | fused vs eager "
              "(rel. norm) |", "|---|---|---|---|---|---|---|---|"]
    for r in layer:
        lines.append(
            f"| T={r['tokens']}, {r['experts']} experts | {r['eager_ms']:.2f} | {r['grouped_mm_ms']:.2f} | "
            f"{r['fused_ms']:.2f} | {r['grouped_mm_ms'] / r['fused_ms']:.2f}x | {r['eager_ms'] / r['fused_ms']:.2f}x | "
            f"{r['eager_peak_gb']:.1f} / {r['grouped_mm_peak_gb']:.1f} / {r['fused_peak_gb']:.1f} | "
            f"{_errors(r['err_fused_vs_eager'])} |")
    lines += ["", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {v} |" for g, m, v in goals(gemm, layer)]
    return "\n".join(lines) + "\n"
