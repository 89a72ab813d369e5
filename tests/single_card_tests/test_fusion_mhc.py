"""Fused mHC (``use_fused_mhc``) vs the pure-Paddle reference (CPU, Triton interpreter, fp32).

The ops (``fleet_ext.ops.mhc``): the pre op (projection, RMS statistics, gates, Sinkhorn, collapse), the
combine and the head, chained as a layer chains them, forward outputs and the gradients of the streams, the
block output and every parameter against Paddle autograd of the reference within the ``mhc_fused`` tolerance
(the kernels sum in other orders and normalise after the projection, so not bitwise; kernel.py), and the
forward against the float64 oracle. Shapes cover n = 4 (V4), n = 3 (padded n x n tiles), n = 1, D off the tile
widths, 1 / 3 / 20 Sinkhorn iterations and a large eps. Planted bugs (one Sinkhorn iteration short, the mixing
matrix transposed) fail the tolerance. Two runs are byte-identical (no atomics), also with the Sinkhorn backward's
states recomputed instead of stored. The tiny model with mHC (4
streams): switch on vs off within ``mhc_fused_model``, every kernel counted; under recompute the fused model is
byte-equal to itself without recompute.
"""

from __future__ import annotations

import functools

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
from fleet_ext.ops import launch  # noqa: E402
from fleet_ext.ops.mhc import function, kernel, reference  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

SWITCH = {"use_fused_mhc": True}
PRE_KERNELS = ("_mhc_proj_fwd", "_mhc_pre_fwd", "_mhc_pre_bwd", "_mhc_dx_bwd", "_mhc_params_bwd")


def _inputs(b, s, n, d, seed):
    rng = np.random.default_rng(seed)
    nout = (2 + n) * n
    arrays = {
        "streams": rng.standard_normal((b, s, n, d)),
        "block_out": rng.standard_normal((b, s, d)),
        "fn": rng.standard_normal((nout, n * d)) * 0.1,
        "base": rng.standard_normal(nout) * 0.5,
        "scale": np.array([0.7, 1.3, 2.0]),
        "head_fn": rng.standard_normal((n, n * d)) * 0.1,
        "head_base": rng.standard_normal(n) * 0.5,
        "head_scale": np.array([1.7]),
    }
    cotangents = {"post": rng.standard_normal((b, s, n)), "comb": rng.standard_normal((b, s, n, n)),
                  "collapsed": rng.standard_normal((b, s, d)), "mixed": rng.standard_normal((b, s, n, d)),
                  "head": rng.standard_normal((b, s, d))}
    as32 = {k: v.astype("float32") for k, v in arrays.items()}
    return as32, {k: v.astype("float32") for k, v in cotangents.items()}


def _run(ops, arrays, cotangents, iterations, eps, norm_eps=1e-6):
    """pre -> combine (with the collapsed input standing in for the block: f = collapsed * block_out) and the
    head on the streams; one loss over every output; every input's gradient."""
    t = {k: paddle.to_tensor(v, stop_gradient=False) for k, v in arrays.items()}
    post, comb, collapsed = ops.mhc_pre(t["streams"], t["fn"], t["base"], t["scale"], iterations, eps, norm_eps)
    mixed = ops.mhc_combine(t["streams"], collapsed * t["block_out"], post, comb)
    head = ops.mhc_head(t["streams"], t["head_fn"], t["head_base"], t["head_scale"], eps, norm_eps)
    outputs = {"post": post, "comb": comb, "collapsed": collapsed, "mixed": mixed, "head": head}
    loss = sum((outputs[k] * paddle.to_tensor(cotangents[k])).sum() for k in outputs)
    loss.backward()
    result = {k: v.numpy() for k, v in outputs.items()}
    result.update({f"grad:{k}": v.grad.numpy() for k, v in t.items()})
    return result


