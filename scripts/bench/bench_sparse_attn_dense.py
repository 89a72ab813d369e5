"""Dense causal rows of ``bench_sparse_attn.py --dense`` (fleet_ext/ops/sparse_attn/causal.py) on a GPU.

For each V3.2 latent shape (d_qk 576, d_v 512, one sequence, ``v32_s{S}_h{H}``) on the same inputs:
- the dense causal mode: forward, deterministic backward (two runs compared byte for byte), TFLOP/s over the
  causal pairs ``S (S + 1) / 2`` (the sparse family's accounting: fwd 2·H·(d_qk + d_v), bwd 2·H·(2·d_v + 3·d_qk)
  per pair);
- the sparse forward on the V3.2 top-2048 table of the same shape (``bench_sparse_attn.v32_index``), TFLOP/s
  over its valid pairs: the goal is dense fwd TFLOP/s >= this;
- the table path the dense mode replaces: the sparse kernels on the full-causal [S, S] int32 table (forward
  timed; forward + backward once), and peak memory (``torch.cuda.max_memory_allocated`` above the inputs) of
  one forward + backward of each path; the table alone is S·S·4 bytes (computed: 1 GiB at S = 16384);
- with ``--baselines``: torch SDPA (math, efficient) with ``is_causal=True`` at d = 576 / 512, no sink (SDPA
  has none), keys expanded to H heads; errors recorded (FlexAttention does not compile at d = 576: the issue's
  measurement, not repeated here);
- with ``--dense-variants``: launch configurations of the causal kernels and the dkv pass's row slices (the dkv
  overrides name ``SHIFT_LAST`` themselves: the bench shapes have far more rows than a step).
"""

from __future__ import annotations

import math

import torch
import triton

from fleet_ext.ops.sparse_attn import causal, kernel

DEV = "cuda"
D_QK, D_V = 576, 512


def _ms(fn, warmup=25, rep=100) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _peak_gib(fn) -> float:
    """GiB allocated at the peak of one call of ``fn`` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


def _full_causal_table(seq: int) -> torch.Tensor:
    keys = torch.arange(seq, device=DEV, dtype=torch.int32)
    return torch.where(keys[None, :] <= keys[:, None], keys[None, :], -1).contiguous()


def _overrides(name: str, configs: dict, fn, warmup: int, rep: int) -> dict:
    out = {}
    for label, cfg in configs.items():
        kernel.OVERRIDES[name] = [cfg]
        try:
            out[label] = round(_ms(fn, warmup, rep), 3)
        except Exception as exc:  # noqa: BLE001 - record why a configuration cannot run
            out[label] = f"{type(exc).__name__}: {str(exc)[:80]}"
        kernel.OVERRIDES.pop(name)
    return out


def _variants(row: dict, fwd, bwd) -> None:
    row["fwd_variants_ms"] = _overrides("causal_fwd", {
        "bn64w8s2": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        "bn64w8s3": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        "bn32w8s3": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
        "bn128w8s2": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2}}, fwd, 25, 100)
    row["dq_variants_ms"] = _overrides("causal_dq", {
        "bn32w8s3": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
        "bn64w8s2": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        "bn32w8s2": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}}, bwd, 5, 30)
    row["dkv_variants_ms"] = _overrides("causal_dkv", {
        "bn64bm32w8s2": {"BLOCK_N": 64, "BLOCK_M": 32, "num_warps": 8, "num_stages": 2, "SHIFT_LAST": True},
        "bn64bm16w8s3": {"BLOCK_N": 64, "BLOCK_M": 16, "num_warps": 8, "num_stages": 3, "SHIFT_LAST": True},
        "bn64bm16w8s2": {"BLOCK_N": 64, "BLOCK_M": 16, "num_warps": 8, "num_stages": 2, "SHIFT_LAST": True},
        "bn64bm32w8s1": {"BLOCK_N": 64, "BLOCK_M": 32, "num_warps": 8, "num_stages": 1, "SHIFT_LAST": True},
    }, bwd, 5, 30)
    row["bwd_splits_ms"] = {n: round(_ms(lambda n=n: bwd(dkv_splits=n), 5, 30), 3) for n in (1, 2, 4, 8, 16)}
    print(f"  variants (ms): {row['dq_variants_ms']} {row['dkv_variants_ms']} splits {row['bwd_splits_ms']}",
          flush=True)


def _sdpa(row: dict, fl: dict, q, kv, scale: float, max_seq: int) -> None:
    """torch SDPA with a causal mask at d = 576 / 512 (no sink), math and efficient backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seq, heads = q.shape[0], q.shape[1]
    if seq > max_seq:
        row["sdpa"] = f"not run: s > {max_seq} (the math backend's [H, s, s] weights)"
        return
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, S, 576]
    k = kv.unsqueeze(0).unsqueeze(0).expand(1, heads, seq, D_QK)
    v = kv[:, :D_V].unsqueeze(0).unsqueeze(0).expand(1, heads, seq, D_V)
    for name, backend in (("math", SDPBackend.MATH), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                def run():
                    return torch.nn.functional.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)

                run()
                row[f"sdpa_{name}_fwd_ms"] = round(_ms(run, 5, 30), 3)
                row[f"sdpa_{name}_fwd_tflops"] = round(fl["fwd"] / row[f"sdpa_{name}_fwd_ms"] / 1e9, 1)
        except Exception as exc:  # noqa: BLE001 - record why SDPA cannot run this shape
            row[f"sdpa_{name}"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        torch.cuda.empty_cache()


def _time_with_index(idx, q, kv, sink, scale: float) -> tuple[int, float]:
    """(valid pairs, median ms) of the sparse forward on ``idx`` (freed on return)."""
    pairs = int((idx >= 0).sum().item())
    return pairs, round(_ms(lambda: kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=D_V)), 3)


