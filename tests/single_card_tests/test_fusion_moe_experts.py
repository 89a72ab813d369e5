"""Fused grouped experts (``moe_expert_fusion``) on the CPU (Triton interpreter, fp32).

The op against the independent float64 NumPy oracle (``helpers.oracles.grouped_swiglu_experts``) and, where it
exists, the pure-Paddle reference grouped MLP: output and every gradient (rows, weight1, weight2) within the
documented tolerance (``grouped_experts``: 1e-5 of each tensor's largest entry), over odd sizes, empty experts,
one expert taking every row, k = 1, no clamp, and rows past ``sum(counts)``. Planted differences (a row moved
across a segment boundary, a clamp limit off by 1 %) must fail that check. The weight gradients are byte-identical
run to run. The tiny model, switch off vs on: loss and every gradient within ``grouped_experts_model``; under
recompute the fused model is byte-equal to itself without recompute. Every fused run counts the kernels' launches.

The GPU's load paths run here too (the interpreter executes Triton's tensor descriptors: bounds-checked block
loads, the ragged ones of the weight gradients included): aligned shapes take the TMA-descriptor path of the GPU's
default setting, odd widths the pointer path; both, one program per tile or persistent, give the same bytes. What
differs from the GPU: 16-row tiles, fp32 only, NumPy dots, and the flattened persistent loop runs as a plain loop.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, assert_close, expect_launches, model_step, tiny_model
from helpers import oracles as orc

pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")
pytest.importorskip("torch", reason="the Triton interpreter needs torch (installed by the `test` extra)")

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.ops.moe_experts import function, kernel, kernel_bwd, kernel_tiles  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

FORWARD = {"_grouped_gate_up": 1, "_grouped_rows_mm": 1}  # gate+up with the SwiGLU epilogue; down
BACKWARD = {"_grouped_d_gate_up": 1, "_grouped_rows_mm": 1, "_grouped_d_weight": 2}  # d_h + SwiGLU bwd; d_rows; d_W*
SWITCH = {"moe_expert_fusion": True}


def _counts(kind: str, tokens: int, experts: int, topk: int, rng) -> np.ndarray:
    """Rows per expert of ``tokens`` tokens routed to ``topk`` distinct experts each (as the permute would sort)."""
    if kind == "one_expert_takes_all":
        return np.eye(experts, dtype=np.int64)[1] * tokens * topk
    allowed = np.arange(0, experts, 2) if kind == "empty_experts" else np.arange(experts)
    picks = np.stack([rng.choice(allowed, topk, replace=False) for _ in range(tokens)])
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int64)


CASES = [  # (tokens, D, I, experts, k, routing, limit)
    (40, 32, 16, 4, 2, "random", 1.5),  # the tiny model's widths
    (23, 19, 11, 5, 3, "random", 2.0),  # odd sizes, nothing a multiple of the tiles
    (30, 24, 20, 6, 3, "empty_experts", 1.0),
    (17, 20, 12, 3, 2, "one_expert_takes_all", 1.0),
    (29, 16, 16, 8, 1, "random", 1.0),  # k = 1
    (21, 12, 8, 4, 2, "random", 0.0),  # limit 0: the plain SwiGLU
    (1, 8, 4, 3, 1, "random", 1.0),  # one row
]


def _data(tokens, dim, inter, experts, topk, routing, limit, seed=0):
    """Rows of scale 2 and weights of scale 0.4, so the clamp at ``limit`` is active on some entries."""
    rng = np.random.default_rng(seed)
    counts = _counts(routing, tokens, experts, topk, rng)
    n = int(counts.sum())
    x = (2.0 * rng.standard_normal((n, dim))).astype("float32")
    w1 = (0.4 * rng.standard_normal((experts, dim, 2 * inter))).astype("float32")
    w2 = (0.4 * rng.standard_normal((experts, inter, dim))).astype("float32")
    g = rng.standard_normal((n, dim)).astype("float32")
    return x, counts, w1, w2, g


def _run(fn, x, counts, w1, w2, g, limit, recompute_activation=False) -> dict[str, np.ndarray]:
    """Forward and backward of ``fn`` (the fused op or a reference with its signature) on fresh leaves."""
    xt = paddle.to_tensor(x, stop_gradient=False)
    w1t = paddle.to_tensor(w1, stop_gradient=False)
    w2t = paddle.to_tensor(w2, stop_gradient=False)
    out = fn(xt, paddle.to_tensor(counts), w1t, w2t, limit, recompute_activation)
    (out * paddle.to_tensor(g)).sum().backward()
    return {"out": out.numpy(), "d_rows": xt.grad.numpy(), "d_weight1": w1t.grad.numpy(),
            "d_weight2": w2t.grad.numpy()}


def _oracle(x, counts, w1, w2, g, limit) -> dict[str, np.ndarray]:
    out, d_x, d_w1, d_w2 = orc.grouped_swiglu_experts(x, counts, w1, w2, limit, d_out=g)
    return {"out": out, "d_rows": d_x, "d_weight1": d_w1, "d_weight2": d_w2}


def _assert_within(got: dict, want: dict, name: str, what: str) -> None:
    for key in want:
        assert_close(got[key], want[key], "fp32", name, what=f"{what}: {key}")


def _launches(*passes: dict[str, int]) -> dict[str, int]:
    total: dict[str, int] = {}
    for p in passes:
        for k, v in p.items():
            total[k] = total.get(k, 0) + v
    return total


def _expect(counts: dict[str, int]):
    """expect_launches for each kernel's exact count (one context per kernel, nested)."""
    import contextlib

    stack = contextlib.ExitStack()
    for name, n in counts.items():
        stack.enter_context(expect_launches(name, exactly=n))
    return stack


