#!/usr/bin/env python
"""Per-step loss table of two runs: two metrics files (or output dirs), or two configs it runs first.

    python scripts/loss_compare.py out/a/metrics.jsonl out/b/metrics.jsonl [--assert-equal | --rtol 1e-6]
    python scripts/loss_compare.py configs/a.yaml configs/b.yaml --max_steps 20 [--nproc_per_node 2]

A ``.yaml``/``.yml`` argument is a config: it is trained with ``scripts/pretrain.py`` into a fresh
directory under ``--workdir`` (through ``paddle.distributed.launch`` when ``--nproc_per_node`` > 1);
other ``--KEY VALUE`` arguments are passed to both runs. ``--assert-equal`` exits 1 on any difference
(bitwise: the floats in metrics.jsonl round-trip exactly) or on a step present in one run only.
``--rtol R`` (with or without ``--assert-equal``) is enforced the same way: exit 1 when a step's relative
difference exceeds R, naming the step and the difference. With neither, the table is only printed.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from fleet_ext.training.metrics import read_metrics, train_losses  # noqa: E402


def _run_config(config: str, outdir: Path, nproc: int, extra: list[str]) -> Path:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += [
            "-m",
            "paddle.distributed.launch",
            "--nproc_per_node",
            str(nproc),
            "--host",
            "127.0.0.1",
            "--log_dir",
            str(outdir / "launch_logs"),
        ]
    cmd += [
        str(_ROOT / "scripts" / "pretrain.py"),
        "--config",
        config,
        "--output_dir",
        str(outdir),
        "--resume_from_checkpoint",
        "null",
        "--disable_tqdm",
        "true",
        *extra,
    ]
    print(f"$ {' '.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(cmd, env=env)
    if result.returncode != 0:
        raise SystemExit(f"loss_compare: the run of {config} failed with exit code {result.returncode}")
    return outdir


def compare(a: dict[int, float], b: dict[int, float], rtol: float | None) -> tuple[list[str], list[str]]:
    """Table lines, and one message per step where the runs disagree (bitwise when ``rtol`` is None)."""
    lines = [f"{'step':>6}  {'loss A':>20}  {'loss B':>20}  {'abs diff':>10}  {'rel diff':>10}  equal"]
    failures = []
    for step in sorted(set(a) | set(b)):
        la, lb = a.get(step), b.get(step)
        if la is None or lb is None:
            failures.append(f"step {step}: present in run {'B' if la is None else 'A'} only")
            lines.append(f"{step:>6}  {la!s:>20}  {lb!s:>20}  {'-':>10}  {'-':>10}  missing")
            continue
        diff = abs(la - lb)
        rel = diff / max(abs(la), abs(lb), 1e-30)
        same = la == lb if rtol is None else rel <= rtol  # a NaN loss never agrees
        if not same:
            allowed = "bitwise equality" if rtol is None else f"rtol {rtol:g}"
            failures.append(f"step {step}: loss A {la!r}, loss B {lb!r}: |A - B| = {diff:.6g}, relative "
                            f"{rel:.6g} exceeds {allowed}")
        lines.append(f"{step:>6}  {la:>20.12g}  {lb:>20.12g}  {diff:>10.3g}  {rel:>10.3g}  {'yes' if same else 'NO'}")
    return lines, failures


def _tolerance(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"--rtol {text}: expected a finite number >= 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="metrics.jsonl, an output dir, or a training YAML")
    parser.add_argument("b", help="metrics.jsonl, an output dir, or a training YAML")
    parser.add_argument("--assert-equal", action="store_true", help="exit 1 unless every step's loss is identical")
    parser.add_argument(
        "--rtol", type=_tolerance, default=None, help="exit 1 unless every step agrees within this relative difference"
    )
    parser.add_argument("--nproc_per_node", type=int, default=1, help="processes per config run (launcher if > 1)")
    parser.add_argument("--workdir", default=None, help="where config runs write (default: a temporary directory)")
    args, extra = parser.parse_known_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="loss_compare_"))
    losses = []
    for tag, source in (("A", args.a), ("B", args.b)):
        if source.endswith((".yaml", ".yml")):
            source = str(_run_config(source, workdir / tag, args.nproc_per_node, extra))
        elif extra:
            parser.error(f"extra arguments {extra} only apply when running configs")
        losses.append(train_losses(read_metrics(source)))
        print(f"{tag}: {source} ({len(losses[-1])} steps)")
    lines, failures = compare(losses[0], losses[1], args.rtol)
    if not losses[0] and not losses[1]:
        failures.append("neither run has a training step to compare")
    print("\n".join(lines))
    kind = "bitwise" if args.rtol is None else f"within rtol {args.rtol:g}"
    print(f"{'runs differ' if failures else 'all steps equal'} ({kind})")
    enforced = args.assert_equal or args.rtol is not None  # a tolerance given is a tolerance enforced
    if failures and enforced:
        more = f"; ... and {len(failures) - 5} more step(s)" if len(failures) > 5 else ""
        print(f"loss_compare: FAILED ({kind}): " + "; ".join(failures[:5]) + more, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
