"""Training checkpoints in FlexCheckpoint format: written atomically, found safely, loaded into any layout.

Layout of ``<output_dir>/checkpoint-<step>/``::

    model/                 FlexCheckpoint of model.sharded_state_dict() (stock, unfused, unsharded names)
    optimizer/             FlexCheckpoint of AdamW's sharded_state_dict (``<param>.moment1_0``, ...)
    rng_state_<rank>.pkl   Python, NumPy and Paddle RNG states of each rank
    trainer_state.json     global step, consumed samples (data position), LR scheduler, world size, ...
    config.yaml            the resolved config of the run
    COMPLETE               written last

Saving: every rank writes into ``tmp-checkpoint-<step>/`` (``paddle.distributed.save_state_dict``, one
file per rank, replicated tensors de-duplicated across ranks); after a barrier rank 0 writes the trainer
state and ``COMPLETE`` and renames the directory to ``checkpoint-<step>``. A run killed mid-save leaves
only a ``tmp-`` directory, which resume never reads (and the next run removes).

Loading: in one process, ``paddle.distributed.load_state_dict`` (purely local reads; works on CPU and
GPU). With several processes, FlexCheckpoint's own loader moves tensors between ranks with ``.cuda()``
copies, which the CPU build cannot do; so each rank instead reads the chunks it needs straight from the
checkpoint files (:func:`read_local`: the metadata says which file holds which region; no cross-rank
traffic). That path works on CPU and GPU alike, for any number of ranks and any expert-parallel split at
save and at load. Both paths first refuse tensors whose global shape differs from the model's. Flattened
(sharding-v2) chunks are refused: Paddle 3.3.1 maps their flat ranges to boxes with ``minimal_nd_slice``,
which is wrong for three or more dimensions; fleet_ext never writes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.base import framework

from fleet_ext.config import RESUME_AUTO

__all__ = [
    "CheckpointError",
    "CHECKPOINT_PREFIX",
    "TMP_PREFIX",
    "is_complete",
    "list_checkpoints",
    "find_latest_checkpoint",
    "resolve_resume",
    "remove_partial_checkpoints",
    "save_checkpoint",
    "load_checkpoint",
    "load_sharded",
    "read_local",
    "optimizer_sharded_state_dict",
]

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = "tmp-checkpoint-"
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (partial, missing, or from an incompatible run)."""


@contextlib.contextmanager
def _quiet_flex_checkpoint():
    """FlexCheckpoint logs every metadata write and file read at INFO; keep the training log readable."""
    from paddle.distributed.fleet.utils.log_util import logger

    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


# --------------------------------------------------------------------------------------------------
# Finding checkpoints.
# --------------------------------------------------------------------------------------------------
def is_complete(path: str | os.PathLike) -> bool:
    """A checkpoint directory whose save finished (COMPLETE marker, trainer state, both FlexCheckpoints)."""
    path = Path(path)
    return (
        (path / COMPLETE).is_file()
        and (path / TRAINER_STATE).is_file()
        and (path / MODEL_DIR / "0.metadata").is_file()
        and (path / OPTIMIZER_DIR / "0.metadata").is_file()
    )


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete ``checkpoint-<step>`` directories of ``output_dir``, oldest first."""
    out = []
    root = Path(output_dir)
    if not root.is_dir():
        return out
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and is_complete(child):
            out.append((int(m.group(1)), child))
    return sorted(out)


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume_from_checkpoint: str | None, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from, or None to start fresh; raise ``CheckpointError`` naming the fix."""
    if resume_from_checkpoint is None:
        existing = list_checkpoints(output_dir)
        if existing:
            raise CheckpointError(
                f"config key `output_dir` = '{output_dir}' already holds checkpoints "
                f"({', '.join(p.name for _, p in existing[-3:])}) and `resume_from_checkpoint` is null. "
                "Fix: set `resume_from_checkpoint: auto` to continue that run, or choose a new output_dir "
                "(existing checkpoints are never overwritten)"
            )
        return None
    if resume_from_checkpoint == RESUME_AUTO:
        return find_latest_checkpoint(output_dir)
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise CheckpointError(
            f"config key `resume_from_checkpoint` = '{resume_from_checkpoint}': no such directory. "
            f"Fix: give a checkpoint-<step> directory, '{RESUME_AUTO}', or null"
        )
    if not is_complete(path):
        raise CheckpointError(
            f"config key `resume_from_checkpoint` = '{resume_from_checkpoint}' is not a complete checkpoint "
            f"(no {COMPLETE} marker, trainer state or model/optimizer metadata: a save that was interrupted?). "
            f"Fix: use an earlier checkpoint-<step> or '{RESUME_AUTO}'"
        )
    return path


def remove_partial_checkpoints(output_dir: str | os.PathLike) -> list[str]:
    """Delete ``tmp-checkpoint-*`` directories left by interrupted saves (rank 0 at start-up)."""
    removed = []
    root = Path(output_dir)
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.name.startswith(TMP_PREFIX) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
    return removed


