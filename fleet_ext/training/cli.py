"""Command line of ``scripts/pretrain.py``: ``--config YAML`` plus any config key as ``--key value``.

Exit codes: 0 done; 2 bad config, data or checkpoint path, or a fusion switch this machine cannot run
(checked on every rank before any process group is joined or model built: nothing was computed); 3 the run
stopped on a non-finite loss (checkpoints untouched); 130 interrupted. Under ``paddle.distributed.launch``
the launcher exits non-zero when any rank does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["DEFAULT_CONFIG", "parse_overrides", "main", "EXIT_OK", "EXIT_BAD_INPUT", "EXIT_TRAINING_FAILED"]

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_TRAINING_FAILED = 3
EXIT_INTERRUPTED = 130
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "dsv4_tiny_cpu.yaml"

USAGE = """scripts/pretrain.py [--config YAML] [--KEY VALUE ...]

  python scripts/pretrain.py --config configs/dsv4_tiny_cpu.yaml --max_steps 20 --output_dir out/run1
  python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 scripts/pretrain.py \\
      --config configs/dsv4_tiny_cpu.yaml

Every config key (README, "Config keys") can be given as --KEY VALUE or --KEY=VALUE; VALUE is read as
YAML (20, 3.0e-4, true, null, "[0, 4, 128, 4]")."""


def parse_overrides(tokens: list[str]) -> dict[str, Any]:
    """``["--max_steps", "20", "--bf16=false"]`` -> ``{"max_steps": 20, "bf16": False}`` (values parsed as YAML)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"unexpected argument {token!r}: config keys are given as --KEY VALUE")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ValueError(f"config key `{key}` on the command line has no value: write --{key} VALUE")
            value = tokens[i + 1]
            i += 1
        i += 1
        try:
            out[key.replace("-", "_")] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"config key `{key}`: cannot read {value!r} as a YAML value ({exc})") from exc
    return out


def _error(message: str) -> None:
    rank = os.environ.get("PADDLE_TRAINER_ID")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("PADDLE_TRAINERS_NUM", "1") != "1" else ""
    print(f"{prefix}fleet_ext pretrain: error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain.py", usage=USAGE, add_help=True)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="training YAML (default: %(default)s)")
    parser.add_argument(
        "--inject_fault", action="append", metavar="KIND@STEP[:RANK]", help="testing only: kill, kill_in_save, nan_loss"
    )
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    # Phase 1: everything that can be checked without computing (no Paddle import for config errors): the
    # config, the data, the machine (bf16, the fusion switches' capability gates), the checkpoint path. Every
    # rank runs it before any process group is joined, so a bad input exits 2 on every rank.
    try:
        from fleet_ext.config import load_config

        overrides = parse_overrides(rest)
        config = load_config(args.config, **overrides)
        from fleet_ext.training.hf_interop import resolve_config

        config = resolve_config(config)  # model_name_or_path: before the data and machine checks below
        from fleet_ext.training.data import prepare_data
        from fleet_ext.training.faults import parse_faults

        faults = parse_faults(args.inject_fault)
        data = prepare_data(config.training, config.model.vocab_size)
        from fleet_ext.training import checkpoint as ckpt
        from fleet_ext.training.trainer import Trainer, TrainingError, check_runtime

        check_runtime(config)  # bf16 and the fusion switches' capability gates, without building a model
        ckpt.resolve_resume(config.training.resume_from_checkpoint, config.training.output_dir)
    except (ValueError, FileNotFoundError) as exc:
        _error(str(exc))
        return EXIT_BAD_INPUT

    # Phase 2: join the process group, build, train.
    try:
        trainer = Trainer(config, data=data, faults=faults)
        summary = trainer.train()
    except TrainingError as exc:
        _error(str(exc))
        return EXIT_TRAINING_FAILED
    except ckpt.CheckpointError as exc:
        _error(str(exc))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    if trainer.env.is_main and summary["steps"]:
        out = config.training.output_dir
        held = (
            f", held-out loss {summary['eval_loss']:.4f} (ppl {summary['eval_ppl']:.2f})"
            if "eval_loss" in summary
            else ""
        )
        print(
            f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}{held}, "
            f"{summary['tokens_per_sec']:,.0f} tokens/s on {trainer.env.world_size} process(es)\n"
            f"  checkpoint {summary['checkpoint']}\n  metrics    {out}/metrics.jsonl\n  loss plot  {out}/loss.png",
            flush=True,
        )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
