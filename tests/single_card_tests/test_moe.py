"""MoE layers (routers, grouped experts, clamped SwiGLU, aux losses) vs independent float64 NumPy oracles.

The oracles below are written from the maths (dsv4_math.md §4 and HF's DeepseekV4 MoE classes) and share
no code with ``fleet_ext.layers.moe`` / ``mlp``.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_close

from fleet_ext.config import load_config
from fleet_ext.layers.mlp import SwiGLUMLP
from fleet_ext.layers.moe import GroupedExperts, HashRouter, MoELayer, TopKRouter

# Tolerances (fp32 layer vs float64 oracle; exactness is impossible, different precision): the fp32 table of
# tests/helpers/tolerances.py, ``oracle`` for fp32 matmuls over D <= 16 with O(1) values, ``fd_grad`` for
# gradients against central finite differences of the float64 oracle, and the named entries below.

D, E, K, I_FFN, VOCAB = 16, 8, 3, 6, 40


def make_config(**overrides):
    base = dict(
        hidden_size=D,
        vocab_size=VOCAB,
        num_hidden_layers=4,
        csa_compress_ratios=[0] * 4,
        n_routed_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=I_FFN,
        n_shared_experts=1,
        moe_n_hash_layers=0,
        init_method_std=0.5,
    )
    base.update(overrides)
    return load_config(base)


def rng(seed=0):
    return np.random.default_rng(seed)


def to_pd(a, dtype="float32"):
    return paddle.to_tensor(np.asarray(a), dtype=dtype)


# --------------------------------------------------------------------------------------------------
# NumPy oracles (float64).
# --------------------------------------------------------------------------------------------------
def np_scores(logits, func):
    if func == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, logits))
    if func == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def np_route(x, w, func, k, bias=None, norm=True, scale=1.5):
    """Return (scores, indices sorted ascending per row, weights in that index order)."""
    scores = np_scores(x.reshape(-1, x.shape[-1]) @ w.T, func)
    sel = scores if bias is None else scores + bias
    idx = np.sort(np.argsort(-sel, axis=-1, kind="stable")[:, :k], axis=-1)
    wts = np.take_along_axis(scores, idx, axis=-1)
    if norm:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    return scores, idx, wts * scale


def np_swiglu_ffn(x, w1, w2, limit):
    """x [.., D] @ w1 [D, 2F] -> clamped SwiGLU -> @ w2 [F, D]."""
    f = w1.shape[1] // 2
    gate, up = x @ w1[:, :f], x @ w1[:, f:]
    if limit > 0:
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
    return (gate / (1.0 + np.exp(-gate)) * up) @ w2


def np_experts_naive(x, idx, wts, w1, w2, limit):
    """Per token, per slot: out[t] += w[t, j] * expert_{idx[t, j]}(x[t])."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            out[t] += wts[t, j] * np_swiglu_ffn(x[t : t + 1], w1[e], w2[e], limit)[0]
    return out


def np_seq_aux_loss(scores, idx, batch, seq, coeff):
    n_exp, k = scores.shape[-1], idx.shape[-1]
    p = scores / scores.sum(-1, keepdims=True)
    total = 0.0
    for b in range(batch):
        rows = slice(b * seq, (b + 1) * seq)
        counts = np.zeros(n_exp)
        for e in idx[rows].reshape(-1):
            counts[e] += 1
        f = counts * n_exp / (k * seq)
        total += (f * p[rows].mean(0)).sum()
    return coeff * total / batch


def sorted_route(weights, indices):
    """Layer output rows reordered by ascending expert id (topk order is not part of the contract)."""
    idx, w = indices.numpy(), weights.numpy()
    order = np.argsort(idx, axis=-1)
    return np.take_along_axis(idx, order, -1), np.take_along_axis(w, order, -1)


