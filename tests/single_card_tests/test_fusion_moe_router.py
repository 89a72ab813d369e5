"""Fused MoE router (``moe_router_fusion``) vs the pure-Paddle reference (CPU, Triton interpreter, fp32).

The op: weights, indices, counts and the scores' gradient byte-equal to the reference's for every score
function (computed by Paddle before the op, as the layer does), with and without the bias and the
renormalisation, k = 1 and k = E, top-k, a given selection (routing replay) and hash routing (repeated
experts in a table row included). The in-kernel scoring (from logits; what the GPU benchmark runs) against
Paddle and a float64 NumPy oracle within tolerance. The layer and the tiny model built twice from one seed,
switch off vs on: outputs, every gradient and the per-expert counts byte-equal, also under recompute. Every
fused run counts the kernels' launches; a planted one-ulp difference must fail the checks.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from helpers import assert_bitwise, assert_close, expect_launches, model_step, move_constant_inits, tiny_model

pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")
pytest.importorskip("torch", reason="the Triton interpreter needs torch (installed by the `test` extra)")

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.ops.moe_router import function, kernel, reference  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

KERNELS = ("_router_fwd", "_router_counts", "_router_bwd")
SWITCH = {"moe_router_fusion": True}
PADDLE_SCORES = {"sqrtsoftplus": lambda x: paddle.sqrt(F.softplus(x)), "sigmoid": F.sigmoid,
                 "softmax": lambda x: F.softmax(x, axis=-1)}


def _inputs(tokens, experts, topk, mode, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((tokens, experts)) * 2).astype("float32")
    bias = (rng.standard_normal(experts) * 0.2).astype("float32")
    selection = {}
    if mode == "given":
        selection["indices"] = np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)])
    elif mode == "hash":  # a table whose rows may repeat an expert
        selection["table"] = rng.integers(0, experts, (23, topk))
        selection["ids"] = rng.integers(0, 23, tokens)
    grad = rng.standard_normal((tokens, topk)).astype("float32")
    return logits, bias, selection, grad


def _run(module, logits, bias, selection, grad, topk, score, norm, scaling):
    x = paddle.to_tensor(logits, stop_gradient=False)
    scores = PADDLE_SCORES[score](x)
    sel = {k: paddle.to_tensor(v) for k, v in selection.items()}
    weights, indices, counts = module.route(scores, None if bias is None else paddle.to_tensor(bias), topk, norm,
                                            scaling, **sel)
    (weights * paddle.to_tensor(grad)).sum().backward()
    return {"weights": weights.numpy(), "indices": indices.numpy(), "counts": counts.numpy(),
            "d_logits": x.grad.numpy()}


CASES = [  # (tokens, experts, k, mode, score, norm, bias, scaling)
    (37, 8, 3, "topk", "sqrtsoftplus", True, True, 1.5),
    (64, 16, 6, "topk", "sqrtsoftplus", True, False, 2.5),
    (20, 5, 1, "topk", "sigmoid", False, True, 1.0),
    (19, 6, 6, "topk", "softmax", True, True, 1.0),  # k = E
    (41, 12, 4, "topk", "softmax", False, False, 2.0),
    (30, 9, 4, "given", "sqrtsoftplus", True, False, 1.5),
    (33, 7, 3, "hash", "sqrtsoftplus", True, False, 1.5),
    (33, 7, 3, "hash", "sigmoid", False, False, 1.5),
    (1, 256, 6, "topk", "sqrtsoftplus", True, True, 2.5),  # DSv4's 256 experts, one token
]


@pytest.mark.parametrize("tokens, experts, topk, mode, score, norm, bias, scaling", CASES,
                         ids=[f"{c[0]}x{c[1]}-k{c[2]}-{c[3]}-{c[4]}-norm{int(c[5])}-bias{int(c[6])}" for c in CASES])
def test_forward_and_backward_are_bitwise_equal_to_the_reference(tokens, experts, topk, mode, score, norm, bias,
                                                                  scaling):
    logits, b, selection, grad = _inputs(tokens, experts, topk, mode, seed=tokens + experts)
    b = b if bias else None
    want = _run(reference, logits, b, selection, grad, topk, score, norm, scaling)
    with expect_launches(*KERNELS, exactly=1):
        got = _run(function, logits, b, selection, grad, topk, score, norm, scaling)
    for key in want:
        assert_bitwise(got[key], want[key], key)
    assert np.abs(got["d_logits"]).max() > 0


def _oracle(logits, bias, topk, score, norm, scaling):
    """float64: scores, indices (descending biased score, lowest id among equals), weights."""
    x = logits.astype(np.float64)
    if score == "sqrtsoftplus":
        s = np.sqrt(np.logaddexp(0.0, x))
    elif score == "sigmoid":
        s = 1.0 / (1.0 + np.exp(-x))
    else:
        z = np.exp(x - x.max(-1, keepdims=True))
        s = z / z.sum(-1, keepdims=True)
    sel = s + (0.0 if bias is None else bias)
    idx = np.argsort(-sel, axis=-1, kind="stable")[:, :topk]
    w = np.take_along_axis(s, idx, -1)
    if norm:
        w = w / w.sum(-1, keepdims=True)
    return s, idx, w * scaling


@pytest.mark.parametrize("score", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_in_kernel_scoring_matches_paddle_and_the_oracle(score):
    """The logits path (GPU benchmark's): scores, selection and weights vs float64; the backward (with an aux
    loss's d_scores) vs Paddle autograd of the reference. Tolerance: fp32 ``oracle`` (numpy's exp / log vs
    Paddle's differ by ulps, so not bitwise)."""
    logits, bias, _, grad = _inputs(48, 16, 4, "topk", seed=11)
    x = paddle.to_tensor(logits)
    with expect_launches("_router_fwd", "_router_counts", exactly=1):
        scores, weights, indices, counts = kernel.route(x, paddle.to_tensor(bias), 4, True, 2.5, score=score)
    s64, idx64, w64 = _oracle(logits, bias, 4, score, True, 2.5)
    assert_close(scores.numpy(), s64, "fp32", "oracle", what="scores")
    np.testing.assert_array_equal(indices.numpy(), idx64)
    assert_close(weights.numpy(), w64, "fp32", "oracle", what="weights")
    np.testing.assert_array_equal(counts.numpy(), np.bincount(idx64.reshape(-1), minlength=16))

    d_aux = np.random.default_rng(2).standard_normal(logits.shape).astype("float32")  # e.g. the aux loss's
    xp = paddle.to_tensor(logits, stop_gradient=False)
    s_ref = PADDLE_SCORES[score](xp)
    w_ref, _, _ = reference.route(s_ref, None, 4, True, 2.5, indices=indices)
    ((w_ref * paddle.to_tensor(grad)).sum() + (s_ref * paddle.to_tensor(d_aux)).sum()).backward()
    with expect_launches("_router_bwd", exactly=1):
        d_logits = kernel.route_backward(paddle.to_tensor(grad), scores, indices, True, 2.5, score=score,
                                         logits=x, d_scores=paddle.to_tensor(d_aux))
    assert_close(d_logits.numpy(), xp.grad.numpy(), "fp32", "oracle", what="d_logits")


def test_ties_go_to_the_lowest_expert_id():
    scores = paddle.to_tensor(np.array([[1, 3, 3, 2, 3, 0.5], [0, 0, 0, 0, 0, 0]], dtype="float32"))
    _, indices, counts = function.route(scores, None, 3, True, 1.0)
    np.testing.assert_array_equal(indices.numpy(), [[1, 2, 4], [0, 1, 2]])
    np.testing.assert_array_equal(counts.numpy(), [1, 2, 2, 0, 1, 0])


def test_planted_scaling_difference_fails_the_bitwise_check():
    """Negative control: the same maths with ``scaling`` one fp32 ulp off is close, not byte-equal."""
    logits, bias, selection, grad = _inputs(37, 8, 3, "topk", seed=5)
    want = _run(reference, logits, bias, selection, grad, 3, "sqrtsoftplus", True, 1.5)
    got = _run(function, logits, bias, selection, grad, 3, "sqrtsoftplus", True,
               float(np.nextafter(np.float32(1.5), np.float32(2))))
    assert_close(got["weights"], want["weights"], "fp32", "oracle")
    with pytest.raises(AssertionError):
        assert_bitwise(got["weights"], want["weights"], "planted scaling")


def test_bad_inputs_raise_naming_the_tensor():
    scores = paddle.zeros([4, 6])
    with pytest.raises(ValueError, match=r"`topk` must lie in \[1, 6\], got 7"):
        function.route(scores, None, 7, True, 1.0)
    with pytest.raises(ValueError, match=r"`bias` must be float32 \[6\]"):
        function.route(scores, paddle.zeros([5]), 2, True, 1.0)
    with pytest.raises(ValueError, match=r"`scores` must be float32 \[T, E\]"):
        function.route(scores.astype("float64"), None, 2, True, 1.0)
    with pytest.raises(ValueError, match="needs both `table` and `ids`"):
        function.route(scores, None, 2, True, 1.0, table=paddle.zeros([3, 2], dtype="int64"))


# -- the layer and the model, switch off vs on -----------------------------------------------------------------
LAYER_CONFIG = {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.1}


def _layer_run(switches: dict, layer_number: int) -> dict[str, np.ndarray]:
    from fleet_ext.layers.moe import MoELayer
    from fleet_ext.specs.backend import BackendProvider

    config = load_config(tiny_model(**LAYER_CONFIG, **switches))
    paddle.seed(0)
    layer = MoELayer(config, layer_number, ops=BackendProvider(config).moe_ops)
    move_constant_inits(layer, np.random.default_rng(0), 0.3)  # the expert bias too: it must steer the choice
    layer.train()
    rng = np.random.default_rng(7)
    x = paddle.to_tensor(rng.standard_normal((2, 40, 32)).astype("float32"), stop_gradient=False)
    out = layer(x, paddle.to_tensor(rng.integers(0, 64, (2, 40))))
    (out * paddle.to_tensor(rng.standard_normal((2, 40, 32)).astype("float32"))).sum().backward()
    result = {"out": out.numpy(), "d_input": x.grad.numpy(), "counts": layer.tokens_per_expert.numpy()}
    if layer.aux_loss is not None:
        result["aux_loss"] = layer.aux_loss.numpy()
    result.update({f"grad:{n}": p.grad.numpy() for n, p in layer.named_parameters() if p.grad is not None})
    return result


def _model_run(switches: dict, **overrides) -> dict[str, np.ndarray]:
    # 2 x 38 tokens with HCA pooling 8: every attention kind has compressed entries (136 tokens with HCA at 128 took
    # over twice the time, mostly in the interpreted permute kernels some of these runs switch on)
    config = load_config(tiny_model(**LAYER_CONFIG, **switches, hca_compress_ratio=8), **overrides)
    model, result = model_step(config, seq=38)
    result.update({f"counts:{i}": m.tokens_per_expert.numpy() for i, m in enumerate(model.moe_layers())})
    return result


def _assert_bytes_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different result sets {sorted(a.keys() ^ b.keys())}"
    for key in a:
        assert_bitwise(b[key], a[key], f"{what}: {key}")


@pytest.mark.parametrize("layer_number", [0, 1], ids=["hash_routed", "top_k"])
def test_moe_layer_is_bitwise_equal_with_the_fusion(layer_number):
    reference_run = _layer_run({}, layer_number)
    _assert_bytes_equal(reference_run, _layer_run({}, layer_number), "two unfused runs")
    assert "grad:router.weight" in reference_run and np.abs(reference_run["grad:router.weight"]).max() > 0
    assert ("aux_loss" in reference_run) == (layer_number == 1)  # the aux loss's gradient reaches the scores
    with expect_launches(*KERNELS, exactly=1):
        fused = _layer_run(SWITCH, layer_number)
    _assert_bytes_equal(reference_run, fused, "moe_router_fusion on vs off")


def test_tiny_model_is_bitwise_equal_with_the_fusion():
    reference_run = _model_run({})
    with expect_launches(*KERNELS, exactly=4):  # TINY_MODEL: 4 MoE layers (the first hash-routed)
        fused = _model_run(SWITCH)
    _assert_bytes_equal(reference_run, fused, "moe_router_fusion on vs off (whole model)")
    with expect_launches(*KERNELS, "_permute_fwd", "_unpermute_bwd", exactly=4):
        both = _model_run({**SWITCH, "moe_permute_fusion": True})
    _assert_bytes_equal(reference_run, both, "both MoE fusions on vs off (whole model)")


def test_branch_gradients_are_added_in_one_fixed_order(monkeypatch):
    """Why ``MoELayer`` adds its three branches' input gradients itself (``_GradsInOrder``): left to Paddle's
    engine they are added in the order the branches finish, which the fused ops (shorter backward chains)
    change. The fixed order is the unfused one (same bits as the engine's there); bypassed, the model with both
    MoE fusions on differs from the unfused one in the last bits (upstream of the hash-routed layer)."""
    from fleet_ext.layers.moe import MoELayer

    reference_run = _model_run({})
    both = {**SWITCH, "moe_permute_fusion": True}
    monkeypatch.setattr(MoELayer, "_fan_out", lambda self, h: (h, h.reshape([-1, self.hidden_size]), h))
    _assert_bytes_equal(reference_run, _model_run({}), "engine order vs the fixed order, unfused")
    with pytest.raises(AssertionError):
        _assert_bytes_equal(reference_run, _model_run(both), "both MoE fusions, engine order")


def test_planted_difference_fails_the_model_check(monkeypatch):
    """Negative control at model level: the fused router's scaling one ulp off."""
    real = function.route

    def planted(scores, bias, topk, norm, scaling, **selection):
        return real(scores, bias, topk, norm, float(np.nextafter(np.float32(scaling), np.float32(9))), **selection)

    reference_run = _model_run({})
    monkeypatch.setattr(function, "route", planted)
    with pytest.raises(AssertionError):
        _assert_bytes_equal(reference_run, _model_run(SWITCH), "planted")


@pytest.mark.parametrize("policy", [
    {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
], ids=["moe", "full_uniform"])
def test_tiny_model_is_bitwise_equal_with_the_fusion_under_recompute(policy):
    """Under recompute the re-run feeds the replayed selection into the kernel (given-indices mode)."""
    reference_run = _model_run({})
    with expect_launches(*KERNELS):
        fused = _model_run(SWITCH, **policy)
    _assert_bytes_equal(reference_run, fused, f"moe_router_fusion under recompute {policy}")


# -- gates -----------------------------------------------------------------------------------------------------
def test_group_limited_routing_raises_at_config_time():
    grouped = tiny_model(n_routed_experts=8, n_group=4, topk_group=2, moe_router_fusion=True)
    with pytest.raises(ValueError, match=r"`moe_router_fusion` = True can never run: the fused router serves "
                                         r"ungrouped top-k.*Fix: set `moe_router_fusion: false`"):
        load_config(grouped)


def test_registry_entry_and_resolved_table():
    from fleet_ext.specs.backend import BackendProvider

    entry = FUSIONS["moe_router_fusion"]
    assert entry.bitwise_equal and entry.load("fused") is function.route
    assert entry.load("reference") is reference.route
    provider = BackendProvider(load_config(tiny_model(**SWITCH)))
    assert provider.moe_ops.router is function.route
    row = {r.switch: r for r in provider.resolved}["moe_router_fusion"]
    assert row.backend == "Triton interpreter (CPU, slow)" and "bitwise equal" in row.reason
    assert BackendProvider(load_config(tiny_model())).moe_ops.router is None
