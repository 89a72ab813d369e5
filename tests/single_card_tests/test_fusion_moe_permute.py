"""Fused MoE permute / unpermute (``moe_permute_fusion``) vs the pure-Paddle reference (CPU, Triton interpreter, fp32).

The op: permuted rows, combined output, the hidden states' and the routing weights' gradients byte-equal to
the reference's (odd sizes, empty experts, one expert taking every token, k = 1, repeated experts in a
token's slots), and against an independent NumPy oracle (a stable sort for the rows, float64 for the sums).
The layer: the real ``MoELayer`` (hash-routed and top-k) and the whole tiny model built twice from one seed,
switch off vs on: output / loss and every gradient byte-equal, also under recompute. Every fused run counts
the kernels' launches; planted differences (a summation order, a weight off by one ulp) must fail the checks.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, assert_close, expect_launches, model_step, move_constant_inits, tiny_model

pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")
pytest.importorskip("torch", reason="the Triton interpreter needs torch (installed by the `test` extra)")

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.ops.moe_permute import function, kernel, reference  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

ROUTE = ("_route_hist", "_route_scan", "_permute_fwd")  # the last computes each token's rows, then copies it
FORWARD = (*ROUTE, "_unpermute_fwd")
BACKWARD = ("_permute_bwd", "_unpermute_bwd")
KERNELS = (*FORWARD, *BACKWARD)
SWITCH = {"moe_permute_fusion": True}


def _routing(kind: str, tokens: int, experts: int, topk: int, rng) -> np.ndarray:
    if kind == "random":
        return np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)])
    if kind == "one_expert_takes_all":  # expert 1 in every token's first slot
        rest = np.stack([rng.choice(np.delete(np.arange(experts), 1), topk - 1, replace=False) for _ in range(tokens)])
        return np.concatenate([np.ones((tokens, 1), dtype=np.int64), rest.reshape(tokens, topk - 1)], axis=1)
    if kind == "empty_experts":  # only the even experts receive tokens
        return np.stack([rng.choice(np.arange(0, experts, 2), topk, replace=False) for _ in range(tokens)])
    if kind == "repeated":  # the same expert twice in a token's slots (a hash table may repeat one)
        first = rng.integers(0, experts, (tokens, 1))
        return np.concatenate([first, first, rng.integers(0, experts, (tokens, topk - 2))], axis=1)
    raise ValueError(kind)


CASES = [  # (tokens, hidden, experts, k, routing)
    (272, 32, 4, 2, "random"),  # the tiny model's MoE shapes
    (37, 19, 8, 3, "random"),  # odd sizes
    (50, 24, 16, 6, "random"),  # k = 6 of DSv4
    (33, 8, 8, 1, "random"),  # k = 1
    (1, 5, 3, 3, "random"),  # one token
    (70, 16, 9, 3, "empty_experts"),
    (41, 12, 6, 3, "one_expert_takes_all"),
    (29, 10, 5, 4, "repeated"),
    (64, 1, 2, 1, "random"),  # D = 1
]


def _data(tokens, hidden, experts, topk, routing, seed=0, dtype="int64"):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype("float32")
    idx = _routing(routing, tokens, experts, topk, rng).astype(dtype)
    w = rng.random((tokens, topk)).astype("float32") + 0.1
    g = rng.standard_normal((tokens, hidden)).astype("float32")
    return x, idx, w, g


def _run(module, x, idx, w, g, experts, plant=None):
    """Permute, a per-row expert stand-in (an affine map), unpermute, backward; every tensor that comes out."""
    xt = paddle.to_tensor(x, stop_gradient=False)
    wt = paddle.to_tensor(w, stop_gradient=False)
    rows, plan = module.permute(xt, paddle.to_tensor(idx), experts)
    if plant is not None:
        plan = plant(plan)
    y = rows * 1.5 + 0.25
    out = module.unpermute(y, wt, plan)
    (out * paddle.to_tensor(g)).sum().backward()
    return {"rows": rows.numpy(), "out": out.numpy(), "d_hidden": xt.grad.numpy(), "d_weights": wt.grad.numpy()}, plan


def _assert_all_bitwise(want: dict, got: dict, what: str) -> None:
    assert want.keys() == got.keys()
    for key in want:
        assert_bitwise(got[key], want[key], f"{what}: {key}")


@pytest.mark.parametrize("tokens, hidden, experts, topk, routing", CASES,
                         ids=[f"{c[0]}x{c[1]}-e{c[2]}-k{c[3]}-{c[4]}" for c in CASES])
def test_forward_and_backward_are_bitwise_equal_to_the_reference(tokens, hidden, experts, topk, routing):
    x, idx, w, g = _data(tokens, hidden, experts, topk, routing)
    want, _ = _run(reference, x, idx, w, g, experts)
    with expect_launches(*KERNELS, exactly=1):
        got, plan = _run(function, x, idx, w, g, experts)
    _assert_all_bitwise(want, got, "fused vs reference")
    counts = np.bincount(idx.reshape(-1), minlength=experts)
    np.testing.assert_array_equal(plan.counts.numpy(), counts)
    np.testing.assert_array_equal(plan.offsets.numpy(), np.concatenate([[0], np.cumsum(counts)]))
    assert np.abs(got["d_weights"]).min() > 0 and np.abs(got["d_hidden"]).max() > 0  # nothing trivially zero


def test_int32_indices_and_run_to_run_determinism():
    x, idx, w, g = _data(50, 24, 16, 6, "random", seed=3)
    first, _ = _run(function, x, idx, w, g, 16)
    again, _ = _run(function, x, idx.astype("int32"), w, g, 16)
    _assert_all_bitwise(first, again, "int32 indices, second run")


@pytest.mark.parametrize("routing, topk", [("random", 3), ("repeated", 4), ("empty_experts", 2)])
def test_against_a_numpy_oracle(routing, topk):
    """Independent of both implementations: rows by NumPy's stable sort (exact), sums in float64."""
    x, idx, w, g = _data(45, 12, 10, topk, routing, seed=5)
    got, _ = _run(function, x, idx, w, g, 10)
    order = np.argsort(idx.reshape(-1), kind="stable")
    np.testing.assert_array_equal(got["rows"], x[order // topk])
    x64, w64, g64 = x.astype(np.float64), w.astype(np.float64), g.astype(np.float64)
    y = x64 * 1.5 + 0.25  # the stand-in expert, per token
    assert_close(got["out"], (w64[:, :, None] * y[:, None, :]).sum(1), "fp32", "oracle")
    assert_close(got["d_hidden"], 1.5 * g64 * w64.sum(1, keepdims=True), "fp32", "oracle")
    assert_close(got["d_weights"], (g64 * y).sum(1, keepdims=True) * np.ones(topk), "fp32", "oracle")


@pytest.mark.parametrize("routing, topk", [("repeated", 4), ("empty_experts", 2)])
def test_the_routing_tables_alone_equal_the_fused_permutes(routing, topk):
    """``kernel.route`` (its own row kernel; the benchmarks and the expert GEMM tests route with it) gives the
    tables ``route_permute`` gives (checked against the reference above), from int32 ids as from int64."""
    x, idx, _, _ = _data(45, 12, 10, topk, routing, seed=4)
    with expect_launches("_route_hist", "_route_scan", "_route_rows", exactly=1):
        tables = kernel.route(paddle.to_tensor(idx.astype("int32")), 10)
    with expect_launches(*ROUTE, exactly=1):
        fused = kernel.route_permute(paddle.to_tensor(x), paddle.to_tensor(idx), 10)
    for name, got, want in zip(("token_rows", "token_srcs", "counts", "offsets"), tables, fused[1:]):
        assert_bitwise(got, want, name)


GPU_SHAPES = [  # the GPU's launch shapes: one token (or two) per copy program, routing blocks smaller than T
    {"route_block_t": 8, "permute_block_t": 1, "permute_block_d": 8, "scan_block_b": 2, "scan_block_e": 4},
    {"route_block_t": 16, "permute_block_t": 2, "permute_block_d": 64, "rows_block_t": 4, "permute_stream": 1},
    {"route_block_t": 4, "permute_block_t": 1, "scan_block_b": 8, "scan_block_e": 256},
]


@pytest.mark.parametrize("setting", GPU_SHAPES, ids=["one_token", "two_tokens", "one_token_wide_scan"])
@pytest.mark.parametrize("tokens, hidden, experts, topk, routing", [CASES[1], CASES[7]], ids=["odd", "repeated"])
def test_gpu_launch_shapes_in_the_interpreter(monkeypatch, setting, tokens, hidden, experts, topk, routing):
    """The launch shapes the GPU takes (the interpreter's own are one program per 64 tokens), run by the interpreter:
    ``_pair_rows`` with copy programs smaller than a routing block, a D loop of several blocks, the scan over
    several expert chunks; rows and tables equal the reference's, ``route`` equals them too."""
    x, idx, _, _ = _data(tokens, hidden, experts, topk, routing, seed=6)
    want, want_plan = reference.permute(paddle.to_tensor(x), paddle.to_tensor(idx), experts)
    monkeypatch.setattr(kernel, "is_interpreted", lambda: False)  # plans only: the kernels stay interpreted
    monkeypatch.setattr(kernel, "TUNE", {**kernel.TUNE, "pdl": 0, **setting})
    out, rows, srcs, counts, offsets = kernel.route_permute(paddle.to_tensor(x), paddle.to_tensor(idx), experts)
    assert_bitwise(out, want, "permuted rows")
    assert_bitwise(counts, want_plan.counts, "counts")
    order = want_plan.order.numpy()
    row_of = np.empty_like(order)
    row_of[order] = np.arange(order.size)
    np.testing.assert_array_equal(rows.numpy(), np.sort(row_of.reshape(tokens, topk), axis=1))
    np.testing.assert_array_equal(srcs.numpy(), order[rows.numpy()])
    for name, got, fused in zip(("token_rows", "token_srcs", "counts", "offsets"), kernel.route(
            paddle.to_tensor(idx), experts), (rows, srcs, counts, offsets)):
        assert_bitwise(got, fused, name)


def test_planted_summation_order_fails_the_bitwise_check():
    """Negative control: the same maths with each token's rows summed in reverse order (still a valid plan) is
    close to the reference but not byte-equal -- so the bitwise test above can fail."""
    x, idx, w, g = _data(64, 16, 8, 3, "random", seed=9)
    want, _ = _run(reference, x, idx, w, g, 8)

    def reverse(plan):
        return plan._replace(token_rows=plan.token_rows.flip([1]), token_srcs=plan.token_srcs.flip([1]))

    got, _ = _run(function, x, idx, w, g, 8, plant=reverse)
    assert_close(got["out"], want["out"], "fp32", "oracle")
    with pytest.raises(AssertionError):
        assert_bitwise(got["out"], want["out"], "reversed summation order")


def test_bad_inputs_raise_naming_the_tensor():
    x = paddle.zeros([4, 8])
    with pytest.raises(ValueError, match=r"`indices` must lie in \[0, 3\), got values in \[0, 3\]"):
        function.permute(x, paddle.to_tensor(np.array([[0, 3]] * 4)), 3)
    with pytest.raises(ValueError, match=r"`indices` must be \[4, k\] int32/int64"):
        function.permute(x, paddle.zeros([4, 2], dtype="float32"), 3)
    rows, plan = function.permute(x, paddle.to_tensor(np.array([[0, 2]] * 4)), 3)
    with pytest.raises(ValueError, match=r"`weights` must be \[4, 2\] float"):
        function.unpermute(rows, paddle.zeros([4, 3]), plan)
    _, ref_plan = reference.permute(x, paddle.to_tensor(np.array([[0, 2]] * 4)), 3)
    with pytest.raises(ValueError, match="`plan` must come from the fused moe_permute"):
        function.unpermute(rows, paddle.zeros([4, 2]), ref_plan)


def test_range_check_left_to_the_caller_reads_nothing_and_stays_in_bounds():
    """``check_range=False`` (the MoE layer checks the ids in its one host read): no read here, ids outside the range
    routed clipped (never out of bounds), and the layer raises naming ``indices`` with the fused permute on."""
    from helpers.transfers import HostTransfers

    from fleet_ext.framework.contracts import MoEOps
    from fleet_ext.layers.moe import GroupedExperts

    x, idx, _, _ = _data(37, 19, 8, 3, "random")
    with HostTransfers() as transfers, expect_launches(*ROUTE, exactly=1):
        rows, plan = function.permute(paddle.to_tensor(x), paddle.to_tensor(idx), 8, check_range=False)
    assert not transfers.to_host, transfers.report()
    want, want_plan = reference.permute(paddle.to_tensor(x), paddle.to_tensor(idx), 8, check_range=False)
    assert_bitwise(rows, want, "rows")
    assert_bitwise(plan.counts, want_plan.counts, "counts")
    bad = idx.copy()
    bad[3, 1], bad[5, 0] = 8, -2
    function.permute(paddle.to_tensor(x), paddle.to_tensor(bad), 8, check_range=False)  # clipped: no crash
    config = load_config(tiny_model(n_routed_experts=8, num_experts_per_tok=3, hidden_size=19))
    layer = GroupedExperts(config, ops=MoEOps(permute=function.permute, unpermute=function.unpermute))
    with pytest.raises(ValueError, match=r"GroupedExperts: `indices` must lie in \[0, 8\), got values in \[-2, 8\]"):
        layer(paddle.to_tensor(x), paddle.to_tensor(bad), paddle.ones([37, 3]))


# -- the layer and the model, switch off vs on -----------------------------------------------------------------
def _layer_run(switches: dict, layer_number: int) -> dict[str, np.ndarray]:
    from fleet_ext.layers.moe import MoELayer
    from fleet_ext.specs.backend import BackendProvider

    config = load_config(tiny_model(**switches))
    paddle.seed(0)
    layer = MoELayer(config, layer_number, ops=BackendProvider(config).moe_ops)
    move_constant_inits(layer, np.random.default_rng(0), 0.3)
    rng = np.random.default_rng(7)
    x = paddle.to_tensor(rng.standard_normal((2, 40, 32)).astype("float32"), stop_gradient=False)
    ids = paddle.to_tensor(rng.integers(0, 64, (2, 40)))
    out = layer(x, ids)
    (out * paddle.to_tensor(rng.standard_normal((2, 40, 32)).astype("float32"))).sum().backward()
    result = {"out": out.numpy(), "d_input": x.grad.numpy()}
    result.update({f"grad:{n}": p.grad.numpy() for n, p in layer.named_parameters() if p.grad is not None})
    return result


def _model_run(switches: dict, plant=None, **overrides) -> dict[str, np.ndarray]:
    return model_step(load_config(tiny_model(**switches), **overrides), seq=136, plant=plant)[1]


def _assert_bytes_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different gradient sets {sorted(a.keys() ^ b.keys())}"
    for key in a:
        assert_bitwise(b[key], a[key], f"{what}: {key}")


@pytest.mark.parametrize("layer_number", [0, 1], ids=["hash_routed", "top_k"])
def test_moe_layer_is_bitwise_equal_with_the_fusion(layer_number):
    reference_run = _layer_run({}, layer_number)
    _assert_bytes_equal(reference_run, _layer_run({}, layer_number), "two unfused runs")
    assert all(np.abs(v).max() > 0 for v in reference_run.values())
    assert {"grad:router.weight", "grad:experts.weight1", "grad:experts.weight2"} <= reference_run.keys()
    with expect_launches(*KERNELS, exactly=1):
        fused = _layer_run(SWITCH, layer_number)
    _assert_bytes_equal(reference_run, fused, "moe_permute_fusion on vs off")


def test_tiny_model_is_bitwise_equal_with_the_fusion():
    reference_run = _model_run({})
    moe_layers = 4  # TINY_MODEL: 4 layers, all MoE (the first hash-routed)
    with expect_launches(*KERNELS, exactly=moe_layers):
        fused = _model_run(SWITCH)
    _assert_bytes_equal(reference_run, fused, "moe_permute_fusion on vs off (whole model)")


def test_planted_weight_difference_fails_the_model_check(monkeypatch):
    """Negative control at model level: one routing weight changed by one fp32 ulp inside the fused path."""
    real = function.unpermute

    def planted(y, weights, plan):
        bumped = paddle.to_tensor(np.nextafter(weights.numpy(), np.float32(np.inf)))
        return real(y, weights + (bumped - weights).detach() * (paddle.arange(weights.shape[0]) == 0)
                    .astype("float32").unsqueeze(-1), plan)

    reference_run = _model_run({})
    monkeypatch.setattr(function, "unpermute", planted)
    fused = _model_run(SWITCH)
    with pytest.raises(AssertionError):
        _assert_bytes_equal(reference_run, fused, "planted")


@pytest.mark.parametrize("policy", [
    {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
    {"recompute_granularity": "selective", "recompute_modules": ["moe_act"]},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
], ids=["moe", "moe_act", "full_uniform"])
def test_tiny_model_is_bitwise_equal_with_the_fusion_under_recompute(policy):
    """The fused path under recompute (the permute re-runs in the recomputed segment) vs the unfused path
    without recompute: loss and every gradient byte-equal."""
    reference_run = _model_run({})
    with expect_launches(*KERNELS):
        fused = _model_run(SWITCH, **policy)
    _assert_bytes_equal(reference_run, fused, f"moe_permute_fusion under recompute {policy}")


# -- gates -----------------------------------------------------------------------------------------------------
def test_switch_without_a_moe_layer_raises_at_config_time():
    dense = tiny_model(moe_n_hash_layers=0, first_k_dense_replace=4, moe_permute_fusion=True)
    with pytest.raises(ValueError, match=r"`moe_permute_fusion` = True can never run: every layer is dense.*Fix: "
                                         r"set `moe_permute_fusion: false`"):
        load_config(dense)


def test_registry_entry_and_resolved_table():
    from fleet_ext.specs.backend import BackendProvider

    entry = FUSIONS["moe_permute_fusion"]
    assert entry.bitwise_equal and entry.load("fused") is function.permute
    assert entry.load("reference") is reference.permute
    provider = BackendProvider(load_config(tiny_model(**SWITCH)))
    assert provider.moe_ops.unpermute is function.unpermute
    row = {r.switch: r for r in provider.resolved}["moe_permute_fusion"]
    assert row.backend == "Triton interpreter (CPU, slow)" and "bitwise equal" in row.reason
    off = BackendProvider(load_config(tiny_model())).moe_ops
    assert off.permute is reference.permute and off.unpermute is reference.unpermute
    assert kernel.is_interpreted()