# --------------------------------------------------------------------------------------------------
# Routers.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("norm", [True, False])
def test_topk_router_matches_oracle(func, norm):
    router = TopKRouter(make_config(scoring_func=func, norm_topk_prob=norm), layer_number=1)
    x = rng(1).standard_normal((2, 5, D))
    weights, indices = router(to_pd(x))
    assert indices.dtype == paddle.int64 and weights.dtype == paddle.float32
    assert list(weights.shape) == [10, K] and list(indices.shape) == [10, K]
    _, ref_idx, ref_w = np_route(x, router.weight.numpy().astype(np.float64), func, K, norm=norm, scale=1.5)
    idx, w = sorted_route(weights, indices)
    np.testing.assert_array_equal(idx, ref_idx)
    assert_close(w, ref_w, "fp32", "oracle")


def test_expert_bias_changes_selection_not_weights():
    router = TopKRouter(make_config(), layer_number=1)
    bias = np.zeros(E)
    bias[5] = 100.0
    paddle.assign(to_pd(bias), output=router.expert_bias)
    x = rng(2).standard_normal((2, 4, D))
    weights, indices = router(to_pd(x))
    assert (indices.numpy() == 5).any(axis=-1).all(), "a huge bias must force expert 5 into every token's top-k"
    w64 = router.weight.numpy().astype(np.float64)
    _, ref_idx, ref_w = np_route(x, w64, "sqrtsoftplus", K, bias=bias)
    _, free_idx, _ = np_route(x, w64, "sqrtsoftplus", K)
    assert not np.array_equal(ref_idx, free_idx), "the bias must change the selection for this test to mean anything"
    idx, w = sorted_route(weights, indices)
    np.testing.assert_array_equal(idx, ref_idx)
    assert_close(w, ref_w, "fp32", "oracle", what="unbiased scores, renormalised")

    # The bias is a buffer: no gradient, not a parameter, untouched by backward + optimizer step.
    assert router.expert_bias.stop_gradient
    assert all(p is not router.expert_bias for p in router.parameters())
    before = router.expert_bias.numpy().copy()
    opt = paddle.optimizer.SGD(learning_rate=1.0, parameters=router.parameters())
    (weights * to_pd(rng(3).standard_normal(weights.shape))).sum().backward()
    opt.step()
    assert router.expert_bias.grad is None
    assert router.weight.grad is not None and np.abs(router.weight.grad.numpy()).sum() > 0
    np.testing.assert_array_equal(router.expert_bias.numpy(), before)


def test_expert_bias_update_rule():
    gamma = 1e-3
    router = TopKRouter(make_config(moe_router_bias_update_rate=gamma), layer_number=1)
    start = rng(4).standard_normal(E).astype(np.float32)
    paddle.assign(to_pd(start), output=router.expert_bias)
    load = np.array([9, 1, 4, 4, 0, 6, 4, 4], dtype=np.float32)  # mean 4
    router.update_expert_bias(to_pd(load))
    delta = router.expert_bias.numpy().astype(np.float64) - start
    assert_close(delta[load > 4], -gamma, "fp32", "bias_step_on_start", what="overloaded experts")
    assert_close(delta[load < 4], gamma, "fp32", "bias_step_on_start", what="underloaded experts")
    np.testing.assert_array_equal(delta[load == 4], 0.0)


def test_tokens_per_expert_accumulate_and_drive_update():
    router = TopKRouter(make_config(), layer_number=1)
    router.train()
    expect = np.zeros(E)
    for seed in (5, 6):
        _, indices = router(to_pd(rng(seed).standard_normal((2, 3, D))))
        expect += np.bincount(indices.numpy().reshape(-1), minlength=E)
    np.testing.assert_array_equal(router.local_tokens_per_expert.numpy(), expect)
    router.update_expert_bias()
    want = -1e-3 * np.sign(expect - expect.mean())
    assert_close(router.expert_bias.numpy(), want, "fp32", "bias_step")
    np.testing.assert_array_equal(router.local_tokens_per_expert.numpy(), np.zeros(E))
    router.eval()
    router(to_pd(rng(7).standard_normal((1, 2, D))))
    np.testing.assert_array_equal(router.local_tokens_per_expert.numpy(), np.zeros(E))  # eval does not count