@pytest.mark.parametrize("tokens, dim, inter, experts, topk, routing, limit", CASES,
                         ids=[f"{c[0]}x{c[1]}-i{c[2]}-e{c[3]}-k{c[4]}-{c[5]}-L{c[6]}" for c in CASES])
def test_forward_and_gradients_match_the_float64_oracle(tokens, dim, inter, experts, topk, routing, limit):
    x, counts, w1, w2, g = _data(tokens, dim, inter, experts, topk, routing, limit)
    with _expect(_launches(FORWARD, BACKWARD)):
        got = _run(function.experts, x, counts, w1, w2, g, limit)
    _assert_within(got, _oracle(x, counts, w1, w2, g, limit), "grouped_experts", "fused vs float64")
    for key, value in got.items():  # no row, and no expert with rows, has an all-zero result
        live = value[counts > 0] if key.startswith("d_weight") else value
        assert (np.abs(live).max(axis=tuple(range(1, live.ndim))) > 0).all(), key
    empty = counts == 0
    assert not got["d_weight1"][empty].any() and not got["d_weight2"][empty].any()
    if limit > 0:  # the clamp was exercised on both halves
        gate_up = np.concatenate([x[s:s + n] @ w1[e] for e, (s, n) in enumerate(zip(np.cumsum(counts) - counts,
                                                                                      counts))])
        assert (gate_up[:, :inter] > limit).any() and (np.abs(gate_up[:, inter:]) > limit).any()


def test_matches_the_pure_paddle_reference():
    """Against task A's reference (``fleet_ext.ops.moe_experts.reference.grouped_mlp``) when it exists."""
    reference = pytest.importorskip("fleet_ext.ops.moe_experts.reference",
                                    reason="the pure-Paddle reference grouped MLP has not landed yet")
    for case in CASES[:4]:
        x, counts, w1, w2, g = _data(*case)
        want = _run(reference.grouped_mlp, x, counts, w1, w2, g, case[-1])
        got = _run(function.experts, x, counts, w1, w2, g, case[-1])
        _assert_within(got, want, "grouped_experts", f"fused vs reference {case}")


def test_planted_differences_fail_the_tolerance_check():
    """Negative controls: the check above passes the fused result and fails (a) one row moved from expert 0 to
    expert 1 (a segment boundary off by one) and (b) the clamp limit off by 1 %."""
    x, counts, w1, w2, g = _data(*CASES[0])
    want = _oracle(x, counts, w1, w2, g, 1.5)
    _assert_within(_run(function.experts, x, counts, w1, w2, g, 1.5), want, "grouped_experts", "unplanted")
    shifted = counts.copy()
    shifted[0] -= 1
    shifted[1] += 1
    with pytest.raises(AssertionError, match="grouped_experts"):
        _assert_within(_run(function.experts, x, shifted, w1, w2, g, 1.5), want, "grouped_experts", "boundary")
    with pytest.raises(AssertionError, match="grouped_experts"):
        _assert_within(_run(function.experts, x, counts, w1, w2, g, 1.5 * 1.01), want, "grouped_experts", "limit")


