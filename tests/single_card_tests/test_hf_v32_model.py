"""External oracle: whole transformers DeepSeek-V3.2 models (torch, fp32, CPU) vs fleet_ext DSv4ForCausalLM.

Tiny random ``DeepseekV32ForCausalLM`` checkpoints (dense first layers, MoE with group-limited routing, the DSA
indexer on every layer) are saved with ``save_pretrained``, loaded with ``DSv4ForCausalLM.from_pretrained`` (all
layers ``-2``) and compared on logits; exports must load back into transformers with the same logits. Negative
controls: a wrong group limit (none, or a group score by the best expert instead of the best two) must break the
parity. The layer-level comparison of the -2 attention is in ``test_hf_v32_parity.py``.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import move_constant_inits, tolerance

torch = pytest.importorskip("torch", reason="HF parity needs torch (installed by the `test` extra)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers==5.23.0 (`test` extra)")

from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.layers.moe import TopKRouter  # noqa: E402
from fleet_ext.models import DSv4ForCausalLM  # noqa: E402
from fleet_ext.models.hf_dsv32 import config_to_hf  # noqa: E402

LOGIT_TOL = tolerance("fp32", "hf_parity").atol  # the bound; fp32 on both sides, observed ~2e-6
VOCAB = 97
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.7, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
CASES = {
    # 8 experts in 4 groups, 2 kept: the group limit removes half the experts of every token.
    "groups4_keep2_default_rope": dict(num_hidden_layers=3, first_k_dense_replace=1, n_group=4, topk_group=2,
                                       seq=37, batch=2),
    "groups2_keep1_yarn_tied_batch3": dict(num_hidden_layers=4, first_k_dense_replace=2, n_group=2, topk_group=1,
                                           n_shared_experts=2, tie_word_embeddings=True, rope_parameters=YARN,
                                           seq=53, batch=3, index_topk=9),
    "no_groups_no_dense": dict(num_hidden_layers=2, first_k_dense_replace=0, n_group=1, topk_group=1, seq=29,
                               batch=2, norm_topk_prob=False),
}


def _hf_model(case: dict, seed: int = 0):
    kwargs = {k: v for k, v in case.items() if k not in ("seq", "batch")}
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=12, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=7,
        initializer_range=0.1, max_position_embeddings=256, routed_scaling_factor=2.5, attn_implementation="eager",
    )
    base.update(kwargs)
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**base)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # norm gains and the indexer's LayerNorm bias: move off their constant init
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):  # the selection bias steers the routing too
                layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=generator))
    return model


def _ids(case: dict, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(case["batch"], case["seq"]))


def _ours(model: DSv4ForCausalLM, ids: np.ndarray) -> np.ndarray:
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).numpy()


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(ids)).logits.numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, transformers logits) of every case."""
    out = {}
    for name, case in CASES.items():
        path = tmp_path_factory.mktemp(name)
        hf = _hf_model(case)
        hf.save_pretrained(path)
        out[name] = (path, _hf_logits(hf, _ids(case)))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_hf_v32_checkpoint_logits_match(name, saved):
    path, expected = saved[name]
    case = CASES[name]
    model = DSv4ForCausalLM.from_pretrained(path)
    m, moe = model.config.model, model.config.moe
    assert m.csa_compress_ratios == [-2] * case["num_hidden_layers"] and not m.enable_hyper_connections
    assert (moe.n_group, moe.topk_group, moe.first_k_dense_replace) == (
        case["n_group"], case["topk_group"], case["first_k_dense_replace"])
    assert len(model.moe_layers()) == case["num_hidden_layers"] - case["first_k_dense_replace"]
    got = _ours(model, _ids(case))
    assert np.abs(expected).max() > 0.5, "logits too small for the comparison to mean anything"
    diff = np.abs(got - expected).max()
    assert diff <= LOGIT_TOL, f"{name}: max |logit diff| {diff:.3e} > {LOGIT_TOL}"


def test_without_the_group_limit_the_parity_fails(saved):
    """Negative control: the same checkpoint loaded without group-limited routing misses the parity."""
    path, expected = saved["groups4_keep2_default_rope"]
    model = DSv4ForCausalLM.from_pretrained(path, n_group=1, topk_group=1)
    diff = np.abs(_ours(model, _ids(CASES["groups4_keep2_default_rope"])) - expected).max()
    assert diff > 100 * LOGIT_TOL, f"the group limit does not change the logits ({diff:.2e}): the test is vacuous"


