"""Hugging Face directories in and out of training.

In: ``model_name_or_path`` (PaddleFormers' key) names a transformers DeepSeek-V4 or DeepSeek-V3.2 directory.
Its ``config.json`` gives the architecture (every key the import maps: widths, layer kinds, RoPE, MoE routing,
...), replacing the YAML's values of those keys; every other key (training, parallel, recompute, fusion, loss
coefficients, phases the import does not fix) stays the YAML's. The model is built from that config and the
directory's weights are loaded before the first step (a resumed checkpoint then overrides them).

Out: :func:`export_checkpoint` turns a FlexCheckpoint training checkpoint (``checkpoint-<step>/``, any data
parallel layout: it is read in one process) into a directory that transformers loads
(``scripts/export_hf.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from fleet_ext.config import KEY_TO_SECTION, FleetExtConfig, load_config

__all__ = ["resolve_config", "build_model", "export_checkpoint", "export_main"]

logger = logging.getLogger(__name__)
KEY = "model_name_or_path"


def resolve_config(config: FleetExtConfig) -> FleetExtConfig:
    """``config`` with the architecture of its ``model_name_or_path`` directory (unchanged when that is null).

    Idempotent, so the command line and the trainer may both call it. YAML values that differ from the
    directory's are replaced, with a warning for those not at their default (most likely written on purpose).
    """
    path = config.training.model_name_or_path
    if path is None:
        return config
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"config key `{KEY}` = {path!r}: no such directory. Fix: give a Hugging Face DeepSeek-V4 or "
            "DeepSeek-V3.2 directory (config.json + *.safetensors), or null to start from random weights"
        )
    from fleet_ext.models.hf_dsv4 import flat_config_from_dir

    from_hf = {k: v for k, v in flat_config_from_dir(path).items() if KEY_TO_SECTION[k] != "training"}
    flat, defaults = config.to_dict(), FleetExtConfig().to_dict()
    changed = sorted(k for k, v in from_hf.items() if flat[k] != v and flat[k] != defaults[k])
    if changed:
        logger.warning(
            "`%s` = %s sets the architecture; replaced from the YAML: %s",
            KEY,
            path,
            ", ".join(f"{k}: {flat[k]!r} -> {from_hf[k]!r}" for k in changed),
        )
    flat.update(from_hf)
    return load_config(flat)


def build_model(config: FleetExtConfig) -> Any:
    """``DSv4ForCausalLM(config)``, then the weights of ``model_name_or_path`` when it is set."""
    from fleet_ext.models import DSv4ForCausalLM

    model = DSv4ForCausalLM(config)
    path = config.training.model_name_or_path
    if path is not None:
        from fleet_ext.models.hf_dsv4 import load_hf_weights

        load_hf_weights(model, path)
    return model


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike) -> Any:
    """Write the model of a training checkpoint as a Hugging Face directory; return the loaded model.

    The config is the checkpoint's ``config.yaml``; the weights are read from its ``model/`` FlexCheckpoint
    in this one process (stock, unsharded names, so the data-parallel rank count at save does not matter).
    DeepSeek-V3.2 when every layer is ``-2``, DeepSeek-V4 otherwise; a config with no equivalent raises.
    """
    from fleet_ext.models import DSv4ForCausalLM
    from fleet_ext.training import checkpoint as ckpt

    checkpoint = Path(checkpoint)
    needed = [checkpoint / "COMPLETE", checkpoint / "config.yaml", checkpoint / ckpt.MODEL_DIR / "0.metadata"]
    if not all(p.is_file() for p in needed):
        raise ckpt.CheckpointError(
            f"{checkpoint} is not a complete training checkpoint (needs COMPLETE, config.yaml and "
            f"{ckpt.MODEL_DIR}/): give a checkpoint-<step> directory written by scripts/pretrain.py"
        )
    model = DSv4ForCausalLM(load_config(checkpoint / "config.yaml"))
    ckpt.load_sharded(model.sharded_state_dict(), checkpoint / ckpt.MODEL_DIR, world_size=1)
    model.save_pretrained(output)
    return model


def export_main(argv: list[str] | None = None) -> int:
    """``scripts/export_hf.py CHECKPOINT OUTPUT``: exit 0 when written, 2 on a bad checkpoint or config."""
    parser = argparse.ArgumentParser(
        prog="export_hf.py", description="Training checkpoint (FlexCheckpoint) -> Hugging Face directory."
    )
    parser.add_argument("checkpoint", help="a checkpoint-<step> directory of a training run")
    parser.add_argument("output", help="the Hugging Face directory to write (config.json + model.safetensors)")
    args = parser.parse_args(argv)
    try:
        model = export_checkpoint(args.checkpoint, args.output)
    except (ValueError, FileNotFoundError) as exc:  # CheckpointError is a ValueError
        print(f"fleet_ext export_hf: error: {exc}", file=sys.stderr, flush=True)
        return 2
    from fleet_ext.models.hf_dsv4 import read_hf_config

    model_type = read_hf_config(args.output)["model_type"]
    print(f"wrote {args.output} (transformers {model_type}, {len(model.state_dict())} fleet_ext tensors)", flush=True)
    return 0