def test_weight_gradients_are_deterministic_and_recompute_activation_changes_nothing():
    """Two runs byte-identical (every output, the weight gradients in particular); ``recompute_activation`` only
    documents what the op always does (h recomputed from the saved gate_up), so it changes no bit."""
    x, counts, w1, w2, g = _data(*CASES[1])
    first = _run(function.experts, x, counts, w1, w2, g, 2.0)
    for flag in (False, True):
        again = _run(function.experts, x, counts, w1, w2, g, 2.0, recompute_activation=flag)
        for key in first:
            assert_bitwise(again[key], first[key], f"run again (recompute_activation={flag}): {key}")


def test_rows_past_the_counts_get_zeros_and_no_gradient():
    """sum(counts) < N: the rows that belong to no expert give 0 (the oracle's convention), their gradient 0."""
    x, counts, w1, w2, g = _data(*CASES[1])
    x = np.concatenate([x, np.ones((5, x.shape[1]), "float32")])
    g = np.concatenate([g, np.ones((5, g.shape[1]), "float32")])
    got = _run(function.experts, x, counts, w1, w2, g, 2.0)
    _assert_within(got, _oracle(x, counts, w1, w2, g, 2.0), "grouped_experts", "rows past the counts")
    assert not got["out"][-5:].any() and not got["d_rows"][-5:].any()


def test_no_grad_forward_and_inputs_without_gradient():
    x, counts, w1, w2, g = _data(*CASES[0])
    want = _oracle(x, counts, w1, w2, g, 1.5)
    with paddle.no_grad(), expect_launches("_grouped_gate_up", exactly=1):
        out = function.experts(paddle.to_tensor(x), paddle.to_tensor(counts), paddle.to_tensor(w1),
                               paddle.to_tensor(w2), 1.5)
    assert_close(out, want["out"], "fp32", "grouped_experts", what="no_grad out")
    xt, w2t = paddle.to_tensor(x), paddle.to_tensor(w2)  # only weight1 needs a gradient: d_rows is not launched
    w1t = paddle.to_tensor(w1, stop_gradient=False)
    with expect_launches("_grouped_rows_mm", exactly=1), expect_launches("_grouped_d_weight", exactly=1):
        (function.experts(xt, paddle.to_tensor(counts), w1t, w2t, 1.5) * paddle.to_tensor(g)).sum().backward()
    assert xt.grad is None and w2t.grad is None
    assert_close(w1t.grad, want["d_weight1"], "fp32", "grouped_experts", what="d_weight1 alone")


def test_bad_inputs_raise_naming_the_tensor():
    x = paddle.zeros([6, 8])
    w1, w2 = paddle.zeros([3, 8, 10]), paddle.zeros([3, 5, 8])
    counts = paddle.to_tensor(np.array([2, 2, 2]))
    with pytest.raises(ValueError, match=r"`weight2` must be \[3, 5, 8\], got \[3, 4, 8\]"):
        function.experts(x, counts, w1, paddle.zeros([3, 4, 8]), 1.0)
    with pytest.raises(ValueError, match=r"`counts` must be \[3\] int64"):
        function.experts(x, paddle.to_tensor(np.array([2, 2, 2], "int32")), w1, w2, 1.0)
    with pytest.raises(ValueError, match=r"`weight1` must be \[E, 8, 2I\]"):
        function.experts(x, counts, paddle.zeros([3, 7, 10]), w2, 1.0)
    with pytest.raises(ValueError, match=r"`limit` must be >= 0"):
        function.experts(x, counts, w1, w2, -1.0)
    with pytest.raises(ValueError, match=r"`rows` must be float32 on CPU"):
        function.experts(x.astype("float64"), counts, w1.astype("float64"), w2.astype("float64"), 1.0)


