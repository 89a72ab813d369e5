"""Config switchboard: round trips, unknown/renamed keys, and each invalid combination's message."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from fleet_ext import config as cfg
from fleet_ext.config import FleetExtConfig, load_config
from fleet_ext.layer_kinds import kind_of_entry

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "num_hidden_layers": 4,
    "csa_compress_ratios": [0, 4, 128, -1],
    "hidden_size": 64,
    "moe_n_hash_layers": 1,
}


def test_defaults_are_deepseek_v4_flash_shaped():
    c = load_config()
    assert c.model.csa_compress_ratios == [0, 0, 4] + [128, 4] * 20
    assert (c.model.num_attention_heads, c.model.v_head_dim, c.model.qk_pos_emb_head_dim) == (64, 512, 64)
    assert (c.model.o_groups, c.model.o_lora_rank, c.model.dsa_index_topk) == (8, 1024, 512)
    assert not any(getattr(c.fusion, f.name) for f in dataclasses.fields(c.fusion) if f.type == "bool")


def test_dict_round_trip_is_exact():
    c = load_config(TINY, rms_norm_eps=1e-5, vha_postmix_rank=3)
    flat = c.to_dict()
    assert load_config(flat) == c
    assert flat["rms_norm_eps"] == 1e-5 and flat["vha_postmix_rank"] == 3


def test_yaml_round_trip_is_exact(tmp_path):
    c = load_config(TINY, scoring_func="sigmoid", use_vha_attention=True, vha_postmix_grouped=True)
    path = tmp_path / "c.yaml"
    c.save_yaml(path)
    text = path.read_text()
    assert "### model" in text and "### fusion" in text
    again = load_config(path)
    assert again == c
    again.save_yaml(tmp_path / "d.yaml")
    assert (tmp_path / "d.yaml").read_text() == text


def test_nested_sections_and_string_numbers_load():
    model_keys = {k: v for k, v in TINY.items() if k != "moe_n_hash_layers"}
    c = load_config({"model": {**model_keys, "csa_compress_rotary_base": "160000.0", "rms_norm_eps": "1e-6"},
                     "moe": {"scoring_func": "softmax", "moe_n_hash_layers": 1}})
    assert c.model.csa_compress_rotary_base == 160000.0 and c.model.rms_norm_eps == 1e-6
    assert c.moe.scoring_func == "softmax"
    with pytest.raises(ValueError, match="belongs to section `model`"):
        load_config({"moe": {"hidden_size": 8}})


def test_every_key_lives_in_exactly_one_section():
    seen = {}
    for section, cls in cfg.SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in seen, f"{f.name} in {seen.get(f.name)} and {section}"
            seen[f.name] = section
            assert f.metadata.get("help"), f"{f.name} has no help text"


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ValueError, match=r"unknown config key `hiden_size`.*Did you mean `hidden_size`"):
        load_config({"hiden_size": 8})
    with pytest.raises(ValueError, match=r"unknown config key `zzz_totally_new`\. The keys"):
        load_config({"zzz_totally_new": 1})


@pytest.mark.parametrize("old, new", sorted(cfg.RENAMED_KEYS.items()))
def test_renamed_keys_raise_with_their_new_name(old, new):
    with pytest.raises(ValueError, match=rf"`{old}` was renamed: use `{new}`"):
        load_config({old: 1})


def test_every_renamed_key_points_at_a_real_key_and_no_table_shadows_one():
    keys = set(cfg.KEY_TO_SECTION)
    assert not set(cfg.RENAMED_KEYS.values()) - keys, "RENAMED_KEYS targets that are not config keys"
    assert not set(cfg.RENAMED_KEYS) & keys and not set(cfg.PADDLEFLEET_ONLY_KEYS) & keys
    assert not set(cfg.RENAMED_KEYS) & set(cfg.PADDLEFLEET_ONLY_KEYS)
    assert {"dw_p2p_overlap", "csa_indexer_init_from_scratch"} <= set(cfg.PADDLEFLEET_ONLY_KEYS)


@pytest.mark.parametrize("key", sorted(cfg.PADDLEFLEET_ONLY_KEYS))
def test_paddlefleet_only_keys_raise_remove_it(key):
    for source in ({key: True}, {"model": {key: True}}):
        with pytest.raises(ValueError, match=rf"`{key}` is a PaddleFleet option that fleet_ext does not have \(.+\): "
                                             "remove it$"):
            load_config(source)


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"tensor_model_parallel_size": 2}, r"`tensor_model_parallel_size` = 2 is invalid.*does not support tensor"),
        ({"context_parallel_size": 3}, r"`context_parallel_size` = 3 is invalid: allowed a divisor of max_seq_len"),
        ({"context_parallel_size": 2, "max_seq_len": 384, "csa_window_size": 16},
         r"`max_seq_len` = 384 is invalid: allowed a multiple of context_parallel_size x 128 \(layer \d+ is hca"),
        ({"context_parallel_size": 2, "max_seq_len": 192},
         r"`context_parallel_size` = 2 is invalid: allowed at most 1 here: each rank's chunk \(96 tokens\) must "
         r"hold the 127-token window halo"),
        ({"expert_model_parallel_size": 3}, r"`expert_model_parallel_size` = 3 is invalid: allowed a divisor of "
         r"n_routed_experts"),
        ({"moe_token_dispatcher_type": "deepep"}, r"`moe_token_dispatcher_type` = 'deepep' is invalid"),
        ({"pipeline_model_parallel_size": 2}, r"pipeline parallelism is not supported yet"),
        ({"sequence_parallel": True}, r"`sequence_parallel`.*needs tensor parallelism"),
        ({"cp_balance_mode": "dualchunk_allgather"}, r"`cp_balance_mode`.*contiguous_allgather"),
        ({"cp_balance_mode": "zigzag"}, r"`cp_balance_mode` = 'zigzag' is invalid: allowed one of"),
        ({"csa_compress_ratios": [0, 1, 128, 0]}, r"entry 1 is invalid.*Ratio 1 would compress nothing"),
        ({"csa_compress_ratios": [0, 129, 128, 0]}, r"entry 129 is invalid"),
        ({"csa_compress_ratios": [0, 4, 128]}, r"`csa_compress_ratios`.*list of 4 integers.*got length 3"),
        ({"csa_compress_ratios": [0, -2, 128, 0]}, r"`hybrid_mla_q_lora_rank` = None.*positive integer when"),
        ({"csa_compress_ratios": [0, 4.0, 128, 0]}, r"integers only"),
        ({"hybrid_mla_attention": "mqa_dsa"}, r"`hybrid_mla_attention`.*'mha' unless csa_compress_ratios has a -2"),
        ({"hybrid_mla_attention": "dense"}, r"allowed one of \['mha', 'mqa_full_causal', 'mqa_dsa'\]"),
        ({"num_nextn_predict_layers": 1},
         r"`csa_compress_ratios` = .* allowed a list of 5 integers \(num_hidden_layers \+ num_nextn_predict_layers\)"),
        ({"qk_pos_emb_head_dim": 7}, r"`qk_pos_emb_head_dim` = 7.*even integer"),
        ({"o_groups": 7}, r"`o_groups` = 7.*divisor of num_attention_heads \* v_head_dim"),
        ({"dsa_index_head_dim": 32}, r"`dsa_index_head_dim` = 32.*>= qk_pos_emb_head_dim"),
        ({"csa_dense_mode": True, "dsa_indexer_loss_coeff": 0.01},
         r"`dsa_indexer_loss_coeff` = 0.01 is invalid: allowed 0.0 unless an indexer exists"),
        ({"dsa_indexer_use_sparse_loss": True}, r"`dsa_indexer_use_sparse_loss` = True.*CSA layers always train"),
        ({"train_indexer_only": True}, r"`dsa_indexer_loss_coeff` = 0.0.*> 0 with train_indexer_only"),
        ({"train_indexer_only": True, "dsa_indexer_loss_coeff": 0.01, "csa_dense_mode": True},
         r"`dsa_indexer_loss_coeff` = 0.01.*unless an indexer exists"),
        ({"train_indexer_only": True, "csa_compress_ratios": [0, 128, 128, -1]},
         r"`train_indexer_only` = True.*or a CSA layer without csa_dense_mode"),
        ({"mscale": 0.7}, r"`mscale` = 0.7.*forces YaRN mscale to 1"),
        ({"vha_postmix_rank": 0}, r"`vha_postmix_rank` = 0"),
        ({"use_vha_attention": True, "vha_postmix_grouped": True, "o_groups": 16, "num_attention_heads": 8},
         r"`vha_postmix_grouped`.*divides by o_groups"),
        ({"hidden_size": 0}, r"`hidden_size` = 0 is invalid: allowed a positive integer"),
        ({"hidden_size": True}, r"`hidden_size` = True is invalid: allowed an integer"),
        ({"rms_norm_eps": "tiny"}, r"`rms_norm_eps` = 'tiny' is invalid: allowed a number"),
        ({"enable_hyper_connections": "yes"}, r"`enable_hyper_connections` = 'yes'.*true or false"),
        ({"pad_token_id": 10**9}, r"`pad_token_id`"),
        ({"scoring_func": "relu"}, r"`scoring_func` = 'relu' is invalid: allowed one of"),
        ({"num_experts_per_tok": 300}, r"`num_experts_per_tok` = 300.*<= n_routed_experts"),
        ({"moe_n_hash_layers": 5}, r"`moe_n_hash_layers` = 5.*<= num_hidden_layers"),
        ({"first_k_dense_replace": 1}, r"`first_k_dense_replace` = 1.*0 when moe_n_hash_layers > 0"),
        ({"swiglu_limit": -1.0}, r"`swiglu_limit`"),
        ({"recompute_granularity": "full"}, r"`recompute_method` = None is invalid: allowed 'uniform' or 'block'"),
        ({"recompute_method": "uniform"}, r"`recompute_method`.*null while recompute_granularity is null"),
        ({"save_checkpoint_format": "pickle"}, r"`save_checkpoint_format` = 'pickle'.*flex_checkpoint"),
        ({"use_fused_mhc": True, "enable_hyper_connections": False},
         r"`use_fused_mhc` = True can never run: enable_hyper_connections is false"),
        ({"fuse_inv_rope_into_vha_postmix": True}, r"`fuse_inv_rope_into_vha_postmix`.*use_vha_attention is false"),
        ({"fuse_inv_rope_into_vha_postmix": True, "use_vha_attention": True, "vha_postmix_grouped": True},
         r"ungrouped postmix only"),
        ({"fuse_inv_rope_into_vha_postmix": True, "use_vha_attention": True}, r"set apply_rope_fusion: true"),
        ({"csa_sparse_attn_backend": "triton", "dsa_sink_grad_fusion": True},
         r"`dsa_sink_grad_fusion`.*Triton sparse-attention backward computes d_sink itself"),
        ({"csa_sparse_attn_backend": "cudnn"}, r"allowed one of \['unfused', 'triton'\]"),
        ({"sparse_attn_dkv_contribution_dtype": "bfloat16"},
         r"`sparse_attn_dkv_contribution_dtype` = 'bfloat16' can never run: .*neither sparse-attention backend is "
         r"triton.*set `csa_sparse_attn_backend: triton`"),
        ({"sparse_attn_dkv_contribution_dtype": "float24"},
         r"`sparse_attn_dkv_contribution_dtype` = 'float24' can never run: .*neither sparse-attention backend is "
         r"triton.*`sparse_attn_dkv_contribution_dtype: auto`"),
        ({"sparse_attn_dkv_contribution_dtype": "float16"},
         r"allowed one of \['auto', 'float32', 'float24', 'bfloat16'\]"),
    ],
)
def test_invalid_values_name_key_allowed_and_fix(overrides, pattern):
    with pytest.raises(ValueError, match=pattern) as err:
        load_config({**TINY, **overrides})
    assert "Fix" in str(err.value) or "allowed" in str(err.value) or "use" in str(err.value)


def test_csa_indexer_loss_and_warmup_are_accepted():
    """The CSA lightning indexer trains by its KL: a positive coefficient and the indexer warm-up load."""
    assert load_config(TINY, dsa_indexer_loss_coeff=0.01).model.dsa_indexer_loss_coeff == 0.01
    assert load_config(TINY, dsa_indexer_loss_coeff=0.01, train_indexer_only=True).model.train_indexer_only


def test_replace_validates_like_a_yaml():
    c = load_config(TINY)
    assert c.replace(hidden_size=128).model.hidden_size == 128
    with pytest.raises(ValueError, match="unknown config key"):
        c.replace(hidden=128)


def test_malformed_and_missing_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: [1, 2\nnum_hidden_layers: 3\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(listy)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_layer_kinds_follow_paddlefleet_semantics():
    assert [kind_of_entry(r).value for r in (-2, -1, 0, 2, 4, 127, 128)] == [
        "hybrid_mla", "full_causal_mqa", "window", "csa", "csa", "csa", "hca"]
    for bad in (1, -3, 129, True, 4.0):
        with pytest.raises(ValueError, match="csa_compress_ratios"):
            kind_of_entry(bad)


def test_postmix_rank_default_is_quarter_of_heads():
    c = load_config(TINY, num_attention_heads=8, o_groups=8)
    assert c.model.postmix_rank == 2
    assert load_config(TINY, num_attention_heads=2, o_groups=2).model.postmix_rank == 1


def test_config_is_a_dataclass_tree():
    assert set(f.name for f in dataclasses.fields(FleetExtConfig)) == set(cfg.SECTIONS)


# Values a fuzz of load_config found accepted before every numeric key had a domain.
KNOWN_ESCAPES = [
    *[(key, value) for key in ("learning_rate", "rotary_base", "init_method_std", "weight_decay", "adam_epsilon",
                               "max_grad_norm") for value in (math.inf, "inf")],
    *[(key, math.nan) for key in ("swiglu_limit", "routed_scaling_factor", "moe_router_bias_update_rate")],
    ("routed_scaling_factor", -1.5),
    ("moe_router_bias_update_rate", -1e-3),
    ("eval_split_ratio", math.nan),
    ("beta_fast", 0.0),
    ("mhc_eps", -1e-6),
    ("moe_aux_loss_coeff", -1e-4),
    ("hybrid_mla_rotary_base", 1.0),  # YaRN divides by ln(base)
    ("learning_rate", 10**400),  # an int beyond the float range
    ("seed", 2**64),  # beyond Paddle's generator
]


@pytest.mark.parametrize("key, value", KNOWN_ESCAPES, ids=lambda v: repr(v)[:24])
def test_non_finite_and_out_of_domain_numbers_are_refused(key, value):
    with pytest.raises(ValueError, match=rf"config key `{key}` = .* is invalid: allowed .*Fix: "):
        load_config(TINY, **{key: value})


@pytest.mark.parametrize("key", [k for k, v in load_config().to_dict().items() if isinstance(v, float)])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, ".nan", "-inf", "1e999"])
def test_every_float_key_refuses_non_finite_values(key, value):
    with pytest.raises(ValueError, match=rf"config key `{key}` = .*finite"):
        load_config(TINY, **{key: value})


def test_every_numeric_key_declares_a_domain():
    for section, cls in cfg.SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            numeric = {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}
            assert not numeric or "domain" in f.metadata, f"{section}.{f.name} has no domain"


def test_sections_built_in_code_validate_like_a_yaml():
    with pytest.raises(ValueError, match=r"`rotary_base` = inf is invalid: allowed a finite number > 1"):
        cfg.ModelConfig(rotary_base=math.inf)
    with pytest.raises(ValueError, match=r"`routed_scaling_factor` = -1.0 is invalid: allowed a finite positive"):
        cfg.MoEConfig(routed_scaling_factor=-1.0)
    assert cfg.ModelConfig(rotary_base=20000).rotary_base == 20000.0 and cfg.TrainingConfig(min_lr=0).min_lr == 0.0


def test_config_only_rules_fail_at_load_config():
    """These passed load_config and failed in the trainer's runtime check; they need no machine."""
    with pytest.raises(ValueError, match=r"`params_dtype` = 'bfloat16' is invalid: allowed one of \['float32'\]. "
                                         r"Fix: set `params_dtype: float32` \(and `bf16: true`"):
        load_config(TINY, params_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"`max_seq_len` = 65 is invalid: allowed <= max_position_embeddings \(64\)"):
        load_config(TINY, max_seq_len=65, max_position_embeddings=64)
    assert load_config(TINY, max_seq_len=64, max_position_embeddings=64).training.max_seq_len == 64
    with pytest.raises(ValueError, match=r"`beta_slow` = 40.0 is invalid: allowed <= beta_fast \(32.0\)"):
        load_config(TINY, beta_slow=40.0)


