"""Nsight Compute profile of the sparse-attention kernels on TileLang's inputs: the forwards (Triton and
warp-specialised Gluon) or the backward's largest kernels (dq, Triton and Gluon; the dkv contributions; the CSR
reduce).

Run on the H200 from the repository root (ncu is on the GPU machine):

    python scripts/bench/profile_sparse_attn.py [--pass fwd|bwd] [--heads 64] [--out DIR]

Launches ``ncu`` once per kernel on a driver process (this file with ``--drive``) that runs the pass twice (the
second launch is the profiled one) on TileLang's example inputs (S 4096, SKV 8192, top-2048, every slot valid).
Collects throughput, tensor-pipe, memory and warp-stall metrics, writes each raw report as text under --out and
prints one table: what limits each kernel.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
METRICS = {
    "duration us": "gpu__time_duration.sum",
    "SM busy %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor pipe %": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "L2 %": "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
    "L2 GB/s": "lts__t_bytes.sum.per_second",
    "DRAM GB/s": "dram__bytes.sum.per_second",
    "smem pipe %": "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
    "regs/thread": "launch__registers_per_thread",
    "stall long sb": "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "stall barrier": "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "stall wait": "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "stall math": "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    "stall sleeping": "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio",
}
# kind -> (pass, kernel name, the kernel_config switch that selects it)
KERNELS = {"triton": ("fwd", "_sparse_attn_fwd_kernel", {"FWD_KERNEL": "triton"}),
           "gluon": ("fwd", "_sparse_attn_fwd_ws_kernel", {"FWD_KERNEL": "gluon"}),
           "dq_triton": ("bwd", "_bwd_dq_kernel", {"DQ_KERNEL": "triton"}),
           "dq_gluon": ("bwd", "_bwd_dq_ws_kernel", {"DQ_KERNEL": "gluon"}),
           "partial": ("bwd", "_bwd_dkv_partial_kernel", {}),
           "reduce": ("bwd", "_bwd_dkv_reduce_kernel", {})}


def drive(kind: str, heads: int) -> None:
    sys.path.insert(0, HERE)
    import torch
    from tune_sparse_fwd_ws import tilelang_inputs

    from fleet_ext.ops.sparse_attn import kernel, kernel_config

    pass_, _, switches = KERNELS[kind]
    for name, value in switches.items():
        setattr(kernel_config, name, value)
    q, kv, idx, sink, scale, d_v = tilelang_inputs(4096, 8192, heads, 2048)
    out, lse = kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=d_v)
    d_out = torch.randn_like(out)
    for _ in range(2):
        if pass_ == "fwd":
            kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=d_v)
        else:
            kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, None, d_v=d_v)
    torch.cuda.synchronize()


SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "WarpStateStats", "Occupancy",
            "LaunchStats"]
KEEP = ("Duration", "Throughput", "Registers Per Thread", "Shared Memory Configuration", "Warp Cycles Per Issued",
        "Issued Ipc", "Achieved Occupancy", "Executed Ipc", "Mem Busy", "Max Bandwidth", "L1/TEX Hit", "L2 Hit")


def _ncu(kind: str, heads: int, extra: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
    skip = "2" if KERNELS[kind][0] == "fwd" else "1"  # one forward for out and lse, then the pass twice
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", KERNELS[kind][1], "--launch-skip", skip,
           "--launch-count", "1", *extra, sys.executable, os.path.abspath(__file__), "--drive", kind, "--heads",
           str(heads)]
    return cmd, subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def profile(kind: str, heads: int, out: str) -> dict:
    """Two ncu runs: the named sections (always available), then the raw metrics (a name this ncu lacks fails only
    that run). Both reports are written under ``out``; returns {label: value} for the table."""
    values: dict[str, str] = {}
    cmd, res = _ncu(kind, heads, [arg for name in SECTIONS for arg in ("--section", name)])
    with open(os.path.join(out, f"ncu_sparse_{KERNELS[kind][0]}_{kind}_h{heads}_sections.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + res.stdout + res.stderr)
    for line in res.stdout.splitlines():
        parts = line.split()
        if any(k in line for k in KEEP) and len(parts) >= 3:
            values[" ".join(parts[:-2])] = " ".join(parts[-2:])
    cmd, res = _ncu(kind, heads, ["--csv", "--metrics", ",".join(METRICS.values())])
    with open(os.path.join(out, f"ncu_sparse_{KERNELS[kind][0]}_{kind}_h{heads}_metrics.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + res.stdout + res.stderr)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith('"')]
    by_name = {row["Metric Name"]: f"{row['Metric Value']} {row.get('Metric Unit', '')}".strip()
               for row in csv.DictReader(io.StringIO("\n".join(lines)))}
    for label, metric in METRICS.items():
        values[label] = by_name.get(metric, "-")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drive", choices=list(KERNELS))
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--pass", dest="pass_", choices=["fwd", "bwd"], default="fwd")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.drive:
        drive(args.drive, args.heads)
        return
    os.makedirs(args.out, exist_ok=True)
    kinds = [kind for kind, (pass_, _, _) in KERNELS.items() if pass_ == args.pass_]
    results = {kind: profile(kind, args.heads, args.out) for kind in kinds}
    labels = list(dict.fromkeys(label for kind in kinds for label in results[kind]))
    print(f"\nncu, TileLang inputs, H {args.heads}" + " " * 22 + "  ".join(f"{k:>18s}" for k in kinds))
    for label in labels:
        print(f"{label[:50]:50s}" + "  ".join(f"{results[kind].get(label, '-'):>18s}" for kind in kinds))


if __name__ == "__main__":
    main()
