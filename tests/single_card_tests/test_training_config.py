"""The `training` config section, the command-line overrides and the shipped training YAMLs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleet_ext import config as cfg
from fleet_ext.config import TrainingConfig, load_config
from fleet_ext.layer_kinds import kinds_of
from fleet_ext.training.cli import parse_overrides

ROOT = Path(__file__).resolve().parents[2]
YAMLS = sorted((ROOT / "configs").glob("*.yaml"))


def test_training_is_a_section_with_paddleformers_key_names():
    assert cfg.SECTIONS["training"] is TrainingConfig
    c = load_config({})
    for key in (
        "output_dir",
        "train_dataset_path",
        "max_seq_len",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "max_steps",
        "learning_rate",
        "min_lr",
        "warmup_steps",
        "lr_scheduler_type",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "seed",
        "logging_steps",
        "eval_steps",
        "eval_iters",
        "save_steps",
        "save_total_limit",
        "resume_from_checkpoint",
        "bf16",
    ):
        assert hasattr(c.training, key), key
    flat = c.to_dict()
    assert flat["max_steps"] == 1000 and flat["resume_from_checkpoint"] is None
    assert load_config(flat) == c


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"max_steps": 0}, r"`max_steps` = 0 is invalid: allowed a positive integer"),
        ({"max_steps": 5, "warmup_steps": 6}, r"`warmup_steps` = 6 .* <= max_steps \(5\)"),
        ({"learning_rate": 1e-3, "min_lr": 1e-2}, r"`min_lr` = 0.01 .* \[0, learning_rate = 0.001\]"),
        ({"lr_scheduler_type": "step"}, r"`lr_scheduler_type` = 'step' .* \['cosine', 'linear', 'constant'\]"),
        ({"save_total_limit": 0}, r"`save_total_limit` = 0 .* null or an integer >= 1"),
        ({"eval_split_ratio": 0.0}, r"`eval_split_ratio` = 0.0 .* eval_iters > 0"),
        ({"adam_beta2": 1.0}, r"`adam_beta2` = 1.0 .* \[0, 1\)"),
        ({"resume_from_checkpoint": " "}, r"`resume_from_checkpoint` = ' ' .* 'auto' or a checkpoint directory"),
        ({"gradient_accumulation_steps": 1.5}, r"`gradient_accumulation_steps` = 1.5 is invalid: allowed an integer"),
        ({"bf16": "yes"}, r"`bf16` = 'yes' is invalid: allowed true or false"),
        ({"max_grad_norm": -1.0}, r"`max_grad_norm` = -1.0 .* >= 0"),
    ],
)
def test_training_values_are_validated_with_key_allowed_and_fix(overrides, pattern):
    with pytest.raises(ValueError, match=pattern) as err:
        load_config(overrides)
    assert "Fix:" in str(err.value) or "write" in str(err.value)


def test_command_line_overrides_are_yaml_values():
    got = parse_overrides(
        [
            "--max_steps",
            "20",
            "--learning_rate=3e-4",
            "--bf16",
            "false",
            "--save_total_limit",
            "null",
            "--csa_compress_ratios",
            "[0, 4, 128, 4]",
            "--output_dir",
            "out/run1",
        ]
    )
    assert got == {
        "max_steps": 20,
        "learning_rate": "3e-4",
        "bf16": False,
        "save_total_limit": None,
        "csa_compress_ratios": [0, 4, 128, 4],
        "output_dir": "out/run1",
    }
    c = load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml", **got)
    assert c.training.learning_rate == 3e-4 and c.training.max_steps == 20
    with pytest.raises(ValueError, match="no value: write --max_steps VALUE"):
        parse_overrides(["--max_steps"])
    with pytest.raises(ValueError, match="unexpected argument 'stray'"):
        parse_overrides(["stray"])
    with pytest.raises(ValueError, match=r"unknown config key `max_step`.*Did you mean `max_steps`"):
        load_config({}, **parse_overrides(["--max_step", "3"]))


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_shipped_training_yamls_validate_and_document_every_key(path):
    c = load_config(path)
    section = None
    seen = set()
    for line in path.read_text().splitlines():
        header = re.match(r"^### (\w+)", line)
        if header:
            section = header.group(1)
            assert section in cfg.SECTIONS, f"{path.name}: unknown section header {line!r}"
            continue
        if not line.strip() or line.lstrip().startswith("#"):  # blank, or a (continued) comment line
            continue
        key = line.split(":", 1)[0]
        assert "#" in line.split(":", 1)[1], f"{path.name}: `{key}` has no comment"
        assert section == cfg._KEY_TO_SECTION[key], f"{path.name}: `{key}` is under ### {section}"
        seen.add(key)
    assert {"max_steps", "learning_rate", "csa_compress_ratios", "output_dir"} <= seen
    assert c.training.resume_from_checkpoint == "auto"


def test_tiny_yaml_matches_the_packaged_model_yaml():
    """configs/dsv4_tiny_cpu.yaml trains the same model as fleet_ext/configs/dsv4_tiny_cpu.yaml (the demo's)."""
    train, model = (
        load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml"),
        load_config(ROOT / "fleet_ext" / "configs" / "dsv4_tiny_cpu.yaml"),
    )
    assert train.model == model.model and train.moe == model.moe
    kinds = {kind.value for kind in kinds_of(train.model)}
    assert kinds == {"window", "csa", "hca"} and train.moe.moe_n_hash_layers >= 1
    assert train.model.enable_hyper_connections and train.model.params_dtype == "float32"


def test_gpu_yaml_is_production_shaped_and_refused_on_cpu():
    from fleet_ext.training.trainer import check_runtime

    c = load_config(ROOT / "configs" / "dsv4_flash_gpu.yaml")
    assert c.training.bf16 and c.model.hidden_size == 4096 and c.model.num_hidden_layers == 43
    assert c.moe.n_routed_experts == 256 and c.fusion.apply_rope_fusion
    assert c.parallel.expert_model_parallel_size == 8  # valid in the YAML; the world is checked at launch:
    with pytest.raises(ValueError, match=r"`expert_model_parallel_size` = 8 is invalid: allowed a divisor of the "
                                         r"number of launched processes \(1"):
        check_runtime(c)  # one process here
    c = load_config(ROOT / "configs" / "dsv4_flash_gpu.yaml", expert_model_parallel_size=1)
    import paddle

    if not paddle.is_compiled_with_cuda():
        with pytest.raises(ValueError, match=r"`bf16` = True cannot run on this machine.*Fix: set `bf16: false`"):
            check_runtime(c)
    else:
        check_runtime(c)


def test_config_only_rules_fail_before_the_runtime_check():
    """The trainer's runtime check holds machine rules only: these need only the config and fail in load_config."""
    tiny = ROOT / "configs" / "dsv4_tiny_cpu.yaml"
    with pytest.raises(ValueError, match=r"`params_dtype` = 'bfloat16' is invalid: allowed one of \['float32'\]"):
        load_config(tiny, params_dtype="bfloat16")
    c = load_config(tiny)
    too_long = c.model.max_position_embeddings + 1
    with pytest.raises(ValueError, match=rf"`max_seq_len` = {too_long} is invalid: allowed <= max_position_embeddings"):
        load_config(tiny, max_seq_len=too_long)
    from fleet_ext.training.trainer import check_runtime

    check_runtime(c)  # fp32 on any machine: nothing left to refuse
