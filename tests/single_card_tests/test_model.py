"""DSv4ForCausalLM on its reference path: shapes, loss, gradients, causality, layer kinds, FlexCheckpoint."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_close, move_constant_inits, tiny_model
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from fleet_ext.config import load_config
from fleet_ext.framework.spec import LayerSpec, build_layer
from fleet_ext.layer_kinds import LayerKind
from fleet_ext.layers.dsv4_attention import DSv4HybridSelfAttention
from fleet_ext.layers.mlp import SwiGLUMLP
from fleet_ext.layers.moe import MoELayer
from fleet_ext.models import DSv4ForCausalLM
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.registry import DERIVED_FUSIONS
from fleet_ext.specs.backend import BackendProvider
from fleet_ext.specs.layer_specs import decoder_layer_spec
from fleet_ext.specs.transformer_layer import TransformerLayer

BASE = tiny_model()
SEQ = 140  # > 128 so the HCA layer has an entry; not a multiple of 4


def _model(seed: int = 0, **overrides) -> DSv4ForCausalLM:
    paddle.seed(seed)
    model = DSv4ForCausalLM({**BASE, **overrides})
    rng = np.random.default_rng(seed)
    move_constant_inits(model, rng, 0.2)
    return model


def _ids(batch: int = 2, seq: int = SEQ, seed: int = 1) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(seed).integers(0, 64, size=(batch, seq)))


def test_logits_and_loss_match_an_independent_cross_entropy():
    model = _model()
    ids = _ids()
    labels = ids.numpy().copy()
    labels[0, :7] = -100
    logits, loss = model(ids, labels=paddle.to_tensor(labels))
    assert logits.shape == [2, SEQ, 64]
    z = logits.numpy().astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    keep = labels != -100
    expected = -logp[keep, labels[keep]].mean()
    assert_close(float(loss), expected, "fp32", "model_loss")
    assert np.array_equal(model(ids).numpy(), logits.numpy()), "logits without labels differ"


def test_every_backbone_parameter_gets_gradient_and_the_indexer_none():
    model = _model()
    _, loss = model(_ids(), labels=_ids(seed=2))
    loss.backward()
    for name, param in model.named_parameters():
        if ".indexer." in name:
            # The indexer's inputs are detached and its top-k is not differentiable: its only
            # training signal is the indexer KL loss, off here (dsa_indexer_loss_coeff 0; see
            # test_csa_indexer_loss.py).
            assert param.grad is None or not np.any(param.grad.numpy()), name
            continue
        assert param.grad is not None, f"{name} got no gradient"
        assert np.abs(param.grad.numpy()).max() > 0, f"{name} has an all-zero gradient"


def test_future_tokens_do_not_change_past_logits():
    model = _model()
    model.eval()
    ids = _ids(batch=1).numpy()
    for pos in (5, 67, 131):  # inside the first window, mid-CSA blocks, inside the first HCA block
        changed = ids.copy()
        changed[0, pos:] = (changed[0, pos:] + 17) % 64
        with paddle.no_grad():
            a = model(paddle.to_tensor(ids)).numpy()
            b = model(paddle.to_tensor(changed)).numpy()
        # Expert grouping spans all tokens, so GEMM shapes (and fp32 rounding) change; a leak is O(1e-1).
        assert_close(a[:, :pos], b[:, :pos], "fp32", "model_token_grouping", what=f"leak from position {pos}")
        assert np.abs(a[:, pos:] - b[:, pos:]).max() > 1e-3, "the change must be visible after it"


def test_batch_rows_are_independent():
    model = _model()
    model.eval()
    ids = _ids(batch=3)
    with paddle.no_grad():
        together = model(ids).numpy()
        alone = model(ids[1:2]).numpy()
    # Not bitwise: experts group tokens across the batch, and the per-expert GEMM's row count changes MKL's
    # blocking (fp32 rounding only).
    assert_close(together[1:2], alone, "fp32", "model_token_grouping", what="batch row 1")


def test_same_seed_builds_bitwise_identical_models():
    ids = _ids()
    assert np.array_equal(_model(seed=4)(ids).numpy(), _model(seed=4)(ids).numpy())
    assert not np.array_equal(_model(seed=4)(ids).numpy(), _model(seed=5)(ids).numpy())


def test_full_causal_layer_equals_a_window_layer_that_covers_the_sequence():
    """-1 attends to 0..t; a window layer with W >= s sees the same keys (in another slot order)."""
    seq = 20
    paddle.seed(3)
    full = _model(csa_compress_ratios=[-1, 0, 0, 0], csa_window_size=32)
    window = _model(csa_compress_ratios=[0, 0, 0, 0], csa_window_size=32)
    window.set_state_dict(full.state_dict())
    x = paddle.randn([2, seq, 32])
    a = full.layers[0].self_attention(x).numpy()
    b = window.layers[0].self_attention(x).numpy()
    assert_close(a, b, "fp32", "attention_slot_order")
    core = full.layers[0].self_attention.core_attention
    table = core.index_table(x, paddle.zeros([2, seq, 16]), SequenceLayout.whole(seq)).numpy()
    assert table.shape == (2, seq, seq) and table[0, 3, :5].tolist() == [0, 1, 2, 3, -1]


@pytest.mark.parametrize(
    "overrides",
    [
        {"csa_dense_mode": True},
        {"use_vha_attention": True},
        {"use_vha_attention": True, "vha_postmix_grouped": True},
        {"enable_hyper_connections": False},
        {"moe_n_hash_layers": 0, "first_k_dense_replace": 2, "intermediate_size": 24},
        {"tie_word_embeddings": True},
        {"scoring_func": "softmax", "n_shared_experts": 0},
    ],
    ids=["csa_dense", "vha", "vha_grouped", "no_mhc", "dense_first", "tied", "softmax_no_shared"],
)
def test_variants_train_a_step(overrides):
    model = _model(**overrides)
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    ids, labels = _ids(), _ids(seed=9)
    losses = []
    for _ in range(3):
        _, loss = model(ids, labels=labels)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_vha_postmix_starts_as_identity():
    paddle.seed(0)
    plain = DSv4ForCausalLM({**BASE})
    paddle.seed(0)
    with_vha = DSv4ForCausalLM({**BASE, "use_vha_attention": True})
    shared = {k: v for k, v in with_vha.state_dict().items() if "vha_postmix" not in k}
    plain.set_state_dict(shared)
    ids = _ids()
    assert np.array_equal(plain(ids).numpy(), with_vha(ids).numpy())


def test_specs_pick_sublayers_per_layer_kind():
    config = load_config({**BASE, "moe_n_hash_layers": 0, "first_k_dense_replace": 1, "intermediate_size": 24})
    backend = BackendProvider(config)
    spec = decoder_layer_spec(config, 0, backend)
    assert isinstance(spec, LayerSpec) and spec.module is TransformerLayer
    assert spec.sublayers["mlp"].module is SwiGLUMLP and decoder_layer_spec(config, 1, backend).sublayers[
        "mlp"].module is MoELayer
    layer = build_layer(decoder_layer_spec(config, 2, backend), config)
    assert isinstance(layer.self_attention, DSv4HybridSelfAttention) and layer.self_attention.kind is LayerKind.HCA
    assert layer.self_attention.core_attention.ratio == config.model.hca_compress_ratio == 128
    assert layer.self_attention.core_attention.indexer is None and layer.self_attention.core_attention.compressor
    csa = build_layer(decoder_layer_spec(config, 1, backend), config).self_attention.core_attention
    assert csa.indexer is not None and csa.compressor.overlap
    window = build_layer(decoder_layer_spec(config, 0, backend), config).self_attention.core_attention
    assert window.compressor is None and window.indexer is None
    assert layer.self_attention.ops is backend.attention_ops


def test_backend_table_lists_every_fusion_switch():
    config = load_config(BASE)
    table = BackendProvider(config)
    switches = {row.switch for row in table.resolved}
    fusion_keys = {f for f in config.fusion.__dataclass_fields__}
    assert switches == fusion_keys | set(DERIVED_FUSIONS)  # and a row per fusion of several switches' ops
    text = table.format_table()
    assert all(key in text for key in fusion_keys) and "reference (pure Paddle)" in text


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda m: m(paddle.rand([2, 8])), r"`input_ids` must be an int32/int64 tensor"),
        (lambda m: m(paddle.zeros([8], dtype="int64")), r"`input_ids` must be an int32/int64 tensor \[batch, seq\]"),
        (lambda m: m(paddle.full([1, 8], 64, dtype="int64")), r"`input_ids` must lie in \[0, 64\)"),
        (lambda m: m(_ids(), labels=_ids(seq=5)), r"`labels` must have the shape of `input_ids`"),
        (lambda m: m.layers[0].self_attention(paddle.rand([2, 8, 31])), r"`hidden_states` must be \[b, s, 32\]"),
    ],
)
def test_bad_inputs_name_the_tensor(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call(_model())


def test_sharded_state_dict_uses_stock_names_and_full_shapes():
    model = _model()
    sharded = model.sharded_state_dict()
    plain = model.state_dict()
    assert list(sharded) == list(plain)
    for name, weight in sharded.items():
        assert isinstance(weight, ShardedWeight) and weight.key == name
        assert tuple(weight.global_shape) == tuple(plain[name].shape) == tuple(weight.local_shape)
        assert all(o == 0 for o in weight.global_offset)
    assert "layers.1.self_attention.core_attention.indexer.compressor.ape" in sharded
    assert "layers.0.mlp.router.tid2eid" in sharded and "layers.1.mlp.router.expert_bias" in sharded


def test_flex_checkpoint_round_trip_is_bitwise(tmp_path):
    source, target = _model(seed=0), _model(seed=1)
    ids = _ids()
    assert not np.array_equal(source(ids).numpy(), target(ids).numpy())
    paddle.distributed.save_state_dict(source.sharded_state_dict(), str(tmp_path))
    paddle.distributed.load_state_dict(target.sharded_state_dict(), str(tmp_path))
    for name, tensor in source.state_dict().items():
        assert np.array_equal(tensor.numpy(), target.state_dict()[name].numpy()), name
    assert np.array_equal(source(ids).numpy(), target(ids).numpy())


def test_the_model_owns_the_auxiliary_loss_backward_scale():
    """The scale reaches every MoE router through the model (instance state, no class-level global), and the
    router's aux-loss gradient scales with it; the trainer reads the losses through the model."""
    grads = {}
    for scale in (1.0, 3.0):
        model = _model(moe_router_load_balancing_type="seq_aux_loss", moe_n_hash_layers=0)
        model.train()
        model.set_aux_loss_backward_scale(scale)
        assert [m.router.aux_loss_backward_scale for m in model.moe_layers()] == [scale] * len(model.moe_layers())
        (model(_ids()) * 0.0).sum().backward()  # only the aux loss sends gradient
        grads[scale] = model.moe_layers()[0].router.weight.grad.numpy()
        losses = model.auxiliary_losses()
        assert losses["moe_aux_loss"].item() > 0 and losses["indexer_loss"].item() == 0.0
    assert np.abs(grads[1.0]).max() > 0
    # The scale enters before several fp32 sums of mixed-sign terms, so entries near 0 cancel: bounded relative
    # to the largest entry; a scale of 1 would miss by 2x.
    assert_close(grads[3.0], 3.0 * grads[1.0], "fp32", "loss_scale_of_max", scale=np.abs(grads[3.0]).max())
