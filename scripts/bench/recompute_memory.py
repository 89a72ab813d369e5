"""Activation bytes kept for the backward, and step time, under each recompute policy (CPU fp32).

    python scripts/bench/recompute_memory.py [--seq 512] [--repeats 5]

Bytes are counted with ``paddle.autograd.saved_tensors_hooks``: every storage a grad node still holds when the
forward ends (a node cut off by ``detach`` frees what it saved), each storage once however many ops save it or
views of it, in the decoder layer that first saved it, summed per layer kind. Not counted: storages that exist
without this forward (weights and slices of them, cached RoPE / index tables, the token ids): a first,
independent forward finds them, as the storages both forwards save. Inside a recomputed segment nothing is kept
but the segment's tensor inputs (Paddle's non-reentrant recompute re-runs the segment from them) and the
decisions its replay records (the CSA indexer's picks, the routed experts), so the script runs each segment with
counting paused and counts those instead: the same accounting as the real run, which cannot be hooked twice
(Paddle allows one pair of saved-tensor hooks at a time and recompute uses it).
``scripts/bench/recompute_formula.py`` gives the same bytes as a formula of the widths (tested equal).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import fleet_ext.models.dsv4 as dsv4_module  # noqa: E402
import fleet_ext.parallel.recompute as recompute_module  # noqa: E402
from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.layer_kinds import kinds_of  # noqa: E402
from fleet_ext.models import DSv4ForCausalLM  # noqa: E402

TINY = ROOT / "fleet_ext" / "configs" / "dsv4_tiny_cpu.yaml"
MODEL = {"csa_compress_ratios": [0, 4, 128, -1], "use_vha_attention": True}
MODULES = ["full_attn", "vha_postmix", "core_attn", "mhc", "moe", "moe_act"]
POLICIES: dict[str, dict] = {
    "none": {},
    "full (uniform, 1 layer per chunk)": {"recompute_granularity": "full", "recompute_method": "uniform",
                                          "recompute_num_layers": 1},
    **{f"selective: {m}": {"recompute_granularity": "selective", "recompute_modules": [m]} for m in MODULES},
    "selective: all": {"recompute_granularity": "selective", "recompute_modules": MODULES},
}


class _Box:
    """What the pack hook hands autograd instead of the tensor: alive exactly as long as the grad node that saved it.

    It holds a detached alias (same storage, no grad node): holding the tensor itself would tie the node that saved
    its own output into a reference cycle and keep it alive after the graph dropped it. Counting never runs the
    backward, so nothing unpacks the alias.
    """

    __slots__ = ("tensor", "persistable", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor, self.persistable = tensor.detach(), tensor.persistable


def _storage(tensor: Any) -> tuple[int, int]:
    """(base address, bytes) of the allocation behind ``tensor`` (a view shares its base's)."""
    return tensor.data_ptr() - tensor._offset(), int(tensor._holder_size())


class _Records(list):
    """A segment's replay records (``fleet_ext.parallel.recompute._Replay.records``): each decision is kept until
    the backward re-runs the segment, so it counts, in the layer that made it."""

    def __init__(self, saved: SavedBytes) -> None:
        super().__init__()
        self.saved = saved

    def append(self, value: Any) -> None:
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, paddle.Tensor):
                self.saved.keep(lambda item=item: _Box(item))
        super().append(value)


class SavedBytes:
    """Bytes of the storages autograd keeps for the backward, per decoder layer (None = embedding, head, loss).

    Each storage counts once, in the layer that first saved it, and only if a grad node still holds it when the
    forward ends (nodes cut off by ``detach`` free what they saved). ``constants`` are the storages that exist
    independently of this forward (weights, cached RoPE / index tables, the token ids): never counted.
    """

    def __init__(self, constants: set[int], trace: bool = False) -> None:
        self.constants, self.trace = constants, trace
        self.layer: int | None = None
        self.paused = 0
        # (layer, a callable giving the box or None once the grad node holding it is gone, where it was saved)
        self.kept: list[tuple[int | None, Any, str]] = []

    def keep(self, holder: Any) -> None:
        self.kept.append((self.layer, holder, _caller() if self.trace else ""))

    def pack(self, tensor: Any) -> Any:
        if self.paused or not isinstance(tensor, paddle.Tensor):
            return tensor
        box = _Box(tensor)
        self.keep(weakref.ref(box))
        return box

    @staticmethod
    def unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Box) else packed

    def checkpointed(self, fn: Any, *args: Any) -> Any:
        """Stand-in for ``recompute_module.checkpointed``: keeps what Paddle's non-reentrant recompute keeps, the
        tensor inputs, and what the segment's replay records for its re-run (indexer picks, routed experts),
        nothing else. A full-recompute chunk's input is charged to the chunk's first layer."""
        if self.paused:
            return fn(*args)
        if getattr(fn, "__name__", "") == "_run_layers":
            self.layer = args[3][0]
        for arg in args:
            if isinstance(arg, paddle.Tensor):
                self.keep(lambda arg=arg: _Box(arg))
        # The real ``checkpointed`` records the segment's decisions in a ``_Replay``; the stand-in too, to count them.
        replay = recompute_module._Replay()
        replay.records = _Records(self)
        recompute_module._ACTIVE.append(replay)
        self.paused += 1
        try:
            return fn(*args)
        finally:
            self.paused -= 1
            recompute_module._ACTIVE.pop()

    def records(self) -> list[tuple[int | None, int, str, list[int], str]]:
        """(layer, bytes, dtype, shape, where) of every storage counted, in the order it was first saved."""
        gc.collect()
        seen: set[int] = set()
        out = []
        for layer, holder, where in self.kept:
            box = holder()
            if box is None:  # the node that saved it is gone: not kept for the backward
                continue
            tensor = box.tensor
            base, nbytes = _storage(tensor)
            if box.persistable or base in self.constants or base in seen or not nbytes:
                continue
            seen.add(base)
            out.append((layer, nbytes, str(tensor.dtype).split(".")[-1], list(tensor.shape), where))
        return out


