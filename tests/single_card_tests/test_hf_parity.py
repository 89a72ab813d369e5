"""External oracle: transformers' DeepSeek-V4 (torch, fp32, CPU) vs fleet_ext DSv4ForCausalLM (Paddle).

Tiny random HF models are saved with ``save_pretrained``, loaded with ``DSv4ForCausalLM.from_pretrained``
and compared on logits. Sequences span several windows and compression blocks and are not multiples
of the ratios; weights that HF initialises to zero/one (sinks, position biases, norms, routing bias)
are moved off their init so every path carries signal.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import DEFAULT_WIDTHS_2L, tolerance

torch = pytest.importorskip("torch", reason="HF parity needs torch (installed by the `test` extra)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers==5.23.0 (`test` extra)")

from fleet_ext.models import DSv4ForCausalLM  # noqa: E402
from fleet_ext.models.hf_dsv4 import config_to_hf  # noqa: E402
from fleet_ext.parallel.layout import SequenceLayout  # noqa: E402

LOGIT_TOL = tolerance("fp32", "hf_parity").atol  # fp32 on both sides; observed differences are ~1e-6

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CASES = {
    "yarn_sqrtsoftplus": dict(
        layer_types=[SWA, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"], scoring_func="sqrtsoftplus",
        compress_rates={CSA: 4, HCA: 128}, rope_parameters={"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}, seq_len=290,
    ),
    "plain_rope_sigmoid_ratio8": dict(
        layer_types=[CSA, HCA, CSA, SWA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        scoring_func="sigmoid", compress_rates={CSA: 8, HCA: 128}, rope_parameters=None, seq_len=277,
        index_topk=3, o_groups=4,
    ),
    "two_streams_hca_first": dict(
        layer_types=[HCA, CSA], mlp_layer_types=["moe", "moe"], scoring_func="sqrtsoftplus",
        compress_rates={CSA: 4, HCA: 128}, rope_parameters={"rope_type": "yarn", "factor": 8.0,
        "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2}, seq_len=261,
        hc_mult=2, hc_sinkhorn_iters=5, sliding_window=24,
    ),
    # HCA rates other than PaddleFleet's 128 (the entry 128 marks the kind, `hca_compress_ratio` is the rate).
    "hca8_csa4_batch3": dict(
        layer_types=[CSA, HCA, SWA, HCA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"], scoring_func="sigmoid",
        compress_rates={CSA: 4, HCA: 8}, rope_parameters=None, seq_len=91, batch=3, sliding_window=12,
    ),
    "hca16_csa8_batch3": dict(
        layer_types=[HCA, CSA, HCA], mlp_layer_types=["moe", "moe", "moe"], scoring_func="sqrtsoftplus",
        compress_rates={CSA: 8, HCA: 16}, rope_parameters={"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}, seq_len=139, batch=3,
        sliding_window=20, index_topk=4,
    ),
}


def _hf_model(case: dict, seed: int = 0):
    case = dict(case)
    case.pop("seq_len")
    case.pop("batch", None)
    base = dict(
        vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=len(case["layer_types"]),
        num_attention_heads=4, head_dim=16, q_lora_rank=12, num_experts_per_tok=2, n_routed_experts=4,
        sliding_window=16, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=5,
        partial_rotary_factor=0.5, initializer_range=0.1, max_position_embeddings=4096,
    )
    base.update(case)
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**base)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norms, sinks, mHC bases/scales: move off their constant init
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
            if "position_bias" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                picks = [torch.randperm(base["n_routed_experts"], generator=generator)[:2] for _ in range(97)]
                gate.tid2eid.copy_(torch.stack(picks))
            else:
                gate.e_score_correction_bias.copy_(0.1 * torch.randn(base["n_routed_experts"], generator=generator))
    return model


def _ids(seq_len: int, batch: int = 2, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 97, size=(batch, seq_len))


def _ours(model: DSv4ForCausalLM, ids: np.ndarray) -> np.ndarray:
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).numpy()


@pytest.mark.parametrize("name", sorted(CASES))
def test_hf_checkpoint_logits_match(name, tmp_path):
    case = CASES[name]
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path)
    ids = _ids(case["seq_len"], batch=case.get("batch", 2))
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    ours = DSv4ForCausalLM.from_pretrained(tmp_path)
    assert ours.config.model.hca_compress_ratio == case["compress_rates"][HCA]
    got = _ours(ours, ids)
    assert np.abs(expected).max() > 0.5, "logits too small for the comparison to mean anything"
    diff = np.abs(got - expected).max()
    assert diff <= LOGIT_TOL, f"{name}: max |logit diff| {diff:.3e} > {LOGIT_TOL}"


def test_indexer_and_compressors_are_exercised(tmp_path):
    """The parity cases really select a strict top-k subset and produce several HCA entries."""
    case = CASES["yarn_sqrtsoftplus"]
    _hf_model(case).save_pretrained(tmp_path)
    model = DSv4ForCausalLM.from_pretrained(tmp_path)
    csa = model.layers[1].self_attention.core_attention
    x = paddle.randn([2, case["seq_len"], 32])
    q_latent = paddle.randn([2, case["seq_len"], 12])
    layout = SequenceLayout.whole(case["seq_len"])
    picks = csa.indexer(x, q_latent, layout).numpy()
    visible = (np.arange(case["seq_len"]) + 1) // 4
    assert picks.shape[-1] == 5 and visible.max() > 5, "top-k must be smaller than the visible set"
    assert (picks[:, -1] >= 0).all(), "late queries fill every top-k slot"
    assert (picks[:, :3] == -1).all(), "queries before the first full block have no compressed entry"
    hca = model.layers[2].self_attention.core_attention
    assert hca.compressor(x, layout).shape[1] == case["seq_len"] // 128 >= 2


@pytest.mark.parametrize("name", ["plain_rope_sigmoid_ratio8", "hca16_csa8_batch3"])
def test_export_round_trip_through_transformers(tmp_path, name):
    """HF -> fleet_ext -> save_pretrained -> transformers loads every tensor -> same logits (any HCA rate)."""
    case = CASES[name]
    _hf_model(case).save_pretrained(tmp_path / "hf")
    ours = DSv4ForCausalLM.from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "export")
    reloaded, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert reloaded.config.compress_rates == case["compress_rates"]
    ids = _ids(case["seq_len"], seed=11)
    with torch.no_grad():
        expected = reloaded.eval()(torch.from_numpy(ids)).logits.numpy()
    diff = np.abs(_ours(ours, ids) - expected).max()
    assert diff <= LOGIT_TOL, f"max |logit diff| after export {diff:.3e}"


def test_fleet_native_model_exports_to_transformers(tmp_path):
    """A model built and initialised by fleet_ext (not imported) is reproduced by transformers."""
    paddle.seed(7)
    model = DSv4ForCausalLM({
        "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 12,
        "v_head_dim": 16, "qk_pos_emb_head_dim": 8, "csa_compress_ratios": [4, 128, 0], "csa_window_size": 16,
        "o_groups": 2, "o_lora_rank": 8, "dsa_index_n_heads": 2, "dsa_index_head_dim": 8, "dsa_index_topk": 4,
        "original_max_position_embeddings": 64, "rotary_scaling_factor": 4.0, "init_method_std": 0.1,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_n_hash_layers": 1,
    })
    rng = np.random.default_rng(5)
    for name, tensor in model.state_dict().items():
        if tensor.dtype == paddle.float32 and (tensor.ndim == 1 or name.endswith(".ape")):
            tensor.set_value(tensor.numpy() + 0.2 * rng.standard_normal(tensor.shape).astype("float32"))
    model.save_pretrained(tmp_path)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(270, seed=2)
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    diff = np.abs(_ours(model, ids) - expected).max()
    assert diff <= LOGIT_TOL, f"max |logit diff| {diff:.3e}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"enable_hyper_connections": False}, "enable_hyper_connections"),
        ({"csa_compress_ratios": [0, -1]}, "-1/-2"),
        ({"use_vha_attention": True}, "use_vha_attention"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
    ],
)
def test_export_rejects_configs_without_hf_equivalent(overrides, message):
    from fleet_ext.config import load_config

    with pytest.raises(ValueError, match=message):
        config_to_hf(load_config({**DEFAULT_WIDTHS_2L, **overrides}))


def test_a_checkpoint_with_short_positions_loads(tmp_path):
    """A model whose max_position_embeddings (100) is below the default training sequence (256) still loads:
    the import caps max_seq_len at the model's positions instead of failing the load_config rule."""
    case = dict(CASES["yarn_sqrtsoftplus"], max_position_embeddings=100)
    _hf_model(case).save_pretrained(tmp_path)
    model = DSv4ForCausalLM.from_pretrained(tmp_path)
    assert model.config.model.max_position_embeddings == 100 and model.config.training.max_seq_len == 100
