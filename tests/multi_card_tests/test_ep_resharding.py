"""A ``dp 2 x ep 2`` checkpoint (2 processes, gloo) loaded under other layouts, and the inputs that must be refused.

One launch saves (``saved_run``: steps 1-5, checkpoint at 3); each layout then resumes from ``checkpoint-3`` and
(1) right after loading, every parameter and AdamW state of every rank equals its region of the saved tensors
byte for byte (read file by file, independently of fleet_ext's loader), (2) steps 4-5 give the saved run's losses
within 1e-6 relative. Layouts: one process (``ep 1``), ``ep 1 x dp 2``, ``dp 4 x ep 2`` (4 processes; per-device
batch 1 keeps the global batch). Also: Paddle 3.3.1's flat-range bug for 3-D tensors (``minimal_nd_slice``) and
how fleet_ext stays clear of it, and a checkpoint with another expert count (exit 2 on every rank).

This file is also the launched script of the layout runs::

    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        tests/multi_card_tests/test_ep_resharding.py --report_dir out/r --output_dir out/x \\
        --resume_from_checkpoint out/saved/checkpoint-3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from launch_helpers import (
    CONFIG,
    ROOT,
    TEST_OVERRIDES,
    cli_args,
    describe,
    launch,
    train_losses,
    worker_log,
)

HERE = Path(__file__)
PRETRAIN = ROOT / "scripts" / "pretrain.py"
GATE = HERE.with_name("test_capability_gate.py")  # runs the CLI and records every rank's exit code
SAVED = {**TEST_OVERRIDES, "max_steps": 5, "save_steps": 3, "expert_model_parallel_size": 2}


def saved_tensors(checkpoint: Path, part: str = "model") -> dict[str, np.ndarray]:
    """Every saved tensor at its global shape, assembled from the chunks the metadata places (independent of
    fleet_ext's loader); a region saved twice must be identical in both files."""
    import paddle

    meta = paddle.load(str(checkpoint / part / "0.metadata"))
    files: dict[str, dict] = {}
    out: dict[str, np.ndarray] = {}
    seen: dict[str, np.ndarray] = {}
    for index, fname in sorted(meta.storage_metadata.items(), key=lambda kv: kv[1]):
        if fname not in files:
            files[fname] = paddle.load(str(checkpoint / part / fname), return_numpy=True)
        chunk = files[fname][index.tensor_key]
        shape = meta.state_dict_metadata[index.tensor_key][0].global_shape
        full = out.setdefault(index.tensor_key, np.zeros(shape, dtype=chunk.dtype))
        mask = seen.setdefault(index.tensor_key, np.zeros(shape, dtype=bool))
        region = tuple(slice(o, o + n) for o, n in zip(index.global_offset, chunk.shape))
        if mask[region].any() and full[region].tobytes() != chunk.tobytes():
            raise AssertionError(f"{fname}: {index.tensor_key} at {index.global_offset} differs from another copy")
        full[region], mask[region] = chunk, True
    uncovered = [key for key, mask in seen.items() if not mask.all()]
    assert not uncovered, f"{checkpoint / part}: not covered by their chunks: {uncovered}"
    return out


def compare_to_saved(trainer, checkpoint: Path) -> dict:
    """Each loaded parameter / AdamW state against its region of the saved tensors: the keys that differ."""
    from fleet_ext.training.checkpoint import optimizer_sharded_state_dict

    report: dict = {}
    for part, loaded in (("model", trainer.model.sharded_state_dict()),
                         ("optimizer", optimizer_sharded_state_dict(trainer.optimizer, trainer.model))):
        saved = saved_tensors(checkpoint, part)
        differ = sorted(set(saved) ^ set(loaded))
        for key, weight in loaded.items():
            if key not in saved:
                continue
            want = saved[key][tuple(slice(o, o + n) for o, n in zip(weight.global_offset, weight.local_shape))]
            got = weight.local_tensor.numpy()
            if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
                differ.append(key)
        sharded = sum(tuple(w.local_shape) != tuple(w.global_shape) for w in loaded.values())
        report[part] = {"checked": len(loaded), "sharded": sharded, "differ": differ}
    return report


def resume_and_check(config) -> tuple:
    """Train ``config`` (which resumes), comparing the state to the checkpoint right after it is loaded."""
    from fleet_ext.training.trainer import Trainer

    trainer, report = Trainer(config), {}
    resume = trainer.resume

    def resume_then_compare(path: Path) -> None:
        resume(path)
        report.update(compare_to_saved(trainer, Path(path)))

    trainer.resume = resume_then_compare
    trainer.train()
    return trainer, report


def _assert_next_losses(saved: Path, resumed: Path) -> None:
    want, got = train_losses(saved), train_losses(resumed)
    for step in (4, 5):
        assert abs(want[step] - got[step]) <= 1e-6 * abs(want[step]), (step, want, got)


def _assert_loaded_bitwise(report: dict, sharded: bool) -> None:
    for part in ("model", "optimizer"):
        assert report[part]["checked"] > 0 and report[part]["differ"] == [], report
        assert (report[part]["sharded"] > 0) == sharded, report  # expert shards hold a part of the stacked tensor


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    out, logs = tmp_path_factory.mktemp("saved") / "run", tmp_path_factory.mktemp("saved_logs")
    result = launch(PRETRAIN, ["--config", str(CONFIG), "--output_dir", str(out), *cli_args(SAVED)], logs,
                    timeout=600)
    assert result.returncode == 0, describe(result, logs)
    return out


def test_dp2_ep2_checkpoint_in_one_process(saved_run, tmp_path):
    from fleet_ext.config import load_config

    config = load_config(CONFIG, **{**SAVED, "expert_model_parallel_size": 1, "gradient_accumulation_steps": 2,
                                    "output_dir": str(tmp_path / "one"),
                                    "resume_from_checkpoint": str(saved_run / "checkpoint-3")})
    trainer, report = resume_and_check(config)
    _assert_loaded_bitwise(report, sharded=False)
    _assert_next_losses(saved_run, tmp_path / "one")
    # Negative control: the comparison catches one planted ulp (the weights have trained on since the load).
    key = next(k for k in trainer.model.sharded_state_dict() if k.endswith("experts.weight1"))
    tensor = trainer.model.sharded_state_dict()[key].local_tensor
    saved = saved_tensors(saved_run / "checkpoint-3")[key]
    tensor.set_value(saved)
    assert key not in compare_to_saved(trainer, saved_run / "checkpoint-3")["model"]["differ"]
    planted = saved.copy()
    planted[0, 0, 0] = np.nextafter(planted[0, 0, 0], np.float32(np.inf))
    tensor.set_value(planted)
    assert key in compare_to_saved(trainer, saved_run / "checkpoint-3")["model"]["differ"]


@pytest.mark.parametrize("nproc, overrides", [
    (2, {"expert_model_parallel_size": 1}),  # ep 1 x dp 2
    (4, {"per_device_train_batch_size": 1}),  # dp 4 x ep 2: the same global batch of 4
], ids=["ep1_dp2", "dp4_ep2"])
def test_dp2_ep2_checkpoint_under_another_layout(saved_run, tmp_path, nproc, overrides):
    out, logs, reports = tmp_path / "run", tmp_path / "logs", tmp_path / "reports"
    args = ["--report_dir", str(reports), "--output_dir", str(out),
            "--resume_from_checkpoint", str(saved_run / "checkpoint-3"), *cli_args(overrides)]
    result = launch(HERE, args, logs, nproc=nproc, timeout=600)
    assert result.returncode == 0, describe(result, logs)
    assert f"resumed from {saved_run / 'checkpoint-3'} at step 3" in worker_log(logs, 0)
    for rank in range(nproc):
        report = json.loads((reports / f"rank_{rank}.json").read_text())
        _assert_loaded_bitwise(report, sharded=overrides.get("expert_model_parallel_size", 2) > 1)
    _assert_next_losses(saved_run, out)


def test_paddle_flat_range_bug_for_3d_tensors_and_fleet_ext_refuses_flattened_chunks(tmp_path):
    """Paddle 3.3.1's ``minimal_nd_slice`` gives a box too narrow when the flat range's start and end share the
    index of the axis before the last but not of an earlier one: the flat range [0, 14) of a (2, 3, 4) tensor
    holds (0, 1, 3) (flat 7), outside the box it returns. Its loader then misplaces such a flattened chunk.
    fleet_ext never writes flattened chunks and refuses to read them, on one process and on several."""
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    from paddle.distributed.flex_checkpoint.dcp.utils import minimal_nd_slice

    from fleet_ext.training.checkpoint import CheckpointError, load_sharded, read_local

    shape, end = (2, 3, 4), 14
    box, _, _ = minimal_nd_slice(shape, 0, end)
    inside = [np.unravel_index(i, shape) for i in range(end)]
    truth = [(min(ix[a] for ix in inside), max(ix[a] for ix in inside) + 1) for a in range(3)]
    assert truth == [(0, 2), (0, 3), (0, 4)]
    assert box == [(0, 2), (0, 3), (0, 2)], f"Paddle's minimal_nd_slice changed ({box}): revisit this test"

    full = np.arange(24, dtype="float32").reshape(shape)
    flat = ShardedWeight("w", paddle.to_tensor(full.reshape(-1)[:end]), shape, shape, (0, 0, 0), is_flattened=True,
                         flattened_range=slice(0, end))
    dist.save_state_dict({"w": flat}, str(tmp_path / "ck"))
    target = paddle.zeros(shape)
    dist.load_state_dict({"w": ShardedWeight("w", target, shape, shape, (0, 0, 0))}, str(tmp_path / "ck"))
    expected = np.where(np.arange(24).reshape(shape) < end, full, 0)
    assert not np.array_equal(target.numpy(), expected), "Paddle now loads a 3-D flattened chunk right: revisit"

    for load in (lambda sd: load_sharded(sd, tmp_path / "ck", 1), lambda sd: read_local(sd, tmp_path / "ck")):
        with pytest.raises(CheckpointError, match=r"tensor `w` is saved flattened \(flat range \(0, 14\)"):
            load({"w": ShardedWeight("w", paddle.zeros(shape), shape, shape, (0, 0, 0))})


def test_expert_checkpoint_chunks_are_boxes_read_exactly_across_shards(saved_run):
    """The saved 3-D expert weights are two box chunks (one per expert rank, never flattened); a region that
    crosses the chunk boundary on every axis is read element for element."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    from fleet_ext.training.checkpoint import read_local

    path = saved_run / "checkpoint-3"
    for part in ("model", "optimizer"):
        meta = paddle.load(str(path / part / "0.metadata"))
        assert not any(index.is_flattened for index in meta.storage_metadata)
    meta = paddle.load(str(path / "model" / "0.metadata"))
    key = next(k for k in meta.state_dict_metadata if k.endswith("experts.weight1"))
    chunks = sorted(index.global_offset for index in meta.storage_metadata if index.tensor_key == key)
    full = saved_tensors(path)[key]
    assert full.ndim == 3 and chunks == [(0, 0, 0), (full.shape[0] // 2, 0, 0)], chunks
    offset = (full.shape[0] // 2 - 1, 1, 2)
    shape = (2, full.shape[1] - 2, full.shape[2] - 3)
    target = paddle.zeros(shape)
    read_local({key: ShardedWeight(key, target, shape, full.shape, offset)}, path / "model")
    want = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    assert target.numpy().tobytes() == want.tobytes()


def test_checkpoint_with_another_expert_count_exits_2_on_every_rank(saved_run, tmp_path):
    gate, logs = tmp_path / "gate", tmp_path / "logs"
    args = ["--gate_dir", str(gate), "--output_dir", str(tmp_path / "out"),
            *cli_args({**SAVED, "n_routed_experts": 4, "resume_from_checkpoint": str(saved_run / "checkpoint-3")})]
    result = launch(GATE, args, logs, timeout=300)
    assert result.returncode == 2, describe(result, logs)
    for rank in (0, 1):
        log = worker_log(logs, rank)
        assert f"[rank {rank}] fleet_ext pretrain: error: {saved_run / 'checkpoint-3' / 'model'}: tensor `" in log, log
        assert "in the checkpoint but [4" in log and "(the checkpoint was saved with n_routed_experts = 8, " \
            "this run has 4)" in log and "Fix: resume with the model keys the checkpoint was saved with" in log, log
        assert json.loads((gate / f"rank_{rank}.json").read_text())["exit_code"] == 2


def _main(argv: list[str]) -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from fleet_ext.config import load_config
    from fleet_ext.parallel.distributed import env_world
    from fleet_ext.training.cli import parse_overrides

    parser = argparse.ArgumentParser()
    parser.add_argument("--report_dir", type=Path, required=True, help="where each rank writes rank_<r>.json")
    args, rest = parser.parse_known_args(argv)
    _, report = resume_and_check(load_config(CONFIG, **{**SAVED, **parse_overrides(rest)}))
    rank, _ = env_world()
    args.report_dir.mkdir(parents=True, exist_ok=True)
    (args.report_dir / f"rank_{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
