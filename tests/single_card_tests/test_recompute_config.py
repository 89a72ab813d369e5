"""Recompute keys: every valid form resolves to the expected plan, every invalid form fails in load_config.

The plan is what the layers follow (``fleet_ext.config.recompute_plan``); these tests pin the resolution
(chunks under full, per-layer modules under selective) and each error's key, allowed values and fix.
"""

from __future__ import annotations

import pytest

from fleet_ext.config import RECOMPUTE_MODULES, RecomputePlan, load_config, module_layers, recompute_plan

TINY = {"num_hidden_layers": 4, "csa_compress_ratios": [0, 4, 128, -1], "hidden_size": 64, "moe_n_hash_layers": 1}
HYBRID = {
    **TINY, "csa_compress_ratios": [0, 4, 128, -2], "hybrid_mla_q_lora_rank": 16, "hybrid_mla_kv_lora_rank": 16,
    "hybrid_mla_qk_nope_head_dim": 8, "hybrid_mla_qk_rope_head_dim": 8, "hybrid_mla_v_head_dim": 8,
    "hybrid_mla_num_attention_heads": 4,
}
# Hybrid model with VHA and two dense first layers: every module has a different set of layers.
RICH = {**HYBRID, "use_vha_attention": True, "moe_n_hash_layers": 0, "first_k_dense_replace": 2}


def _plan(base: dict, **keys) -> RecomputePlan:
    return recompute_plan(load_config(base, **keys))


def _selective(base: dict, modules) -> RecomputePlan:
    return _plan(base, recompute_granularity="selective", recompute_modules=modules)


def test_no_recompute_is_the_default_and_describes_as_none():
    plan = recompute_plan(load_config(TINY))
    assert plan == RecomputePlan() and plan.granularity is None
    assert [plan.describe(i) for i in range(4)] == ["none"] * 4


@pytest.mark.parametrize(
    ("method", "per_chunk", "chunks"),
    [
        ("uniform", 3, ((0, 1, 2), (3,))),
        ("uniform", 2, ((0, 1), (2, 3))),
        ("uniform", 1, ((0,), (1,), (2,), (3,))),
        ("uniform", 4, ((0, 1, 2, 3),)),
        ("block", 2, ((0,), (1,))),
        ("block", 4, ((0,), (1,), (2,), (3,))),
    ],
)
def test_full_recompute_resolves_to_chunks(method, per_chunk, chunks):
    plan = _plan(TINY, recompute_granularity="full", recompute_method=method, recompute_num_layers=per_chunk)
    assert plan.chunks == chunks and plan.modules == {} and plan.granularity == "full"


