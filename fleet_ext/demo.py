"""A short built-in demo: build the tiny DSv4-hybrid MoE model on the CPU and train it for a few steps.

Run ``python -m fleet_ext.demo`` (or ``fleet-ext-demo``). It prints the resolved config, the backend of
every fusion switch, then trains on a small embedded public-domain text (byte-level tokens) and
reports the loss before and after. The full pretraining job is ``scripts/pretrain.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "dsv4_tiny_cpu.yaml")

# The opening of the United States Declaration of Independence (1776), public domain.
DEMO_TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political "
    "bands which have connected them with another, and to assume among the powers of the earth, the "
    "separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent "
    "respect to the opinions of mankind requires that they should declare the causes which impel them "
    "to the separation. We hold these truths to be self-evident, that all men are created equal, that "
    "they are endowed by their Creator with certain unalienable Rights, that among these are Life, "
    "Liberty and the pursuit of Happiness. "
)


def _batches(seq_len: int, batch: int, steps: int):
    """Byte-level windows of the demo text, cycling deterministically."""
    import numpy as np

    data = np.frombuffer((DEMO_TEXT * 8).encode("utf-8"), dtype=np.uint8).astype(np.int64)
    stride = 37
    for step in range(steps):
        rows = []
        for b in range(batch):
            start = ((step * batch + b) * stride) % (len(data) - seq_len - 1)
            rows.append(data[start : start + seq_len + 1])
        chunk = np.stack(rows)
        yield chunk[:, :-1], chunk[:, 1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="model YAML (default: the embedded tiny model)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    import paddle
    from tqdm import tqdm

    from fleet_ext.config import load_config
    from fleet_ext.models import DSv4ForCausalLM

    config = load_config(args.config)
    paddle.seed(1234)
    model = DSv4ForCausalLM(config)
    n_params = sum(int(p.numel()) for p in model.parameters())
    kinds = [str(r) for r in config.model.csa_compress_ratios]
    print(f"fleet_ext demo: DSv4ForCausalLM, {n_params / 1e6:.2f} M parameters, layer ratios [{', '.join(kinds)}]")
    print(model.backend.format_table())
    optimizer = paddle.optimizer.AdamW(learning_rate=args.lr, parameters=model.parameters(), weight_decay=0.0)
    first = last = None
    start = time.time()
    bar = tqdm(_batches(args.seq_len, args.batch_size, args.steps), total=args.steps, desc="demo", unit="step")
    for inputs, labels in bar:
        _, loss = model(paddle.to_tensor(inputs), labels=paddle.to_tensor(labels))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        last = float(loss)
        first = last if first is None else first
        bar.set_postfix(loss=f"{last:.3f}")
    tokens = args.steps * args.batch_size * args.seq_len
    print(f"loss {first:.3f} -> {last:.3f} over {args.steps} steps, {tokens / (time.time() - start):.0f} tokens/s")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
