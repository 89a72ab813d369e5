"""Time MoE routing, token movement, the grouped expert GEMMs and the whole layer on a GPU (issue 14).

Run on the H200 (torch + Triton, no Paddle):
    python scripts/bench/bench_moe.py [--out DIR] [--experts 256 32] [--sections route experts router_gemm layer]
    python scripts/bench/bench_moe.py --sections permute --no-compile --diagnose   # the permute section alone
    python scripts/bench/bench_moe.py --warm I/N   # compile shard I of N of the expert GEMMs' candidates, untimed

``route`` (this module) times the router and the permute / unpermute, as below; ``experts`` and ``layer``
(``cases_moe_experts.py``) time the grouped expert GEMMs against ``torch.matmul`` / ``torch._grouped_mm`` / a dense
GEMM (with a launch-setting sweep whose winners the rest uses) and the whole MoE layer (T = 8192 and 16384)
against an eager and a ``_grouped_mm`` mirror; they write moe_experts.md (the RESULTS.md tables) and
moe_experts.json. ``router_gemm`` (``cases_moe_router_gemm.py``) times the router's fp32 logits GEMM and its backward,
eager against ``moe_router.kernel_gemm``, at the layer's token counts. Route section:

T = 8192 tokens, top-6, D = 4096, bf16 hidden states, fp32 routing, random routing. Per expert count:

- router (sqrt-softplus scores, biased top-k, renormalised scaled weights, counts), forward and forward + backward;
- permute (stable sort by expert + row copy), unpermute (weighted combine), and their backwards.

Eager is the reference's op sequence in torch (``index_add_`` for the combine and for the gather's gradient,
as autograd does); ``torch.compile`` compiles that function; "fused" is ``fleet_ext.ops.moe_*.kernel``. Each
fused output is checked against the eager one before timing (bitwise where the tests say so, else close).
Bandwidth counts the fewest bytes (each input read once, each output written once) against a device-to-device
copy measured in the same run; the copy kernels' launch settings are swept and the best is reported (the
sweep is printed). The fused permute (``route_permute``: histogram, scan, rows + copy) sweeps ``PERMUTE_VARIANTS``
(changes to its ``TUNE``), each checked exactly against eager (rows, tables, counts, offsets) before timing, with
its CUDA-graph time and the CPU's enqueue time per call. ``--diagnose`` adds the routing alone, the copy alone
(rows given), the same bytes written in order by a torch broadcast copy, the copy kernel over other row patterns
(in order, slot-major, random; reading x or one row) and the write-only bandwidth. Times are
medians of ``triton.testing.do_bench``. Prints one table last, writes bench_moe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # repo root, for fleet_ext

import cases_moe_experts  # noqa: E402
import cases_moe_router_gemm  # noqa: E402

from fleet_ext.ops.moe_permute import kernel as permute_kernel  # noqa: E402
from fleet_ext.ops.moe_router import kernel as router_kernel  # noqa: E402

T, D, K = 8192, 4096, 6
DEVICE = "cuda"
COPY_VARIANTS = [(1, 2048, 8), (1, 4096, 8), (2, 1024, 4)]  # (BLOCK_T, BLOCK_D, warps)
# The fused permute (routing + rows + copy, three launches): changes to the kernel's TUNE, each checked against eager.
# Runs 2-4 (2026-12-01) also swept register caps 48 / 40 / 32, 16 and 4 warps, 2048-wide column blocks, two tokens
# per program, streaming hints, PDL off, routing block 64, 1-D slot ranks and (run 4) the copy on the bulk copy
# engine (a Gluon TMA ring): none faster (benchmarks/RESULTS.md), dropped. The default is timed twice (the spread).
PERMUTE_VARIANTS = {
    "base": {},  # the defaults in kernel.TUNE
    "base_again": {},
}
BWD_VARIANTS = [(2, 1024, 4), (1, 2048, 8), (2, 2048, 8)]  # the unpermute backward's (BLOCK_T, BLOCK_D, warps)
ROUTER_VARIANTS = [(2, 4), (4, 4), (8, 8)]  # (BLOCK_T, warps)


def median_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def copy_bandwidth_gbs(n_bytes: int = 2 << 30) -> float:
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    return 2 * n_bytes / (median_us(lambda: dst.copy_(src)) * 1e-6) / 1e9


def compiled_us(fn) -> tuple[float | None, str | None]:
    try:
        compiled = torch.compile(fn, dynamic=False)
        compiled()
        return median_us(compiled), None
    except Exception as exc:  # report, do not hide
        return None, f"{type(exc).__name__}: {exc}"[:160]


def eager_router(logits, bias, experts):
    s = torch.sqrt(F.softplus(logits))
    idx = torch.topk(s + bias, K, dim=-1).indices
    w = torch.gather(s, 1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
    return s, w, idx, torch.bincount(idx.reshape(-1), minlength=experts)


def close_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within six bf16 ulps of the largest value (six rounded adds in another order)."""
    return (got.float() - want.float()).abs().max().item() <= 6 * 2**-8 * want.float().abs().max().item()


