"""-2 (hybrid-MLA) layers: absorbed latent MQA vs dense MLA, float64 oracles for the output and the indexer KL in
each phase, gradient isolation (warm-up: only the indexer trains; sparse: backbone and indexer from their own
losses only), the loss mask, the backend op slot, config validation, checkpoint names, and a tiny model trained
through full-causal -> warm-up -> sparse from YAML files."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import paddle
import pytest
import yaml
from helpers import TINY_HYBRID_MLA, assert_close
from helpers import oracles as orc

from fleet_ext.config import load_config
from fleet_ext.framework.contracts import AttentionOps
from fleet_ext.layers.dsa_indexer import DSAIndexer
from fleet_ext.layers.mla import MLASelfAttention
from fleet_ext.layers.mqa_latent_attention import MQALatentAttention
from fleet_ext.models import DSv4ForCausalLM
from fleet_ext.ops.sparse_attn.reference import sparse_attention_with_sink
from fleet_ext.specs.backend import BackendProvider

# fp32 tolerances: tests/helpers/tolerances.py (DESIGN.md rule 6): ``mla_absorbed`` (absorption reorders the
# sums), ``oracle_layer`` (against the float64 oracle: fp32 rounding of the whole layer), ``kl_loss_layer``.
BASE = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 16,
    "v_head_dim": 16, "qk_pos_emb_head_dim": 8, "csa_compress_ratios": [-2, 0, -2], "csa_window_size": 4,
    "o_groups": 2, "o_lora_rank": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "moe_n_hash_layers": 1, **TINY_HYBRID_MLA, "dsa_index_n_heads": 8, "hybrid_mla_rope_type": "rope",
    "init_method_std": 0.2,
}
YARN = {"hybrid_mla_rope_type": "yarn", "hybrid_mla_rotary_scaling_factor": 4.0,
        "hybrid_mla_original_max_position_embeddings": 8, "hybrid_mla_mscale": 0.8}
SEQ = 13


def _config(mode: str, **overrides):
    return load_config({**BASE, "hybrid_mla_attention": mode, **overrides})


def _layer(mode: str, seed: int = 0, ops: AttentionOps | None = None, **overrides) -> MLASelfAttention:
    config = _config(mode, **overrides)
    paddle.seed(seed)
    layer = MLASelfAttention(config, 0, ops or BackendProvider(config).attention_ops)
    rng = np.random.default_rng(seed)
    for tensor in layer.state_dict().values():  # norms, sink, LayerNorm bias: off their constant init
        if tensor.ndim == 1:
            tensor.set_value(tensor.numpy() + 0.3 * rng.standard_normal(tensor.shape).astype("float32"))
    return layer


def _load(dst, state: dict) -> None:
    """Load the keys dst has; the only keys allowed to be missing are the indexer's (a dense-MLA checkpoint)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dst.set_state_dict({k: v for k, v in state.items() if k in dst.state_dict()})
    for w in caught:
        assert "Skip loading for" in str(w.message) and ".indexer." in str(w.message), str(w.message)


def _copy(dst: MLASelfAttention, src: MLASelfAttention) -> MLASelfAttention:
    _load(dst, src.state_dict())
    return dst


def _x(batch: int = 2, seq: int = SEQ, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, seq, 32)).astype("float32")


def _oracle_setup(layer: MLASelfAttention, config):
    m = config.model
    if m.hybrid_mla_rope_type == "yarn":
        inv, factor, soft = orc.yarn_parameters(8, m.hybrid_mla_rotary_base, m.hybrid_mla_rotary_scaling_factor,
                                                m.hybrid_mla_original_max_position_embeddings, m.beta_fast,
                                                m.beta_slow, m.hybrid_mla_mscale, m.hybrid_mla_mscale_all_dim)
    else:
        inv, factor, soft = orc.plain_inv_freq(8, m.hybrid_mla_rotary_base), 1.0, 1.0
    p = {"q_down": layer.linear_q_down_proj.weight.numpy(), "q_norm": layer.q_layernorm.weight.numpy(),
         "q_up": layer.linear_q_up_proj.weight.numpy(), "kv_down": layer.linear_kv_down_proj.weight.numpy(),
         "kv_norm": layer.kv_layernorm.weight.numpy(), "kv_up": layer.linear_kv_up_proj.weight.numpy(),
         "o": layer.o_proj.weight.numpy()}
    sink = None if layer.attn_sink is None else layer.attn_sink.numpy()
    return p, inv, factor, 16**-0.5 * soft, sink


