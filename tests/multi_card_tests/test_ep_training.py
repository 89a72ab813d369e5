"""Expert-parallel training from the YAML under ``paddle.distributed.launch`` (gloo, 2 processes): ``dp 2 x ep 2``
against data parallelism alone, a killed rank that resumes, checkpoints that reshard between EP=2 and EP=1, context
parallelism composed with EP, bad layouts that exit 2 on every rank.

The reference is one process with twice the accumulation (bitwise DP=2, test_dp_training.py). The tiny YAML has a
hash-routed first layer and the aux-loss-free bias on. The per-step losses are held to ``scripts/loss_compare.py
--rtol 1e-6`` (the brief's bound) and, at 2 ranks, to exact equality: each expert adds its two sources' weight-
gradient partials, which commute exactly, and the global norm squares each expert weight's whole gradient.
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
EP_OVERRIDES = {**TEST_OVERRIDES, "max_steps": 6, "save_steps": 3}


def _in_process(out: Path, **overrides) -> Path:
    from fleet_ext.config import load_config
    from fleet_ext.training.trainer import Trainer

    merged = {**EP_OVERRIDES, "gradient_accumulation_steps": 2, "output_dir": str(out), **overrides}
    Trainer(load_config(CONFIG, **merged)).train()
    return out


def _launch(out: Path, logs: Path, fault: str | None = None, **overrides):
    args = ["--config", str(CONFIG), "--output_dir", str(out), *cli_args({**EP_OVERRIDES, **overrides})]
    return launch(PRETRAIN, args + (["--inject_fault", fault] if fault else []), logs, timeout=600)


def _assert_losses_match(a: Path, b: Path, steps: list[int], exact: bool = True) -> None:
    la, lb = train_losses(a), train_losses(b)
    for step in steps:
        assert abs(la[step] - lb[step]) <= (0.0 if exact else 1e-6 * abs(la[step])), (step, la, lb)
    if sorted(la) == steps and sorted(lb) == steps:
        cmd = [sys.executable, str(ROOT / "scripts" / "loss_compare.py"), str(a), str(b), "--rtol", "1e-6"]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def dp_reference(tmp_path_factory):
    return _in_process(tmp_path_factory.mktemp("dp_ref"))


def test_ep2_equals_dp2_through_a_killed_rank_and_resume(dp_reference, tmp_path):
    out = tmp_path / "ep2"
    result = _launch(out, tmp_path / "logs1", fault="kill@5:1", expert_model_parallel_size=2)
    assert result.returncode != 0 and "SIGKILL to rank 1" in worker_log(tmp_path / "logs1", 1)
    result = _launch(out, tmp_path / "logs2", expert_model_parallel_size=2)
    assert result.returncode == 0, describe(result, tmp_path / "logs2")
    log0 = worker_log(tmp_path / "logs2", 0)
    assert f"resumed from {out / 'checkpoint-3'} at step 3" in log0, log0[-3000:]
    assert "experts over 2 ranks (alltoall" in log0, log0[-3000:]
    _assert_losses_match(dp_reference, out, [1, 2, 3, 4, 5, 6])
    # The EP=2 checkpoint in one process (EP=1): the same steps 4-6, and the same final parameters and moments.
    back = _in_process(tmp_path / "back", resume_from_checkpoint=str(out / "checkpoint-3"))
    _assert_losses_match(dp_reference, back, [4, 5, 6])
    from launch_helpers import assert_same_tensors, checkpoint_tensors

    for part in ("model", "optimizer"):
        assert_same_tensors(checkpoint_tensors(dp_reference / "checkpoint-6", part),
                            checkpoint_tensors(back / "checkpoint-6", part), f"EP=2 -> EP=1 resume, {part}")


def test_ep2_under_recompute_equals_dp2(dp_reference, tmp_path):
    """Full recompute re-runs each chunk's all-to-all exchanges in the backward, in the same order on every rank,
    and selective ``moe`` recompute the experts between them: the losses stay DP=2's without recompute, exactly."""
    for name, keys in (("full", {"recompute_granularity": "full", "recompute_method": "uniform",
                                 "recompute_num_layers": 2}),
                       ("moe", {"recompute_granularity": "selective", "recompute_modules": ["moe", "mhc"]})):
        out = tmp_path / name
        result = _launch(out, tmp_path / f"logs_{name}", expert_model_parallel_size=2, save_steps=0, **keys)
        assert result.returncode == 0, describe(result, tmp_path / f"logs_{name}")
        _assert_losses_match(dp_reference, out, [1, 2, 3, 4, 5, 6])


def test_ep1_checkpoint_resumes_under_ep2_allgather(dp_reference, tmp_path):
    out = tmp_path / "fwd"
    result = _launch(out, tmp_path / "logs", expert_model_parallel_size=2, moe_token_dispatcher_type="allgather",
                     resume_from_checkpoint=str(dp_reference / "checkpoint-3"))
    assert result.returncode == 0, describe(result, tmp_path / "logs")
    assert "experts over 2 ranks (allgather" in worker_log(tmp_path / "logs", 0)
    _assert_losses_match(dp_reference, out, [4, 5, 6])


def test_cp2_by_ep2_equals_one_process(tmp_path):
    """2 processes: context 2, and the experts split over the same 2 ranks (EP carved from DP x CP). The reference
    runs the whole sequences in one process, so expert weight gradients sum over a different split of rows:
    within 1e-6, as the CP tests."""
    cp = {"max_seq_len": 256, "max_steps": 3, "save_steps": 0}
    ref = _in_process(tmp_path / "ref", gradient_accumulation_steps=1, **cp)
    result = _launch(tmp_path / "cpep", tmp_path / "logs", context_parallel_size=2, expert_model_parallel_size=2,
                     **cp)
    assert result.returncode == 0, describe(result, tmp_path / "logs")
    log0 = worker_log(tmp_path / "logs", 0)
    assert "x context 2 x expert 2" in log0 and "experts over 2 ranks (alltoall)" in log0
    _assert_losses_match(ref, tmp_path / "cpep", [1, 2, 3], exact=False)


@pytest.mark.parametrize("overrides, message", [
    ({"expert_model_parallel_size": 3},
     "config key `expert_model_parallel_size` = 3 is invalid: allowed a divisor of n_routed_experts (8)"),
    ({"expert_model_parallel_size": 4},
     "config key `expert_model_parallel_size` = 4 is invalid: allowed a divisor of the number of launched "
     "processes (2"),
    ({"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "deepep"},
     "config key `moe_token_dispatcher_type` = 'deepep' is invalid"),
])
def test_bad_expert_parallel_layouts_exit_2_on_every_rank(tmp_path, overrides, message):
    assert_bad_config_exits_2_on_every_rank(tmp_path, overrides, message)
