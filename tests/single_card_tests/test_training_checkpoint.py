"""Training checkpoints (one process): what is saved, atomic completion, auto-resume never picking a partial
save, rotation, the local FlexCheckpoint reader, and bitwise resume (2N steps straight == N + resume + N)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from fleet_ext.config import load_config
from fleet_ext.training import checkpoint as ckpt
from fleet_ext.training.metrics import read_metrics, train_losses
from fleet_ext.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SMALL = {
    "max_seq_len": 64,
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 2,
    "max_steps": 8,
    "warmup_steps": 2,
    "save_steps": 4,
    "eval_steps": 0,
    "eval_iters": 1,
    "logging_steps": 1,
    "disable_tqdm": True,
    "resume_from_checkpoint": "auto",
}


def _trainer(out: Path, **overrides) -> Trainer:
    return Trainer(
        load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml", **{**SMALL, "output_dir": str(out), **overrides})
    )


def _tensors(path: Path) -> dict[str, bytes]:
    """name -> raw bytes of every tensor in a FlexCheckpoint directory (read file by file, with paddle.load)."""
    out = {}
    for f in sorted(path.glob("*.distcp")):
        for key, value in paddle.load(str(f), return_numpy=True).items():
            out[key] = (value.dtype.str, value.shape, value.tobytes())
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 steps in one go, checkpoints at 4 and 8; also the trainer, for in-memory comparisons."""
    out = tmp_path_factory.mktemp("straight")
    trainer = _trainer(out)
    trainer.train()
    return out, trainer