def router_cases(experts: int) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(experts)
    logits = torch.randn(T, experts, generator=gen, device=DEVICE) * 2
    bias = torch.randn(experts, generator=gen, device=DEVICE) * 0.1
    grad = torch.randn(T, K, generator=gen, device=DEVICE)
    s, w, idx, counts = eager_router(logits, bias, experts)
    _, fw, fidx, fcounts = router_kernel.route(logits, bias, K, True, 2.5, score="sqrtsoftplus")
    top = torch.topk(s + bias, K + 1, dim=-1).values
    clear = (top[:, :-1] - top[:, 1:]).min(-1).values > 1e-5
    same = torch.equal(fidx[clear], idx[clear]) and torch.allclose(fw[clear], w[clear], rtol=1e-5, atol=1e-6)
    leaf = logits.clone().requires_grad_(True)

    def eager_fb():
        _, w_, _, _ = eager_router(leaf, bias, experts)
        return torch.autograd.grad(w_, leaf, grad)

    def fused():
        return router_kernel.route(logits, bias, K, True, 2.5, score="sqrtsoftplus")

    def fused_fb():
        sc, _, ix, _ = fused()
        return router_kernel.route_backward(grad, sc, ix, True, 2.5, score="sqrtsoftplus", logits=logits)

    small = T * K * 12 + experts * 8
    return [
        dict(name=f"router fwd E={experts}", eager=lambda: eager_router(logits, bias, experts), fused=fused,
             bytes=2 * T * experts * 4 + small, check=same and torch.equal(fcounts, counts), tune="router"),
        dict(name=f"router fwd+bwd E={experts}", eager=eager_fb, fused=fused_fb, bytes=5 * T * experts * 4 + 2 * small,
             check=same, tune="router"),
    ]


