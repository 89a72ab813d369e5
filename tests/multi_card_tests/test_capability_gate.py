"""A fusion switch this machine cannot run, under ``paddle.distributed.launch`` (2 CPU ranks): every rank exits 2
with the gate's message before any process group is joined or model built, and nothing is written.

The machine is faked (``fleet_ext.capability.override``: a GPU of compute capability sm75, below the kernels'
sm80) by this file run as the launched script, which then calls the pretraining CLI as ``scripts/pretrain.py``
does. Run by hand::

    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        tests/multi_card_tests/test_capability_gate.py --gate_dir out/gate --apply_rope_fusion true

Each rank writes ``rank_<r>.json`` (exit code, models built, process group joined) to ``--gate_dir`` and waits
until every rank has written its own before exiting: the launcher stops the other ranks as soon as one exits
non-zero, and the test needs to hear from both. The ranks then exit together, at one instant on the shared clock
and without Python's teardown: the launcher looks at its ranks once a second, and one that looks between two
exits stops the later rank (SIGTERM: a signal trace in its log, code 241 reported if it is rank 0; seen once in
CI when the ranks left 50 ms of polling and their teardowns apart).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from launch_helpers import CONFIG, ROOT, TEST_OVERRIDES, cli_args, describe, launch, worker_log

HERE = Path(__file__)
MESSAGE = (
    "fleet_ext pretrain: error: config key `apply_rope_fusion` = True cannot run on this machine (GPU sm75): "
    "GPU compute capability sm75 is below sm80. Fix: install what is missing or set `apply_rope_fusion` off"
)


def test_every_rank_exits_2_with_the_message_and_builds_nothing(tmp_path):
    out, logs, gate = tmp_path / "out", tmp_path / "logs", tmp_path / "gate"
    result = launch(HERE, ["--gate_dir", str(gate), "--output_dir", str(out), "--apply_rope_fusion", "true"], logs,
                    timeout=120)
    assert result.returncode == 2, describe(result, logs)  # the launcher passes a failed rank's exit code on
    for rank in (0, 1):
        log = worker_log(logs, rank)
        assert f"[rank {rank}] {MESSAGE}" in log, describe(result, logs)
        assert "Traceback" not in log and "fleet_ext pretraining" not in log, log[-3000:]
        state = json.loads((gate / f"rank_{rank}.json").read_text())
        assert state == {"rank": rank, "exit_code": 2, "models_built": 0, "process_group_joined": False}, state
    assert not out.exists()  # no checkpoint, no metrics: nothing was written


def _report(gate: Path, state: dict, world: int, timeout: float = 60.0) -> float:
    """Write this rank's result, then wait until every rank has written its own (a file barrier); returns the
    instant all ranks exit at (a quarter second after the last file was written, the same on every rank)."""
    gate.mkdir(parents=True, exist_ok=True)
    tmp = gate / f".rank_{state['rank']}.json.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, gate / f"rank_{state['rank']}.json")
    deadline = time.monotonic() + timeout
    while len(list(gate.glob("rank_*.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.005)
    return max(f.stat().st_mtime for f in gate.glob("rank_*.json")) + 0.25


def _exit_at(instant: float, code: int) -> None:
    """Exit with ``code`` at wall-clock ``instant``, output flushed, without Python's teardown (whose length differs
    from rank to rank)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(max(0.0, instant - time.time()))
    os._exit(code)


def _main(argv: list[str]) -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import paddle.distributed as dist

    from fleet_ext import capability
    from fleet_ext.models import DSv4ForCausalLM
    from fleet_ext.parallel.distributed import env_world
    from fleet_ext.training.cli import main

    parser = argparse.ArgumentParser()
    parser.add_argument("--gate_dir", type=Path, required=True, help="where each rank writes rank_<r>.json")
    args, argv = parser.parse_known_args(argv)
    built = []
    build = DSv4ForCausalLM.__init__
    DSv4ForCausalLM.__init__ = lambda self, *a, **k: (built.append(1), build(self, *a, **k))[1]
    overrides = {**TEST_OVERRIDES, "output_dir": "out/multi_card_capability_gate"}
    with capability.override(capability.Capability(triton=True, torch=True, gpu=True, sm=(7, 5))):
        code = main(["--config", str(CONFIG), *cli_args(overrides), *argv])
    rank, world = env_world()
    exit_at = _report(args.gate_dir, {"rank": rank, "exit_code": code, "models_built": len(built),
                                      "process_group_joined": bool(dist.is_initialized())}, world)
    _exit_at(exit_at, code)


if __name__ == "__main__":
    _main(sys.argv[1:])