def _caller() -> str:
    """``file:line`` of the innermost fleet_ext frame that made autograd save a tensor (for ``--trace``)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/fleet_ext/" in frame.filename and "parallel/recompute" not in frame.filename:
            return f"{frame.filename.split('fleet_ext/')[-1]}:{frame.lineno}"
    return "?"


def _forward(model: Any, ids: Any, hooks: tuple, stand_in: Any) -> Any:
    """One training forward (loss included) under ``hooks`` with ``stand_in`` for ``checkpointed``."""
    original = (recompute_module.checkpointed, dsv4_module.checkpointed)
    recompute_module.checkpointed = dsv4_module.checkpointed = stand_in
    try:
        with paddle.autograd.saved_tensors_hooks(*hooks):
            return model(*ids)
    finally:
        recompute_module.checkpointed, dsv4_module.checkpointed = original


def saved_records(config: Any, batch: int, seq: int, trace: bool = False) -> list[tuple]:
    """``SavedBytes.records()`` of one training forward of ``config``'s model on ``batch`` x ``seq`` tokens.

    A first forward (everything saved, nothing recomputed, all of it held) finds the constants: storages a
    second, independent forward saves again are not created by it.
    """
    paddle.seed(0)
    model = DSv4ForCausalLM(config)
    model.train()
    vocab = config.model.vocab_size
    tokens = np.random.default_rng(0).integers(1, vocab, size=(batch, seq + 1)).astype("int64")
    ids = paddle.to_tensor(tokens[:, :-1].copy()), paddle.to_tensor(tokens[:, 1:].copy())  # as a data loader gives them
    held: list[Any] = []
    first = _forward(model, ids, (lambda t: held.append(t) or t, lambda t: t), lambda fn, *args: fn(*args))
    # The token ids too: a segment that takes them (a full-recompute chunk, an attention reading its loss mask) keeps
    # a reference to the data loader's tensor, not a new storage, and no op saves them since the embedding remaps them.
    constants = {_storage(t)[0] for t in [*held, *ids] if isinstance(t, paddle.Tensor)}
    saved = SavedBytes(constants, trace)
    for index, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda _layer, _args, i=index: setattr(saved, "layer", i))
        layer.register_forward_post_hook(lambda _layer, _args, _out: setattr(saved, "layer", None))
    second = _forward(model, ids, (saved.pack, saved.unpack), saved.checkpointed)
    records = saved.records()
    held.clear()
    del first, second
    return records


def measure(overrides: dict, seq: int, batch: int = 1, source: Any = TINY) -> dict[str, int]:
    """Bytes kept per layer kind (and "other", "total") for one training forward of the model."""
    config = load_config(source, **MODEL, **overrides) if source == TINY else load_config(source, **overrides)
    kinds = kinds_of(config.model)
    out: dict[str, int] = defaultdict(int)
    for layer, nbytes, *_ in saved_records(config, batch, seq):
        out["other" if layer is None else kinds[layer].value] += nbytes
    out["total"] = sum(v for k, v in out.items())
    return dict(out)


def step_times(seq: int, repeats: int) -> dict[str, float]:
    """Per policy, the fastest of ``repeats`` real forward + backward steps (the real recompute, not the stand-in).

    The policies take turns, one step each per round, after a warm-up round: on a shared machine a burst of load
    then slows every policy alike, and the minimum is the step least disturbed by it.
    """
    ids = paddle.to_tensor(np.random.default_rng(0).integers(1, 200, size=(1, seq + 1)).astype("int64"))
    models = {}
    for name, overrides in POLICIES.items():
        paddle.seed(0)
        models[name] = DSv4ForCausalLM(load_config(TINY, **MODEL, **overrides))
        models[name].train()
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    for _ in range(repeats + 1):
        for name, model in models.items():
            start = time.perf_counter()
            _, loss = model(ids[:, :-1], labels=ids[:, 1:])
            loss.backward()
            model.clear_gradients()
            times[name].append(time.perf_counter() - start)
    return {name: min(values[1:]) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kept = {name: measure(overrides, args.seq) for name, overrides in POLICIES.items()}
    seconds = step_times(args.seq, args.repeats)
    base, base_time = kept["none"], seconds["none"]
    kinds = [k for k in base if k not in ("total", "other")]
    print(f"| policy | {' | '.join(f'{k} (KiB/layer kind)' for k in kinds)} | other | total | kept vs none | "
          "step time (s) | vs none |")
    print("|---" * (len(kinds) + 6) + "|")
    for name, got in kept.items():
        cells = [f"{got.get(k, 0) / 1024:,.0f}" for k in [*kinds, "other", "total"]]
        print(f"| {name} | {' | '.join(cells)} | {got['total'] / base['total']:.1%} | {seconds[name]:.3f} | "
              f"{seconds[name] / base_time:.2f}x |")


if __name__ == "__main__":
    main()