def _oracle_mla(layer, config, x, allowed=None):
    p, inv, factor, scale, sink = _oracle_setup(layer, config)
    return orc.mla_dense(x, p, (4, 8, 8, 8, 16), inv, factor, scale, 1e-6, sink, allowed)


def _oracle_scores(layer, config, x):
    p, inv, factor, _, _ = _oracle_setup(layer, config)
    cq = orc.rms_norm(orc.f64(x) @ orc.f64(p["q_down"]), p["q_norm"], 1e-6)
    ix = layer.core_attention.indexer
    ip = {"wq_b": ix.linear_wq_b.weight.numpy(), "wk": ix.linear_wk.weight.numpy(),
          "k_norm_w": ix.k_norm.weight.numpy(), "k_norm_b": ix.k_norm.bias.numpy(),
          "weights_proj": ix.linear_weights_proj.weight.numpy()}
    return orc.dsa_indexer_scores(x, cq, ip, 8, 16, inv, factor, config.model.dsa_indexer_rotary_interleaved)


# --------------------------------------------------------------------------------------------------
# Absorption.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, {"add_full_attention_sink_bias": True}, YARN],
                         ids=["plain", "sink", "yarn_mscale"])
def test_absorbed_latent_mqa_equals_dense_mla_and_the_oracle(overrides):
    dense = _layer("mha", **overrides)
    latent = _copy(_layer("mqa_full_causal", seed=5, **overrides), dense)
    x = _x()
    xs = [paddle.to_tensor(x) for _ in range(2)]
    for t in xs:
        t.stop_gradient = False
    out_dense, out_latent = dense(xs[0]), latent(xs[1])
    scale = np.abs(out_dense.numpy()).max()
    assert_close(out_latent.numpy(), out_dense.numpy(), "fp32", "mla_absorbed", what="latent vs dense")
    want, _, _ = _oracle_mla(dense, _config("mha", **overrides), x)
    assert_close(out_dense.numpy(), want, "fp32", "oracle_layer", what="dense vs oracle", scale=scale)
    assert np.abs(want).max() > 1e-2
    # Backward through the absorption matches the dense MLA backward.
    g = paddle.to_tensor(np.random.default_rng(7).standard_normal(out_dense.shape).astype("float32"))
    (out_dense * g).sum().backward()
    (out_latent * g).sum().backward()
    assert_close(xs[1].grad.numpy(), xs[0].grad.numpy(), "fp32", "mla_absorbed", what="d_input")
    latent_params = dict(latent.named_parameters())
    for name, param in dense.named_parameters():
        ref = param.grad.numpy()
        assert np.abs(ref).max() > 0, name
        assert_close(latent_params[name].grad.numpy(), ref, "fp32", "mla_absorbed_param_grad", what=name)


def test_every_mode_keeps_the_dense_mla_parameter_layout():
    dense = _layer("mha")
    names = {k: v.shape for k, v in dense.state_dict().items()}
    assert set(names) == {
        "linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
        "kv_layernorm.weight", "linear_kv_up_proj.weight", "o_proj.weight"}
    assert names["linear_kv_up_proj.weight"] == [16, 4 * (8 + 8)] and names["linear_kv_down_proj.weight"] == [32, 24]
    assert {k: v.shape for k, v in _layer("mqa_full_causal").state_dict().items()} == names
    dsa = _layer("mqa_dsa", add_full_attention_sink_bias=True).state_dict()
    extra = set(dsa) - set(names)
    assert extra == {"attn_sink"} | {f"core_attention.indexer.{n}" for n in (
        "linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias", "linear_weights_proj.weight")}
    assert all(dsa[k].shape == v for k, v in names.items())