def test_checkpoint_layout_and_stock_names(straight):
    out, trainer = straight
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [4, 8]
    c8 = out / "checkpoint-8"
    assert {p.name for p in c8.iterdir()} == {
        "model",
        "optimizer",
        "rng_state_0.pkl",
        "trainer_state.json",
        "config.yaml",
        "COMPLETE",
    }
    state = json.loads((c8 / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and state["consumed_samples"] == 16 and state["world_size"] == 1
    assert state["lr_scheduler"]["last_epoch"] == 8
    saved = paddle.load(str(c8 / "model" / "0_0.distcp"))
    assert set(saved) == set(trainer.model.state_dict())  # stock names: model.state_dict() keys, nothing else
    opt = paddle.load(str(c8 / "optimizer" / "0_0.distcp"))
    assert "layers.0.mlp.experts.weight1.moment1_0" in opt and "word_embeddings.weight.beta2_pow_acc_0" in opt
    # The CSA indexer gets no gradient yet (no indexer loss), so it has no optimizer state.
    assert not any(".indexer." in k for k in opt)
    assert load_config(c8 / "config.yaml") == trainer.config
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_straight_vs_resume_is_bitwise(straight, tmp_path):
    """2N = 8 steps straight == 4 steps, stop, auto-resume from checkpoint-4, 4 more steps."""
    out, _ = straight
    shutil.copytree(out / "checkpoint-4", tmp_path / "checkpoint-4")
    shutil.copy(out / "metrics.jsonl", tmp_path / "metrics.jsonl")  # holds steps 1..8: resume keeps 1..4
    resumed = _trainer(tmp_path)
    resumed.train()
    assert train_losses(read_metrics(tmp_path)) == train_losses(read_metrics(out))
    assert sorted(train_losses(read_metrics(tmp_path))) == list(range(1, 9))
    # The final checkpoints hold bitwise-identical parameters, buffers and AdamW state.
    for part in ("model", "optimizer"):
        got, want = _tensors(tmp_path / "checkpoint-8" / part), _tensors(out / "checkpoint-8" / part)
        assert got.keys() == want.keys() and all(got[k] == want[k] for k in want), part


def test_load_restores_model_optimizer_schedule_data_position(straight, tmp_path):
    out, trainer = straight
    fresh = _trainer(tmp_path, resume_from_checkpoint=str(out / "checkpoint-8"))
    fresh.resume(out / "checkpoint-8")
    assert fresh.global_step == 8 and fresh.consumed_samples == trainer.consumed_samples
    assert fresh.scheduler.last_epoch == trainer.scheduler.last_epoch and fresh.scheduler() == trainer.scheduler()
    for (name, a), b in zip(trainer.model.state_dict().items(), fresh.model.state_dict().values()):
        assert a.numpy().tobytes() == b.numpy().tobytes(), name
    want = {
        k: v.local_tensor.numpy()
        for k, v in ckpt.optimizer_sharded_state_dict(trainer.optimizer, trainer.model).items()
    }
    got = ckpt.optimizer_sharded_state_dict(fresh.optimizer, fresh.model)
    assert set(got) == set(want)
    for key, weight in got.items():
        assert weight.local_tensor.numpy().tobytes() == want[key].tobytes(), key


def test_auto_resume_never_picks_a_partial_checkpoint(straight, tmp_path):
    out, _ = straight
    root = tmp_path / "run"
    shutil.copytree(out / "checkpoint-4", root / "checkpoint-4")
    shutil.copytree(out / "checkpoint-8", root / "tmp-checkpoint-12")  # a save killed before the rename
    shutil.copytree(out / "checkpoint-8", root / "checkpoint-16")
    (root / "checkpoint-16" / "COMPLETE").unlink()  # e.g. a half-copied directory
    shutil.copytree(out / "checkpoint-8", root / "checkpoint-20")
    shutil.rmtree(root / "checkpoint-20" / "optimizer")
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [4]
    assert ckpt.resolve_resume("auto", root) == root / "checkpoint-4"
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint-16' is not a complete checkpoint.*Fix: use an earlier"):
        ckpt.resolve_resume(str(root / "checkpoint-16"), root)
    with pytest.raises(
        ckpt.CheckpointError, match=r"already holds checkpoints \(checkpoint-4\).*resume_from_checkpoint"
    ):
        ckpt.resolve_resume(None, root)
    assert ckpt.resolve_resume("auto", tmp_path / "empty") is None
    assert ckpt.remove_partial_checkpoints(root) == ["tmp-checkpoint-12"]
    assert (root / "checkpoint-16").is_dir()  # not ours to delete: only tmp- directories are removed


def test_save_total_limit_keeps_the_newest(tmp_path):
    _trainer(tmp_path, max_steps=6, save_steps=2, save_total_limit=2, eval_iters=0).train()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    assert not list(tmp_path.glob("tmp-*"))


def test_local_reader_matches_flexcheckpoint_and_reads_shards(straight):
    """read_local (the multi-rank load path) gives what paddle.distributed.load_state_dict gives, and fills a
    sharded target (rows 4..8 of a tensor) from the saved full tensor."""
    out, trainer = straight
    path = out / "checkpoint-8" / "model"
    a, b = _trainer(out.parent / "a").model, _trainer(out.parent / "b").model
    ckpt.read_local(a.sharded_state_dict(), path)
    paddle.distributed.load_state_dict(b.sharded_state_dict(), str(path))
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), trainer.model.state_dict().values()):
        assert x.numpy().tobytes() == y.numpy().tobytes() == z.numpy().tobytes(), name
    full = trainer.model.output_layer.weight.numpy()
    shard = paddle.zeros([4, full.shape[1]], dtype="float32")
    target = ShardedWeight("output_layer.weight", shard, (4, full.shape[1]), tuple(full.shape), (4, 0))
    ckpt.read_local({"output_layer.weight": target}, path)
    np.testing.assert_array_equal(shard.numpy(), full[4:8])
    with pytest.raises(ckpt.CheckpointError, match="tensor `no.such` is not in the checkpoint"):
        ckpt.read_local({"no.such": ShardedWeight("no.such", shard, (4, 256), (4, 256), (0, 0))}, path)