CASES = [  # (b, s, n, D, iterations, eps)
    (2, 5, 4, 32, 20, 1e-6),  # V4's n and iterations
    (1, 7, 3, 24, 3, 0.05),  # n x n tiles padded to 4 x 4, D off the tile width, eps visible
    (2, 3, 1, 16, 1, 1e-6),  # one stream, one Sinkhorn pass
    (1, 9, 4, 40, 20, 1e-6),  # D over one tile (interpreter tiles: next power of two)
]
IDS = [f"b{c[0]}s{c[1]}-n{c[2]}-D{c[3]}-it{c[4]}-eps{c[5]}" for c in CASES]


@pytest.mark.parametrize("b, s, n, d, iterations, eps", CASES, ids=IDS)
def test_ops_match_the_reference_within_the_tolerance(b, s, n, d, iterations, eps):
    arrays, cot = _inputs(b, s, n, d, seed=b * 100 + s * 10 + n)
    want = _run(reference, arrays, cot, iterations, eps)
    # The pre op: two forward kernels (split projection, then gates + collapse) and three backward ones (gates,
    # streams + parameter splits, parameter sums); the head is the pre kernels again; the combine one each way.
    with expect_launches(*PRE_KERNELS, exactly=2), expect_launches("_mhc_combine_fwd", "_mhc_combine_bwd", exactly=1):
        got = _run(function, arrays, cot, iterations, eps)
    assert want.keys() == got.keys()
    for key in want:
        assert np.abs(want[key]).max() > 1e-3, f"{key}: the reference is ~0, the comparison would be vacuous"
        entry = "mhc_fused_gain" if key.endswith("scale") else "mhc_fused"
        assert_close(got[key], want[key], "fp32", entry, what=key)
    # The forward against the float64 oracle (independent of both).
    post, comb, y = orc.hc_pre(arrays["streams"], arrays["fn"], arrays["base"], arrays["scale"], iterations, eps, 1e-6)
    for key, oracle in (("post", post), ("comb", comb), ("collapsed", y)):
        assert_close(got[key], oracle, "fp32", "oracle", what=f"{key} vs float64")
    head = orc.hc_head(arrays["streams"], arrays["head_fn"], arrays["head_base"], arrays["head_scale"], eps, 1e-6)
    assert_close(got["head"], head, "fp32", "oracle", what="head vs float64")


def test_split_geometries_match_the_reference(monkeypatch):
    """The GPU's geometry on the interpreter: the projection split over K, the streams' gradient and the parameter
    gradient split over tokens (several splits, a ragged last one; the streams' gradient with two token tiles in a
    split, so its prefetch of the next tile's inputs runs), small tiles (the combine backward's too: a
    ragged last token block, channel tiles of two 8-wide vectors, a partial last tile): every output and gradient
    within the tolerance of the reference, as with one split."""
    monkeypatch.setattr(kernel, "TUNE", {"proj": {"SPLITS": 3, "BT": 16, "BK": 16}, "pre_fwd": {"BT": 16, "BD": 16},
                                         "pre_bwd": {"BT": 16, "BD": 16}, "dx": {"SPLITS": 2, "BT": 16, "BD": 16},
                                         "params": {"BLOCK": 64, "BB": 2},
                                         "combine_bwd": {"BT": 16, "BD": 16, "V": 8}})
    arrays, cot = _inputs(2, 19, 4, 40, seed=11)  # 38 tokens: splits of 16, 16 and 6 (dx: 32 and 6); K = 160
    want = _run(reference, arrays, cot, 20, 1e-6)
    with expect_launches(*PRE_KERNELS, exactly=2):
        got = _run(function, arrays, cot, 20, 1e-6)
    for key in want:
        assert_close(got[key], want[key], "fp32", "mhc_fused_gain" if key.endswith("scale") else "mhc_fused", what=key)