def test_a_wrong_group_score_fails_the_parity(saved, monkeypatch):
    """Negative control: a planted bug, groups ranked by their best expert (not the sum of the best two)."""

    def best_expert_only(self, biased):
        grouped = biased.reshape([-1, self.n_group, self.num_experts // self.n_group])
        best = paddle.topk(grouped.max(axis=-1), self.topk_group, axis=-1)[1]
        keep = paddle.nn.functional.one_hot(best, self.n_group).sum(axis=1) > 0
        keep = keep.unsqueeze(-1).expand(grouped.shape).reshape(biased.shape)
        return paddle.where(keep, biased, paddle.full_like(biased, float("-inf")))

    path, expected = saved["groups4_keep2_default_rope"]
    model = DSv4ForCausalLM.from_pretrained(path)
    monkeypatch.setattr(TopKRouter, "_keep_best_groups", best_expert_only)
    diff = np.abs(_ours(model, _ids(CASES["groups4_keep2_default_rope"])) - expected).max()
    assert diff > LOGIT_TOL, f"a wrong group score passes the parity ({diff:.2e})"


@pytest.mark.parametrize("name", ["groups4_keep2_default_rope", "groups2_keep1_yarn_tied_batch3"])
def test_export_round_trip_through_transformers(name, saved, tmp_path):
    """HF -> fleet_ext -> save_pretrained -> transformers loads every tensor -> the same logits."""
    path, _ = saved[name]
    ours = DSv4ForCausalLM.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    reloaded, info = transformers.DeepseekV32ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert reloaded.config.n_group == CASES[name]["n_group"]
    ids = _ids(CASES[name], seed=11)
    diff = np.abs(_ours(ours, ids) - _hf_logits(reloaded, ids)).max()
    assert diff <= LOGIT_TOL, f"max |logit diff| after export {diff:.3e}"


V32_NATIVE = {
    "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 3, "csa_compress_ratios": [-2, -2, -2],
    "enable_hyper_connections": False, "hybrid_mla_attention": "mqa_dsa", "dsa_indexer_use_sparse_loss": True,
    "dsa_indexer_force_window": False, "hybrid_mla_q_lora_rank": 12, "hybrid_mla_kv_lora_rank": 16,
    "hybrid_mla_qk_nope_head_dim": 8, "hybrid_mla_qk_rope_head_dim": 8, "hybrid_mla_v_head_dim": 8,
    "hybrid_mla_num_attention_heads": 4, "hybrid_mla_rope_type": "rope", "dsa_index_n_heads": 2,
    "dsa_index_head_dim": 16, "dsa_index_topk": 6, "init_method_std": 0.1, "n_routed_experts": 8,
    "num_experts_per_tok": 3, "moe_intermediate_size": 16, "intermediate_size": 40, "first_k_dense_replace": 1,
    "moe_n_hash_layers": 0, "scoring_func": "sigmoid", "swiglu_limit": 0.0, "n_group": 4, "topk_group": 3,
}


def test_fleet_native_v32_model_exports_to_transformers(tmp_path):
    """A model built and initialised by fleet_ext (all -2 layers) is reproduced by transformers."""
    paddle.seed(7)
    model = DSv4ForCausalLM(V32_NATIVE)
    move_constant_inits(model, np.random.default_rng(5), 0.2)  # norms, k_norm bias, routing bias
    model.save_pretrained(tmp_path)
    hf = transformers.DeepseekV32ForCausalLM.from_pretrained(tmp_path)
    ids = np.random.default_rng(2).integers(0, VOCAB, size=(2, 41))
    diff = np.abs(_ours(model, ids) - _hf_logits(hf, ids)).max()
    assert diff <= LOGIT_TOL, f"max |logit diff| {diff:.3e}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"csa_compress_ratios": [-2, 0, -2]}, "every csa_compress_ratios entry must be -2"),
        ({"enable_hyper_connections": True}, "enable_hyper_connections"),
        ({"dsa_indexer_force_window": True}, "dsa_indexer_force_window"),
        ({"scoring_func": "sqrtsoftplus"}, "scoring_func=sigmoid"),
        ({"hybrid_mla_attention": "mqa_full_causal", "dsa_indexer_use_sparse_loss": False}, "mqa_dsa"),
    ],
)
def test_export_rejects_configs_without_a_v32_equivalent(overrides, message):
    with pytest.raises(ValueError, match=message):
        config_to_hf(load_config({**V32_NATIVE, **overrides}))


def test_unknown_model_type_and_layouts_are_refused(saved, tmp_path):
    import json

    path, _ = saved["no_groups_no_dense"]
    hf = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, model_type="deepseek_v3")))
    with pytest.raises(ValueError, match="model_type must be 'deepseek_v4' or 'deepseek_v32'"):
        DSv4ForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, mlp_layer_types=["sparse", "dense"])))
    with pytest.raises(ValueError, match="dense layers must come first"):
        DSv4ForCausalLM.from_pretrained(tmp_path)
