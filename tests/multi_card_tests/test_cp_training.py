"""Context-parallel training from the YAML under ``paddle.distributed.launch`` (gloo): the same per-step losses
as one process, checkpoints that move between CP=1 and CP=2, a killed rank that resumes, bad layouts that exit 2.

Sequences of 256 tokens: a CP=2 chunk of 128 holds the 31-token window halo and whole compressed blocks (CSA 4,
HCA 128), so every exchange runs. Losses are compared with ``scripts/loss_compare.py --rtol 1e-6`` (the issue's
bound; the layer-level test shows the forward is bitwise and the gradients differ by summation order only).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import (
    CONFIG,
    ROOT,
    TEST_OVERRIDES,
    assert_bad_config_exits_2_on_every_rank,
    cli_args,
    describe,
    launch,
    train_losses,
    worker_log,
)

PRETRAIN = ROOT / "scripts" / "pretrain.py"
HYBRID = ROOT / "configs" / "dsv4_hybrid_mla_cpu.yaml"
CP_OVERRIDES = {**TEST_OVERRIDES, "max_seq_len": 256, "max_steps": 6, "save_steps": 3}


def _in_process(config: Path, out: Path, **overrides) -> Path:
    from fleet_ext.config import load_config
    from fleet_ext.training.trainer import Trainer

    Trainer(load_config(config, **{**CP_OVERRIDES, "output_dir": str(out), **overrides})).train()
    return out


def _launch(config: Path, out: Path, logs: Path, nproc: int = 2, fault: str | None = None, **overrides):
    args = ["--config", str(config), "--output_dir", str(out), *cli_args({**CP_OVERRIDES, **overrides})]
    return launch(PRETRAIN, args + (["--inject_fault", fault] if fault else []), logs, nproc=nproc, timeout=600)


def _assert_losses_match(a: Path, b: Path, steps: list[int]) -> None:
    """The losses of ``steps`` agree within 1e-6 relative; runs of exactly those steps also pass
    ``scripts/loss_compare.py --rtol 1e-6`` (the user's tool)."""
    la, lb = train_losses(a), train_losses(b)
    for step in steps:
        assert abs(la[step] - lb[step]) <= 1e-6 * abs(la[step]), (step, la, lb)
    if sorted(la) != steps or sorted(lb) != steps:
        return
    cmd = [sys.executable, str(ROOT / "scripts" / "loss_compare.py"), str(a), str(b), "--rtol", "1e-6"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def cp1_tiny(tmp_path_factory):
    return _in_process(CONFIG, tmp_path_factory.mktemp("cp1_tiny"))


def test_cp2_equals_cp1_through_a_killed_rank_and_resume(cp1_tiny, tmp_path):
    out = tmp_path / "out"
    result = _launch(CONFIG, out, tmp_path / "logs1", fault="kill@5:1", context_parallel_size=2)
    assert result.returncode != 0 and "SIGKILL to rank 1" in worker_log(tmp_path / "logs1", 1)
    result = _launch(CONFIG, out, tmp_path / "logs2", context_parallel_size=2)
    assert result.returncode == 0, describe(result, tmp_path / "logs2")
    log0 = worker_log(tmp_path / "logs2", 0)
    assert f"resumed from {out / 'checkpoint-3'} at step 3" in log0, log0[-3000:]
    assert "data 1 x tensor 1 x pipeline 1 x context 2" in log0 and "chunks of 128 tokens" in log0
    _assert_losses_match(cp1_tiny, out, [1, 2, 3, 4, 5, 6])


def test_checkpoints_move_between_cp1_and_cp2(cp1_tiny, tmp_path):
    """A CP=1 checkpoint resumes under CP=2, and a CP=2 checkpoint in one process: the same steps 4-6."""
    cp2 = tmp_path / "cp2"
    result = _launch(CONFIG, cp2, tmp_path / "logs", context_parallel_size=2,
                     resume_from_checkpoint=str(cp1_tiny / "checkpoint-3"))
    assert result.returncode == 0, describe(result, tmp_path / "logs")
    _assert_losses_match(cp1_tiny, cp2, [4, 5, 6])
    back = _in_process(CONFIG, tmp_path / "back", resume_from_checkpoint=str(cp2 / "checkpoint-6"), max_steps=8)
    forward = _in_process(CONFIG, tmp_path / "forward", resume_from_checkpoint=str(cp1_tiny / "checkpoint-6"),
                          max_steps=8)
    _assert_losses_match(forward, back, [7, 8])


def test_hybrid_mla_cp2_equals_cp1(tmp_path):
    """-2 layers (latent MQA with the DSA indexer and its KL loss, sparse phase) and HCA under CP=2."""
    cp1 = _in_process(HYBRID, tmp_path / "cp1")
    result = _launch(HYBRID, tmp_path / "cp2", tmp_path / "logs", context_parallel_size=2)
    assert result.returncode == 0, describe(result, tmp_path / "logs")
    _assert_losses_match(cp1, tmp_path / "cp2", [1, 2, 3, 4, 5, 6])


def test_dp2_by_cp2_equals_dp2(tmp_path):
    """4 processes (data 2 x context 2) against data parallelism alone; DP=2 is bitwise DP=1 with twice the
    accumulation (test_dp_training.py), which is what runs here as the reference."""
    dp2 = _in_process(CONFIG, tmp_path / "dp2", gradient_accumulation_steps=2, max_steps=3, save_steps=0)
    result = _launch(CONFIG, tmp_path / "dp2cp2", tmp_path / "logs", nproc=4, context_parallel_size=2, max_steps=3,
                     save_steps=0)
    assert result.returncode == 0, describe(result, tmp_path / "logs")
    assert "data 2 x tensor 1 x pipeline 1 x context 2" in worker_log(tmp_path / "logs", 0)
    _assert_losses_match(dp2, tmp_path / "dp2cp2", [1, 2, 3])


@pytest.mark.parametrize("overrides, message", [
    ({"context_parallel_size": 2, "max_seq_len": 200},
     "config key `max_seq_len` = 200 is invalid: allowed a multiple of context_parallel_size x 128"),
    ({"context_parallel_size": 4, "max_seq_len": 512},
     "config key `context_parallel_size` = 4 is invalid: allowed a divisor of the number of launched processes (2)"),
    ({"context_parallel_size": 2, "num_nextn_predict_layers": 1, "csa_compress_ratios": [0, 4, 128, 4, 0]},
     "config key `num_nextn_predict_layers` = 1: MTP under context parallelism"),
])
def test_bad_context_parallel_layouts_exit_2_on_every_rank(tmp_path, overrides, message):
    """Through the capability-gate test's launched script, which records each rank's exit code (the launcher
    stops the others as soon as one exits): 2 everywhere, no process group joined, no model built."""
    assert_bad_config_exits_2_on_every_rank(tmp_path, overrides, message)