def test_the_core_calls_the_backend_sparse_attention_slot():
    calls = []

    def spy(q, kv, idx, sink, scale, **kwargs):
        calls.append((q.shape, kv.shape, idx.shape, sink.shape, scale, kwargs))
        return sparse_attention_with_sink(q, kv, idx, sink, scale, **kwargs)

    config = _config("mqa_dsa", dsa_indexer_use_sparse_loss=True)
    ops = BackendProvider(config).attention_ops
    ops = dataclasses.replace(ops, mqa_sparse_attn=spy)
    layer = _layer("mqa_dsa", ops=ops, dsa_indexer_use_sparse_loss=True)
    layer(paddle.to_tensor(_x()))
    (q, kv, idx, sink, scale, kwargs) = calls[-1]
    assert q == [2, SEQ, 4, 16 + 8] and kv == [2, SEQ, 24] and sink == [4] and kwargs == {"d_v": 16}
    assert idx == [2, SEQ, 5 + 4]
    assert_close(scale, 16**-0.5, "float64", "scalar_formula", what="softmax scale")


# --------------------------------------------------------------------------------------------------
# Phases: values against the oracle.
# --------------------------------------------------------------------------------------------------
def test_sparse_phase_covering_every_key_equals_full_causal():
    full = _layer("mqa_full_causal")
    for overrides in ({"dsa_index_topk": SEQ, "dsa_indexer_force_window": False}, {"dsa_index_topk": SEQ - 4}):
        sparse = _copy(_layer("mqa_dsa", dsa_indexer_use_sparse_loss=True, **overrides), full)
        x = paddle.to_tensor(_x())
        assert_close(sparse(x).numpy(), full(x).numpy(), "fp32", "attention_slot_order")


@pytest.mark.parametrize("overrides", [{}, {"dsa_indexer_force_window": False}, {"add_full_attention_sink_bias": True,
                                       "dsa_indexer_rotary_interleaved": True, **YARN}],
                         ids=["window", "topk_only", "sink_interleaved_yarn"])
def test_sparse_phase_output_topk_and_kl_match_the_oracle(overrides):
    overrides = {"dsa_indexer_use_sparse_loss": True, "dsa_indexer_loss_coeff": 0.1, **overrides}
    config = _config("mqa_dsa", **overrides)
    layer = _layer("mqa_dsa", **overrides)
    x = _x()
    mask = np.ones((2, SEQ), dtype=bool)
    mask[1, -3:] = False
    out = layer(paddle.to_tensor(x), loss_mask=paddle.to_tensor(mask))
    window = 0 if overrides.get("dsa_indexer_force_window") is False else 4
    scores = _oracle_scores(layer, config, x)
    table, k_top = orc.topk_window_table(scores, 5, window)
    # The selection itself: the same sets (order inside the top-k is by score, also equal here).
    got_top = layer.topk_indices(paddle.to_tensor(x)).numpy()
    np.testing.assert_array_equal(got_top, table[..., :k_top])
    allowed = np.zeros((2, SEQ, SEQ), dtype=bool)
    for b in range(2):
        for t in range(SEQ):
            allowed[b, t, table[b, t][table[b, t] >= 0]] = True
    want, probs, _ = _oracle_mla(layer, config, x, allowed)
    assert_close(out.numpy(), want, "fp32", "oracle_layer")
    picked = np.zeros_like(allowed)
    for b in range(2):
        for t in range(SEQ):
            picked[b, t, table[b, t, :k_top][table[b, t, :k_top] >= 0]] = True
    want_kl = orc.kl_rows(probs, scores, picked, mask)
    assert want_kl > 1e-3
    assert_close(float(layer.indexer_loss), want_kl, "fp32", "kl_loss_layer", what="KL")


