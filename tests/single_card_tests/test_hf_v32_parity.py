"""External oracle: transformers' DeepSeek-V3.2 attention (torch, fp32, CPU) vs a fleet_ext -2 layer.

A tiny random ``DeepseekV32ForCausalLM`` runs on token ids; hooks capture its attention input (after the input
RMSNorm), its attention output and the indexer's top-k. Its attention weights load into ``MLASelfAttention`` built
the way V3.2 is: ``hybrid_mla_attention: mqa_dsa`` in the sparse phase, top-k only
(``dsa_indexer_force_window: false``), no sink. Checked: the output within 1e-4 and, per query, the same top-k key
set (HF picks masked future keys when fewer than ``index_topk`` are visible; only keys j <= t count).

Known, documented differences (none changes the values compared here): HF lays the roped q/k channels out
de-interleaved after rotating interleaved pairs, fleet_ext keeps them interleaved (same dot products); HF skips the
indexer's Hadamard rotation (orthogonal), fleet_ext applies it (scores equal up to rounding); HF attends through a
dense masked softmax over per-head keys, fleet_ext through the absorbed latent MQA and the sparse-attention op.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_close, tolerance

torch = pytest.importorskip("torch", reason="HF parity needs torch (installed by the `test` extra)")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers==5.23.0 (`test` extra)")

from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.layers.mla import MLASelfAttention  # noqa: E402
from fleet_ext.parallel.layout import SequenceLayout  # noqa: E402
from fleet_ext.specs.backend import BackendProvider  # noqa: E402

OUT_TOL = tolerance("fp32", "hf_parity").atol  # the bound; fp32 on both sides, observed ~1e-7
# Near-ties at the top-k boundary could flip a pick between two fp32 implementations; the cases are chosen so
# the k-th and (k+1)-th scores differ by more than this (checked, so a bad seed fails loudly, not flakily).
MIN_BOUNDARY_GAP = 1e-4

DIMS = dict(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, index_n_heads=8, index_head_dim=32, index_topk=12)
CASES = {
    "default_rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "yarn_v32": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "beta_fast": 32, "beta_slow": 1}),
    "yarn_attention_factor": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                                   "original_max_position_embeddings": 8, "mscale": 0.7,
                                                   "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}),
}
BATCH, SEQ = 2, 40  # SEQ > index_topk: most rows really are sparse


def _hf_model(case: dict, seed: int = 0):
    rope = case["rope_parameters"]
    max_pos = int(rope.get("factor", 1) * rope.get("original_max_position_embeddings", 64))
    config = transformers.DeepseekV32Config(
        vocab_size=64, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1, num_key_value_heads=4,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        max_position_embeddings=max_pos, initializer_range=0.1, attn_implementation="eager", **DIMS, **case,
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # RMSNorm / LayerNorm gains and biases: move off their constant init
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model


def _capture(model, ids: np.ndarray) -> dict:
    captured = {}
    attn = model.model.layers[0].self_attn
    hooks = [
        attn.register_forward_hook(
            lambda mod, args, kwargs, out: captured.update(x=kwargs["hidden_states"], out=out[0]), with_kwargs=True
        ),
        attn.indexer.register_forward_hook(lambda mod, args, out: captured.update(topk=out)),
    ]
    with torch.no_grad():
        model(torch.as_tensor(ids))
    for hook in hooks:
        hook.remove()
    return {k: v.detach().numpy() for k, v in captured.items()}


def _ours(hf_model, **overrides) -> MLASelfAttention:
    """A -2 layer configured the way V3.2 is (``overrides`` change it), holding the HF attention's weights."""
    hf = hf_model.config
    rope = hf.rope_parameters
    yarn = rope["rope_type"] == "yarn"
    config = load_config({
        "vocab_size": 64, "hidden_size": hf.hidden_size, "num_hidden_layers": 1, "csa_compress_ratios": [-2],
        "moe_n_hash_layers": 0, "hybrid_mla_attention": "mqa_dsa", "dsa_indexer_use_sparse_loss": True,
        "dsa_indexer_force_window": False, "add_full_attention_sink_bias": False,
        "hybrid_mla_q_lora_rank": hf.q_lora_rank, "hybrid_mla_kv_lora_rank": hf.kv_lora_rank,
        "hybrid_mla_qk_nope_head_dim": hf.qk_nope_head_dim, "hybrid_mla_qk_rope_head_dim": hf.qk_rope_head_dim,
        "hybrid_mla_v_head_dim": hf.v_head_dim, "hybrid_mla_num_attention_heads": hf.num_attention_heads,
        "dsa_index_n_heads": hf.index_n_heads, "dsa_index_head_dim": hf.index_head_dim,
        "dsa_index_topk": hf.index_topk, "rms_norm_eps": hf.rms_norm_eps,
        "hybrid_mla_rope_type": "yarn" if yarn else "rope", "hybrid_mla_rotary_base": rope["rope_theta"],
        **({"hybrid_mla_rotary_scaling_factor": rope["factor"],
            "hybrid_mla_original_max_position_embeddings": rope["original_max_position_embeddings"],
            "hybrid_mla_mscale": rope["mscale"], "hybrid_mla_mscale_all_dim": rope["mscale_all_dim"],
            "beta_fast": float(rope["beta_fast"]), "beta_slow": float(rope["beta_slow"])} if yarn else {}),
        **overrides,
    })
    layer = MLASelfAttention(config, 0, BackendProvider(config).attention_ops)
    layer.eval()
    attn = hf_model.model.layers[0].self_attn
    linear = {  # ours <- HF (torch [out, in] -> Paddle [in, out])
        "linear_q_down_proj": attn.q_a_proj, "linear_q_up_proj": attn.q_b_proj,
        "linear_kv_down_proj": attn.kv_a_proj_with_mqa, "linear_kv_up_proj": attn.kv_b_proj, "o_proj": attn.o_proj,
        "core_attention.indexer.linear_wq_b": attn.indexer.wq_b, "core_attention.indexer.linear_wk": attn.indexer.wk,
        "core_attention.indexer.linear_weights_proj": attn.indexer.weights_proj,
    }
    state = {f"{k}.weight": v.weight.detach().numpy().T for k, v in linear.items()}
    state.update({
        "q_layernorm.weight": attn.q_a_layernorm.weight, "kv_layernorm.weight": attn.kv_a_layernorm.weight,
        "core_attention.indexer.k_norm.weight": attn.indexer.k_norm.weight,
        "core_attention.indexer.k_norm.bias": attn.indexer.k_norm.bias,
    })
    state = {k: np.ascontiguousarray(v.detach().numpy() if hasattr(v, "detach") else v) for k, v in state.items()}
    if layer.core_attention is None or layer.core_attention.indexer is None:
        state = {k: v for k, v in state.items() if ".indexer." not in k}
    assert set(state) == set(layer.state_dict()), "every tensor of the -2 layer must come from HF"
    layer.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    assert_close(layer.softmax_scale, attn.scaling, "float64", "scalar_formula", what="softmax scale")
    return layer


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_attention_output_and_topk_sets_match_hf_deepseek_v32(case):
    hf_model = _hf_model(CASES[case])
    ids = np.random.default_rng(5).integers(0, 64, size=(BATCH, SEQ))
    hf = _capture(hf_model, ids)
    layer = _ours(hf_model)
    x = paddle.to_tensor(hf["x"])
    with paddle.no_grad():
        out = layer(x).numpy()
        ours_top = layer.topk_indices(x).numpy()
        core = layer.core_attention
        q_latent = layer.q_layernorm(layer.linear_q_down_proj(x))
        cos, sin = layer.cos_sin(SequenceLayout.whole(SEQ))
        scores = core.indexer.scores(*core.indexer(x, q_latent, cos, sin)).numpy()
    # The test is well posed: no near-tie at the top-k boundary of any row that has more visible keys than k.
    k = DIMS["index_topk"]
    for b in range(BATCH):
        for t in range(k, SEQ):
            row = np.sort(scores[b, t, : t + 1])[::-1]
            assert row[k - 1] - row[k] > MIN_BOUNDARY_GAP * np.abs(row).max(), f"near-tie at row {(b, t)}"
    diff = np.abs(out - hf["out"]).max()
    assert diff < OUT_TOL, f"attention output differs from HF DeepSeek-V3.2 by {diff:.3e}"
    assert np.abs(hf["out"]).max() > 1e-2
    sparse_rows = 0
    for b in range(BATCH):
        for t in range(SEQ):
            hf_set = {int(j) for j in hf["topk"][b, t] if j <= t}
            our_set = {int(j) for j in ours_top[b, t] if j >= 0}
            assert our_set == hf_set, f"top-k sets differ at (batch {b}, query {t})"
            sparse_rows += t + 1 > k
    assert sparse_rows == BATCH * (SEQ - k), "rows with more visible keys than index_topk"
    assert ours_top.shape == (BATCH, SEQ, k)


def test_the_topk_restriction_matters_in_this_setting():
    """The sparse output differs visibly from dense attention, so the parity above really tests the selection."""
    hf_model = _hf_model(CASES["default_rope"])
    hf = _capture(hf_model, np.random.default_rng(5).integers(0, 64, size=(BATCH, SEQ)))
    full = _ours(hf_model, hybrid_mla_attention="mqa_full_causal", dsa_indexer_use_sparse_loss=False)
    with paddle.no_grad():
        gap = np.abs(full(paddle.to_tensor(hf["x"])).numpy() - hf["out"]).max()
    assert gap > 100 * OUT_TOL, f"dense and top-{DIMS['index_topk']} attention are too close ({gap:.2e})"
