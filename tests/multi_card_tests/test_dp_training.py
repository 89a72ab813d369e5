"""Data parallel over ``paddle.distributed`` (gloo on CPU): identical parameters on every rank, DP=2 equal to
DP=1 with twice the gradient accumulation, and bitwise resume across process counts.

Run by hand (2 CPU ranks)::

    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        tests/multi_card_tests/test_dp_training.py [--output_dir DIR] [--KEY VALUE ...]

Launched, this file trains the tiny test config on every rank, all-gathers a SHA-256 of each rank's
parameters and buffers, writes ``<output_dir>/rank_<r>.json`` and exits 1 if the ranks differ. Under pytest
the tests below spawn that launch (``conftest.py``) and compare its output with one-process runs.

Bitwise DP=2 == DP=1 x 2 accumulation: each rank back-propagates its micro-batch's mean loss, the gradient
sums go through one all-reduce and the 1/2 average is applied once, so both layouts compute
``(g0 + g1) * 0.5`` with the same two addends (IEEE addition of two numbers is commutative). With more than
two addends the association order would differ and only a tolerance could be promised.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
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


def _run_in_this_process(output_dir: Path, **overrides):
    from fleet_ext.config import load_config
    from fleet_ext.training.trainer import Trainer

    config = load_config(CONFIG, **{**TEST_OVERRIDES, "output_dir": str(output_dir), **overrides})
    return Trainer(config).train()


@pytest.fixture(scope="module")
def dp1_accum2(tmp_path_factory):
    """The same 8 steps in one process with gradient_accumulation_steps 2 (same global batch)."""
    out = tmp_path_factory.mktemp("dp1_accum2")
    _run_in_this_process(out, gradient_accumulation_steps=2)
    return out


def test_dp2_ranks_hold_identical_parameters(dp2_reference):
    ranks = dp2_reference["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    assert all(r["all_ranks_equal"] for r in ranks), ranks
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert ranks[0]["global_step"] == 8
    startup = worker_log(dp2_reference["logs"], 0)
    assert "backend gloo" in startup and "micro 2 x accumulation 1 x data 2" in startup, startup[-3000:]


def test_dp2_equals_dp1_with_twice_the_accumulation_bitwise(dp2_reference, dp1_accum2):
    ref = dp2_reference["out"]
    assert train_losses(dp1_accum2) == train_losses(ref)  # every step, exact floats
    for part in ("model", "optimizer"):
        assert_same_tensors(
            checkpoint_tensors(dp1_accum2 / "checkpoint-8", part), checkpoint_tensors(ref / "checkpoint-8", part), part
        )


def test_one_process_resumes_a_two_rank_checkpoint_bitwise(dp2_reference, tmp_path):
    """2-rank checkpoint (rank files de-duplicated) -> 1 process: FlexCheckpoint's own local load."""
    ref = dp2_reference["out"]
    _run_in_this_process(tmp_path, gradient_accumulation_steps=2, resume_from_checkpoint=str(ref / "checkpoint-4"))
    losses = train_losses(tmp_path)
    assert sorted(losses) == [5, 6, 7, 8]
    assert losses == {s: v for s, v in train_losses(ref).items() if s > 4}
    for part in ("model", "optimizer"):
        assert_same_tensors(
            checkpoint_tensors(tmp_path / "checkpoint-8", part), checkpoint_tensors(ref / "checkpoint-8", part), part
        )


def test_two_ranks_resume_a_one_process_checkpoint_bitwise(dp2_reference, dp1_accum2, tmp_path):
    """1-process checkpoint -> 2 ranks: each rank reads its tensors from the files (fleet_ext's local reader)."""
    ref, out, logs = dp2_reference["out"], tmp_path / "out", tmp_path / "logs"
    args = cli_args({**TEST_OVERRIDES, "resume_from_checkpoint": str(dp1_accum2 / "checkpoint-4")})
    result = launch(Path(__file__), ["--output_dir", str(out), *args], logs)
    assert result.returncode == 0, describe(result, logs)
    assert "at step 4" in worker_log(logs, 0)
    assert train_losses(out) == {s: v for s, v in train_losses(ref).items() if s > 4}
    for part in ("model", "optimizer"):
        assert_same_tensors(
            checkpoint_tensors(out / "checkpoint-8", part), checkpoint_tensors(ref / "checkpoint-8", part), part
        )
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["digest"] == ranks[1]["digest"] == dp2_reference["ranks"][0]["digest"]


def _state_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


def _main(argv: list[str]) -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from fleet_ext.config import load_config
    from fleet_ext.training.cli import parse_overrides
    from fleet_ext.training.trainer import Trainer

    overrides = {**TEST_OVERRIDES, "output_dir": "out/multi_card_dp_training", **parse_overrides(argv)}
    trainer = Trainer(load_config(CONFIG, **overrides))
    summary = trainer.train()
    digest = _state_digest(trainer.model)
    digests = trainer.env.all_gather_object(digest)
    result = {
        "rank": trainer.env.rank,
        "world_size": trainer.env.world_size,
        "digest": digest,
        "all_ranks_equal": len(set(digests)) == 1,
        "global_step": trainer.global_step,
        "last_loss": summary["last_loss"],
    }
    path = Path(overrides["output_dir"]) / f"rank_{trainer.env.rank}.json"
    path.write_text(json.dumps(result))
    print(f"rank {trainer.env.rank}: parameters identical on all ranks: {result['all_ranks_equal']}", flush=True)
    return 0 if result["all_ranks_equal"] else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
