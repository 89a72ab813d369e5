"""Benchmark the Triton sparse MQA attention with sink (fleet_ext/ops/sparse_attn/kernel.py) on a GPU.

Run on the H200 (torch + Triton, no Paddle), from the repository root:

    python scripts/bench/bench_sparse_attn.py [--out DIR] [--shapes NAME ...] [--compare] [--baselines] [--variants]
        [--dense [--dense-shapes NAME ...] [--dense-table] [--dense-variants]]

Shapes (one sequence, B = 1; the kernels see the flat layout T = B * S):
- ``v32_s{4096,16384}_h{64,128}``: DeepSeek-V3.2 DSA latent MQA, d_qk 576 / d_v 512, 2048 index slots per
  query: a forced window of the 128 latest keys plus the top of random scores over the other visible keys,
  -1 where fewer keys are visible (early queries).
- ``v4csa_s*``: DSv4 CSA, h 64, d 512 (K = V), kv = [raw (s) ; compressed (s/4)], 128 window slots +
  top-512 of random scores over the visible compressed entries (c < (t+1)/4), -1 where not visible.
- ``v4hca_s*``: DSv4 HCA, h 64, d 512, 128 window slots + every visible compressed entry (c < (t+1)/128):
  K = 128 + s/128.

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

from fleet_ext.ops import launch  # noqa: E402
from fleet_ext.ops.sparse_attn import kernel, kernel_config  # noqa: E402

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
    if kind == "v4csa":
        return {"name": name, "seq": seq, "heads": 64, "d_qk": 512, "d_v": 512, "n_kv": seq + seq // 4,
                "idx": lambda: v4_index(seq, 4, 512)}
    if kind == "v4hca":
        return {"name": name, "seq": seq, "heads": 64, "d_qk": 512, "d_v": 512, "n_kv": seq + seq // 128,
                "idx": lambda: v4_index(seq, 128, None)}
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
def median_ms(fn, warmup=25, rep=100) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def kernel_breakdown(fn) -> dict:
    """GPU time per kernel name for one call of fn (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" or getattr(evt, "self_device_time_total", 0):
            t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
            if t:
                out[evt.key[:48]] = round(t / 1e3, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


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


def _time_compare(row: dict, fl: dict, fwd, bwd, bound) -> None:
    """--compare: no trailing bound, the old backward launch defaults, the bound alone."""
    row["bound_us"] = median_ms(bound) * 1e3
    row["fwd_nobound_ms"] = median_ms(lambda: fwd(derive_bound=False))
    row["fwd_nobound_tflops"] = fl["fwd"] / row["fwd_nobound_ms"] / 1e9
    row["bwd_nobound_ms"] = median_ms(lambda: bwd(derive_bound=False), warmup=10, rep=60)
    row["bwd_nobound_tflops"] = fl["bwd"] / row["bwd_nobound_ms"] / 1e9
    kernel.OVERRIDES["dq"] = [{"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}]
    kernel.OVERRIDES["partial"] = [{"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}]
    try:
        row["bwd_olddefaults_nobound_ms"] = median_ms(lambda: bwd(derive_bound=False), warmup=10, rep=60)
        row["bwd_olddefaults_nobound_tflops"] = fl["bwd"] / row["bwd_olddefaults_nobound_ms"] / 1e9
    finally:
        kernel.OVERRIDES.pop("dq")
        kernel.OVERRIDES.pop("partial")


def _time_reduce_split(row: dict, fl: dict, bwd) -> None:
    """--reduce-ab: the dkv reduce with one program per kv row (``kernel.REDUCE_CHUNK`` past any row's length) vs
    long rows split into items (the default), three alternating rounds each; dkv's relative difference (rows of one
    item keep their bytes); the per-kernel breakdown of both; launch settings of the reduce."""
    runs: dict[str, list[float]] = {"whole": [], "split": []}
    grads, breakdown = {}, {}
    try:
        for _ in range(3):
            for mode, chunk in (("whole", 1 << 40), ("split", None)):
                kernel.REDUCE_CHUNK = chunk
                if mode not in grads:
                    grads[mode] = bwd()
                    breakdown[mode] = kernel_breakdown(bwd)
                runs[mode].append(median_ms(bwd, warmup=5, rep=40))
    finally:
        kernel.REDUCE_CHUNK = None
    dkv_w, dkv_s = grads["whole"][1].float(), grads["split"][1].float()
    row["reduce_split_dkv_rel"] = float((dkv_s - dkv_w).norm() / dkv_w.norm())
    row["reduce_split_other_bitwise"] = all(torch.equal(grads["whole"][k], grads["split"][k]) for k in (0, 2))
    for mode in runs:
        row[f"bwd_reduce_{mode}_ms"] = sorted(runs[mode])[1]
        row[f"bwd_reduce_{mode}_tflops"] = fl["bwd"] / row[f"bwd_reduce_{mode}_ms"] / 1e9
        row[f"breakdown_reduce_{mode}_ms"] = breakdown[mode]
    saved = dict(kernel_config.REDUCE_CONFIG_GPU)
    row["reduce_variants"] = {}
    try:  # launch settings of the reduce (BLOCK_P and warps change the lanes, hence the bits)
        for block_p, warps in ((16, 4), (16, 8), (32, 4), (32, 8)):
            kernel_config.REDUCE_CONFIG_GPU.update(BLOCK_P=block_p, num_warps=warps)
            ms = median_ms(bwd, warmup=5, rep=40)
            red = kernel_breakdown(bwd).get("_bwd_dkv_reduce_kernel", float("nan"))
            row["reduce_variants"][f"p{block_p}w{warps}"] = {"bwd_ms": ms, "reduce_ms": red}
    finally:
        kernel_config.REDUCE_CONFIG_GPU.clear()
        kernel_config.REDUCE_CONFIG_GPU.update(saved)


def _time_dq_kernels(row: dict, fl: dict, bwd) -> None:
    """--dq-ab: the backward with the Triton dq kernel vs the warp-specialised Gluon one (``kernel_config.DQ_KERNEL``,
    where it fits), three alternating rounds each; dq's and dkv's relative difference; both breakdowns."""
    runs: dict[str, list[float]] = {"triton": [], "gluon": []}
    grads, breakdown, default = {}, {}, kernel_config.DQ_KERNEL
    try:
        for _ in range(3):
            for choice in runs:
                kernel_config.DQ_KERNEL = choice
                if choice not in grads:
                    grads[choice] = bwd()
                    breakdown[choice] = kernel_breakdown(bwd)
                runs[choice].append(median_ms(bwd, warmup=5, rep=40))
    except ValueError as exc:  # the Gluon kernel cannot run this shape: say so
        row["dq_ab"] = str(exc)[:160]
        return
    finally:
        kernel_config.DQ_KERNEL = default
    for k, name in ((0, "dq"), (1, "dkv")):
        a, b = grads["gluon"][k].float(), grads["triton"][k].float()
        row[f"dq_ab_{name}_rel"] = float((a - b).norm() / b.norm())
    for choice in runs:
        row[f"bwd_dq_{choice}_ms"] = sorted(runs[choice])[1]
        row[f"bwd_dq_{choice}_tflops"] = fl["bwd"] / row[f"bwd_dq_{choice}_ms"] / 1e9
        row[f"breakdown_dq_{choice}_ms"] = breakdown[choice]
    names = (("triton", "_bwd_dq_kernel"), ("gluon", "_bwd_dq_ws_kernel"))
    dq_ms = {c: breakdown[c].get(k, float("nan")) for c, k in names}
    saved = dict(kernel_config.WS_DQ_META)
    row["dq_ws_variants"] = {}
    kernel_config.DQ_KERNEL = "gluon"
    try:  # register splits (B warpgroup, gather); warpgroup A gets the rest of 3 x 168
        for b_regs, g_regs in ((208, 48), (200, 56), (192, 64), (184, 72)):
            kernel_config.WS_DQ_META.update(B_REGS=b_regs, GATHER_REGS=g_regs)
            try:
                same = all(torch.equal(a, b) for a, b in zip(bwd(), grads["gluon"]))
                row["dq_ws_variants"][f"b{b_regs}g{g_regs}"] = {"bwd_ms": median_ms(bwd, warmup=5, rep=40),
                                                                "same": same}
            except Exception as exc:  # report, go on
                row["dq_ws_variants"][f"b{b_regs}g{g_regs}"] = {"error": str(exc)[:120]}
    finally:
        kernel_config.WS_DQ_META.clear()
        kernel_config.WS_DQ_META.update(saved)
        kernel_config.DQ_KERNEL = default
    print(f"  {row['shape']} dq A/B: bwd triton {row['bwd_dq_triton_ms']:.2f} / gluon {row['bwd_dq_gluon_ms']:.2f} ms, "
          f"dq kernel {dq_ms['triton']:.3f} / {dq_ms['gluon']:.3f} ms, dq rel {row['dq_ab_dq_rel']:.2e}, "
          f"dkv rel {row['dq_ab_dkv_rel']:.2e}; register splits (bwd ms, same bytes): "
          + ", ".join(f"{k} {v.get('bwd_ms', float('nan')):.2f} {v.get('same', v.get('error'))}"
                      for k, v in row["dq_ws_variants"].items()), flush=True)


PARTIAL_AB = {"bm128w8s2": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
              "bm128w8s3": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3},
              "bm128w8s4": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 4},
              "bm256w8s3": {"BLOCK_M": 256, "num_warps": 8, "num_stages": 3},
              "bm64w4s3": {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3}}


def _time_partial_configs(row: dict, fl: dict, bwd) -> None:
    """--partial-ab: the backward with each ``PARTIAL_AB`` launch setting of the dkv-contribution kernel, three
    alternating rounds each (the middle one), that kernel's own time, and whether the gradients keep the first
    setting's bytes."""
    runs: dict[str, list[float]] = {k: [] for k in PARTIAL_AB}
    first, kernel_ms, same = None, {}, {}
    try:
        for _ in range(3):
            for label, cfg in PARTIAL_AB.items():
                kernel.OVERRIDES["partial"] = [cfg]
                try:
                    if label not in kernel_ms:
                        grads = bwd()
                        first = first or grads
                        same[label] = all(torch.equal(a, b) for a, b in zip(grads, first))
                        kernel_ms[label] = kernel_breakdown(bwd).get("_bwd_dkv_partial_kernel", float("nan"))
                    runs[label].append(median_ms(bwd, warmup=5, rep=40))
                except Exception as exc:  # out of shared memory and the like: report, go on
                    kernel_ms[label], same[label] = float("nan"), str(exc)[:80]
                    runs[label].append(float("nan"))
    finally:
        kernel.OVERRIDES.pop("partial", None)
    row["partial_ab"] = {k: {"bwd_ms": sorted(v)[1], "kernel_ms": kernel_ms[k], "same": same[k]}
                         for k, v in runs.items()}
    print(f"  {row['shape']} partial A/B (bwd ms / contribution kernel ms / same bytes): " + ", ".join(
        f"{k} {v['bwd_ms']:.2f} / {v['kernel_ms']:.3f} / {v['same']}" for k, v in row["partial_ab"].items()),
        flush=True)


def _time_overrides(name: str, configs: dict, fn, warmup: int, rep: int, digits: int) -> dict:
    """Median ms of ``fn`` with each launch configuration of kernel ``name`` (errors recorded, not hidden)."""
    out = {}
    for label, cfg in configs.items():
        kernel.OVERRIDES[name] = [cfg]
        try:
            out[label] = round(median_ms(fn, warmup=warmup, rep=rep), digits)
        except Exception as exc:  # report, do not hide
            out[label] = f"{type(exc).__name__}: {str(exc)[:80]}"
        kernel.OVERRIDES.pop(name)
    return out


def _time_variants(row: dict, fwd, bwd) -> None:
    """--variants: a single query chunk, and the launch configurations of the fwd, dq and partial kernels."""
    row["bwd_16g_ms"] = median_ms(lambda: bwd(max_partial_bytes=16 << 30), warmup=10, rep=60)
    row["bwd_breakdown_ms"] = kernel_breakdown(bwd)
    row["fwd_variants_ms"] = _time_overrides("fwd", {
        "bn64s2": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        "bn32s3": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
        "bn32s2": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}}, fwd, 25, 100, 4)
    row["dq_variants_ms"] = _time_overrides("dq", {
        "bn32s3": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
        "bn32s2": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        "bn16s3": {"BLOCK_N": 16, "num_warps": 8, "num_stages": 3}}, bwd, 5, 30, 3)
    row["partial_variants_ms"] = _time_overrides("partial", {
        "bm64w4s2": {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2},
        "bm128w8s2": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
        "bm64w4s3": {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3}}, bwd, 5, 30, 3)


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
        _time_compare(row, fl, fwd, bwd, lambda: kernel.row_bound(idx, n_kv))
    if args.variants or args.compare:
        row["bwd_bf16part_ms"] = median_ms(lambda: bwd(partial_dtype="bfloat16"), warmup=10, rep=60)
        row["bwd_bf16part_tflops"] = fl["bwd"] / row["bwd_bf16part_ms"] / 1e9
    if args.compare:
        row["bwd_breakdown_ms"] = kernel_breakdown(bwd)
    if args.variants:
        _time_variants(row, fwd, bwd)
    if args.reduce_ab:
        _time_reduce_split(row, fl, bwd)
    if args.dq_ab:
        _time_dq_kernels(row, fl, bwd)
    if args.partial_ab:
        _time_partial_configs(row, fl, bwd)
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