# --------------------------------------------------------------------------------------------------
# State pieces.
# --------------------------------------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "paddle": paddle.get_rng_state()}
    if paddle.is_compiled_with_cuda():
        state["paddle_cuda"] = paddle.get_cuda_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    paddle.set_rng_state(state["paddle"])
    if "paddle_cuda" in state and paddle.is_compiled_with_cuda():
        paddle.set_cuda_rng_state(state["paddle_cuda"])


def optimizer_sharded_state_dict(optimizer: paddle.optimizer.AdamW, model: paddle.nn.Layer) -> dict:
    """AdamW moments and beta powers as FlexCheckpoint weights keyed by the parameters' stock names."""
    return optimizer.sharded_state_dict(model.sharded_state_dict())


def _create_optimizer_state(optimizer: paddle.optimizer.AdamW, model: paddle.nn.Layer, keys: set[str]) -> None:
    """Allocate AdamW accumulators for exactly the parameters that have state in the checkpoint.

    A fresh optimizer has no accumulators until its first step; parameters that never received a
    gradient (e.g. the CSA indexer until its KL loss lands) have none in the checkpoint either, and must
    not get any here, or the resumed run would differ from the uninterrupted one.
    """
    wanted = [p for name, p in model.named_parameters() if f"{name}.moment1_0" in keys]
    optimizer._create_accumulators(framework.default_main_program().global_block(), wanted)


# --------------------------------------------------------------------------------------------------
# Loading FlexCheckpoint data.
# --------------------------------------------------------------------------------------------------
def _metadata(path: Path) -> Any:
    files = sorted(path.glob("*.metadata"))
    if len(files) != 1:
        raise CheckpointError(f"{path}: expected one FlexCheckpoint *.metadata file, found {[f.name for f in files]}")
    return paddle.load(str(files[0]))


def read_local(state_dict: dict, path: str | os.PathLike) -> None:
    """Fill every ``ShardedWeight`` of ``state_dict`` from a FlexCheckpoint directory by local file reads.

    For each tensor the metadata lists the saved chunks (global offset, shape, file). Each distinct
    chunk that overlaps the region this rank owns is read (this rank's own file first) and its overlap
    copied in; the overlaps must cover the region exactly. Nothing is sent between ranks.
    """
    path = Path(path)
    meta = _metadata(path)
    own_file = f"{dist.get_rank() if dist.is_initialized() else 0}_"
    chunks: dict[str, dict[tuple, str]] = defaultdict(dict)
    for index, fname in sorted(meta.storage_metadata.items(), key=lambda kv: not kv[1].startswith(own_file)):
        if index.is_flattened:
            raise CheckpointError(
                f"{path}: tensor `{index.tensor_key}` is saved flattened (flat range {index.flattened_range}, a "
                "sharding-v2 checkpoint): fleet_ext reads only box-shaped chunks (Paddle 3.3.1's flat-range loader "
                "misplaces tensors of three or more dimensions). Fix: re-save it from a run without sharding-v2"
            )
        region = (tuple(index.global_offset), tuple(index.local_shape))
        chunks[index.tensor_key].setdefault(region, fname)  # one replica per region, preferring our own file
    files: dict[str, dict] = {}
    for key, weight in state_dict.items():
        if key not in chunks:
            raise CheckpointError(f"{path}: tensor `{key}` is not in the checkpoint")
        target = weight.local_tensor
        t_off, t_shape = tuple(weight.global_offset), tuple(weight.local_shape)
        out, covered = None, 0
        for (offset, shape), fname in chunks[key].items():
            lo = [max(a, b) for a, b in zip(t_off, offset)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(t_off, t_shape, offset, shape)]
            if any(low >= high for low, high in zip(lo, hi)):
                continue
            if fname not in files:
                files[fname] = paddle.load(str(path / fname))
            source = files[fname][key]
            src = tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, offset))
            dst = tuple(slice(a - b, c - b) for a, c, b in zip(lo, hi, t_off))
            piece = source[src] if src else source
            if shape == t_shape and offset == t_off:
                out = piece
            else:
                if out is None:
                    out = paddle.zeros(t_shape, dtype=source.dtype)
                out[dst] = piece
            covered += int(np.prod([c - a for a, c in zip(lo, hi)]))
        if covered != int(np.prod(t_shape)):
            raise CheckpointError(
                f"{path}: the saved chunks of `{key}` cover {covered} of the {int(np.prod(t_shape))} elements "
                f"at offset {t_off} shape {t_shape}"
            )
        paddle.assign(out.astype(target.dtype).to(target.place), target)


def _check_global_shapes(state_dict: dict, meta: Any, path: str | os.PathLike, hint: str = "") -> None:
    """Refuse a checkpoint whose tensors have another global shape than the model's (e.g. another expert count).

    Without this, a smaller model would silently load a corner of each larger saved tensor, and a larger one
    would fail on only the ranks whose shards reach past the saved shape (the others would wait forever).
    Every rank holds every key with the same global shape, so every rank raises the same error.
    """
    for key, weight in state_dict.items():
        saved = meta.state_dict_metadata.get(key)
        shape = saved[0].global_shape if saved else None
        if shape is not None and tuple(shape) != tuple(weight.global_shape):
            raise CheckpointError(
                f"{path}: tensor `{key}` has global shape {list(shape)} in the checkpoint but "
                f"{list(weight.global_shape)} in this model{hint}. Fix: resume with the model keys the checkpoint "
                "was saved with (its config.yaml), or start a fresh run (new output_dir, `resume_from_checkpoint: "
                "null`)"
            )