def permute_cases(experts: int) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(100 + experts)
    x = torch.randn(T, D, generator=gen, device=DEVICE).bfloat16()
    idx = torch.rand(T, experts, generator=gen, device=DEVICE).topk(K, dim=-1).indices.contiguous()
    w = torch.rand(T, K, generator=gen, device=DEVICE)
    g = torch.randn(T, D, generator=gen, device=DEVICE).bfloat16()
    order = torch.argsort(idx.reshape(-1), stable=True)
    token_of = order // K
    rows, srcs, _, _ = permute_kernel.route(idx, experts)
    y = x[token_of]  # expert outputs stand-in (permuted rows)

    def eager_permute():
        o = torch.argsort(idx.reshape(-1), stable=True)
        return x[o // K], torch.bincount(idx.reshape(-1), minlength=experts)

    def eager_unpermute():
        scaled = (y.float() * w.reshape(-1)[order][:, None]).bfloat16()
        return torch.zeros_like(x).index_add_(0, token_of, scaled)

    def eager_permute_bwd():
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def eager_unpermute_bwd():
        gr = g[token_of].float()
        d_y = (gr * w.reshape(-1)[order][:, None]).bfloat16()
        d_w = torch.empty(T * K, device=DEVICE).index_copy_(0, order, (gr * y.float()).sum(-1))
        return d_y, d_w

    def fused_permute():
        return permute_kernel.route_permute(x, idx, experts)

    def permute_ok() -> bool:
        """The fused permute's rows, tables, counts and offsets equal eager's exactly. The outputs' sizes are filled
        with NaN / -7 and freed first, so the caching allocator likely hands those blocks back: unwritten shows."""
        junk = [torch.full((T * K, D), float("nan"), dtype=torch.bfloat16, device=DEVICE),
                torch.full((2, T, K), -7, dtype=torch.int32, device=DEVICE),
                torch.full((2 * experts + 1,), -7, dtype=torch.int64, device=DEVICE)]
        del junk
        out, f_rows, f_srcs, f_counts, f_offsets = fused_permute()
        counts = torch.bincount(idx.reshape(-1), minlength=experts)
        row_of = torch.empty_like(order)
        row_of[order] = torch.arange(order.numel(), device=DEVICE)
        token_rows = row_of.view(T, K).sort(dim=-1).values
        return (torch.equal(out, x[order // K]) and torch.equal(f_rows.long(), token_rows)
                and torch.equal(f_srcs.long(), order[token_rows]) and torch.equal(f_counts, counts)
                and torch.equal(f_offsets, torch.cat([counts.new_zeros(1), counts.cumsum(0)])))

    moved = T * D * 2 * (1 + K)
    checks = {  # bitwise where the tests show it; vs index_add_ (atomics, any order): within 6 bf16 ulps
        "permute": permute_ok(),
        "unpermute": close_bf16(permute_kernel.unpermute(y, w, rows, srcs), eager_unpermute()),
        "permute_bwd": close_bf16(permute_kernel.permute_backward(y, rows, torch.bfloat16), eager_permute_bwd()),
        "unpermute_bwd": torch.equal(permute_kernel.unpermute_backward(g, y, w, rows, srcs)[0],
                                     eager_unpermute_bwd()[0]),
    }
    return [
        dict(name=f"permute E={experts}", eager=eager_permute, fused=fused_permute, bytes=moved,
             check=checks["permute"], tune="permute", recheck=permute_ok),
        dict(name=f"unpermute E={experts}", eager=eager_unpermute,
             fused=lambda: permute_kernel.unpermute(y, w, rows, srcs), bytes=moved, check=checks["unpermute"],
             tune="copy"),
        dict(name=f"permute bwd E={experts}", eager=eager_permute_bwd,
             fused=lambda: permute_kernel.permute_backward(y, rows, torch.bfloat16), bytes=moved,
             check=checks["permute_bwd"], tune="copy"),
        dict(name=f"unpermute bwd E={experts}", eager=eager_unpermute_bwd,
             fused=lambda: permute_kernel.unpermute_backward(g, y, w, rows, srcs), bytes=T * D * 2 * (1 + 2 * K),
             check=checks["unpermute_bwd"], tune="bwd"),
    ]


def sweep(case: dict) -> tuple[float, str, dict]:
    """The fused time under each launch setting; (best us, its label, all)."""
    times = {}
    if case["tune"] == "router":
        saved = dict(router_kernel.TUNE)
        for block_t, warps in ROUTER_VARIANTS:
            router_kernel.TUNE.update(block_t=block_t, warps=warps)
            times[f"bt{block_t}w{warps}"] = median_us(case["fused"])
        router_kernel.TUNE.update(saved)
    elif case["tune"] == "permute":
        return sweep_permute(case)
    else:
        saved = dict(permute_kernel.TUNE)
        if case["tune"] == "bwd":
            for block_t, block_d, warps in BWD_VARIANTS:
                permute_kernel.TUNE.update(bwd_block_t=block_t, bwd_block_d=block_d, bwd_warps=warps)
                times[f"bt{block_t}bd{block_d}w{warps}"] = median_us(case["fused"])
        else:
            for block_t, block_d, warps in COPY_VARIANTS:
                permute_kernel.TUNE.update(copy_block_t=block_t, copy_block_d=block_d, copy_warps=warps)
                times[f"bt{block_t}bd{block_d}w{warps}"] = median_us(case["fused"])
        permute_kernel.TUNE.update(saved)
    best = min(times, key=times.get)
    return times[best], best, times


def host_us(fn, calls: int = 30) -> float:
    """CPU time to enqueue one call (no synchronisation inside the loop: the GPU work queues up)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def sweep_permute(case: dict) -> tuple[float, str, dict]:
    """Each ``PERMUTE_VARIANTS`` entry: checked against eager (exact), then do_bench, CUDA graph and host enqueue
    times; (best do_bench us, its label, all). A variant that fails its check is reported and never chosen."""
    saved = dict(permute_kernel.TUNE)
    times, details = {}, {}
    for label, change in PERMUTE_VARIANTS.items():
        permute_kernel.TUNE.update(saved)
        permute_kernel.TUNE.update(change)
        try:
            ok = bool(case["recheck"]())
            fn = case["fused"]
            details[label] = dict(ok=ok, fused_us=median_us(fn), graph_us=graph_us(fn), host_us=host_us(fn))
        except Exception as exc:  # report, do not hide
            details[label] = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
        if details[label]["ok"]:
            times[label] = details[label]["fused_us"]
        print(f"  {case['name']} {label}: {details[label]}", flush=True)
    permute_kernel.TUNE.update(saved)
    case["variants"] = details
    best = min(times, key=times.get) if times else "none"
    return times.get(best, float("nan")), best, details


def graph_us(fn) -> float | None:
    """GPU time of ``fn`` replayed from a CUDA graph (no Python launch overhead), or None if it cannot be captured."""
    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception:  # e.g. a host sync inside fn
        return None


def compiled_info(fn) -> str:
    """Registers / spills of every compiled variant of a Triton kernel (best effort: Triton internals)."""
    out = []
    for cache in getattr(fn, "device_caches", {}).values():
        for compiled in (cache[0] if isinstance(cache, tuple) else cache).values():
            out.append(f"regs {getattr(compiled, 'n_regs', '?')} spills {getattr(compiled, 'n_spills', '?')}")
    return "; ".join(out) or "n/a"


def diagnose(experts: int) -> None:
    """Where the fused permute's time goes: the routing alone, the copy alone, both; GPU (graph) and CPU enqueue."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(T, D, generator=gen, device=DEVICE).bfloat16()
    idx = torch.rand(T, experts, generator=gen, device=DEVICE).topk(K, dim=-1).indices.contiguous()
    pk = permute_kernel
    rows = pk.route(idx, experts)[0]
    parts = {"route (3 launches)": lambda: pk.route(idx, experts),
             "copy alone (rows given)": lambda: pk.permute(x, rows),
             "route_permute (3 launches)": lambda: pk.route_permute(x, idx, experts)}
    for label, fn in parts.items():
        print(f"diag E={experts} {label}: graph {graph_us(fn)} us, do_bench {median_us(fn):.1f} us, "
              f"host {host_us(fn):.1f} us", flush=True)
    if experts == 32:
        return
    saved = dict(pk.TUNE)
    for block_t, block_d, warps in [*COPY_VARIANTS, (1, 4096, 4)]:
        pk.TUNE.update(copy_block_t=block_t, copy_block_d=block_d, copy_warps=warps)
        fn = lambda: pk.permute(x, rows)  # noqa: E731
        print(f"diag E={experts} copy alone bt{block_t}bd{block_d}w{warps}: graph {graph_us(fn)} us, "
              f"do_bench {median_us(fn):.1f} us", flush=True)
    pk.TUNE.update(saved)
    out = torch.empty(T * K, D, dtype=torch.bfloat16, device=DEVICE)
    broadcast = lambda: out.view(T, K, D).copy_(x[:, None, :].expand(T, K, D))  # noqa: E731
    print(f"diag same bytes as the permute, rows in order (torch broadcast copy x -> [T, k, D]): graph "
          f"{graph_us(broadcast)} us, do_bench {median_us(broadcast):.1f} us", flush=True)
    write_patterns(x, rows)
    write = torch.empty(1 << 29, dtype=torch.int32, device=DEVICE)  # 2 GiB, written only
    print(f"diag write-only bandwidth (zero_ of 2 GiB): {(2 << 30) / (median_us(write.zero_) * 1e-6) / 1e9:.0f} GB/s",
          flush=True)
    for name in ("_route_hist", "_route_scan", "_route_rows", "_permute_fwd", "_permute_copy", "_unpermute_fwd",
                 "_unpermute_bwd", "_permute_bwd"):
        print(f"diag {name}: {compiled_info(getattr(pk, name))}")
    for name in ("_router_fwd", "_router_counts", "_router_bwd"):
        print(f"diag {name}: {compiled_info(getattr(router_kernel, name))}")


def write_patterns(x: torch.Tensor, rows: torch.Tensor) -> None:
    """Where the copy's rows go, and whether x is read, against its time: the copy kernel (``permute``, rows given)
    writing the same bytes to the routing's rows, in order (token t to rows t*k ... t*k+k-1), slot-major (slot i of
    every token to one region) and to random rows; each from x and from one row read by every token (x's stride 0:
    the reads hit L2, so the stores alone)."""
    tokens, topk = rows.shape
    seq = torch.arange(tokens * topk, dtype=torch.int32, device=DEVICE).view(tokens, topk)
    patterns = {"routing": rows, "in order": seq, "slot-major": seq.view(topk, tokens).t().contiguous(),
                "random": torch.randperm(tokens * topk, device=DEVICE).int().view(tokens, topk)}
    one_row = x[:1].expand(tokens, x.shape[1])
    for label, r in patterns.items():
        for source, src in (("x", x), ("one row", one_row)):
            fn = lambda src=src, r=r: permute_kernel.permute(src, r)  # noqa: E731
            print(f"diag write pattern {label:10} from {source:7}: graph {graph_us(fn)} us, "
                  f"do_bench {median_us(fn):.1f} us", flush=True)


def experts_and_layer(args: argparse.Namespace, header: str) -> None:
    """The grouped-GEMM and whole-layer tables (``cases_moe_experts``): JSON and markdown under ``--out``."""
    def log(msg: str) -> None:
        print(msg, flush=True)

    gemm = [cases_moe_experts.gemm_rows(e, log) for e in args.experts] if "experts" in args.sections else []
    layer = []
    if "layer" in args.sections:
        for tokens in args.layer_tokens:
            for e in args.experts:
                layer.append(cases_moe_experts.layer_rows(tokens, e, log))
                torch.cuda.empty_cache()
    with open(os.path.join(args.out, "moe_experts.json"), "w") as fh:
        json.dump({"header": header, "gemm": gemm, "layer": layer,
                   "tune": cases_moe_experts.ek.TUNE}, fh, indent=1, default=str)
    table = cases_moe_experts.markdown(gemm, layer, header) if gemm else ""
    with open(os.path.join(args.out, "moe_experts.md"), "w") as fh:
        fh.write(table)
    print("\n" + table)
    if gemm:
        print(cases_moe_experts.sweep_table(gemm))


def router_gemm(args: argparse.Namespace, header: str) -> None:
    """The router logits GEMM table (``cases_moe_router_gemm``): JSON and markdown under ``--out``."""
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    rows = [cases_moe_router_gemm.router_gemm_row(t, e, log) for t in args.layer_tokens for e in args.experts]
    rows += [cases_moe_router_gemm.router_gemm_row(t, e, log, torch.float32, sweep=False)  # fp32 x: no sweep
             for t in args.layer_tokens for e in args.experts]
    with open(os.path.join(args.out, "moe_router_gemm.json"), "w") as fh:
        json.dump({"header": header, "rows": rows, "tune": cases_moe_router_gemm.kg.TUNE}, fh, indent=1)
    print(cases_moe_router_gemm.sweep_lines(rows))
    print("\n" + cases_moe_router_gemm.markdown(rows, header))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--experts", nargs="*", type=int, default=[256, 32])
    parser.add_argument("--sections", nargs="*", default=["route", "experts", "router_gemm", "layer"],
                        choices=["route", "permute", "experts", "router_gemm", "layer"],
                        help="route: router + permute cases; permute: the permute / unpermute cases only")
    parser.add_argument("--layer-tokens", nargs="*", type=int, default=[8192, 16384])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--only", nargs="*", default=[""], help="only the cases whose name starts with one of these")
    parser.add_argument("--diagnose", action="store_true", help="per-launch GPU times and launch-setting sweeps")
    parser.add_argument("--warm", default=None, metavar="I/N",
                        help="only compile shard I of N of the expert GEMMs' candidates (untimed), then exit")
    args = parser.parse_args()
    if args.warm:
        shard, shards = map(int, args.warm.split("/"))
        cases_moe_experts.warm(shard, shards, lambda msg: print(msg, flush=True))
        return
    props = torch.cuda.get_device_properties(0)
    header = f"{props.name}, sm{props.major}{props.minor}, torch {torch.__version__}, triton {triton.__version__}"
    if "router_gemm" in args.sections:
        router_gemm(args, header)
    if "experts" in args.sections or "layer" in args.sections:
        experts_and_layer(args, header)
    if "route" not in args.sections and "permute" not in args.sections:
        return
    copy_gbs = copy_bandwidth_gbs()
    print(header, f"\ndevice copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    rows = []
    for experts in args.experts:
        for case in (router_cases(experts) if "route" in args.sections else []) + permute_cases(experts):
            if not case["name"].startswith(tuple(args.only)):
                continue
            row = {"name": case["name"], "bytes": case["bytes"], "check": bool(case["check"])}
            row["eager_us"] = median_us(case["eager"])
            skipped = (None, "skipped")
            row["compile_us"], row["compile_error"] = skipped if args.no_compile else compiled_us(case["eager"])
            row["default_us"] = median_us(case["fused"])
            row["fused_us"], row["best"], row["sweep"] = sweep(case)
            row["variants"] = case.get("variants")
            row["graph_us"] = graph_us(case["fused"])  # the same launches replayed from a CUDA graph
            row["roof_us"] = case["bytes"] / (copy_gbs * 1e9) * 1e6
            row["pct_copy"] = 100 * row["roof_us"] / row["fused_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_moe.json"), "w") as fh:
        json.dump({"gpu": props.name, "header": header, "copy_gbs": copy_gbs, "rows": rows}, fh, indent=1)
    if args.diagnose:
        for experts in args.experts:
            diagnose(experts)
    for r in rows:
        for label, v in (r.get("variants") or {}).items():  # the fused permute's sweep: do_bench, graph, host enqueue
            print(f"sweep {r['name']:14} {label:12} ok={v['ok']!s:5} " + (
                f"{v['fused_us']:7.1f} graph {v['graph_us'] if v['graph_us'] is None else round(v['graph_us'], 1)!s:>6}"
                f" host {v['host_us']:6.1f}" if "fused_us" in v else v.get("error", "")))
    print(f"\n{header}; copy {copy_gbs:.0f} GB/s; T={T} D={D} k={K} bf16 rows, fp32 routing")
    print(f"{'case':24} {'eager':>8} {'compile':>8} {'fused':>8} {'dflt':>8} {'graph':>8} {'roof':>7} {'%copy':>6} "
          f"{'x eag':>6} {'x cmp':>6} ok  best")
    for r in rows:
        comp, graph = r["compile_us"], r["graph_us"]
        print(f"{r['name']:24} {r['eager_us']:8.1f} {comp if comp is None else round(comp, 1)!s:>8} "
              f"{r['fused_us']:8.1f} {r['default_us']:8.1f} {graph if graph is None else round(graph, 1)!s:>8} "
              f"{r['roof_us']:7.1f} {r['pct_copy']:6.1f} "
              f"{r['eager_us'] / r['fused_us']:6.2f} {'-' if comp is None else round(comp / r['fused_us'], 2)!s:>6} "
              f"{'y' if r['check'] else 'N':3} {r['best']}")


if __name__ == "__main__":
    main()
