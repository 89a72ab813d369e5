"""Faults under ``paddle.distributed.launch`` (2 CPU ranks): a rank killed mid-run, a rank killed mid-save, a
bad data path. After each kill the next launch with ``resume_from_checkpoint: auto`` continues from the last
complete checkpoint (never the partial one) and reaches exactly the losses and parameters of the
uninterrupted run (``conftest.dp2_reference``).

Run by hand (the pretraining job on the tiny test config, with an optional fault)::

    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        tests/multi_card_tests/test_fault_tolerance.py --output_dir out/f --inject_fault kill@5:1

The kills are real SIGKILLs (no cleanup runs); ``--inject_fault`` only picks the exact moment, so the
tests are deterministic (see ``fleet_ext/training/faults.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from launch_helpers import (
    CONFIG,
    ROOT,
    TEST_OVERRIDES,
    assert_same_tensors,
    checkpoint_tensors,
    cli_args,
    describe,
    launch,
    train_losses,
    worker_log,
)

HERE = Path(__file__)


def _complete_steps(out: Path) -> list[int]:
    from fleet_ext.training.checkpoint import list_checkpoints

    return [step for step, _ in list_checkpoints(out)]


def test_kill_a_rank_mid_run_then_mid_save_and_resume_to_the_same_result(dp2_reference, tmp_path):
    out = tmp_path / "out"

    # 1. Rank 1 is killed before step 5: checkpoints 2 and 4 are complete, nothing else.
    logs = tmp_path / "logs1"
    result = launch(HERE, ["--output_dir", str(out), "--inject_fault", "kill@5:1"], logs)
    assert result.returncode != 0, describe(result, logs)
    assert "[fault injection] kill: SIGKILL to rank 1" in worker_log(logs, 1)
    assert _complete_steps(out) == [2, 4]
    assert not list(out.glob("tmp-checkpoint-*"))

    # 2. Auto resume from checkpoint-4; rank 0 is killed after writing its files of the step-6 checkpoint.
    logs = tmp_path / "logs2"
    result = launch(HERE, ["--output_dir", str(out), "--inject_fault", "kill_in_save@6:0"], logs)
    assert result.returncode != 0, describe(result, logs)
    log0 = worker_log(logs, 0)
    assert f"resumed from {out / 'checkpoint-4'} at step 4" in log0, log0[-3000:]
    assert "[fault injection] kill_in_save: SIGKILL to rank 0" in log0
    partial = out / "tmp-checkpoint-6"
    assert (partial / "model" / "0_0.distcp").is_file(), "the kill should land after rank 0 wrote its shard"
    assert not (out / "checkpoint-6").exists()
    assert _complete_steps(out) == [2, 4]

    # 3. Auto resume again: the partial step-6 save is ignored (and removed), the run finishes.
    logs = tmp_path / "logs3"
    result = launch(HERE, ["--output_dir", str(out)], logs)
    assert result.returncode == 0, describe(result, logs)
    log0 = worker_log(logs, 0)
    assert "removed partial checkpoint(s) left by an interrupted save: tmp-checkpoint-6" in log0
    assert f"resumed from {out / 'checkpoint-4'} at step 4" in log0
    assert _complete_steps(out) == [2, 4, 6, 8] and not partial.exists()

    ref = dp2_reference["out"]
    assert train_losses(out) == train_losses(ref)  # steps 1..8, exact floats
    for part in ("model", "optimizer"):
        assert_same_tensors(
            checkpoint_tensors(out / "checkpoint-8", part), checkpoint_tensors(ref / "checkpoint-8", part), part
        )


def test_missing_data_file_fails_on_every_rank_before_computing(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    missing = tmp_path / "no_such_tokens.bin"
    result = launch(HERE, ["--output_dir", str(out), "--train_dataset_path", str(missing)], logs)
    assert result.returncode != 0
    for rank in (0, 1):
        log = worker_log(logs, rank)
        assert f"error: config key `train_dataset_path` = '{missing}': the file does not exist" in log, log[-2000:]
        assert "fleet_ext pretraining" not in log  # no start-up table: no model was built
    assert not out.exists()


def _main(argv: list[str]) -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from fleet_ext.training.cli import main

    defaults = cli_args({**TEST_OVERRIDES, "output_dir": "out/multi_card_fault_tolerance"})
    return main(["--config", str(CONFIG), *defaults, *argv])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