def test_warmup_phase_is_dense_and_its_kl_spans_the_causal_set():
    overrides = {"dsa_indexer_loss_coeff": 0.5, "add_full_attention_sink_bias": True}
    config = _config("mqa_dsa", **overrides)
    layer = _layer("mqa_dsa", **overrides)
    full = _copy(_layer("mqa_full_causal", add_full_attention_sink_bias=True), layer)
    x = _x()
    mask = np.ones((2, SEQ), dtype=bool)
    mask[0, :2] = False
    out = layer(paddle.to_tensor(x), loss_mask=paddle.to_tensor(mask))
    assert np.array_equal(out.numpy(), full(paddle.to_tensor(x)).numpy()), "the loss attach changed the output"
    _, probs, _ = _oracle_mla(layer, config, x)
    causal = np.broadcast_to(np.tril(np.ones((SEQ, SEQ), dtype=bool)), (2, SEQ, SEQ))
    want_kl = orc.kl_rows(probs, _oracle_scores(layer, config, x), causal, mask)
    assert want_kl > 1e-3
    assert_close(float(layer.indexer_loss), want_kl, "fp32", "kl_loss_layer", what="KL")
    layer.eval()
    layer(paddle.to_tensor(x))
    assert layer.indexer_loss is None, "no KL outside training"


# --------------------------------------------------------------------------------------------------
# Phases: who gets which gradient.
# --------------------------------------------------------------------------------------------------
def _grads(layer: MLASelfAttention, x: np.ndarray, scale: float = 1.0):
    xt = paddle.to_tensor(x)
    xt.stop_gradient = False
    layer.clear_gradients()
    layer.core_attention.set_aux_loss_backward_scale(scale)  # the layer owns the scale (no class-level global)
    out = layer(xt)
    (out * paddle.to_tensor(np.linspace(-1, 1, out.size).reshape(out.shape).astype("float32"))).sum().backward()
    layer.core_attention.set_aux_loss_backward_scale(1.0)
    grads = {n: None if p.grad is None else p.grad.numpy().copy() for n, p in layer.named_parameters()}
    return out.numpy(), xt.grad.numpy(), grads


def test_sparse_phase_backbone_and_indexer_learn_from_their_own_losses_only():
    layer = _layer("mqa_dsa", dsa_indexer_use_sparse_loss=True, dsa_indexer_loss_coeff=0.3)
    no_loss = _copy(_layer("mqa_dsa", dsa_indexer_use_sparse_loss=True), layer)
    x = _x()
    out1, dx1, g1 = _grads(layer, x)
    out0, dx0, g0 = _grads(layer, x, scale=0.0)
    out2, dx2, g2 = _grads(layer, x, scale=2.0)
    out_n, dx_n, g_n = _grads(no_loss, x)
    indexer = [n for n in g1 if ".indexer." in n]
    backbone = [n for n in g1 if n not in indexer]
    assert len(indexer) == 5 and len(backbone) == 7
    for out, dx, g in ((out0, dx0, g0), (out2, dx2, g2), (out_n, dx_n, g_n)):
        assert np.array_equal(out, out1) and np.array_equal(dx, dx1), "the KL leaked into the backbone"
        for name in backbone:
            assert np.array_equal(g[name], g1[name]), name
    for name in indexer:
        assert np.abs(g1[name]).max() > 0, f"{name}: the indexer got no KL gradient"
        assert not np.any(g0[name]), f"{name}: the LM path reached the indexer"
        assert_close(g2[name], 2 * g1[name], "fp32", "loss_scale_linearity", what=name)
        assert g_n[name] is None


def _model(config_overrides: dict, seed: int = 0) -> DSv4ForCausalLM:
    paddle.seed(seed)
    return DSv4ForCausalLM({**BASE, **config_overrides})


def _ids(batch: int = 2, seq: int = 24, seed: int = 3, pad_tail: int = 0) -> paddle.Tensor:
    ids = np.random.default_rng(seed).integers(1, 64, size=(batch, seq))
    if pad_tail:
        ids[1, -pad_tail:] = 0
    return paddle.to_tensor(ids)


