"""The A/B and launch-setting sweeps of ``bench_sparse_attn.py`` (``--compare``, ``--reduce-ab``, ``--dq-ab``,
``--partial-ab``, ``--variants``), and the timing helpers they share with it: each runs the backward (or forward)
of one shape under two or more settings, alternating rounds where a ratio is the point, and records in ``row``
the times, the per-kernel breakdown and whether the gradients keep their bytes."""

from __future__ import annotations

import torch
import triton

from fleet_ext.ops.sparse_attn import kernel, kernel_config


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


def time_compare(row: dict, fl: dict, fwd, bwd, bound) -> None:
    """--compare: no trailing bound, the old backward launch defaults (the Triton dq kernel with its old setting,
    as before the Gluon dq kernel), the bound alone."""
    row["bound_us"] = median_ms(bound) * 1e3
    row["fwd_nobound_ms"] = median_ms(lambda: fwd(derive_bound=False))
    row["fwd_nobound_tflops"] = fl["fwd"] / row["fwd_nobound_ms"] / 1e9
    row["bwd_nobound_ms"] = median_ms(lambda: bwd(derive_bound=False), warmup=10, rep=60)
    row["bwd_nobound_tflops"] = fl["bwd"] / row["bwd_nobound_ms"] / 1e9
    kernel.OVERRIDES["dq"] = [{"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}]
    kernel.OVERRIDES["partial"] = [{"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}]
    dq_kernel, kernel_config.DQ_KERNEL = kernel_config.DQ_KERNEL, "triton"
    try:
        row["bwd_olddefaults_nobound_ms"] = median_ms(lambda: bwd(derive_bound=False), warmup=10, rep=60)
        row["bwd_olddefaults_nobound_tflops"] = fl["bwd"] / row["bwd_olddefaults_nobound_ms"] / 1e9
    finally:
        kernel.OVERRIDES.pop("dq")
        kernel.OVERRIDES.pop("partial")
        kernel_config.DQ_KERNEL = dq_kernel


def time_reduce_split(row: dict, fl: dict, bwd) -> None:
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


# (B warpgroup registers, gather registers); warpgroup A gets the rest of 3 x 168
DQ_WS_VARIANTS = ((208, 48), (200, 56), (192, 64), (184, 72))


def time_dq_kernels(row: dict, fl: dict, bwd) -> None:
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
    try:
        for _ in range(3):  # alternating rounds, the middle one kept
            for b_regs, g_regs in DQ_WS_VARIANTS:
                label = f"b{b_regs}g{g_regs}"
                kernel_config.WS_DQ_META.update(B_REGS=b_regs, GATHER_REGS=g_regs)
                entry = row["dq_ws_variants"].setdefault(label, {"runs": []})
                try:
                    if "same" not in entry:
                        entry["same"] = all(torch.equal(a, b) for a, b in zip(bwd(), grads["gluon"]))
                        entry["dq_ms"] = kernel_breakdown(bwd).get("_bwd_dq_ws_kernel", float("nan"))
                    entry["runs"].append(median_ms(bwd, warmup=5, rep=40))
                    entry["bwd_ms"] = sorted(entry["runs"])[len(entry["runs"]) // 2]
                except Exception as exc:  # report, go on
                    entry["error"] = str(exc)[:120]
    finally:
        kernel_config.WS_DQ_META.clear()
        kernel_config.WS_DQ_META.update(saved)
        kernel_config.DQ_KERNEL = default
    print(f"  {row['shape']} dq A/B: bwd triton {row['bwd_dq_triton_ms']:.2f} / gluon {row['bwd_dq_gluon_ms']:.2f} ms, "
          f"dq kernel {dq_ms['triton']:.3f} / {dq_ms['gluon']:.3f} ms, dq rel {row['dq_ab_dq_rel']:.2e}, "
          f"dkv rel {row['dq_ab_dkv_rel']:.2e}; register splits (bwd ms, same bytes): "
          + ", ".join(f"{k} {v.get('bwd_ms', float('nan')):.2f} (dq {v.get('dq_ms', float('nan')):.3f}) "
                      f"{v.get('same', v.get('error'))}" for k, v in row["dq_ws_variants"].items()), flush=True)


PARTIAL_AB = {"bm128w8s2": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
              "bm128w8s3": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3},
              "bm128w8s4": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 4},
              "bm256w8s3": {"BLOCK_M": 256, "num_warps": 8, "num_stages": 3},
              "bm64w4s3": {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3}}


def time_partial_configs(row: dict, fl: dict, bwd) -> None:
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


def time_overrides(name: str, configs: dict, fn, warmup: int, rep: int, digits: int) -> dict:
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


def time_variants(row: dict, fwd, bwd) -> None:
    """--variants: a single query chunk, and the launch configurations of the fwd, dq and partial kernels."""
    row["bwd_16g_ms"] = median_ms(lambda: bwd(max_partial_bytes=16 << 30), warmup=10, rep=60)
    row["bwd_breakdown_ms"] = kernel_breakdown(bwd)
    row["fwd_variants_ms"] = time_overrides("fwd", {
        "bn64s2": {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        "bn32s3": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
        "bn32s2": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}}, fwd, 25, 100, 4)
    row["dq_variants_ms"] = time_overrides("dq", {
        "bn32s3": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
        "bn32s2": {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        "bn16s3": {"BLOCK_N": 16, "num_warps": 8, "num_stages": 3}}, bwd, 5, 30, 3)
    row["partial_variants_ms"] = time_overrides("partial", {
        "bm64w4s2": {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2},
        "bm128w8s2": {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
        "bm64w4s3": {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3}}, bwd, 5, 30, 3)


STORED = [d for d in kernel.PARTIAL_DTYPES if d != "auto"]  # the ways of storing contributions ("auto" picks one)
assert STORED[0] == "float32"


def partial_dtype_error(row: dict, bwd, q, kv, idx, sink, d_out, scale: float, d_v: int, eager) -> None:
    """--partial-dtype: the backward with each way of storing the per-pair dkv contributions, each against an
    fp32 reference (``eager``, the gather-softmax on fp32 copies of the same inputs, autograd): dq and dkv relative
    errors, dkv's on the 1 % most-read kv rows alone (where rounding every contribution could add up), how far dkv
    moved from the fp32 contributions' dkv, the backward times (three alternating rounds, the middle one) and each
    one's per-kernel breakdown."""
    leaves = [t.detach().float().requires_grad_(True) for t in (q, kv)]
    out_ref, _ = eager(leaves[0], leaves[1], idx, sink, scale, d_v)
    out_ref.backward(d_out.float())
    dq_ref, dkv_ref = leaves[0].grad, leaves[1].grad
    del out_ref, leaves
    reads = torch.bincount(idx[(idx >= 0) & (idx < kv.shape[0])].long(), minlength=kv.shape[0])
    hot = reads >= torch.quantile(reads.float(), 0.99)

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    dkv_full = None
    for dtype in STORED:  # float32 first: the others' dkv moved from its
        dq, dkv, _ = bwd(partial_dtype=dtype)
        dkv_full = dkv.float() if dkv_full is None else dkv_full
        row[f"partial_{dtype}"] = {"dq_rel": rel(dq, dq_ref), "dkv_rel": rel(dkv, dkv_ref),
                                   "dkv_hot_rows_rel": rel(dkv[hot], dkv_ref[hot]),
                                   "dkv_moved_rel": rel(dkv, dkv_full),
                                   "hot_rows": int(hot.sum()), "hot_min_reads": int(reads[hot].min()),
                                   "kernels_ms": kernel_breakdown(lambda d=dtype: bwd(partial_dtype=d))}
    del dq, dkv, dkv_full
    rounds = {dtype: [] for dtype in STORED}
    for _ in range(3):
        for dtype in STORED:
            rounds[dtype].append(median_ms(lambda d=dtype: bwd(partial_dtype=d), warmup=5, rep=40))
    for dtype, times in rounds.items():
        row[f"partial_{dtype}"].update(bwd_ms=sorted(times)[1], bwd_rounds_ms=times)
    torch.cuda.empty_cache()
    print(f"  {row['shape']} partial dtype (vs fp32 reference): " + ", ".join(
        f"{k}: dq {v['dq_rel']:.2e} dkv {v['dkv_rel']:.2e} hot rows {v['dkv_hot_rows_rel']:.2e} "
        f"({v['hot_rows']} rows, >= {v['hot_min_reads']} reads) bwd {v['bwd_ms']:.2f} ms"
        for k, v in ((d, row[f"partial_{d}"]) for d in STORED)), flush=True)


BAND_VARIANTS = {  # --band-ab: launch settings of the band kernel tried beside the default
    "k128d128w8s3": {"BLOCK_K": 128, "BLOCK_D": 128, "POISON": False, "num_warps": 8, "num_stages": 3},
    "poison_k128d128w8s3": {"BLOCK_K": 128, "BLOCK_D": 128, "POISON": True, "num_warps": 8, "num_stages": 3},
    "poison_k128d128w8s4": {"BLOCK_K": 128, "BLOCK_D": 128, "POISON": True, "num_warps": 8, "num_stages": 4},
    "poison_k64d128w4s3": {"BLOCK_K": 64, "BLOCK_D": 128, "POISON": True, "num_warps": 4, "num_stages": 3},
    "poison_k64d128w4s4": {"BLOCK_K": 64, "BLOCK_D": 128, "POISON": True, "num_warps": 4, "num_stages": 4},
    "poison_k64d128w4s2": {"BLOCK_K": 64, "BLOCK_D": 128, "POISON": True, "num_warps": 4, "num_stages": 2},
    "poison_q2_k64d128w4s2": {"BLOCK_K": 64, "BLOCK_D": 128, "POISON": True, "QPS": 2, "num_warps": 4,
                              "num_stages": 2},
    "poison_q2_k64d128w4s3": {"BLOCK_K": 64, "BLOCK_D": 128, "POISON": True, "QPS": 2, "num_warps": 4,
                              "num_stages": 3},
    "poison_q2_k64d64w4s3": {"BLOCK_K": 64, "BLOCK_D": 64, "POISON": True, "QPS": 2, "num_warps": 4, "num_stages": 3},
    "poison_k64d64w4s4": {"BLOCK_K": 64, "BLOCK_D": 64, "POISON": True, "num_warps": 4, "num_stages": 4},
    "poison_k128d256w8s2": {"BLOCK_K": 128, "BLOCK_D": 256, "POISON": True, "num_warps": 8, "num_stages": 2},
}


def _band_rows(bwd, bands, dq_ref, dkv_ref, rel) -> dict:
    """--band-ab's comparison at the default launch setting: errors, bytes, breakdowns, alternating rounds."""
    plain, banded, again = bwd(), bwd(slot_bands=bands), bwd(slot_bands=bands)
    torch.cuda.synchronize()
    out = {"bands": repr(bands), "dkv_rel_plain": rel(plain[1], dkv_ref), "dkv_rel_bands": rel(banded[1], dkv_ref),
           "dq_rel": rel(banded[0], dq_ref),
           "dq_dsink_bytes_equal": bool(torch.equal(plain[0], banded[0]) and torch.equal(plain[2], banded[2])),
           "bitwise_repeat": all(torch.equal(a, b) for a, b in zip(banded, again)),
           "kernels_ms_plain": kernel_breakdown(bwd),
           "kernels_ms_bands": kernel_breakdown(lambda: bwd(slot_bands=bands))}
    del plain, banded, again
    times = {"plain": [], "bands": []}
    for _ in range(3):
        times["plain"].append(median_ms(bwd, warmup=5, rep=40))
        times["bands"].append(median_ms(lambda: bwd(slot_bands=bands), warmup=5, rep=40))
    out.update({f"bwd_{k}_ms": sorted(v)[1] for k, v in times.items()}, rounds_ms=times)
    return out


def band_ab(row: dict, bwd, bands, q, kv, idx, sink, d_out, scale: float, d_v: int, eager) -> None:
    """--band-ab: the backward with the table's band slots (``band.SlotBands``: the window, HCA's entries) summed
    key-major against the CSR path for every slot: errors of both against an fp32 reference (``eager``), dq and
    d_sink byte-equal, run-to-run bytes, per-kernel breakdowns, three alternating rounds (the middle one), then the
    band kernel's launch settings (``BAND_VARIANTS``), each with its dkv error against the fp32 reference (their
    sums differ in tile order, so no two are byte-equal)."""
    from fleet_ext.ops.sparse_attn import band_bwd

    leaves = [t.detach().float().requires_grad_(True) for t in (q, kv)]
    out_ref, _ = eager(leaves[0], leaves[1], idx, sink, scale, d_v)
    out_ref.backward(d_out.float())
    dq_ref, dkv_ref = leaves[0].grad, leaves[1].grad
    del out_ref, leaves

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    saved_min, saved = band_bwd.BAND_MIN_QUERIES_GPU, dict(band_bwd.BAND_CONFIG_GPU)
    band_bwd.BAND_MIN_QUERIES_GPU = 0  # timed at every size
    try:
        row["bands"] = _band_rows(bwd, bands, dq_ref, dkv_ref, rel)
        variants = {}
        for name, cfg in BAND_VARIANTS.items():
            band_bwd.BAND_CONFIG_GPU.clear()
            band_bwd.BAND_CONFIG_GPU.update(cfg)
            try:
                grads = bwd(slot_bands=bands)
                variants[name] = {"dkv_rel": rel(grads[1], dkv_ref), "bwd_ms": median_ms(
                    lambda: bwd(slot_bands=bands), warmup=5, rep=40),
                    "band_ms": kernel_breakdown(lambda: bwd(slot_bands=bands)).get("_bwd_dkv_band_kernel")}
            except Exception as exc:  # noqa: BLE001 - a setting that does not fit is recorded, not fatal
                variants[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    finally:  # the module's settings as they were, whatever failed
        band_bwd.BAND_CONFIG_GPU.clear()
        band_bwd.BAND_CONFIG_GPU.update(saved)
        band_bwd.BAND_MIN_QUERIES_GPU = saved_min
    row["bands"]["variants"] = variants
    torch.cuda.empty_cache()
    b = row["bands"]
    print(f"  {row['shape']} bands: bwd {b['bwd_plain_ms']:.2f} -> {b['bwd_bands_ms']:.2f} ms, dkv err "
          f"{b['dkv_rel_plain']:.2e} -> {b['dkv_rel_bands']:.2e}, dq/d_sink bytes equal {b['dq_dsink_bytes_equal']}, "
          f"repeat {b['bitwise_repeat']}; variants " + ", ".join(
              f"{k} {v.get('bwd_ms', float('nan')):.2f}" for k, v in variants.items()), flush=True)
