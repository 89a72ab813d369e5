"""Benchmark the Triton sparse MQA attention with sink (fleet_ext/ops/sparse_attn/kernel.py) on a GPU.

Run on the H200 (torch + Triton, no Paddle), from the repository root:

    python scripts/bench/bench_sparse_attn.py [--out DIR] [--shapes NAME ...] [--compare] [--baselines] [--variants]
        [--reduce-ab] [--dq-ab] [--partial-ab] [--band-ab]
        [--dense [--dense-shapes NAME ...] [--dense-table] [--dense-variants]]

The A/B and launch-setting sweeps (``--compare``, ``--variants``, ``--reduce-ab``, ``--dq-ab``, ``--partial-ab``,
``--band-ab``) live in ``sparse_attn_ab.py``.

Shapes (one sequence, B = 1; the kernels see the flat layout T = B * S):
- ``v32_s{4096,16384}_h{64,128}``: DeepSeek-V3.2 DSA latent MQA, d_qk 576 / d_v 512, 2048 index slots per
  query: a forced window of the 128 latest keys plus the top of random scores over the other visible keys,
  -1 where fewer keys are visible (early queries).
- ``v4csa_s*``: DSv4 CSA, h 64, d 512 (K = V), kv = [raw (s) ; compressed (s/4)], 128 window slots +
  top-512 of random scores over the visible compressed entries (c < (t+1)/4), -1 where not visible.
- ``v4hca_s*``: DSv4 HCA, h 64, d 512, 128 window slots + every visible compressed entry (c < (t+1)/128):
  K = 128 + s/128.
- ``v4win_s*``: a DSv4 window-only layer, h 64, d 512, the 128 window slots alone (kv = the raw rows).

FLOPs (dsv4_math.md §8), over *valid* (query, index) pairs only (the -1 slots are not counted):
fwd 2·H·(d_qk + d_v) per pair, bwd 2·H·(2·d_v + 3·d_qk) per pair (TileLang's accounting).
Times are medians of ``triton.testing.do_bench``. The default launchers derive each row's trailing bound
(last valid slot + 1, ``kernel.row_bound``) inside every call, so ``fwd_ms`` / ``bwd_ms`` include it.
``--compare`` also times, on the same inputs: the forward and backward without the bound
(``derive_bound=False``), the backward with the launch defaults before 2026-11-30's switch (dq BLOCK_N 32 /
2 stages, dkv-contribution BLOCK_M 64 / 4 warps) and no bound (the "before" configuration), the backward
with bf16 dkv contributions, ``row_bound`` alone, and checks that the bound changes no byte of out, lse,
dq, dkv, d_sink. Baselines: the unfused torch eager gather-softmax
(forward, and forward + autograd backward; only where it fits in memory) and
``torch.nn.attention.flex_attention`` with a block mask built from the index table and the sink applied
exactly afterwards (``out * sigmoid(lse - sink)``, ``lse' = logaddexp(lse, sink)``: flex has no
value-less sink column). Anchors: FlashMLA sparse prefill 640 TFLOP/s fwd and TileLang ~600 fwd on H800;
TileLang ~115 bwd (atomic, non-deterministic) on H200.

``--dense``: the dense causal mode's rows (no index table; ``bench_sparse_attn_dense.py`` says what each
holds): V3.2 latent shapes, dense fwd/bwd TFLOP/s over the causal pairs against the sparse forward of the same
shape, peak memory against the full-causal-table path (``--dense-table``), torch SDPA with a causal mask
(``--baselines``), launch-configuration variants (``--dense-variants``). ``--shapes`` with no name skips the
sparse rows.

Prints a short table last and writes ``bench_sparse_attn.json`` under --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # repo root, for fleet_ext

import sparse_attn_ab as ab  # noqa: E402
from sparse_attn_ab import kernel_breakdown, median_ms  # noqa: E402

from fleet_ext.ops import launch  # noqa: E402
from fleet_ext.ops.sparse_attn import band, kernel, kernel_config  # noqa: E402

DEV = "cuda"
ANCHORS = {"flashmla_fwd_h800": 640.0, "tilelang_fwd_h800": 600.0, "tilelang_bwd_h200": 115.0}


# ------------------------------------------------------------------------------------------------------
# index tables
# ------------------------------------------------------------------------------------------------------
def _topk_rows(score: torch.Tensor, k: int) -> torch.Tensor:
    val, idx = torch.topk(score, min(k, score.shape[1]), dim=-1)
    idx = torch.where(torch.isfinite(val), idx, -1)
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], k - idx.shape[1]), -1)], 1)
    return idx


def v32_index(seq: int, topk: int = 2048, window: int = 128, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    out = []
    for t0 in range(0, seq, 2048):
        t = torch.arange(t0, min(seq, t0 + 2048), device=DEV)[:, None]
        j = torch.arange(seq, device=DEV)[None, :]
        score = torch.rand((t.shape[0], seq), device=DEV, generator=gen)
        score = torch.where(j <= t, score, float("-inf"))
        score = torch.where((j <= t) & (j > t - window), 2.0, score)  # forced window first
        out.append(_topk_rows(score, topk))
    return torch.cat(out).to(torch.int32).contiguous()


def v4_index(seq: int, ratio: int, topk: int | None, window: int = 128, seed: int = 0) -> torch.Tensor:
    """[seq, window + width]: window slots into raw kv [0, seq), compressed slots into [seq, seq + seq/ratio)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    t = torch.arange(seq, device=DEV)[:, None]
    win = t - (window - 1) + torch.arange(window, device=DEV)[None, :]
    win = torch.where(win >= 0, win, -1)
    n_comp = seq // ratio
    visible = (t + 1) // ratio  # compressed entries c < visible
    c = torch.arange(n_comp, device=DEV)[None, :]
    if topk is None:  # HCA: every visible compressed entry
        comp = torch.where(c < visible, c + seq, -1)
    else:  # CSA: top-k of random indexer scores over the visible compressed entries
        parts = []
        for t0 in range(0, seq, 4096):
            rows = slice(t0, min(seq, t0 + 4096))
            score = torch.rand((rows.stop - rows.start, n_comp), device=DEV, generator=gen)
            score = torch.where(c < visible[rows], score, float("-inf"))
            parts.append(_topk_rows(score, topk))
        comp = torch.cat(parts)
        comp = torch.where(comp >= 0, comp + seq, -1)
    return torch.cat([win, comp], 1).to(torch.int32).contiguous()