def test_full_plan_describes_each_layer():
    uniform = _plan(TINY, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    assert [uniform.describe(i) for i in range(4)] == ["full (chunk 0-2)"] * 3 + ["full (chunk 3)"]
    block = _plan(TINY, recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert [block.describe(i) for i in range(4)] == ["full (chunk 0)", "full (chunk 1)", "none", "none"]
    assert block.chunk_of(1) == (1,) and block.chunk_of(2) is None


def test_which_layers_have_which_module():
    config = load_config(RICH)
    assert module_layers(config.model, config.moe) == {
        "full_attn": (0, 1, 2, 3), "vha_postmix": (0, 1, 2), "core_attn": (0, 1, 2, 3), "mhc": (0, 1, 2, 3),
        "moe": (2, 3), "moe_act": (2, 3), "mla_up_proj": (3,),
    }
    plain = load_config(TINY, enable_hyper_connections=False)
    layers = module_layers(plain.model, plain.moe)
    assert layers["vha_postmix"] == layers["mhc"] == layers["mla_up_proj"] == ()


def test_selective_list_recomputes_each_module_on_every_layer_having_it():
    plan = _selective(RICH, ["core_attn", "moe_act", "mla_up_proj"])
    assert plan.chunks == () and plan.granularity == "selective"
    assert plan.modules == {
        0: frozenset({"core_attn"}), 1: frozenset({"core_attn"}), 2: frozenset({"core_attn", "moe_act"}),
        3: frozenset({"core_attn", "moe_act", "mla_up_proj"}),
    }
    assert plan.describe(3) == "selective: core_attn, moe_act, mla_up_proj"  # RECOMPUTE_MODULES order
    assert plan.modules_of(0) == {"core_attn"}


def test_selective_mapping_with_all_ids_and_counts():
    plan = _selective(RICH, {"full_attn": "all", "vha_postmix": [2, 0], "moe": 1, "mhc": [3]})
    assert plan.modules == {
        0: frozenset({"full_attn", "vha_postmix"}), 1: frozenset({"full_attn"}),
        2: frozenset({"full_attn", "vha_postmix", "moe"}), 3: frozenset({"full_attn", "mhc"}),
    }
    counted = _selective(RICH, {"vha_postmix": 2, "moe_act": 2})  # the first N layers HAVING the module
    assert counted.modules == {0: {"vha_postmix"}, 1: {"vha_postmix"}, 2: {"moe_act"}, 3: {"moe_act"}}
    only = _selective(TINY, {"moe": [1]})
    assert only.modules == {1: {"moe"}} and [only.describe(i) for i in (0, 1)] == ["none", "selective: moe"]


def test_every_module_name_resolves_somewhere_on_the_rich_model():
    plan = _selective(RICH, list(RECOMPUTE_MODULES))
    assert set().union(*plan.modules.values()) == set(RECOMPUTE_MODULES)


@pytest.mark.parametrize(
    ("base", "keys", "pattern"),
    [
        (TINY, {"recompute_granularity": "selective"},
         r"config key `recompute_modules` = None is invalid: allowed a non-empty list or mapping.*Fix: list"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": []}, r"`recompute_modules` = \[\]"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {}}, r"`recompute_modules` = \{\}"),
        (TINY, {"recompute_granularity": "full", "recompute_num_layers": 2},
         r"config key `recompute_method` = None is invalid: allowed 'uniform' or 'block'.*Fix: set"),
        (TINY, {"recompute_granularity": "full", "recompute_method": "block"},
         r"config key `recompute_num_layers` = None is invalid: allowed a layer count in \[1, num_hidden_layers\]"),
        (TINY, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 0},
         r"config key `recompute_num_layers` = 0 is invalid: allowed null or a positive integer.*\[1, num_hidden"),
        (TINY, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 5},
         r"`recompute_num_layers` = 5 is invalid: allowed a layer count in \[1, num_hidden_layers = 4\]"),
        (TINY, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
                "recompute_modules": ["moe"]},
         r"`recompute_modules` = \['moe'\].*null with recompute_granularity: full"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": ["moe"], "recompute_method": "block"},
         r"`recompute_method` = 'block' is invalid: allowed null with recompute_granularity: selective"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": ["moe"], "recompute_num_layers": 2},
         r"`recompute_num_layers` = 2 is invalid: allowed null with recompute_granularity: selective"),
        (TINY, {"recompute_method": "uniform"}, r"`recompute_method`.*null while recompute_granularity is null"),
        (TINY, {"recompute_modules": ["moe"]}, r"`recompute_modules`.*null while recompute_granularity is null"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": ["core_atn"]},
         r"`recompute_modules` = \['core_atn'\].*'core_atn' is not one. Fix: did you mean `core_attn`\?"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {"moe_activation": "all"}},
         r"'moe_activation' is not one. Fix: did you mean `moe_act`"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": [3]}, r"3 is not one. Fix: use one of"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": ["moe", "moe"]}, r"`moe` is listed twice"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": "moe"},
         r"`recompute_modules` = 'moe' is invalid: allowed a list or a mapping. Fix: write `recompute_modules` as"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]},
         r"no layer has `mla_up_proj`: csa_compress_ratios has no -2 \(hybrid-MLA\) layer. Fix: drop `mla_up_proj`"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": ["vha_postmix"]},
         r"no layer has `vha_postmix`: use_vha_attention is false"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": ["mhc"], "enable_hyper_connections": False},
         r"no layer has `mhc`: enable_hyper_connections is false"),
        ({**TINY, "moe_n_hash_layers": 0, "first_k_dense_replace": 4},
         {"recompute_granularity": "selective", "recompute_modules": {"moe_act": 1}},
         r"no layer has `moe_act`: every layer is dense \(the first first_k_dense_replace = 4 layers"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {"core_attn": [4]}},
         r"`recompute_modules` = \{'core_attn': \[4\]\} is invalid: allowed layer ids in \[0, 3\]"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {"core_attn": [-1]}},
         r"for module `core_attn`: 'all', a non-empty list of distinct layer ids, or a positive layer count"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {"core_attn": [1, 1]}},
         r"`recompute_modules` = \{'core_attn': \[1, 1\]\}.*distinct layer ids"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {"core_attn": 0}},
         r"`recompute_modules` = \{'core_attn': 0\}.*a count of 0 selects no layer"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {"core_attn": True}},
         r"`recompute_modules` = \{'core_attn': True\}"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {"core_attn": "every"}},
         r"Fix: write e.g. `core_attn: all`"),
        (TINY, {"recompute_granularity": "selective", "recompute_modules": {"core_attn": 5}},
         r"for `core_attn` a count <= 4 \(the layers having it: \[0, 1, 2, 3\]\)"),
        (RICH, {"recompute_granularity": "selective", "recompute_modules": {"vha_postmix": [3]}},
         r"layers that have `vha_postmix`: \[0, 1, 2\]; layer 3 is a -2 \(hybrid-MLA\) layer, which has no VHA"),
        (RICH, {"recompute_granularity": "selective", "recompute_modules": {"moe": [0, 3]}},
         r"layer 0 is dense \(the first first_k_dense_replace = 2 layers use a dense MLP\)"),
        (RICH, {"recompute_granularity": "selective", "recompute_modules": {"mla_up_proj": [1]}},
         r"layer 1 is a csa layer; only -2 \(hybrid-MLA\) layers have one"),
        (RICH, {"recompute_granularity": "selective", "recompute_modules": {"mla_up_proj": 2}},
         r"for `mla_up_proj` a count <= 1"),
    ],
)
def test_every_invalid_form_fails_naming_the_key(base, keys, pattern):
    with pytest.raises(ValueError, match=r"^config key `recompute_\w+` = ") as err:
        load_config(base, **keys)
    assert err.match(pattern), str(err.value)


