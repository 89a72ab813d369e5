"""Nsight Compute profile of the mHC pre op's kernels at V4-Flash's shape: the streams' gradient (Gluon and
Triton), the gates' pass with the Sinkhorn backward, the projection (Gluon).

Run on the H200 from the repository root (ncu is on the GPU machine):

    python scripts/bench/profile_mhc.py [--out DIR] [--source] [--kinds gluon gates ...] [--tune JSON]

Launches ``ncu`` once per kernel on a driver process (this file with ``--drive``) that runs the fused pre op
forward + backward twice on ``bench_mhc.py``'s inputs (T 16384, 4 streams, D 4096, bf16; the second backward is
the profiled launch). Collects throughput, pipe and warp-stall metrics, writes each raw report under --out and
prints one table. ``--source`` also writes the per-instruction (SASS) stall samples of each kernel as CSV.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# kind: (kernel profiled, kernel.GLUON, kernel.TUNE)
KERNELS = {"gluon": ("_mhc_dx_streams", "gluon", {}), "gluon1": ("_mhc_dx_gluon", "gluon", {"dx_gluon": {"SPP": 1}}),
           "triton": ("_mhc_dx_bwd", "triton", {}),
           "gates": ("_mhc_gates_bwd", "auto", {}), "proj": ("_mhc_proj_gluon", "gluon", {})}
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "wait", "math_pipe_throttle", "mio_throttle",
          "lg_throttle", "membar", "dispatch_stall", "not_selected", "selected", "no_instruction", "sleeping",
          "branch_resolving", "drain", "tex_throttle", "imc_miss")
METRICS = {
    "duration us": "gpu__time_duration.sum",
    "DRAM GB/s": "dram__bytes.sum.per_second",
    "SM busy %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gmma pipe %": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "hmma pipe %": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "L1 %": "l1tex__throughput.avg.pct_of_peak_sustained_elapsed",
    "smem wavefronts %": "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
    "L2 %": "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
    "issued IPC": "sm__inst_issued.avg.per_cycle_active",
    "warps active / SM": "sm__warps_active.avg.per_cycle_active",
    "regs/thread": "launch__registers_per_thread",
    **{f"stall {s}": f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS},
}


def drive(kind: str, tune: dict) -> None:
    sys.path.insert(0, HERE)
    import bench_mhc
    import torch

    from fleet_ext.ops.mhc import kernel

    _, kernel.GLUON, kind_tune = KERNELS[kind]
    kernel.TUNE.update({**kind_tune, **tune})
    a = bench_mhc._inputs()
    for _ in range(2):
        bench_mhc._fused_pre_step(a)
    torch.cuda.synchronize()


def _ncu(kind: str, extra: list[str], tune: str) -> tuple[list[str], subprocess.CompletedProcess]:
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", KERNELS[kind][0], "--launch-skip", "1",
           "--launch-count", "1", *extra, sys.executable, os.path.abspath(__file__), "--drive", kind, "--tune", tune]
    return cmd, subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def profile(kind: str, out: str, source: bool, tune: str) -> dict[str, str]:
    cmd, res = _ncu(kind, ["--csv", "--metrics", ",".join(METRICS.values())], tune)
    with open(os.path.join(out, f"ncu_mhc_{kind}_metrics.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + res.stdout + res.stderr)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith('"')]
    by_name = {row["Metric Name"]: row["Metric Value"] for row in csv.DictReader(io.StringIO("\n".join(lines)))}
    if source:
        rep = os.path.join(out, f"ncu_mhc_{kind}")
        _ncu(kind, ["--set", "full", "--import-source", "no", "-f", "-o", rep], tune)
        res = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--print-source", "sass", "--csv"],
                             capture_output=True, text=True)
        with open(os.path.join(out, f"ncu_mhc_{kind}_sass.csv"), "w") as f:
            f.write(res.stdout + res.stderr)
        os.remove(rep + ".ncu-rep")
    return {label: by_name.get(metric, "-") for label, metric in METRICS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drive", choices=list(KERNELS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--source", action="store_true", help="per-instruction stall samples (CSV)")
    parser.add_argument("--kinds", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--tune", default="{}", help="kernel.TUNE for every kind, as JSON")
    args = parser.parse_args()
    if args.drive:
        drive(args.drive, json.loads(args.tune))
        return
    os.makedirs(args.out, exist_ok=True)
    results = {kind: profile(kind, args.out, args.source, args.tune) for kind in args.kinds}
    print(f"\n{'ncu, mHC pre op, T 16384 x 4 x 4096 bf16':50s}" + "".join(f"{k:>14s}" for k in results))
    for label in METRICS:
        print(f"{label:50s}" + "".join(f"{results[k][label]:>14s}" for k in results))


if __name__ == "__main__":
    main()
