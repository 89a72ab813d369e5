"""Host round trips per training step (issue 9 §3): every device-to-host read and host-to-device copy of
``Trainer.train_step``, by site, averaged over the steps after the first (which builds the cached tables).

    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        scripts/bench/host_transfers.py --config configs/dsv4_tiny_cpu.yaml [--steps 6] [--KEY VALUE ...]

Counted with ``tests/helpers/transfers.py`` (the counter of ``tests/single_card_tests/test_host_transfers.py``):
patched tensor exits (``numpy``, ``tolist``, ``item``, ``__float__``, ...) and the ops whose output shape depends
on the values (``bincount``, ``nonzero``, ...), which on a GPU read a size back. Paddle's CPU build has no device,
so this counts the reads a GPU run would make; it does not time them. Rank 0 prints the table; the per-step counts
are the same on every rank. Checkpoints and evaluation are off (they are not part of a step).
"""

from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers.transfers import HostTransfers  # noqa: E402

from fleet_ext.training import cli  # noqa: E402
from fleet_ext.training.trainer import Trainer  # noqa: E402


def main(argv: list[str]) -> int:
    steps = 6
    if "--steps" in argv:
        i = argv.index("--steps")
        steps = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    counted: list[HostTransfers] = []
    first = HostTransfers()
    step = Trainer.train_step

    def counting_step(self: Trainer, number: int) -> dict:
        with HostTransfers() if number > 1 else first as transfers:  # step 1 builds the cached tables: apart
            out = step(self, number)
        if number > 1:
            counted.append(transfers)
        return out

    Trainer.train_step = counting_step
    with tempfile.TemporaryDirectory() as out:
        overrides = ["--max_steps", str(steps), "--warmup_steps", "1", "--output_dir", out, "--save_steps", "0",
                     "--eval_iters", "0", "--disable_tqdm", "true", "--resume_from_checkpoint", "null"]
        code = cli.main([*argv, *overrides])
    if code or not counted:
        return code or 1
    to_host, to_device = collections.Counter(), collections.Counter()
    for transfers in counted:
        to_host.update(transfers.to_host)
        to_device.update(transfers.to_device)
    n = len(counted)
    from fleet_ext.parallel.distributed import env_world

    if env_world()[0] == 0:
        print(f"\nhost transfers per training step (mean over steps 2..{steps}, rank 0 of {env_world()[1]})")
        print("| direction | what | site | per step |\n|---|---|---|---|")
        for direction, counter in (("device -> host", to_host), ("host -> device", to_device)):
            for (what, site), count in sorted(counter.items(), key=lambda kv: kv[0][1]):
                print(f"| {direction} | `{what}` | `{site}` | {count / n:g} |")
        print(f"| **device -> host, total** | | | **{sum(to_host.values()) / n:g}** |")
        print(f"| **host -> device, total** | | | **{sum(to_device.values()) / n:g}** |")
        print(f"\nstep 1 (builds the cached tables): {sum(first.to_host.values())} device -> host, "
              f"{sum(first.to_device.values())} host -> device")
        print(first.report())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