def _table_path(row: dict, q, kv, sink, d_out, scale: float) -> None:
    """The sparse kernels on the full-causal table: forward timed, forward + backward once, peak memory."""
    seq = q.shape[0]
    row["table_gib_computed"] = round(seq * seq * 4 / 2**30, 3)
    try:
        row["table_fwd_ms"] = _time_with_index(_full_causal_table(seq), q, kv, sink, scale)[1]

        def both():
            idx = _full_causal_table(seq)
            out, lse = kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=D_V)
            kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_v=D_V)

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        row["table_fwdbwd_peak_gib"] = _peak_gib(both)
        end.record()
        torch.cuda.synchronize()
        row["table_fwdbwd_once_ms"] = round(start.elapsed_time(end), 1)
    except torch.OutOfMemoryError:
        row["table_path"] = "out of memory"
    torch.cuda.empty_cache()


def bench_dense_shape(name: str, args, v32_index) -> dict:
    """One dense row: ``name`` is ``v32_s{S}_h{H}``."""
    _, s_part, h_part = name.split("_")
    seq, heads = int(s_part[1:]), int(h_part[1:])
    torch.manual_seed(0)
    q = torch.randn((seq, heads, D_QK), device=DEV, dtype=torch.bfloat16)
    kv = torch.randn((seq, D_QK), device=DEV, dtype=torch.bfloat16)
    sink = torch.rand((heads,), device=DEV) * 3 - 1
    d_out = torch.randn((seq, heads, D_V), device=DEV, dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(D_QK)
    fl = causal.causal_flops(seq, seq, heads, D_QK, D_V)
    row = {"shape": f"dense_{name}", "seq": seq, "heads": heads, "causal_pairs": causal.causal_pairs(seq, seq)}

    def fwd():
        return causal.causal_attn_fwd(q, kv, sink, scale, seq, 0, d_v=D_V)

    out, lse = fwd()

    def bwd(**kw):
        return causal.causal_attn_bwd(q, kv, sink, scale, out, lse, d_out, seq=seq, d_v=D_V, **kw)

    g1, g2 = bwd(), bwd()
    torch.cuda.synchronize()
    row["bwd_bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(g1, g2))
    del g1, g2
    row["fwd_ms"] = round(_ms(fwd), 3)
    row["fwd_tflops"] = round(fl["fwd"] / row["fwd_ms"] / 1e9, 1)
    row["bwd_ms"] = round(_ms(bwd, 10, 60), 3)
    row["bwd_tflops"] = round(fl["bwd"] / row["bwd_ms"] / 1e9, 1)
    row["dkv_splits_default"] = causal.default_dkv_splits(seq, 1, seq, D_QK, 1 << 30)
    row["probs_ms"] = round(_ms(lambda: causal.causal_probs(q, kv, lse, scale, seq, 0, d_v=D_V), 5, 30), 3)

    # the sparse forward of the same shape: V3.2 top-2048 (window 128 + random scores)
    pairs, row["sparse_fwd_ms"] = _time_with_index(v32_index(seq), q, kv, sink, scale)
    row["sparse_fwd_tflops"] = round(kernel.flops(pairs, heads, D_QK, D_V)["fwd"] / row["sparse_fwd_ms"] / 1e9, 1)
    row["dense_over_sparse_fwd"] = round(row["fwd_tflops"] / row["sparse_fwd_tflops"], 3)
    row["dense_fwdbwd_peak_gib"] = _peak_gib(lambda: causal.causal_attn_bwd(
        q, kv, sink, scale, *fwd(), d_out, seq=seq, d_v=D_V))
    if args.dense_table:
        _table_path(row, q, kv, sink, d_out, scale)
    if args.baselines:
        _sdpa(row, fl, q, kv, scale, args.sdpa_max_seq)
    if args.dense_variants:
        _variants(row, fwd, bwd)
    print(f"  {row['shape']}: fwd {row['fwd_ms']:.3f} ms {row['fwd_tflops']:.0f} TF/s (sparse fwd "
          f"{row['sparse_fwd_tflops']:.0f}, x{row['dense_over_sparse_fwd']:.2f}) | bwd {row['bwd_ms']:.2f} ms "
          f"{row['bwd_tflops']:.0f} TF/s | bitwise {row['bwd_bitwise_repeat']} | peak {row['dense_fwdbwd_peak_gib']} "
          f"GiB (table path {row.get('table_fwdbwd_peak_gib', '-')} GiB)", flush=True)
    return row


def print_dense_table(rows: list) -> None:
    print("\ndense causal      fwd ms  fwd TF/s  sparse fwd TF/s  ratio  bwd ms  bwd TF/s  bitwise  peak GiB  "
          "table peak GiB  table GiB (computed)  sdpa math / eff fwd TF/s")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:16s} ERROR {r['error'][-120:]!r}")
            continue
        sdpa = " / ".join(str(r.get(f"sdpa_{n}_fwd_tflops", "fail" if f"sdpa_{n}" in r else "-"))
                          for n in ("math", "efficient"))
        print(f"{r['shape']:16s} {r['fwd_ms']:7.3f} {r['fwd_tflops']:8.0f} {r['sparse_fwd_tflops']:15.0f} "
              f"{r['dense_over_sparse_fwd']:6.2f} {r['bwd_ms']:7.2f} {r['bwd_tflops']:9.0f}  "
              f"{str(r['bwd_bitwise_repeat']):7s} {r['dense_fwdbwd_peak_gib']:8.3f}  "
              f"{str(r.get('table_fwdbwd_peak_gib', '-')):>14s}  {str(r.get('table_gib_computed', '-')):>20s}  {sdpa}")