def test_hash_router():
    cfg = make_config(moe_n_hash_layers=2)
    router = HashRouter(cfg, layer_number=0)
    table = router.tid2eid.numpy()
    assert table.dtype == np.int64 and table.shape == (VOCAB, K)
    np.testing.assert_array_equal(table, (np.arange(VOCAB)[:, None] + np.arange(K)[None, :]) % E)
    custom = np.stack([rng(8).permutation(E)[:K] for _ in range(VOCAB)])
    paddle.assign(to_pd(custom, "int64"), output=router.tid2eid)
    x = rng(9).standard_normal((2, 5, D))
    ids = rng(10).integers(0, VOCAB, (2, 5))
    weights, indices = router(to_pd(x), to_pd(ids, "int64"))
    np.testing.assert_array_equal(indices.numpy(), custom[ids.reshape(-1)])
    scores = np_scores(x.reshape(-1, D) @ router.weight.numpy().astype(np.float64).T, "sqrtsoftplus")
    ref_w = np.take_along_axis(scores, custom[ids.reshape(-1)], -1)
    ref_w = ref_w / ref_w.sum(-1, keepdims=True) * 1.5
    assert_close(weights.numpy(), ref_w, "fp32", "oracle")
    with pytest.raises(ValueError, match="`input_ids`"):
        router(to_pd(x))
    layer = MoELayer(cfg, 1)
    assert layer.is_hash and "router.tid2eid" in layer.state_dict() and "router.expert_bias" not in layer.state_dict()
    with pytest.raises(ValueError, match="`input_ids`"):
        layer(to_pd(x))
    layer.update_expert_bias()  # no-op on hash layers
    assert not MoELayer(cfg, 2).is_hash


# --------------------------------------------------------------------------------------------------
# Clamped SwiGLU and grouped experts.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_mlp_clamp(limit):
    mlp = SwiGLUMLP(make_config(swiglu_limit=limit), D, 5)
    assert list(mlp.linear_fc1.weight.shape) == [D, 10] and list(mlp.linear_fc2.weight.shape) == [5, D]
    x = 12.0 * rng(11).standard_normal((2, 3, D))  # init std 0.5 -> pre-activations of ~|25|
    w1 = mlp.linear_fc1.weight.numpy().astype(np.float64)
    w2 = mlp.linear_fc2.weight.numpy().astype(np.float64)
    pre = x @ w1
    assert (pre[..., :5] > 10).any() and (pre[..., 5:] > 10).any() and (pre[..., 5:] < -10).any(), "clamp must bite"
    out = mlp(to_pd(x)).numpy()
    assert_close(out, np_swiglu_ffn(x, w1, w2, limit), "fp32", "oracle_swiglu_large")  # |out| ~ 1e3
    if limit:
        assert not np.allclose(out, np_swiglu_ffn(x, w1, w2, 0.0), rtol=1e-3), "clamped and unclamped must differ"


def _expert_case(seed, tokens, scale):
    r = rng(seed)
    x = scale * r.standard_normal((tokens, D))
    idx = np.stack([r.choice([0, 1, 3, 4, 6], size=2, replace=False) for _ in range(tokens)])  # experts 2,5,7 idle
    wts = r.uniform(0.1, 1.0, (tokens, 2))
    return x, idx, wts


def test_grouped_experts_forward_matches_naive_loop():
    experts = GroupedExperts(make_config())
    assert list(experts.weight1.shape) == [E, D, 2 * I_FFN] and list(experts.weight2.shape) == [E, I_FFN, D]
    x, idx, wts = _expert_case(12, tokens=9, scale=4.0)
    w1, w2 = experts.weight1.numpy().astype(np.float64), experts.weight2.numpy().astype(np.float64)
    assert (np.einsum("td,tjdf->tjf", x, w1[idx]) > 10).any(), "clamp must be active in this case"
    out = experts(to_pd(x), to_pd(idx, "int64"), to_pd(wts)).numpy()
    assert_close(out, np_experts_naive(x, idx, wts, w1, w2, 10.0), "fp32", "oracle_experts")