def make_shape(name: str) -> dict:
    kind, s_part, *rest = name.split("_")
    seq = int(s_part[1:])
    if kind == "v32":
        heads = int(rest[0][1:])
        return {"name": name, "seq": seq, "heads": heads, "d_qk": 576, "d_v": 512, "n_kv": seq,
                "idx": lambda: v32_index(seq)}
    window = band.Band(0, 128, 1, -127)  # v4_index's window: slot j of query t holds key t - 127 + j
    if kind == "v4csa":
        return {"name": name, "seq": seq, "heads": 64, "d_qk": 512, "d_v": 512, "n_kv": seq + seq // 4,
                "idx": lambda: v4_index(seq, 4, 512), "bands": band.SlotBands(seq, seq + seq // 4, (window,))}
    if kind == "v4win":  # a window-only layer (V4-Flash's first two and its MTP layer)
        return {"name": name, "seq": seq, "heads": 64, "d_qk": 512, "d_v": 512, "n_kv": seq,
                "idx": lambda: v4_index(seq, 128, None)[:, :128].contiguous(),
                "bands": band.SlotBands(seq, seq, (window,))}
    if kind == "v4hca":  # ... and slot 128 + c entry c (row seq + c)
        return {"name": name, "seq": seq, "heads": 64, "d_qk": 512, "d_v": 512, "n_kv": seq + seq // 128,
                "idx": lambda: v4_index(seq, 128, None), "bands": band.SlotBands(
                    seq, seq + seq // 128, (window, band.Band(128, seq // 128, 0, seq - 128)))}
    raise ValueError(f"unknown shape {name}")


# ------------------------------------------------------------------------------------------------------
# baselines
# ------------------------------------------------------------------------------------------------------
def eager_sparse_attn(q, kv, idx, sink, scale, d_v):
    """The unfused gather-softmax-with-sink (bf16 GEMMs, fp32 softmax), autograd for the backward."""
    valid = idx >= 0
    g = kv[torch.where(valid, idx, 0).long()]  # [T, K, d]
    logits = torch.einsum("thd,tkd->thk", q, g).float() * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(logits.amax(-1), sink[None, :]).detach()
    e = torch.exp(logits - m[..., None])
    z = e.sum(-1) + torch.exp(sink[None, :] - m)
    p = (e / z[..., None]).to(q.dtype)
    out = torch.einsum("thk,tkd->thd", p, g[..., :d_v])
    return out, m + torch.log(z)


def flex_fn(q, kv, idx, sink, scale, d_v, n_kv):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seq = q.shape[0]
    dense = torch.zeros((seq, n_kv), dtype=torch.bool, device=DEV)
    valid = idx >= 0
    dense.scatter_(1, torch.where(valid, idx, 0).long(), valid)

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, None, None, seq, n_kv, device=DEV)
    flex = torch.compile(flex_attention, dynamic=False)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, d]
    k = kv.unsqueeze(0).unsqueeze(0)
    v = kv[:, :d_v].unsqueeze(0).unsqueeze(0)

    def make_run(options):
        def run():
            out, lse = flex(qh, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True,
                            kernel_options=options)
            # flex has no value-less sink column: apply it exactly afterwards
            gate = torch.sigmoid(lse - sink[None, :, None])
            return (out * gate[..., None].to(out.dtype)), torch.logaddexp(lse, sink[None, :, None])

        return run

    # flex's default tiles need more shared memory than an H200 has at head dims 512/576 (measured
    # 2026-11-30: "out of resource ... Required: 266240 / 430080, Hardware limit: 232448"): retry smaller tiles
    errors = []
    for options in (None, {"BLOCK_M": 32, "BLOCK_N": 32}, {"BLOCK_M": 16, "BLOCK_N": 16}):
        run = make_run(options)
        try:
            run()
            torch.cuda.synchronize()
            return run, block_mask, options, errors
        except Exception as exc:  # noqa: BLE001 - the next, smaller tile may fit
            errors.append(f"{options}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    raise RuntimeError("; ".join(errors))


# ------------------------------------------------------------------------------------------------------
def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    return 2 * n**3 / median_ms(lambda: a @ b) / 1e9


def _inputs(shape: dict) -> tuple:
    """(q, kv, idx, sink, d_out, scale) for one shape, from seed 0."""
    torch.manual_seed(0)
    seq, heads, d_qk, d_v, n_kv = shape["seq"], shape["heads"], shape["d_qk"], shape["d_v"], shape["n_kv"]
    q = torch.randn((seq, heads, d_qk), device=DEV, dtype=torch.bfloat16)
    kv = torch.randn((n_kv, d_qk), device=DEV, dtype=torch.bfloat16)
    idx = shape["idx"]()
    sink = torch.rand((heads,), device=DEV) * 3 - 1
    d_out = torch.randn((seq, heads, d_v), device=DEV, dtype=torch.bfloat16)
    return q, kv, idx, sink, d_out, 1.0 / math.sqrt(d_qk)


def _time_eager(row: dict, fl: dict, args, q, kv, idx, sink, d_out, scale, d_v) -> None:
    """--baselines: the unfused torch gather-softmax, forward and forward + autograd backward."""
    if q.shape[0] > args.eager_max_seq:
        row["eager"] = f"not run: s > {args.eager_max_seq} (gathered [s, K, d] and [s, h, K] logits exceed memory)"
        return
    try:
        row["eager_fwd_ms"] = median_ms(lambda: eager_sparse_attn(q, kv, idx, sink, scale, d_v), 5, 30)
        row["eager_fwd_tflops"] = fl["fwd"] / row["eager_fwd_ms"] / 1e9
        qg, kvg = q.detach().requires_grad_(True), kv.detach().requires_grad_(True)
        sg = sink.detach().requires_grad_(True)

        def eager_fb():
            o, _ = eager_sparse_attn(qg, kvg, idx, sg, scale, d_v)
            o.backward(d_out)

        torch.cuda.reset_peak_memory_stats()
        row["eager_fwdbwd_ms"] = median_ms(eager_fb, 3, 20)
        row["eager_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    except torch.OutOfMemoryError:
        row["eager"] = "out of memory"
    torch.cuda.empty_cache()


def _time_flex(row: dict, fl: dict, args, q, kv, idx, sink, scale, d_v, n_kv, out) -> None:
    """--baselines: flex_attention with a block mask from the index table (the sink applied afterwards)."""
    if q.shape[0] > args.flex_max_seq:
        row["flex"] = f"not run: s > {args.flex_max_seq}"
        return
    try:
        t0 = time.time()
        run, block_mask, options, errors = flex_fn(q, kv, idx, sink, scale, d_v, n_kv)
        row["flex_compile_s"] = round(time.time() - t0, 1)
        row["flex_kernel_options"] = str(options)
        row["flex_failed_options"] = errors
        row["flex_fwd_ms"] = median_ms(run, 5, 30)
        row["flex_fwd_tflops"] = fl["fwd"] / row["flex_fwd_ms"] / 1e9
        row["flex_block_density"] = round(1.0 - float(block_mask.sparsity()) / 100.0, 3)
        fo, flse = run()
        row["flex_out_rel_err"] = ((fo.float() - out.float()).norm() / out.float().norm()).item()
    except Exception as exc:  # noqa: BLE001 - record why flex cannot run this shape
        row["flex"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    torch.cuda.empty_cache()


def _print_row(shape: dict, row: dict) -> None:
    print(f"  {shape['name']}: fwd {row['fwd_ms']:.3f} ms {row['fwd_tflops']:.0f} TF/s | "
          f"bwd {row['bwd_ms']:.2f} ms {row['bwd_tflops']:.0f} TF/s | bitwise {row['bwd_bitwise_repeat']} | "
          + " ".join(f"{k} {row[k]:.3f}" if isinstance(row[k], float) else f"{k} {row[k]}"
                     for k in ("fwd_nobound_ms", "bwd_nobound_ms", "bwd_olddefaults_nobound_ms", "bwd_bf16part_ms",
                               "bound_us", "bound_bitwise") if k in row),
          flush=True)


def bench_shape(shape: dict, args, rows: list) -> None:
    q, kv, idx, sink, d_out, scale = _inputs(shape)
    seq, heads, d_qk, d_v, n_kv = shape["seq"], shape["heads"], shape["d_qk"], shape["d_v"], shape["n_kv"]
    pairs = int((idx >= 0).sum().item())
    fl = kernel.flops(pairs, heads, d_qk, d_v)
    row = {"shape": shape["name"], "seq": seq, "heads": heads, "d_qk": d_qk, "d_v": d_v, "K": idx.shape[1],
           "n_kv": n_kv, "valid_pairs": pairs, "valid_frac": round(pairs / idx.numel(), 4),
           "fwd_gflop": round(fl["fwd"] / 1e9, 1), "bwd_gflop": round(fl["bwd"] / 1e9, 1)}

    bound = kernel.row_bound(idx, n_kv)
    row["executed_frac"] = round(int(bound.sum().item()) / idx.numel(), 4)  # slots the bounded kernels walk

    def fwd(**kw):
        return kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=d_v, **kw)

    before = launch.LAUNCH_COUNTS["_sparse_attn_fwd_ws_kernel"]
    out, lse = fwd()
    row["fwd_kernel"] = "gluon_ws" if launch.LAUNCH_COUNTS["_sparse_attn_fwd_ws_kernel"] > before else "triton"
    row["fwd_ms"] = median_ms(fwd)
    row["fwd_tflops"] = fl["fwd"] / row["fwd_ms"] / 1e9
    row["ns_per_pair_fwd"] = row["fwd_ms"] * 1e6 / pairs
    if row["fwd_kernel"] != "triton":  # the Triton forward on the same inputs, same run
        kernel_config.FWD_KERNEL = "triton"
        try:
            out_t, lse_t = fwd()
            row["fwd_triton_ms"] = median_ms(fwd)
        finally:
            kernel_config.FWD_KERNEL = "auto"
        row["fwd_triton_tflops"] = fl["fwd"] / row["fwd_triton_ms"] / 1e9
        row["fwd_vs_triton_out_rel"] = float((out.float() - out_t.float()).norm() / out_t.float().norm())
        finite = torch.isfinite(lse_t)
        row["fwd_vs_triton_lse_maxabs"] = float((lse - lse_t)[finite].abs().max())
        del out_t, lse_t

    def bwd(**kw):
        return kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_v=d_v, **kw)

    g1 = bwd()
    g2 = bwd()
    torch.cuda.synchronize()
    row["bwd_bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(g1, g2))
    del g2
    if args.compare:
        out_f, lse_f = fwd(derive_bound=False)
        g_f = kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out_f, lse_f, d_out, d_v=d_v, derive_bound=False)
        torch.cuda.synchronize()
        row["bound_bitwise"] = all(torch.equal(a, b) for a, b in zip((out, lse, *g1), (out_f, lse_f, *g_f)))
        del out_f, lse_f, g_f
    del g1
    row["bwd_ms"] = median_ms(bwd, warmup=10, rep=60)
    row["bwd_tflops"] = fl["bwd"] / row["bwd_ms"] / 1e9
    if args.compare:
        ab.time_compare(row, fl, fwd, bwd, lambda: kernel.row_bound(idx, n_kv))
    if args.variants or args.compare:
        row["bwd_bf16part_ms"] = median_ms(lambda: bwd(partial_dtype="bfloat16"), warmup=10, rep=60)
        row["bwd_bf16part_tflops"] = fl["bwd"] / row["bwd_bf16part_ms"] / 1e9
    if args.compare:
        row["bwd_breakdown_ms"] = kernel_breakdown(bwd)
    if args.variants:
        ab.time_variants(row, fwd, bwd)
    if args.reduce_ab:
        ab.time_reduce_split(row, fl, bwd)
    if args.dq_ab:
        ab.time_dq_kernels(row, fl, bwd)
    if args.partial_ab:
        ab.time_partial_configs(row, fl, bwd)
    if args.partial_dtype:
        ab.partial_dtype_error(row, bwd, q, kv, idx, sink, d_out, scale, d_v, eager_sparse_attn)
    if args.band_ab and shape.get("bands") is not None:
        ab.band_ab(row, bwd, shape["bands"], q, kv, idx, sink, d_out, scale, d_v, eager_sparse_attn)
    _print_row(shape, row)
    if args.baselines:
        _time_eager(row, fl, args, q, kv, idx, sink, d_out, scale, d_v)
        _time_flex(row, fl, args, q, kv, idx, sink, scale, d_v, n_kv, out)
    rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", nargs="*", default=[
        "v32_s4096_h64", "v32_s4096_h128", "v32_s16384_h64", "v32_s16384_h128",
        "v4csa_s4096", "v4csa_s16384", "v4hca_s4096", "v4hca_s16384"])
    parser.add_argument("--baselines", action="store_true", help="eager and flex_attention baselines")
    parser.add_argument("--variants", action="store_true", help="time launch-configuration variants")
    parser.add_argument("--compare", action="store_true",
                        help="also time without the trailing bound, with the old backward defaults, and with bf16 "
                             "dkv contributions; check the bound changes no byte")
    parser.add_argument("--reduce-ab", action="store_true",
                        help="the dkv reduce with one program per row vs long rows split (alternating rounds)")
    parser.add_argument("--partial-ab", action="store_true",
                        help="launch settings of the dkv-contribution kernel (PARTIAL_AB), alternating rounds")
    parser.add_argument("--partial-dtype", action="store_true",
                        help="fp32 vs bf16 dkv contributions: errors against an fp32 reference, backward times")
    parser.add_argument("--dq-kernel", choices=["auto", "triton", "gluon"], default=None,
                        help="kernel_config.DQ_KERNEL for the whole run (sparse and dense backward)")
    parser.add_argument("--band-ab", action="store_true",
                        help="DSv4 shapes: the window (and HCA's entries) as band slots vs the CSR path")
    parser.add_argument("--dq-ab", action="store_true", help="the Triton dq kernel vs the warp-specialised Gluon one")
    parser.add_argument("--eager-max-seq", type=int, default=4096)
    parser.add_argument("--dense", action="store_true", help="dense causal mode rows (bench_sparse_attn_dense.py)")
    parser.add_argument("--dense-shapes", nargs="*", default=[
        "v32_s4096_h128", "v32_s4096_h64", "v32_s16384_h128", "v32_s16384_h64"])
    parser.add_argument("--dense-table", action="store_true",
                        help="dense rows: also run the full-causal-table path once (time, peak memory)")
    parser.add_argument("--dense-variants", action="store_true", help="dense rows: launch-configuration variants")
    parser.add_argument("--sdpa-max-seq", type=int, default=4096)
    parser.add_argument("--flex-max-seq", type=int, default=4096)
    args = parser.parse_args()
    if args.dq_kernel:
        kernel_config.DQ_KERNEL = args.dq_kernel

    props = torch.cuda.get_device_properties(0)
    mm_tflops = matmul_tflops()
    header = (f"{props.name}, sm{props.major}{props.minor}, {props.multi_processor_count} SMs, "
              f"torch {torch.__version__}, triton {triton.__version__}; bf16 8192^3 matmul {mm_tflops:.0f} TFLOP/s")
    print(header, flush=True)
    rows: list[dict] = []
    os.makedirs(args.out, exist_ok=True)
    command = "python scripts/bench/bench_sparse_attn.py " + " ".join(sys.argv[1:])
    dense_rows: list[dict] = []
    jobs = [("sparse", name) for name in args.shapes] + [("dense", name) for name in args.dense_shapes if args.dense]
    for kind, name in jobs:
        try:
            if kind == "sparse":
                bench_shape(make_shape(name), args, rows)
            else:
                from bench_sparse_attn_dense import bench_dense_shape

                dense_rows.append(bench_dense_shape(name, args, v32_index))
        except Exception:  # keep going: the table says which shape failed
            traceback.print_exc()
            (rows if kind == "sparse" else dense_rows).append(
                {"shape": name, "error": traceback.format_exc(limit=2)[-300:]})
            torch.cuda.empty_cache()
        with open(os.path.join(args.out, "bench_sparse_attn.json"), "w") as f:  # after each shape: a cut run keeps rows
            json.dump({"command": command, "device": header, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                       "anchors": ANCHORS, "rows": rows, "dense_rows": dense_rows}, f, indent=1, default=str)

    print("\nshape             K     valid  fwd ms  fwd TF/s  bwd ms   bwd TF/s  bitwise  eager fwd TF/s"
          "  flex fwd TF/s  fwd kernel  triton fwd TF/s  vs triton out rel")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:16s} ERROR {r['error'][-120:]!r}")
            continue
        eager = f"{r['eager_fwd_tflops']:.0f}" if "eager_fwd_tflops" in r else "-"
        flex = f"{r['flex_fwd_tflops']:.0f}" if "flex_fwd_tflops" in r else ("fail" if "flex" in r else "-")
        print(f"{r['shape']:16s} {r['K']:5d} {r['valid_frac']:6.3f} {r['fwd_ms']:7.3f} {r['fwd_tflops']:8.0f} "
              f"{r['bwd_ms']:8.2f} {r['bwd_tflops']:9.0f}  {str(r['bwd_bitwise_repeat']):7s} {eager:>14s} {flex:>14s}"
              f"  {r['fwd_kernel']:10s} {r.get('fwd_triton_tflops', float('nan')):15.0f}"
              f"  {r.get('fwd_vs_triton_out_rel', float('nan')):.2e}")
    if args.compare:
        print("\n[compare] ms (TFLOP/s over valid pairs); nobound = derive_bound=False; old = dq bn32s2 + partial "
              "bm64w4 defaults, no bound")
        print("shape            valid  exec  fwd nobound     fwd bound     bwd old        bwd nobound    bwd bound"
              "      bwd bound bf16  bound_us  identical")
        for r in rows:
            if "error" in r or "bwd_olddefaults_nobound_ms" not in r:
                continue

            def cell(key, r=r):
                return f"{r[key + '_ms']:6.2f} ({r[key + '_tflops']:3.0f})"

            print(f"{r['shape']:16s} {r['valid_frac']:5.3f} {r['executed_frac']:5.3f}  {cell('fwd_nobound')}  "
                  f"{cell('fwd')}  {cell('bwd_olddefaults_nobound')}  {cell('bwd_nobound')}  {cell('bwd')}  "
                  f"{cell('bwd_bf16part')}  {r['bound_us']:8.1f}  {r['bound_bitwise']}")
    if args.reduce_ab:
        print("\n[reduce-ab] backward ms (TFLOP/s), middle of 3 alternating rounds; reduce (+ combine) kernel ms")
        print("shape             bwd one per row   bwd rows split   gain   reduce whole  reduce split  combine  "
              "dkv rel diff  dq/d_sink same")
        for r in rows:
            if "bwd_reduce_whole_ms" not in r:
                continue
            red_w = r["breakdown_reduce_whole_ms"].get("_bwd_dkv_reduce_kernel", float("nan"))
            red_s = r["breakdown_reduce_split_ms"].get("_bwd_dkv_reduce_kernel", float("nan"))
            comb = r["breakdown_reduce_split_ms"].get("_bwd_dkv_combine_kernel", 0.0)
            print(f"{r['shape']:16s} {r['bwd_reduce_whole_ms']:7.2f} ({r['bwd_reduce_whole_tflops']:3.0f})    "
                  f"{r['bwd_reduce_split_ms']:7.2f} ({r['bwd_reduce_split_tflops']:3.0f})   "
                  f"{r['bwd_reduce_whole_ms'] / r['bwd_reduce_split_ms']:4.2f}x  {red_w:11.3f}  {red_s:11.3f}"
                  f"  {comb:7.3f}  {r['reduce_split_dkv_rel']:.2e}      {r['reduce_split_other_bitwise']}")
            print("    reduce settings (bwd ms / reduce ms): " + ", ".join(
                f"{k} {v['bwd_ms']:.2f}/{v['reduce_ms']:.3f}" for k, v in r["reduce_variants"].items()))
    if dense_rows:
        from bench_sparse_attn_dense import print_dense_table

        print_dense_table(dense_rows)
    print(f"anchors (TFLOP/s): {ANCHORS}; goals: fwd >= 450, deterministic bwd >= 150 at the V3.2 shape")


if __name__ == "__main__":
    main()