def test_warmup_freezes_the_backbone_and_trains_the_indexer():
    warm = {"hybrid_mla_attention": "mqa_dsa", "train_indexer_only": True, "dsa_indexer_loss_coeff": 1.0}
    model = _model(warm)
    reference = _model({"hybrid_mla_attention": "mqa_full_causal"})
    reference.set_state_dict({k: v for k, v in model.state_dict().items() if ".indexer." not in k})
    ids = _ids()
    logits, loss = model(ids, labels=ids)
    assert np.array_equal(logits.numpy(), reference(ids).numpy()), "the warm-up changed the LM output"
    loss.backward()
    n_indexer = 0
    for name, param in model.named_parameters():
        if ".core_attention.indexer." in name:
            n_indexer += 1
            assert not param.stop_gradient and np.abs(param.grad.numpy()).max() > 0, name
        else:
            assert param.stop_gradient and param.grad is None, f"frozen {name} got a gradient"
    assert n_indexer == 2 * 5 and sorted(model.indexer_losses()) == [0, 2]


def test_the_model_masks_padding_rows_of_the_indexer_loss():
    model = _model({"hybrid_mla_attention": "mqa_dsa", "dsa_indexer_loss_coeff": 1.0, "pad_token_id": 0})
    seen = []
    attention = model.layers[2].self_attention
    attention.core_attention.register_forward_pre_hook(lambda layer, args: seen.append(args[7].numpy()))
    ids = _ids(pad_tail=5)
    model(ids, labels=ids)
    assert isinstance(attention, MLASelfAttention) and model.layers[2].attention_takes_ids
    np.testing.assert_array_equal(seen[0], ids.numpy() != 0)
    assert not seen[0][1, -5:].any() and seen[0][0].all()


# --------------------------------------------------------------------------------------------------
# Config, checkpoint names, and the three phases end to end.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"hybrid_mla_kv_lora_rank": None}, r"`hybrid_mla_kv_lora_rank` = None.*positive integer when"),
        ({"hybrid_mla_num_attention_heads": 0}, r"`hybrid_mla_num_attention_heads` = 0.*positive integer"),
        ({"hybrid_mla_qk_rope_head_dim": 7}, r"`hybrid_mla_qk_rope_head_dim` = 7.*even integer"),
        ({"csa_compress_ratios": [0, 0, 0], "hybrid_mla_attention": "mqa_full_causal"},
         r"`hybrid_mla_attention` = 'mqa_full_causal'.*'mha' unless csa_compress_ratios has a -2"),
        ({"hybrid_mla_attention": "mqa_dsa", "dsa_index_head_dim": 24}, r"`dsa_index_head_dim` = 24.*power of two"),
        ({"hybrid_mla_attention": "mqa_dsa", "dsa_index_head_dim": 4}, r"`dsa_index_head_dim` = 4.*>= hybrid_mla_qk"),
        ({"hybrid_mla_attention": "mqa_dsa", "train_indexer_only": True, "dsa_indexer_loss_coeff": 0.1,
          "dsa_indexer_use_sparse_loss": True}, r"`train_indexer_only` = True.*false in the sparse phase"),
        ({"hybrid_mla_attention": "mqa_dsa", "train_indexer_only": True},
         r"`dsa_indexer_loss_coeff` = 0.0.*> 0 with train_indexer_only"),
        ({"hybrid_mla_attention": "mqa_full_causal", "train_indexer_only": True, "dsa_indexer_loss_coeff": 0.1},
         r"`dsa_indexer_loss_coeff` = 0.1.*unless an indexer exists"),
        ({"hybrid_mla_attention": "mha", "train_indexer_only": True},
         r"`train_indexer_only` = True.*only with a -2 layer under hybrid_mla_attention: mqa_dsa"),
        ({"dsa_indexer_use_sparse_loss": True}, r"`dsa_indexer_use_sparse_loss` = True.*unless an indexer exists"),
        ({"hybrid_mla_attention": "mqa_dsa", "dsa_indexer_loss_coeff": -1.0}, r"`dsa_indexer_loss_coeff` = -1.0"),
        ({"hybrid_mla_rotary_scaling_factor": 0.0}, r"`hybrid_mla_rotary_scaling_factor` = 0.0.*positive number"),
        ({"kv_lora_rank": 512}, r"`kv_lora_rank` was renamed: use `hybrid_mla_kv_lora_rank`"),
        ({"hybrid_mla_attention": "mqa_dsa", "mqa_indexer_cp_mode": "dualchunk"},
         r"`mqa_indexer_cp_mode` = 'dualchunk' is invalid: allowed one of \['contiguous', 'dualchunk_p2p'\]"),
    ],
)
def test_invalid_hybrid_mla_configs_name_the_key_and_the_fix(overrides, pattern):
    with pytest.raises(ValueError, match=pattern) as err:
        load_config({**BASE, **overrides})
    assert "Fix" in str(err.value) or "renamed" in str(err.value)


