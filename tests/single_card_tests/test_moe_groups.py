"""Group-limited top-k routing (DeepSeek-V3's ``n_group`` / ``topk_group``) of ``TopKRouter``: against
transformers' ``DeepseekV32TopkRouter`` (external oracle) and a float64 NumPy oracle; no-op settings leave the
selection exactly as without groups; the config rules."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_close

from fleet_ext.config import load_config
from fleet_ext.layers.moe import TopKRouter

BASE = {"hidden_size": 16, "num_hidden_layers": 2, "csa_compress_ratios": [0, 0], "moe_n_hash_layers": 0,
        "scoring_func": "sigmoid", "routed_scaling_factor": 2.5}
SETTINGS = [  # (experts, k, n_group, topk_group, norm_topk_prob, expert_bias)
    (16, 4, 4, 2, True, True),
    (16, 3, 8, 3, False, True),
    (12, 2, 3, 1, True, False),
    (32, 8, 8, 4, True, True),  # DeepSeek-V3's 8 groups / 4 kept / 8 experts per token, at 32 experts
]


def _router(experts: int, k: int, groups: int, keep: int, norm: bool, bias: bool, seed: int = 0) -> TopKRouter:
    config = load_config({**BASE, "n_routed_experts": experts, "num_experts_per_tok": k, "n_group": groups,
                          "topk_group": keep, "norm_topk_prob": norm, "moe_router_enable_expert_bias": bias})
    paddle.seed(seed)
    router = TopKRouter(config, 0)
    router.eval()
    if bias:
        rng = np.random.default_rng(seed + 1)
        router.expert_bias.set_value((0.1 * rng.standard_normal(experts)).astype("float32"))
    return router


def _hidden(seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, 21, 16)).astype("float32")


def _sorted(indices: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(indices, axis=-1)
    return np.take_along_axis(indices, order, -1), np.take_along_axis(weights, order, -1)


def _oracle(x: np.ndarray, w: np.ndarray, bias: np.ndarray, k: int, groups: int, keep: int, norm: bool, scale: float):
    """float64: sigmoid scores; groups ranked by the sum of their two best biased scores; top-k inside the kept."""
    scores = 1.0 / (1.0 + np.exp(-(x.reshape(-1, x.shape[-1]).astype(np.float64) @ w.T.astype(np.float64))))
    biased = scores + bias
    per = biased.shape[-1] // groups
    group_score = np.sort(biased.reshape(-1, groups, per), axis=-1)[..., -2:].sum(-1)
    kept = np.argsort(-group_score, axis=-1)[:, :keep]
    allowed = np.zeros_like(biased, dtype=bool)
    for t, gs in enumerate(kept):
        for g in gs:
            allowed[t, g * per : (g + 1) * per] = True
    indices = np.argsort(-np.where(allowed, biased, -np.inf), axis=-1)[:, :k]
    weights = np.take_along_axis(scores, indices, -1)
    if norm:
        weights = weights / weights.sum(-1, keepdims=True)
    return indices, weights * scale


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"E{s[0]}k{s[1]}g{s[2]}keep{s[3]}" for s in SETTINGS])
def test_group_limited_routing_matches_oracles(setting):
    experts, k, groups, keep, norm, bias = setting
    router = _router(*setting)
    x = _hidden()
    with paddle.no_grad():
        weights, indices = router(paddle.to_tensor(x))
    got_i, got_w = _sorted(indices.numpy(), weights.numpy())
    b = router.expert_bias.numpy() if bias else np.zeros(experts, np.float32)
    want_i, want_w = _sorted(*_oracle(x, router.weight.numpy(), b, k, groups, keep, norm, 2.5))
    np.testing.assert_array_equal(got_i, want_i)
    assert_close(got_w, want_w, "fp32", "oracle", what="routing weights vs float64 oracle")
    # The group limit is active: the unlimited top-k picks some expert outside the kept groups.
    free_i, _ = _sorted(*_oracle(x, router.weight.numpy(), b, k, 1, 1, norm, 2.5))
    assert (free_i != want_i).any(), "the group limit never changed a selection: the setting tests nothing"

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter

    hf = DeepseekV32TopkRouter(transformers.DeepseekV32Config(
        hidden_size=16, n_routed_experts=experts, num_experts_per_tok=k, n_group=groups, topk_group=keep,
        norm_topk_prob=norm, routed_scaling_factor=2.5))
    with torch.no_grad():
        hf.weight.copy_(torch.from_numpy(router.weight.numpy()))
        hf.e_score_correction_bias.copy_(torch.from_numpy(b))
        _, hf_w, hf_i = hf(torch.from_numpy(x))
    hf_i, hf_w = _sorted(hf_i.numpy(), hf_w.numpy())
    np.testing.assert_array_equal(got_i, hf_i)
    assert_close(got_w, hf_w, "fp32", "oracle", what="routing weights vs transformers")


@pytest.mark.parametrize("groups", [1, 4])
def test_keeping_every_group_is_exactly_the_plain_top_k(groups):
    """topk_group == n_group (or n_group 1) leaves the selection and weights byte for byte as without groups."""
    plain, grouped = _router(16, 4, 1, 1, True, True), _router(16, 4, groups, groups, True, True)
    x = paddle.to_tensor(_hidden(5))
    with paddle.no_grad():
        (w0, i0), (w1, i1) = plain(x), grouped(x)
    np.testing.assert_array_equal(i0.numpy(), i1.numpy())
    np.testing.assert_array_equal(w0.numpy(), w1.numpy())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_routed_experts": 16, "n_group": 3}, r"`n_group` = 3 is invalid: allowed 1 or a divisor"),
        ({"n_routed_experts": 16, "n_group": 16}, r"`n_group` = 16 .*>= 2 experts per group"),
        ({"n_routed_experts": 16, "n_group": 4, "topk_group": 5}, r"`topk_group` = 5 .*<= n_group \(4\)"),
        ({"n_routed_experts": 16, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 6},
         r"`topk_group` = 1 .*>= num_experts_per_tok / experts per group = 6 / 4"),
        ({"n_group": 0}, r"`n_group` = 0 is invalid"),
        ({"moe_router_num_groups": 8}, r"`moe_router_num_groups` was renamed: use `n_group`"),
        ({"moe_router_group_topk": 4}, r"`moe_router_group_topk` was renamed: use `topk_group`"),
    ],
)
def test_group_config_rules(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config({**BASE, **overrides})