def test_grouped_experts_gradients_match_finite_differences():
    cfg = make_config(hidden_size=4, n_routed_experts=4, moe_intermediate_size=3)
    experts = GroupedExperts(cfg)
    r = rng(13)
    x = 6.0 * r.standard_normal((3, 4))
    idx = np.array([[0, 2], [2, 3], [0, 2]])
    wts = r.uniform(0.2, 1.0, (3, 2))
    probe = r.standard_normal((3, 4))
    w1, w2 = experts.weight1.numpy().astype(np.float64), experts.weight2.numpy().astype(np.float64)
    xt, wt = to_pd(x), to_pd(wts)
    xt.stop_gradient = wt.stop_gradient = False
    (experts(xt, to_pd(idx, "int64"), wt) * to_pd(probe)).sum().backward()

    def loss(xa, wa, a1, a2):
        return (np_experts_naive(xa, idx, wa, a1, a2, 10.0) * probe).sum()

    args = [x, wts, w1, w2]
    grads = [xt.grad, wt.grad, experts.weight1.grad, experts.weight2.grad]
    for pos, (arg, got) in enumerate(zip(args, grads, strict=True)):
        fd = np.zeros_like(arg)
        for i in np.ndindex(arg.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[pos][i] += 1e-6
            minus[pos][i] -= 1e-6
            fd[i] = (loss(*plus) - loss(*minus)) / 2e-6
        assert_close(got.numpy(), fd, "fp32", "fd_grad")
    assert np.abs(grads[3].numpy()[1]).sum() == 0, "expert 1 got no tokens: its weight2 gradient must be exactly 0"
    assert (np.abs(np.einsum("td,tjdf->tjf", x, w1[idx])) > 10).any(), "clamp must be active in the gradient case"


# --------------------------------------------------------------------------------------------------
# Sequence-wise aux loss.
# --------------------------------------------------------------------------------------------------
def _twin_layers(**overrides):
    """Two MoE layers with identical weights, aux loss off and on."""
    paddle.seed(21)
    plain = MoELayer(make_config(**overrides), 1)
    aux = MoELayer(make_config(moe_router_load_balancing_type="seq_aux_loss", **overrides), 1)
    aux.set_state_dict(plain.state_dict())
    return plain, aux


def test_seq_aux_loss_value_gradient_and_forward():
    coeff = 0.5
    plain, aux = _twin_layers(moe_aux_loss_coeff=coeff)
    x = rng(14).standard_normal((2, 6, D))
    probe = to_pd(rng(15).standard_normal((2, 6, D)))
    out_plain, out_aux = plain(to_pd(x)), aux(to_pd(x))
    np.testing.assert_array_equal(out_aux.numpy(), out_plain.numpy())  # forward value untouched
    assert plain.aux_loss is None

    w64 = aux.router.weight.numpy().astype(np.float64)
    scores, idx, _ = np_route(x, w64, "sqrtsoftplus", K)
    assert_close(float(aux.aux_loss), np_seq_aux_loss(scores, idx, 2, 6, coeff), "fp32", "oracle")

    (out_plain * probe).sum().backward()
    (out_aux * probe).sum().backward()
    extra = aux.router.weight.grad.numpy().astype(np.float64) - plain.router.weight.grad.numpy()

    # d(aux)/dW by central differences of the oracle; the selection (idx) is a constant of the loss.
    fd = np.zeros_like(w64)
    for i in np.ndindex(w64.shape):
        wp, wm = w64.copy(), w64.copy()
        wp[i] += 1e-6
        wm[i] -= 1e-6
        lp = np_seq_aux_loss(np_scores(x.reshape(-1, D) @ wp.T, "sqrtsoftplus"), idx, 2, 6, coeff)
        lm = np_seq_aux_loss(np_scores(x.reshape(-1, D) @ wm.T, "sqrtsoftplus"), idx, 2, 6, coeff)
        fd[i] = (lp - lm) / 2e-6
    assert np.abs(fd).max() > 1e-3
    assert_close(extra, fd, "fp32", "fd_grad_difference")  # a difference of two fp32 grads
    for name in ("experts.weight1", "experts.weight2", "shared_experts.linear_fc1.weight"):
        a, b = (dict(m.named_parameters())[name].grad.numpy() for m in (plain, aux))
        np.testing.assert_array_equal(a, b)  # the aux loss only reaches the router

    # With a zero upstream gradient only the aux loss gradient remains; the autoscaler scales it.
    for scale in (1.0, 3.0):
        aux.clear_gradients()
        aux.set_aux_loss_backward_scale(scale)  # the layer owns the scale (no class-level global)
        (aux(to_pd(x)) * 0.0).sum().backward()
        assert_close(aux.router.weight.grad.numpy(), scale * fd, "fp32", "fd_grad_small", what=f"scale {scale}")


def test_seq_aux_loss_only_in_training():
    _, aux = _twin_layers()
    aux.eval()
    aux(to_pd(rng(16).standard_normal((1, 4, D))))
    assert aux.aux_loss is None
    with paddle.no_grad():
        aux.train()
        aux(to_pd(rng(16).standard_normal((1, 4, D))))
    assert aux.aux_loss is None


# --------------------------------------------------------------------------------------------------
# The MoE layer.
# --------------------------------------------------------------------------------------------------
def test_moe_layer_matches_oracle_and_state_dict():
    layer = MoELayer(make_config(), 1)
    x = rng(17).standard_normal((2, 4, D))
    out = layer(to_pd(x)).numpy()
    p = {k: v.numpy().astype(np.float64) for k, v in layer.state_dict().items()}
    _, idx, wts = np_route(x, p["router.weight"], "sqrtsoftplus", K, bias=p["router.expert_bias"])
    flat = x.reshape(-1, D)
    ref = np_experts_naive(flat, idx, wts, p["experts.weight1"], p["experts.weight2"], 10.0)
    ref += np_swiglu_ffn(flat, p["shared_experts.linear_fc1.weight"], p["shared_experts.linear_fc2.weight"], 10.0)
    assert_close(out, ref.reshape(2, 4, D), "fp32", "oracle_experts")

    shapes = {k: (tuple(v.local_shape), tuple(v.global_shape)) for k, v in layer.sharded_state_dict().items()}
    assert shapes == {
        "router.weight": ((E, D), (E, D)),
        "router.expert_bias": ((E,), (E,)),
        "experts.weight1": ((E, D, 2 * I_FFN), (E, D, 2 * I_FFN)),
        "experts.weight2": ((E, I_FFN, D), (E, I_FFN, D)),
        "shared_experts.linear_fc1.weight": ((D, 2 * I_FFN), (D, 2 * I_FFN)),
        "shared_experts.linear_fc2.weight": ((I_FFN, D), (I_FFN, D)),
    }
    no_shared = MoELayer(make_config(n_shared_experts=0, moe_router_enable_expert_bias=False), 1)
    assert sorted(no_shared.sharded_state_dict()) == ["experts.weight1", "experts.weight2", "router.weight"]
    indices_weights = _route_args(no_shared, x)
    routed_only = no_shared.experts(to_pd(flat), *indices_weights).numpy().reshape(2, 4, D)
    np.testing.assert_array_equal(no_shared(to_pd(x)).numpy(), routed_only)  # no shared branch added


def _route_args(layer, x):
    weights, indices = layer.router(to_pd(x))
    return indices, weights


def test_moe_layer_matches_hugging_face():
    """Same weights in HF's DeepseekV4SparseMoeBlock (torch, fp32) give the same output (the import target)."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    hf_cfg = DeepseekV4Config(
        hidden_size=D,
        moe_intermediate_size=I_FFN,
        n_routed_experts=E,
        num_experts_per_tok=K,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        mlp_layer_types=["hash_moe", "moe"],
        head_dim=32,
        num_attention_heads=2,
        q_lora_rank=8,
        o_groups=1,
        o_lora_rank=8,
    )
    x = rng(18).standard_normal((2, 5, D)).astype(np.float32)
    ids = rng(19).integers(0, VOCAB, (2, 5))
    ours = MoELayer(make_config(moe_n_hash_layers=1), 0), MoELayer(make_config(moe_n_hash_layers=1), 1)
    paddle.assign(to_pd(rng(20).normal(0, 0.3, E), "float32"), output=ours[1].router.expert_bias)
    for layer_idx, layer in enumerate(ours):
        p = {k: torch.from_numpy(v.numpy()) for k, v in layer.state_dict().items()}
        block = hf.DeepseekV4SparseMoeBlock(hf_cfg, layer_idx)
        with torch.no_grad():
            block.gate.weight.copy_(p["router.weight"])
            if layer_idx == 0:
                block.gate.tid2eid.copy_(p["router.tid2eid"])
            else:
                block.gate.e_score_correction_bias.copy_(p["router.expert_bias"])
            block.experts.gate_up_proj.copy_(p["experts.weight1"].transpose(1, 2))
            block.experts.down_proj.copy_(p["experts.weight2"].transpose(1, 2))
            fc1, fc2 = p["shared_experts.linear_fc1.weight"], p["shared_experts.linear_fc2.weight"]
            block.shared_experts.gate_proj.weight.copy_(fc1[:, :I_FFN].T)
            block.shared_experts.up_proj.weight.copy_(fc1[:, I_FFN:].T)
            block.shared_experts.down_proj.weight.copy_(fc2.T)
            ref = block(torch.from_numpy(x), input_ids=torch.from_numpy(ids)).numpy()
        out = layer(to_pd(x), to_pd(ids, "int64")).numpy()
        assert_close(out, ref, "fp32", "oracle")


# --------------------------------------------------------------------------------------------------
# Input validation.
# --------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_naming_the_tensor():
    cfg = make_config(moe_n_hash_layers=1)
    hash_layer, topk_layer = MoELayer(cfg, 0), MoELayer(cfg, 1)
    good = to_pd(rng(22).standard_normal((2, 3, D)))
    ids = to_pd(rng(23).integers(0, VOCAB, (2, 3)), "int64")
    for bad in (to_pd(np.zeros((2, 3, D + 1))), to_pd(np.zeros((6, D))), to_pd(np.zeros((2, 3, D)), "int64"), "x"):
        with pytest.raises(ValueError, match="MoELayer: `hidden_states` must be \\[batch, seq, 16\\] float"):
            topk_layer(bad)
    for bad in (to_pd(np.zeros((2, 4)), "int64"), to_pd(np.zeros((2, 3))), ids.reshape([6])):
        with pytest.raises(ValueError, match="`input_ids`"):
            hash_layer(good, bad)
    experts = topk_layer.experts
    flat, idx, w = good.reshape([6, D]), to_pd(np.zeros((6, 2)), "int64"), to_pd(np.ones((6, 2)))
    with pytest.raises(ValueError, match="`indices`"):
        experts(flat, to_pd(np.full((6, 2), E), "int64"), w)
    with pytest.raises(ValueError, match="`indices`"):
        experts(flat, to_pd(np.zeros((6, 2))), w)
    with pytest.raises(ValueError, match="`weights`"):
        experts(flat, idx, to_pd(np.ones((6, 3))))
    with pytest.raises(ValueError, match="`hidden_states`"):
        experts(good, idx, w)
    with pytest.raises(ValueError, match="`x`"):
        topk_layer.shared_experts(to_pd(np.zeros((2, D - 1))))
    with pytest.raises(ValueError, match="`tokens_per_expert`"):
        topk_layer.update_expert_bias(to_pd(np.ones(E + 1)))
    with pytest.raises(ValueError, match="`layer_number`"):
        MoELayer(cfg, 4)
    with pytest.raises(ValueError, match="`first_k_dense_replace`"):
        MoELayer(make_config(first_k_dense_replace=2), 1)