def test_load_paths_and_grid_kinds_give_the_same_bytes():
    """Pointer loads and TMA-descriptor loads, one program per tile or a persistent grid, on aligned shapes with
    rows past the counts (zero tiles): every result byte-identical, each run on the path asked for (6 launches
    each); odd widths fall back to the pointer path. (The interpreter runs a flattened persistent loop as a plain
    one: ``persistent`` 1 and 2 are one code path here.) Negative control: a weight one ulp off fails the bitwise
    check."""
    x, counts, w1, w2, g = _data(12, 16, 8, 4, 2, "empty_experts", 1.0)  # D 16, I 8: 16-byte aligned fp32 rows
    x = np.concatenate([x, np.ones((3, x.shape[1]), "float32")])
    g = np.concatenate([g, np.ones((3, g.shape[1]), "float32")])
    runs = {}
    for tma, persistent in ((False, 0), (True, 0), (True, 2)):
        kernel_tiles.PATH_COUNTS.clear()
        with kernel.launch_overrides(tma=tma, persistent=persistent):
            runs[tma, persistent] = _run(function.experts, x, counts, w1, w2, g, 1.0)
        assert {k[1:] for k in kernel_tiles.PATH_COUNTS} == {
            ("tma" if tma else "pointer", kernel_tiles.GRID_KINDS[persistent])}
        assert sum(kernel_tiles.PATH_COUNTS.values()) == 6
    first = runs[False, 0]
    assert not first["out"][-3:].any() and not first["d_rows"][-3:].any()
    for variant, got in runs.items():
        for key in first:
            assert_bitwise(got[key], first[key], f"load path / grid {variant}: {key}")
    kernel_tiles.PATH_COUNTS.clear()
    odd = _data(7, 19, 5, 3, 1, "random", 2.0)  # D 19: rows not 16-byte aligned
    with kernel.launch_overrides(tma=True, persistent=2):
        _run(function.experts, *odd, 2.0)
    assert {k[1] for k in kernel_tiles.PATH_COUNTS} == {"pointer"}
    w1_off = w1.copy()
    w1_off[0, 0, 0] = np.nextafter(w1_off[0, 0, 0], np.float32(np.inf))
    planted = _run(function.experts, x, counts, w1_off, w2, g, 1.0)
    with pytest.raises(AssertionError):
        assert_bitwise(planted["out"], first["out"], "planted: one weight one ulp off")


def test_d_gate_up_epilogue_in_quarters_gives_the_halves_bytes(monkeypatch):
    """From 256 columns a tile's d_gate_up epilogue runs in column quarters (else halves): ``gate_up_backward``'s
    d_gate_up and h are the same bytes as with 16-column tiles (halves), with an empty expert. ``d_out`` and ``W2``
    are multiples of 1/8 in [-1, 1], so ``d_h = d_out @ W2^T`` is exact in fp32 whatever order the interpreter's
    matmul sums in (its BLAS's order can depend on the tile width: on some machines a 16-column and a 256-column
    product differ in the last bit); the epilogue is what is compared. Negative control: quarters stored in the
    wrong order (the middle two swapped) fail the bitwise check."""
    import torch

    _, counts, _, _, _ = _data(21, 16, 256, 3, 2, "empty_experts", 1.0)
    rng = np.random.default_rng(5)
    n, dim, inter, experts = int(counts.sum()), 16, 256, len(counts)
    d_out = torch.from_numpy((rng.integers(-8, 9, (n, dim)) / 8).astype("float32"))
    w2 = torch.from_numpy((rng.integers(-8, 9, (experts, inter, dim)) / 8).astype("float32"))
    gate_up = torch.from_numpy((2.0 * rng.standard_normal((n, 2 * inter))).astype("float32"))
    counts_t = torch.from_numpy(counts)

    def run():
        return dict(zip(("d_gate_up", "h"), kernel_bwd.gate_up_backward(d_out, counts_t, w2, gate_up, 1.0)))

    halves = run()
    monkeypatch.setattr(kernel, "INTERPRETER_TILE", (16, 256, 16, 1, 4, 1))
    quarters = run()
    for key in halves:
        assert_bitwise(quarters[key].numpy(), halves[key].numpy(), f"d_gate_up epilogue quarters: {key}")
    split = kernel_bwd._halves.fn
    calls = []

    def swapped(t, bm, w):  # the second split of the first half returns its parts swapped
        calls.append(w)
        a, b = split(t, bm, w)
        return (b, a) if len(calls) == 2 else (a, b)

    monkeypatch.setattr(kernel_bwd, "_halves", swapped)
    planted = run()
    with pytest.raises(AssertionError):
        assert_bitwise(planted["d_gate_up"].numpy(), halves["d_gate_up"].numpy(), "planted: quarters swapped")