def test_planted_bugs_fail_the_tolerance(monkeypatch):
    """Negative control: one Sinkhorn iteration short, and the mixing matrix transposed in the combine (forward:
    the combined streams fail; the backward alone: the streams' gradient fails), and the streams' order reversed
    in the combine backward alone (its ``g_comb`` reduction: the gradient of ``base`` fails)."""
    arrays, cot = _inputs(2, 5, 4, 32, seed=7)
    want = _run(reference, arrays, cot, 20, 1e-6)
    with expect_launches("_mhc_pre_fwd", min=1):
        short = _run(function, arrays, cot, 19, 1e-6)
    with pytest.raises(AssertionError, match="outside fp32 'mhc_fused'"):
        assert_close(short["comb"], want["comb"], "fp32", "mhc_fused", what="planted: 19 iterations")
    real = kernel.combine_forward
    monkeypatch.setattr(kernel, "combine_forward", lambda x, f, post, comb: real(x, f, post, comb.transpose([0, 2, 1])
                                                                                 .contiguous()))
    with expect_launches("_mhc_combine_fwd", exactly=1):
        transposed = _run(function, arrays, cot, 20, 1e-6)
    with pytest.raises(AssertionError, match="outside fp32 'mhc_fused'"):
        assert_close(transposed["mixed"], want["mixed"], "fp32", "mhc_fused", what="planted: comb transposed")
    monkeypatch.setattr(kernel, "combine_forward", real)
    real_bwd = kernel.combine_backward
    for key, plant in (("grad:streams", lambda x, comb: (x, comb.transpose([0, 2, 1]).contiguous())),
                       ("grad:base", lambda x, comb: (paddle.flip(x, axis=[1]), comb))):
        monkeypatch.setattr(kernel, "combine_backward", lambda x, f, post, comb, d_out, plant=plant: real_bwd(
            plant(x, comb)[0], f, post, plant(x, comb)[1], d_out))
        with expect_launches("_mhc_combine_bwd", exactly=1):
            planted = _run(function, arrays, cot, 20, 1e-6)
        assert_close(planted["mixed"], want["mixed"], "fp32", "mhc_fused", what="forward untouched")
        with pytest.raises(AssertionError, match="outside fp32 'mhc_fused'"):
            assert_close(planted[key], want[key], "fp32", "mhc_fused", what=f"planted in the combine backward: {key}")


def test_two_runs_are_byte_identical_and_no_grad_runs_the_same_forward(monkeypatch):
    """Run to run the same bytes; the Sinkhorn backward's states stored to scratch (``STATES`` 1) or recomputed (0)
    instead of kept in registers (2, the default): the same bytes too; the forward without autograd: the same bytes
    as with it."""
    arrays, cot = _inputs(2, 6, 4, 32, seed=3)
    with expect_launches("_mhc_pre_bwd", "_mhc_dx_bwd", "_mhc_params_bwd", "_mhc_combine_bwd", min=2):
        first = _run(function, arrays, cot, 20, 1e-6)
        second = _run(function, arrays, cot, 20, 1e-6)
    for key in first:
        assert_bitwise(second[key], first[key], key)
    assert kernel._config("pre_bwd", 4, 32)["STATES"] == 2
    for states in (1, 0):
        monkeypatch.setattr(kernel, "TUNE", {"pre_bwd": {"STATES": states}})
        with expect_launches("_mhc_pre_bwd", min=2):
            other = _run(function, arrays, cot, 20, 1e-6)
        for key in first:
            assert_bitwise(other[key], first[key], f"Sinkhorn states {('recomputed', 'stored')[states]}: {key}")
    t = {k: paddle.to_tensor(v) for k, v in arrays.items()}
    with paddle.no_grad(), expect_launches("_mhc_proj_fwd", "_mhc_pre_fwd", "_mhc_combine_fwd", exactly=1):
        post, comb, collapsed = function.mhc_pre(t["streams"], t["fn"], t["base"], t["scale"], 20, 1e-6, 1e-6)
        mixed = function.mhc_combine(t["streams"], collapsed * t["block_out"], post, comb)
    for key, value in (("post", post), ("comb", comb), ("collapsed", collapsed), ("mixed", mixed)):
        assert_bitwise(value.numpy(), first[key], f"no_grad {key}")


