"""metrics.jsonl (one JSON object per logged step or evaluation) and the loss-curve PNG. Rank 0 only."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "read_metrics", "train_losses", "plot_loss"]

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file (or of ``<dir>/metrics.jsonl``)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def train_losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """{step: loss} of the training records (evaluation records carry ``eval_loss`` instead)."""
    return {int(r["step"]): float(r["loss"]) for r in records if "loss" in r}


class MetricsLog:
    """Append-only JSONL writer; on resume it first drops the records after the resumed step."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []

    def start(self, resume_step: int | None) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.is_file():
            kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)
        self.records = kept

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")


def plot_loss(records: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """Training loss per step and held-out loss per evaluation, written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out loss", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title or "fleet_ext pretraining")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
