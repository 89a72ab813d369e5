"""Shared by the multi-card tests: spawn ``paddle.distributed.launch`` and read what the ranks left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "scripts" / "pretrain.py"
CONFIG = ROOT / "configs" / "dsv4_tiny_cpu.yaml"

# The tiny training YAML, shrunk so a step takes ~0.1 s: 8 steps, a checkpoint every 2.
TEST_OVERRIDES = {
    "max_seq_len": 64,
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "max_steps": 8,
    "warmup_steps": 2,
    "save_steps": 2,
    "save_total_limit": None,
    "eval_steps": 0,
    "eval_iters": 1,
    "logging_steps": 1,
    "disable_tqdm": True,
    "resume_from_checkpoint": "auto",
}


def cli_args(overrides: dict) -> list[str]:
    """``{"max_steps": 8, "bf16": False}`` -> ``["--max_steps", "8", "--bf16", "false"]``."""
    out = []
    for key, value in overrides.items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        out += [f"--{key}", text]
    return out


def launch(script: Path, args: list[str], log_dir: Path, nproc: int = 2, timeout: int = 300):
    """``python -m paddle.distributed.launch --nproc_per_node N --host 127.0.0.1 script args`` from the repo root."""
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        str(nproc),
        "--host",
        "127.0.0.1",
        "--log_dir",
        str(log_dir),
        str(script),
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def worker_log(log_dir: Path, rank: int) -> str:
    path = Path(log_dir) / f"workerlog.{rank}"
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""


def describe(result, log_dir: Path) -> str:
    """Everything useful when a launch did not do what a test expected."""
    logs = "\n".join(f"--- workerlog.{r} ---\n{worker_log(log_dir, r)[-4000:]}" for r in (0, 1))
    return f"exit code {result.returncode}\n--- launcher ---\n{result.stdout[-3000:]}{result.stderr[-3000:]}\n{logs}"


def train_losses(output_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def checkpoint_tensors(checkpoint_dir: Path, part: str = "model") -> dict[str, np.ndarray]:
    """Every tensor of a FlexCheckpoint directory, read file by file (independent of fleet_ext's loader).

    Replicated tensors are de-duplicated across the rank files at save time, so the union of the files
    holds each tensor once; a tensor found in two files must be identical in both.
    """
    import paddle

    out: dict[str, np.ndarray] = {}
    for path in sorted((Path(checkpoint_dir) / part).glob("*.distcp")):
        for key, value in paddle.load(str(path), return_numpy=True).items():
            if key in out and not np.array_equal(out[key], value):
                raise AssertionError(f"{path}: {key} differs from its copy in another rank file")
            out[key] = value
    return out


def assert_same_tensors(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: different tensor names"
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, f"{what}: {key} dtype/shape"
        if a[key].tobytes() != b[key].tobytes():
            diff = np.abs(a[key].astype(np.float64) - b[key].astype(np.float64)).max()
            raise AssertionError(f"{what}: {key} differs (max |diff| {diff})")


GATE = Path(__file__).with_name("test_capability_gate.py")  # runs the CLI and records every rank's exit code


def assert_bad_config_exits_2_on_every_rank(tmp_path: Path, overrides: dict, message: str) -> None:
    """Launch 2 ranks through the capability-gate test's script (it records each rank's exit code; the launcher
    stops the others as soon as one exits): every rank exits 2 with ``message``, before joining a process group or
    building a model, and writes nothing."""
    import json

    gate, logs, out = tmp_path / "gate", tmp_path / "logs", tmp_path / "out"
    result = launch(GATE, ["--gate_dir", str(gate), "--output_dir", str(out), *cli_args(overrides)], logs, timeout=120)
    assert result.returncode == 2, describe(result, logs)
    for rank in (0, 1):
        assert f"[rank {rank}] fleet_ext pretrain: error: {message}" in worker_log(logs, rank), worker_log(logs, rank)
        state = json.loads((gate / f"rank_{rank}.json").read_text())
        assert state == {"rank": rank, "exit_code": 2, "models_built": 0, "process_group_joined": False}, state
    assert not out.exists()