def test_the_warp_specialised_kernels_never_run_here_and_forcing_them_names_why(monkeypatch):
    """The Gluon gate+up and weight gradient need a Hopper GPU: here ``auto`` keeps the Triton kernels (their
    launches counted), and forcing either (``'gluon'``) raises naming why (their results are tested on the H200:
    tests/gpu/test_moe_experts_gpu.py)."""
    from fleet_ext.ops.moe_experts import kernel_bwd

    x, counts, w1, w2, g = _data(12, 16, 8, 4, 2, "random", 1.0)
    with expect_launches("_grouped_gate_up", exactly=1), expect_launches("_grouped_d_weight", exactly=2), \
            expect_launches("_gate_up_ws_kernel", "_d_weight_ws_kernel", exactly=0):
        _run(function.experts, x, counts, w1, w2, g, 1.0)
    assert kernel.gate_up_ws_fits(paddle.to_tensor(x), paddle.to_tensor(w1)) == "not a Hopper GPU (sm90)"
    for module, switch in ((kernel, "GATE_UP_KERNEL"), (kernel_bwd, "D_WEIGHT_KERNEL")):
        with monkeypatch.context() as patch:
            patch.setattr(module, switch, "gluon")
            # the weight gradient's error comes through Paddle's backward, which re-raises it as an OSError
            with pytest.raises((ValueError, OSError), match=switch + r" = 'gluon' cannot run here: not a Hopper GPU"):
                _run(function.experts, x, counts, w1, w2, g, 1.0)


# -- the tiny model, switch off vs on --------------------------------------------------------------------------
# 2 x 38 tokens, top-2 of 4 experts: ~38 rows an expert, several 16-row tiles with a ragged last one (the interpreted
# kernels' time grows with the rows; every attention kind has compressed entries with HCA pooling 8 tokens)
SEQ = 38


def _model_run(switches: dict, **overrides) -> dict[str, np.ndarray]:
    return model_step(load_config(tiny_model(**switches, hca_compress_ratio=8), **overrides), seq=SEQ)[1]


MOE_LAYERS = 4  # TINY_MODEL: 4 layers, all MoE (the first hash-routed)


@pytest.fixture(scope="module")
def fused_run() -> dict[str, np.ndarray]:
    """The tiny model with the switch on, run once for the two tests below; its launches counted (every MoE layer
    runs each kernel of the forward and the backward its fixed number of times)."""
    with _expect({k: v * MOE_LAYERS for k, v in _launches(FORWARD, BACKWARD).items()}):
        return _model_run(SWITCH)


def test_tiny_model_matches_the_unfused_path_within_tolerance(fused_run):
    reference_run = _model_run({})
    fused = fused_run
    assert fused.keys() == reference_run.keys()
    assert sum(k.endswith(("experts.weight1", "experts.weight2")) for k in fused) == 2 * MOE_LAYERS
    for key in reference_run:
        assert_close(fused[key], reference_run[key], "fp32", "grouped_experts_model", what=f"switch on vs off: {key}")


def test_tiny_model_under_recompute_is_bitwise_equal_to_no_recompute(fused_run):
    """The fused path is deterministic, so recomputing it (``moe``: the whole experts block re-runs; ``moe_act``)
    must leave the loss and every gradient byte-equal to the fused run without recompute."""
    plain = fused_run
    for policy in ({"recompute_granularity": "selective", "recompute_modules": ["moe"]},
                   {"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}):
        with expect_launches("_grouped_gate_up", min=MOE_LAYERS):
            again = _model_run(SWITCH, **policy)
        assert again.keys() == plain.keys()
        for key in plain:
            assert_bitwise(again[key], plain[key], f"recompute {policy['recompute_modules']}: {key}")


# -- gates and the table ---------------------------------------------------------------------------------------
def test_switch_without_a_moe_layer_raises_at_config_time():
    dense = tiny_model(moe_n_hash_layers=0, first_k_dense_replace=4, **SWITCH)
    with pytest.raises(ValueError, match=r"`moe_expert_fusion` = True can never run: every layer is dense.*Fix: "
                                         r"set `moe_expert_fusion: false`"):
        load_config(dense)


def test_registry_entry_and_resolved_table():
    from fleet_ext.specs.backend import BackendProvider

    entry = FUSIONS["moe_expert_fusion"]
    assert entry.landed and not entry.bitwise_equal and entry.load("fused") is function.experts
    assert "1e-5" in entry.tolerance and "deterministic" in entry.tolerance
    provider = BackendProvider(load_config(tiny_model(**SWITCH)))
    assert provider.moe_ops.experts is function.experts
    row = {r.switch: r for r in provider.resolved}["moe_expert_fusion"]
    assert row.backend == "Triton interpreter (CPU, slow)" and "not bitwise" in row.reason
    assert BackendProvider(load_config(tiny_model())).moe_ops.experts is None
    assert kernel.is_interpreted()
