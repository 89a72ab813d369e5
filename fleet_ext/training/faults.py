"""Fault injection for the fault-tolerance tests (``scripts/pretrain.py --inject_fault KIND@STEP[:RANK]``).

Not a config key: it exists so that tests can kill a rank at an exact point or poison one loss, and it
does nothing unless given. Kinds:

- ``kill@S[:R]``: rank R (every rank if omitted) sends itself SIGKILL before computing step S;
- ``kill_in_save@S[:R]``: SIGKILL after rank R has written its files of the step-S checkpoint, before
  the checkpoint is complete (so a partial ``tmp-checkpoint-S`` stays behind);
- ``nan_loss@S[:R]``: the loss of step S on rank R becomes NaN (as a diverged run would).

Steps are global steps, 1-based (the step number a metrics record and a checkpoint would carry).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

__all__ = ["FAULT_KINDS", "Fault", "FaultPlan", "parse_faults"]

FAULT_KINDS = ("kill", "kill_in_save", "nan_loss")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None

    def hits(self, kind: str, step: int, rank: int) -> bool:
        return self.kind == kind and self.step == step and (self.rank is None or self.rank == rank)


def _parse_one(spec: str) -> Fault:
    usage = f"--inject_fault expects KIND@STEP[:RANK] with KIND in {list(FAULT_KINDS)}, got {spec!r}"
    kind, _, rest = spec.partition("@")
    step, _, rank = rest.partition(":")
    if kind not in FAULT_KINDS or not step.isdigit() or (rank and not rank.isdigit()):
        raise ValueError(usage)
    return Fault(kind, int(step), int(rank) if rank else None)


def parse_faults(specs: list[str] | None) -> FaultPlan:
    return FaultPlan([_parse_one(s) for s in specs or []])


class FaultPlan:
    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults

    def __bool__(self) -> bool:
        return bool(self.faults)

    def kill_point(self, kind: str, step: int, rank: int) -> None:
        if any(f.hits(kind, step, rank) for f in self.faults):
            print(f"[fault injection] {kind}: SIGKILL to rank {rank} (pid {os.getpid()}) at step {step}", flush=True)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def poison_loss(self, loss, step: int, rank: int):
        if any(f.hits("nan_loss", step, rank) for f in self.faults):
            return loss * float("nan")
        return loss