_RECOMPUTE_NEEDS = {  # the keys a recompute choice requires alongside it
    "full": {"recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_modules": ["core_attn"]},
    "uniform": {"recompute_granularity": "full", "recompute_num_layers": 1},
    "block": {"recompute_granularity": "full", "recompute_num_layers": 1},
}
_MODE_NEEDS = {  # a mode other than its key's default needs the switch it refines (and that switch's prerequisites)
    ("inv_rope_postmix_mode", "fast"): {"use_vha_attention": True, "apply_rope_fusion": True,
                                        "fuse_inv_rope_into_vha_postmix": True},
    ("sparse_attn_dkv_contribution_dtype", "bfloat16"): {"csa_sparse_attn_backend": "triton"},
    ("sparse_attn_dkv_contribution_dtype", "float24"): {"csa_sparse_attn_backend": "triton"},
}


def test_every_offered_choice_loads():
    """A key's choices (printed in the README) offer only what validation accepts."""
    base = {**TINY, "csa_compress_ratios": [0, 4, 128, -2], "hybrid_mla_q_lora_rank": 16,
            "hybrid_mla_kv_lora_rank": 16, "hybrid_mla_qk_nope_head_dim": 8, "hybrid_mla_qk_rope_head_dim": 8,
            "hybrid_mla_v_head_dim": 8, "hybrid_mla_num_attention_heads": 4}
    for cls in cfg.SECTIONS.values():
        for f in dataclasses.fields(cls):
            for choice in f.metadata.get("choices", ()):
                needs = _RECOMPUTE_NEEDS.get(choice, {}) if f.name.startswith("recompute_") else {}
                needs = {**needs, **_MODE_NEEDS.get((f.name, choice), {})}
                loaded = load_config(base, **needs, **{f.name: choice})
                assert getattr(loaded, _section(f.name)).__dict__[f.name] == choice
    assert cfg.SECTIONS["parallel"].__dataclass_fields__["cp_balance_mode"].metadata["choices"] == (
        "contiguous_allgather",)
    help_text = dict((k, h) for _, k, _, h in cfg.config_key_table())["cp_balance_mode"]
    assert "contiguous" in help_text and "dualchunk_allgather" in help_text


def _section(key):
    return cfg.KEY_TO_SECTION[key]


def test_the_config_package_imports_no_paddle():
    code = ("import sys; from fleet_ext.config import load_config; load_config(); "
            "sys.exit(1 if 'paddle' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0
