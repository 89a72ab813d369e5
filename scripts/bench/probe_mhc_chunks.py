"""Probe: the mHC pre op over L2-sized token chunks (each chunk's second pass over X finds it in L2?).

Times forward and backward over the whole T and over chunks of the tokens (the launchers on token slices), by
CUDA-graph replay (GPU time only) and do_bench; checks the chunked outputs byte-equal where they are per token.

    cd scripts/bench && python probe_mhc_chunks.py [OUT_DIR]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_mhc as b  # noqa: E402
from bench_fusions import copy_bandwidth_gbs  # noqa: E402

from fleet_ext.ops.mhc import kernel  # noqa: E402


def main():
    a = b._inputs()
    x, fn, base, scale = a["x"], a["fn"], a["base"], a["scale"]
    T = x.shape[0]
    post, comb, y, mix, r = kernel.pre_forward(x, fn, base, scale, b.ITERS, b.EPS, b.EPS)
    full_bwd = kernel.pre_backward(x, fn, base, scale, mix, r, a["g_post"], a["g_comb"], a["g_y"], b.ITERS, b.EPS)
    copy = copy_bandwidth_gbs()
    out = {"copy_gbs": copy}
    rows = []
    for chunk in (T, 4096, 2048, 1024, 512):
        cuts = [(c, min(T, c + chunk)) for c in range(0, T, chunk)]

        def fwd(cuts=cuts):
            return [kernel.pre_forward(x[c0:c1], fn, base, scale, b.ITERS, b.EPS, b.EPS) for c0, c1 in cuts]

        def bwd(cuts=cuts):
            return [kernel.pre_backward(x[c0:c1], fn, base, scale, mix[c0:c1], r[c0:c1], a["g_post"][c0:c1],
                                        a["g_comb"][c0:c1], a["g_y"][c0:c1], b.ITERS, b.EPS) for c0, c1 in cuts]

        fo, bo = fwd(), bwd()
        same_fwd = all(torch.equal(torch.cat([o[i] for o in fo]), ref) for i, ref in enumerate((post, comb, y, mix, r)))
        same_gx = torch.equal(torch.cat([o[0] for o in bo]), full_bwd[0])
        gfn = sum(o[1] for o in bo)
        gfn_err = ((gfn - full_bwd[1]).abs().max() / full_bwd[1].abs().max()).item()
        row = {"chunk": chunk, "fwd_graph_us": 1e3 * triton.testing.do_bench_cudagraph(fwd),
               "bwd_graph_us": 1e3 * triton.testing.do_bench_cudagraph(bwd),
               "fwd_bench_us": 1e3 * triton.testing.do_bench(fwd, return_mode="median"),
               "bwd_bench_us": 1e3 * triton.testing.do_bench(bwd, return_mode="median"),
               "same_fwd": same_fwd, "same_gx": same_gx, "gfn_rel": gfn_err}
        rows.append(row)
        print(row, flush=True)
    out["rows"] = rows
    xb, yb = x.numel() * 2, y.numel() * 2
    floor_f, floor_b = xb + yb, 2 * xb + yb
    print(f"copy {copy:.0f} GB/s; floor fwd {floor_f/1e6:.0f} MB bwd {floor_b/1e6:.0f} MB")
    print(f"{'chunk':>6} {'fwd graph':>10} {'bwd graph':>10} {'sum':>8} {'%floor':>7} {'fwd bench':>10} "
          f"{'bwd bench':>10} same")
    for r_ in rows:
        s = r_["fwd_graph_us"] + r_["bwd_graph_us"]
        pct = 100 * (floor_f + floor_b) / (s * 1e-6) / 1e9 / copy
        print(f"{r_['chunk']:6d} {r_['fwd_graph_us']:10.1f} {r_['bwd_graph_us']:10.1f} {s:8.1f} {pct:7.1f} "
              f"{r_['fwd_bench_us']:10.1f} {r_['bwd_bench_us']:10.1f} {r_['same_fwd']} {r_['same_gx']} "
              f"{r_['gfn_rel']:.1e}")
    if len(sys.argv) > 1:
        os.makedirs(sys.argv[1], exist_ok=True)
        json.dump(out, open(os.path.join(sys.argv[1], "probe_mhc_chunks.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