def test_indexer_cp_mode_reaches_the_core_and_is_checked_there():
    """``mqa_indexer_cp_mode`` (parallel section) is handed to every -2 layer's core; the core refuses an unknown
    mode itself, naming the key (a layer built without the config)."""
    config = _config("mqa_dsa", mqa_indexer_cp_mode="dualchunk_p2p", dsa_indexer_use_sparse_loss=True)
    assert config.parallel.mqa_indexer_cp_mode == "dualchunk_p2p"
    assert _config("mqa_dsa").parallel.mqa_indexer_cp_mode == "contiguous"
    layer = MLASelfAttention(config, 0, BackendProvider(config).attention_ops)
    assert layer.core_attention.indexer_cp_mode == "dualchunk_p2p"
    with pytest.raises(ValueError, match=r"`mqa_indexer_cp_mode` must be one of \['contiguous', 'dualchunk_p2p'\]"):
        MQALatentAttention(config.model, layer.ops.mqa_sparse_attn, 1.0, "zigzag")


def test_dualchunk_middle_rank_of_an_odd_group_keeps_its_halves():
    """CP 3, rank 1 is its own mirror: it scores its early half against the keys before the half's end and its late
    half against the keys before the chunk's end (no transfer, so it runs in one process); the table is bitwise the
    rows of the whole sequence's, ties included, and the entries scored are the formula's."""
    from fleet_ext.layers.dsa_indexer import SCORE_ENTRIES
    from fleet_ext.layers.mqa_latent_attention import indexer_work_per_rank
    from fleet_ext.parallel.layout import SequenceLayout

    seq, cp, rank = 48, 3, 1
    core = _layer("mqa_dsa", dsa_indexer_use_sparse_loss=True, mqa_indexer_cp_mode="dualchunk_p2p").core_attention
    rng = np.random.default_rng(5)
    q = paddle.to_tensor(rng.standard_normal((2, seq, 8, 16)).astype("float32"))
    k = paddle.to_tensor(rng.standard_normal((2, seq, 16)).astype("float32"))
    w = paddle.to_tensor(np.where(rng.random((2, seq, 8)) < 0.5, 0.0, 1.0).astype("float32"))  # zero scores: ties
    whole, k_whole = core._table(q, k, w, SequenceLayout.whole(seq))
    layout = SequenceLayout.contiguous_shard(seq, cp, rank)
    SCORE_ENTRIES.clear()
    table, k_top = core._table(q[:, layout.offset:layout.end], k, w[:, layout.offset:layout.end], layout)
    assert k_top == k_whole and table.numpy().tobytes() == whole.numpy()[:, layout.offset:layout.end].tobytes()
    assert SCORE_ENTRIES["causal"] == 2 * indexer_work_per_rank(seq, cp, "dualchunk_p2p")[rank] == 2 * 8 * (24 + 32)


def test_dualchunk_mode_without_context_parallelism_is_the_contiguous_path():
    """One rank holds the whole sequence: ``dualchunk_p2p`` changes nothing (bitwise output, picks and KL)."""
    x = paddle.to_tensor(_x())
    results = []
    for mode in ("contiguous", "dualchunk_p2p"):
        layer = _layer("mqa_dsa", dsa_indexer_use_sparse_loss=True, dsa_indexer_loss_coeff=0.1,
                       mqa_indexer_cp_mode=mode)
        layer.train()
        out = layer(x)
        results.append((out.numpy(), layer.indexer_loss.numpy(), layer.topk_indices(x).numpy()))
    for got, want in zip(*results):
        assert got.tobytes() == want.tobytes()