def load_sharded(state_dict: dict, path: str | os.PathLike, world_size: int, hint: str = "") -> None:
    """FlexCheckpoint load into any layout: one process reads with Paddle's loader, several with
    :func:`read_local` (see the module docstring). ``hint``: what differs between the runs, for the error."""
    meta = _metadata(Path(path))
    _check_global_shapes(state_dict, meta, path, hint)
    if world_size == 1 and not any(index.is_flattened for index in meta.storage_metadata):
        missing = sorted(set(state_dict) - set(meta.state_dict_metadata))
        if missing:
            raise CheckpointError(f"{path}: tensors missing from the checkpoint: {missing[:5]}")
        with _quiet_flex_checkpoint():
            dist.load_state_dict(state_dict, str(path))
    else:
        read_local(state_dict, path)


# --------------------------------------------------------------------------------------------------
# Save and load a training checkpoint.
# --------------------------------------------------------------------------------------------------
def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    model: paddle.nn.Layer,
    optimizer: paddle.optimizer.AdamW,
    trainer_state: dict[str, Any],
    env: Any,
    config: Any,
    save_total_limit: int | None = None,
    faults: Any = None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically (all ranks call this); return its path."""
    root = Path(output_dir)
    tmp = root / f"{TMP_PREFIX}{step}"
    final = root / f"{CHECKPOINT_PREFIX}{step}"
    if env.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    env.barrier()
    with _quiet_flex_checkpoint():
        dist.save_state_dict(model.sharded_state_dict(), str(tmp / MODEL_DIR))
        dist.save_state_dict(optimizer_sharded_state_dict(optimizer, model), str(tmp / OPTIMIZER_DIR))
    with open(tmp / f"rng_state_{env.rank}.pkl", "wb") as fh:
        pickle.dump(_rng_state(), fh)
    if faults:
        faults.kill_point("kill_in_save", step, env.rank)
    env.barrier()
    if env.is_main:
        state = dict(trainer_state, world_size=env.world_size, saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        _write_json(tmp / TRAINER_STATE, state)
        config.save_yaml(tmp / "config.yaml")
        _write_json(tmp / COMPLETE, {"global_step": step, "world_size": env.world_size})
        _fsync_dir(tmp)
        if final.exists():  # only when resuming from an older checkpoint of the same output_dir
            stale = root / f"{TMP_PREFIX}{step}-replaced"
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        if save_total_limit is not None:
            for _, old in list_checkpoints(root)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    env.barrier()
    return final


def _config_difference(path: Path, config: Any) -> str:
    """`` (saved with n_routed_experts = 8, this run has 4)``: the model keys that differ from the checkpoint's
    config.yaml, for the shape error; empty when the file or the model's config is not there."""
    saved_file = path / "config.yaml"
    if config is None or not saved_file.is_file() or not hasattr(config, "to_dict"):
        return ""
    import yaml

    saved = yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {}
    sections = [getattr(config, name, None) for name in ("model", "moe")]
    now: dict[str, Any] = {}
    for section in sections:
        if dataclasses.is_dataclass(section):
            now.update(dataclasses.asdict(section))
    diff = [f"{key} = {saved[key]!r}, this run has {value!r}" for key, value in now.items()
            if key in saved and saved[key] != value]
    return f" (the checkpoint was saved with {'; '.join(diff)})" if diff else ""


def load_checkpoint(
    path: str | os.PathLike,
    model: paddle.nn.Layer,
    optimizer: paddle.optimizer.AdamW,
    scheduler: Any,
    env: Any,
) -> dict[str, Any]:
    """Restore model, optimizer, LR scheduler and this rank's RNG states; return the trainer state."""
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint")
    with open(path / TRAINER_STATE, encoding="utf-8") as fh:
        state = json.load(fh)
    hint = _config_difference(path, getattr(model, "config", None))
    load_sharded(model.sharded_state_dict(), path / MODEL_DIR, env.world_size, hint)
    opt_keys = set(_metadata(path / OPTIMIZER_DIR).state_dict_metadata)
    _create_optimizer_state(optimizer, model, opt_keys)
    opt_sd = optimizer_sharded_state_dict(optimizer, model)
    missing = sorted(opt_keys - set(opt_sd))
    if missing:
        raise CheckpointError(f"{path / OPTIMIZER_DIR}: optimizer state for unknown parameters: {missing[:5]}")
    load_sharded(opt_sd, path / OPTIMIZER_DIR, env.world_size)
    scheduler.set_state_dict(state["lr_scheduler"])
    rng_file = path / f"rng_state_{env.rank}.pkl"
    if state.get("world_size") == env.world_size and rng_file.is_file():
        with open(rng_file, "rb") as fh:
            _set_rng_state(pickle.load(fh))
        state["rng_restored"] = True
    else:
        state["rng_restored"] = False
    return state