def test_repeat_calls_reuse_their_launch_plans(monkeypatch):
    """The launchers check their arguments and plan their launches once per layout (host cost, issue 16 §4): a
    repeat step builds no plan; another ``TUNE`` builds new ones (the plans depend on it) and a bad argument of a
    new layout still raises (the checks run on a miss), leaving no plan behind."""
    arrays, cot = _inputs(1, 5, 4, 32, seed=4)
    caches = [launch.plan_cache(name) for name in ("mhc pre", "mhc pre (backward)", "mhc combine")]
    _run(function, arrays, cot, 3, 1e-6)
    built = [c.builds for c in caches]
    with expect_launches("_mhc_pre_fwd", "_mhc_pre_bwd", "_mhc_combine_fwd", "_mhc_combine_bwd", min=1):
        _run(function, arrays, cot, 3, 1e-6)
    assert [c.builds for c in caches] == built
    monkeypatch.setattr(kernel, "TUNE", {"pre_bwd": {"STATES": 1}})
    _run(function, arrays, cot, 3, 1e-6)
    assert [c.builds for c in caches] == [b + 2 for b in built]  # pre and head; the combine both ways
    sizes = [len(c) for c in caches]
    streams = paddle.zeros([1, 5, 4, 32])
    with pytest.raises(ValueError, match=r"`base` must be float32 \[24\]"):
        function.mhc_pre(streams, paddle.zeros([24, 128]), paddle.zeros([23]), paddle.ones([3]), 3, 1e-6, 1e-6)
    assert [len(c) for c in caches] == sizes


@pytest.mark.parametrize("iterations", [3, 20])
def test_split_pre_backward_gives_the_same_bytes(monkeypatch, iterations):
    """The pre backward split (``gates`` SPLIT: ``_mhc_gates_bwd`` runs the first pass over the streams and the
    Sinkhorn backward side by side, ``_mhc_pre_bwd`` the rest), in the pre op and the head, the pass with and
    without its prefetch of the next channel tile, Sinkhorn blocks of another size than the pass's: the same sums in
    the same order, so every output and gradient byte-equal to the one-kernel pre backward (three channel tiles, a
    partial last one; ragged token blocks; Sinkhorn programs interleaved with the pass's); with ``LANES`` within the
    tolerance of the reference."""
    arrays, cot = _inputs(1, 19, 4, 40, seed=5)
    monkeypatch.setattr(kernel, "TUNE", {"pre_bwd": {"BT": 16, "BD": 16}})
    first = _run(function, arrays, cot, iterations, 1e-6)
    for gates in ({"BT": 16, "BD": 16, "SINKHORN_BT": 16},
                  {"BT": 8, "BD": 16, "PREFETCH": 1, "SINKHORN_BT": 4},
                  {"BT": 4, "BD": 16, "SINKHORN_BT": 8, "INTERLEAVE": 1}):
        tune = {"pre_bwd": {"BT": 16, "BD": 16}, "gates": {"SPLIT": 1, **gates}}
        monkeypatch.setattr(kernel, "TUNE", tune)
        with expect_launches("_mhc_gates_bwd", "_mhc_pre_bwd", exactly=2):  # the pre op and the head
            got = _run(function, arrays, cot, iterations, 1e-6)
        for key in first:
            assert_bitwise(got[key], first[key], f"{tune}: {key}")
    # LANES (the GPU default): each channel lane sums over the tiles, the lanes are added at the end: another order
    want = _run(reference, arrays, cot, iterations, 1e-6)
    monkeypatch.setattr(kernel, "TUNE", {"gates": {"SPLIT": 1, "BT": 8, "BD": 16, "LANES": 1, "PREFETCH": 1}})
    with expect_launches("_mhc_gates_bwd", "_mhc_pre_bwd", exactly=2):
        got = _run(function, arrays, cot, iterations, 1e-6)
    for key in want:
        assert_close(got[key], want[key], "fp32", "mhc_fused_gain" if key.endswith("scale") else "mhc_fused", what=key)