def test_hybrid_mla_config_round_trips_through_yaml(tmp_path):
    config = _config("mqa_dsa", dsa_indexer_use_sparse_loss=True, dsa_indexer_force_window=False,
                     add_full_attention_sink_bias=True, **YARN)
    path = tmp_path / "mla.yaml"
    config.save_yaml(path)
    assert load_config(path) == config and load_config(config.to_dict()) == config
    assert load_config(BASE).model.hybrid_mla_attention == "mha"  # the default phase: dense MLA
    no_mla = load_config({**BASE, "csa_compress_ratios": [0, 0, 0], "hybrid_mla_kv_lora_rank": None})
    assert no_mla.model.hybrid_mla_kv_lora_rank is None  # shapes are only required when a -2 layer exists


def test_sharded_state_dict_keeps_the_stock_names():
    model = _model({"hybrid_mla_attention": "mqa_dsa", "add_full_attention_sink_bias": True})
    sharded = model.sharded_state_dict()
    assert set(sharded) == set(model.state_dict())
    for key in ("layers.0.self_attention.linear_kv_up_proj.weight", "layers.2.self_attention.attn_sink",
                "layers.2.self_attention.core_attention.indexer.linear_wq_b.weight",
                "layers.1.self_attention.linear_kv_proj.weight"):
        assert key in sharded, key
        assert tuple(sharded[key].global_shape) == tuple(model.state_dict()[key].shape)


def _train(model: DSv4ForCausalLM, steps: int, lr: float = 1e-2) -> tuple[list[float], list[float]]:
    opt = paddle.optimizer.AdamW(learning_rate=lr, parameters=model.parameters(), weight_decay=0.0)
    ids = _ids(pad_tail=3)
    labels = paddle.where(ids == 0, paddle.full_like(ids, -100), ids)
    losses, kls = [], []
    for _ in range(steps):
        _, loss = model(ids[:, :-1], labels=labels[:, 1:])
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        kl = model.indexer_losses()
        kls.append(float(np.mean([float(v) for v in kl.values()])) if kl else float("nan"))
    return losses, kls


def test_tiny_model_trains_through_the_three_phases_from_yaml(tmp_path):
    common = {**BASE, "dsa_index_topk": 6}
    phases = {
        "full_causal": {"hybrid_mla_attention": "mqa_full_causal"},
        "warmup": {"hybrid_mla_attention": "mqa_dsa", "train_indexer_only": True, "dsa_indexer_loss_coeff": 1.0},
        "sparse": {"hybrid_mla_attention": "mqa_dsa", "dsa_indexer_use_sparse_loss": True,
                   "dsa_indexer_loss_coeff": 0.1},
    }
    state = None
    for name, overrides in phases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**common, **overrides}))
        paddle.seed(0)
        model = DSv4ForCausalLM(str(path))
        if state is not None:
            _load(model, state)
        before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
        losses, kls = _train(model, steps=6)
        assert np.isfinite(losses).all(), (name, losses)
        after = model.state_dict()
        if name == "full_causal":
            assert losses[-1] < losses[0] - 0.1, losses
            assert np.isnan(kls).all()
        elif name == "warmup":
            for key, value in before.items():
                changed = not np.array_equal(after[key].numpy(), value)
                assert changed == (".indexer." in key), f"{key}: changed={changed} in the warm-up"
            assert np.isfinite(kls).all() and kls[-1] < kls[0], kls
            assert_close(losses[-1], losses[0], "fp32", "frozen_loss", what="the frozen backbone's LM loss moved")
        else:
            assert losses[-1] < losses[0] - 0.1, losses
            assert np.isfinite(kls).all() and all(k > 0 for k in kls), kls
            assert all(not np.array_equal(after[k].numpy(), v) for k, v in before.items() if ".indexer." in k)
        state = {k: v.numpy() for k, v in after.items()}


def test_indexer_sublayers_are_dsa_indexers_only_in_mqa_dsa_layers():
    model = _model({"hybrid_mla_attention": "mqa_dsa"})
    kinds = [type(sub).__name__ for _, sub in model.named_sublayers() if isinstance(sub, DSAIndexer)]
    assert kinds == ["DSAIndexer", "DSAIndexer"]
    assert all(not p.stop_gradient for p in model.parameters()), "only train_indexer_only freezes parameters"