def test_absence_reasons_name_the_cause():
    """The same module is present once the cause is fixed (each error's reason is the real one)."""
    assert _selective(HYBRID, ["mla_up_proj"]).modules == {3: {"mla_up_proj"}}
    assert _selective({**TINY, "use_vha_attention": True}, ["vha_postmix"]).modules_of(3) == {"vha_postmix"}
    dense3 = {**TINY, "moe_n_hash_layers": 0, "first_k_dense_replace": 3}
    assert _selective(dense3, {"moe_act": 1}).modules == {3: {"moe_act"}}


@pytest.mark.parametrize(
    "keys",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3},
        {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe"]},
        {"recompute_granularity": "selective", "recompute_modules": {"full_attn": "all", "moe": [1, 3], "mhc": 2}},
    ],
)
def test_round_trip_keeps_the_form(keys, tmp_path):
    config = load_config(TINY, **keys)
    flat = config.to_dict()
    assert all(flat[key] == value for key, value in keys.items())
    assert load_config(flat) == config
    path = tmp_path / "c.yaml"
    config.save_yaml(path)
    again = load_config(path)
    assert again == config and recompute_plan(again) == recompute_plan(config)


def test_yaml_written_by_hand_accepts_list_and_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    lines = [f"{k}: {v}" for k, v in TINY.items()] + [
        "recompute_granularity: selective",
        "recompute_modules:",
        "  core_attn: all",
        "  moe: [1, 2]",
        "  moe_act: 1",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    plan = recompute_plan(load_config(path))
    assert plan.modules == {0: {"core_attn", "moe_act"}, 1: {"core_attn", "moe"}, 2: {"core_attn", "moe"},
                            3: {"core_attn"}}


def test_a_changed_plan_is_noticed():
    """Negative control: plans of different policies compare unequal (the equality above can fail)."""
    a = _plan(TINY, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    b = _plan(TINY, recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert a != b and _selective(TINY, ["moe"]) != _selective(TINY, {"moe": 3})