def test_bad_inputs_raise_naming_the_tensor():
    streams = paddle.zeros([2, 3, 4, 8])
    fn, base, scale = paddle.zeros([24, 32]), paddle.zeros([24]), paddle.ones([3])
    with pytest.raises(ValueError, match=r"mhc_pre: `streams` must be a \[b, s, n, D\] float paddle.Tensor"):
        function.mhc_pre(streams[0], fn, base, scale, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"`fn` must be float32 \[24, 32\]"):
        function.mhc_pre(streams, paddle.zeros([24, 30]), base, scale, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"`scale` must be float32 \[3\]"):
        function.mhc_pre(streams, fn, base, paddle.ones([1]), 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"mhc_combine: `comb` must be \[2, 3, 4, 4\]"):
        function.mhc_combine(streams, paddle.zeros([2, 3, 8]), paddle.zeros([2, 3, 4]), paddle.zeros([2, 3, 4]))
    with pytest.raises(ValueError, match=r"`post` must be float32 \[6, 4\]"):
        function.mhc_combine(streams, paddle.zeros([2, 3, 8]), paddle.zeros([2, 3, 4], "float64"),
                             paddle.zeros([2, 3, 4, 4]))
    with pytest.raises(ValueError, match=r"`streams` must be float32 on CPU"):
        function.mhc_head(streams.astype("float64"), paddle.zeros([4, 32]), paddle.zeros([4]), paddle.ones([1]),
                          1e-6, 1e-6)


def test_fn_pieces_rebuild_fn_to_fp32_accuracy():
    """``_mhc_fn_pieces`` (the Gluon projection's operand; a Triton kernel, here in the interpreter on torch tensors):
    hi + mid + lo equals fn within 2^-24 of each entry (three bf16 pieces carry fp32's 24 bits), every piece is a
    bf16 value, rows past NOUT are zero; dropping the lowest piece fails the bound (negative control)."""
    import torch

    w = torch.tensor(np.random.default_rng(0).standard_normal((24, 200)) * 0.1, dtype=torch.float32)
    with expect_launches("_mhc_fn_pieces", exactly=1):
        p = kernel.fn_pieces(w, 32, torch.zeros(1, dtype=torch.bfloat16))
    assert p.dtype == torch.bfloat16 and list(p.shape) == [3, 32, 200]
    f, want = p.double(), w.double()

    def rebuilt_within_fp32(pieces) -> bool:
        return bool(((pieces.sum(0)[:24] - want).abs() <= 2**-24 * want.abs()).all())

    assert rebuilt_within_fp32(f)
    assert bool((f[:, 24:] == 0).all())
    assert not rebuilt_within_fp32(f[:2])


def test_forcing_the_gluon_kernels_where_they_cannot_run_raises(monkeypatch):
    """``kernel.GLUON = "gluon"`` (Hopper only: ``kernel_proj_gluon.py``, ``kernel_dx_gluon.py``) raises naming why
    it cannot run here; "auto" falls back to the Triton kernels (the launch counts of the tests above)."""
    arrays, cot = _inputs(1, 5, 4, 32, seed=3)
    monkeypatch.setattr(kernel, "GLUON", "gluon")
    with pytest.raises(ValueError, match=r"mhc_pre: GLUON = 'gluon' cannot run here: the Triton interpreter"):
        _run(function, arrays, cot, 20, 1e-6)


# -- the tiny model, switch on vs off ---------------------------------------------------------------------------
SEQ = 40  # the interpreted Sinkhorn backward is the slow part on CPU: a short sequence (one token block per op)


def _model_run(switches: dict, **overrides) -> dict[str, np.ndarray]:
    config = load_config(tiny_model(**switches), **overrides)
    assert config.model.enable_hyper_connections and config.model.num_residual_streams == 4
    return model_step(config, seq=SEQ)[1]  # (it moves the mHC base / scale and norm gains off 0 / 1)


_REFERENCE: dict[str, dict] = {}


def _unfused() -> dict[str, np.ndarray]:
    if "run" not in _REFERENCE:
        _REFERENCE["run"] = _model_run({})
    return _REFERENCE["run"]


