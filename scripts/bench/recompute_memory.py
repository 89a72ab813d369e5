"""Activation bytes kept for the backward, and step time, under each recompute policy (CPU fp32).

    python scripts/bench/recompute_memory.py [--seq 512] [--repeats 3]

Bytes are counted with ``paddle.autograd.saved_tensors_hooks``: every tensor autograd saves during the
forward, each storage counted once, attributed to the decoder layer that saved it, summed per layer kind.
Inside a recomputed segment nothing is kept but the segment's tensor inputs (Paddle's non-reentrant
recompute re-runs the segment from them), so the script runs each segment with counting paused and counts its
inputs instead: the same accounting as the real run, which cannot be hooked twice (Paddle allows one pair of
saved-tensor hooks at a time and recompute uses it). Weights, cached RoPE / index tables and token ids are
not activations and are not counted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
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


class SavedBytes:
    """Per-layer bytes of the storages autograd keeps; layer None = embedding, head and loss."""

    def __init__(self) -> None:
        self.layer: int | None = None
        self.paused = 0
        self.seen: set[tuple[int, int]] = set()
        self.per_layer: dict[int | None, int] = defaultdict(int)

    def count(self, tensor: Any) -> None:
        if self.paused or not isinstance(tensor, paddle.Tensor):
            return
        if tensor.persistable or (tensor.is_leaf and tensor.stop_gradient):  # weights, cached tables, token ids
            return
        nbytes = int(tensor.size) * tensor.element_size()
        key = (tensor.data_ptr(), nbytes)
        if nbytes and key not in self.seen:
            self.seen.add(key)
            self.per_layer[self.layer] += nbytes

    def pack(self, tensor: Any) -> Any:
        self.count(tensor)
        return tensor

    def checkpointed(self, fn: Any, *args: Any) -> Any:
        """Stand-in for ``recompute_module.checkpointed``: keeps the inputs, nothing inside."""
        if self.paused:
            return fn(*args)
        for arg in args:
            self.count(arg)
        self.paused += 1
        try:
            return fn(*args)
        finally:
            self.paused -= 1


def measure(overrides: dict, seq: int) -> dict[str, int]:
    """Bytes kept per layer kind for one forward of the tiny model (batch 1, ``seq`` tokens)."""
    config = load_config(TINY, **MODEL, **overrides)
    paddle.seed(0)
    model = DSv4ForCausalLM(config)
    model.train()
    saved = SavedBytes()
    for index, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda _layer, _args, i=index: setattr(saved, "layer", i))
        layer.register_forward_post_hook(lambda _layer, _args, _out: setattr(saved, "layer", None))
    ids = paddle.to_tensor(np.random.default_rng(0).integers(1, 200, size=(1, seq + 1)).astype("int64"))
    original = (recompute_module.checkpointed, dsv4_module.checkpointed)
    recompute_module.checkpointed = dsv4_module.checkpointed = saved.checkpointed
    try:
        with paddle.autograd.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            _, loss = model(ids[:, :-1], labels=ids[:, 1:])
    finally:
        recompute_module.checkpointed, dsv4_module.checkpointed = original
    kinds = kinds_of(config.model)
    out: dict[str, int] = defaultdict(int)
    for layer, nbytes in saved.per_layer.items():
        out["other" if layer is None else kinds[layer].value] += nbytes
    out["total"] = sum(saved.per_layer.values())
    return dict(out)


def step_time(overrides: dict, seq: int, repeats: int) -> float:
    """Median seconds of one real forward + backward (the real recompute, not the stand-in)."""
    config = load_config(TINY, **MODEL, **overrides)
    paddle.seed(0)
    model = DSv4ForCausalLM(config)
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(1, 200, size=(1, seq + 1)).astype("int64"))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        _, loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        model.clear_gradients()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = measure({}, args.seq)
    base_time = step_time({}, args.seq, args.repeats)
    kinds = [k for k in base if k not in ("total", "other")]
    print(f"| policy | {' | '.join(f'{k} (KiB/layer kind)' for k in kinds)} | other | total | kept vs none | "
          "step time (s) | vs none |")
    print("|---" * (len(kinds) + 6) + "|")
    for name, overrides in POLICIES.items():
        got = base if name == "none" else measure(overrides, args.seq)
        seconds = base_time if name == "none" else step_time(overrides, args.seq, args.repeats)
        cells = [f"{got.get(k, 0) / 1024:,.0f}" for k in [*kinds, "other", "total"]]
        print(f"| {name} | {' | '.join(cells)} | {got['total'] / base['total']:.1%} | {seconds:.3f} | "
              f"{seconds / base_time:.2f}x |")


if __name__ == "__main__":
    main()