def _fused() -> dict[str, np.ndarray]:
    """The switch-on run, once per session (the interpreted kernels are what makes the model tests slow)."""
    if "fused" not in _REFERENCE:
        _REFERENCE["fused"] = _model_run(SWITCH)
    return _REFERENCE["fused"]


def test_tiny_model_matches_the_unfused_model_within_the_tolerance():
    want = _unfused()
    layers = tiny_model()["num_hidden_layers"]
    # Two HyperConnections and two combines per layer; the head's collapse is the pre kernel too.
    _REFERENCE.pop("fused", None)  # counted here: this test runs the fused model itself
    with expect_launches(*PRE_KERNELS, exactly=2 * layers + 1), \
            expect_launches("_mhc_combine_fwd", "_mhc_combine_bwd", exactly=2 * layers):
        got = _fused()
    assert want.keys() == got.keys()
    mhc_grads = [k for k in want if "mhc_" in k]
    assert len(mhc_grads) == 3 * (2 * layers + 1) and all(np.abs(want[k]).max() > 0 for k in mhc_grads)
    for key in want:
        assert_close(got[key], want[key], "fp32", "mhc_fused_model", what=key)


def test_planted_difference_fails_the_model_check(monkeypatch):
    """Negative control at model level: the fused pre op one Sinkhorn iteration short."""
    real = function.mhc_pre

    @functools.wraps(real)  # the provider takes mhc_head / mhc_combine from this function's module
    def planted(streams, fn, base, scale, iterations, eps, norm_eps):
        return real(streams, fn, base, scale, iterations - 1, eps, norm_eps)

    monkeypatch.setattr(function, "mhc_pre", planted)
    with expect_launches("_mhc_pre_fwd", min=1):
        planted = _model_run(SWITCH)
    with pytest.raises(AssertionError, match="outside|>"):
        for key, value in _unfused().items():
            assert_close(planted[key], value, "fp32", "mhc_fused_model", what=key)


def test_tiny_model_under_recompute_is_bitwise_equal_to_no_recompute():
    """Recompute re-runs the fused kernels on the same inputs: the same bytes (deterministic kernels)."""
    fused = _fused()
    for policy in ({"recompute_granularity": "selective", "recompute_modules": ["mhc"]},
                   {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2}):
        with expect_launches("_mhc_pre_fwd", min=2 * tiny_model()["num_hidden_layers"] + 2):  # re-run forwards
            again = _model_run(SWITCH, **policy)
        assert fused.keys() == again.keys()
        for key in fused:
            assert_bitwise(again[key], fused[key], f"{policy}: {key}")


# -- registry, provider and gates ------------------------------------------------------------------------------
def test_registry_entry_and_resolved_table():
    from fleet_ext.layers.mhc import REFERENCE_OPS
    from fleet_ext.specs.backend import BackendProvider

    entry = FUSIONS["use_fused_mhc"]
    assert entry.landed and not entry.bitwise_equal and "mhc_fused" in entry.tolerance
    assert entry.load("fused") is function.mhc_pre and entry.load("reference") is reference.mhc_pre
    ops = BackendProvider(load_config(tiny_model(**SWITCH))).mhc_ops
    assert (ops.pre, ops.head, ops.combine) == (function.mhc_pre, function.mhc_head, function.mhc_combine)
    provider = BackendProvider(load_config(tiny_model()))
    assert provider.mhc_ops == REFERENCE_OPS
    row = {r.switch: r for r in BackendProvider(load_config(tiny_model(**SWITCH))).resolved}["use_fused_mhc"]
    assert row.backend == "Triton interpreter (CPU, slow)" and "not bitwise" in row.reason


def test_the_switch_without_hyper_connections_raises_at_config_time():
    with pytest.raises(ValueError, match=r"`use_fused_mhc` = True can never run: enable_hyper_connections is false"
                                         r".*Fix: set `use_fused_mhc: false`"):
        load_config(tiny_model(enable_hyper_connections=False, **SWITCH))
