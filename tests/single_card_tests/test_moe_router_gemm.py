"""The router's logits GEMM (``moe_router.kernel_gemm``, ``moe_router_logits_fusion``) on the CPU interpreter.

The kernels (logits, d_x, d_w with token splits) against float64 for fp32 hidden states (IEEE products) and for
bf16 ones through the bf16-pieces path the GPU takes (``PIECES`` forced: the interpreter multiplies the pieces in
fp32), by ``helpers.fp32_gemm``'s bounds, which a bf16-accurate product fails. The Paddle op (bf16 and fp32 hidden
states) runs the kernels (launch counters) and matches the reference's fp32 GEMM and its autograd, computing only
the gradients asked for; the router picks the same experts with it. The tiny model with the switch on vs off within
the ``router_logits_model`` tolerance (a planted 1e-3 error fails it), byte-equal to itself under full recompute;
the registry row, the resolved table and the gate. Bad inputs raise naming the tensor. GPU accuracy and speed:
``tests/gpu/test_moe_router_gemm_gpu.py``,
``scripts/bench/bench_moe.py --sections router_gemm``.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, assert_close, expect_launches, model_step, tiny_model

torch = pytest.importorskip("torch", reason="the Triton interpreter needs torch (installed by the `test` extra)")
pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")

from helpers.fp32_gemm import assert_fp32_accurate, assert_one_rounding, magnitudes  # noqa: E402

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.ops.moe_router import function, kernel_gemm, reference  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

KERNELS = ("_router_logits", "_router_dx", "_router_dw")


def _torch_inputs(tokens, experts, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    w = torch.randn(experts, dim, generator=gen) * 0.1
    d_logits = torch.randn(tokens, experts, generator=gen)
    return x, w, d_logits


@pytest.mark.parametrize("pieces,dtype", [(False, torch.float32), (True, torch.bfloat16)], ids=["fp32", "bf16_pieces"])
@pytest.mark.parametrize("tokens,experts,dim", [(37, 20, 48), (300, 16, 16)], ids=["odd", "token_splits"])
def test_kernels_are_fp32_accurate(monkeypatch, pieces, dtype, tokens, experts, dim):
    monkeypatch.setattr(kernel_gemm, "PIECES", pieces)
    x, w, d_logits = _torch_inputs(tokens, experts, dim, dtype)
    splits = ("_sum_splits",) if tokens == 300 else ()  # 300 tokens: the weight gradient's token splits
    with expect_launches(*KERNELS, *splits, exactly=1), expect_launches("_split3", exactly=3 if pieces else 0):
        logits = kernel_gemm.logits(x, w)
        d_x, d_w = kernel_gemm.logits_backward(d_logits, x, w)
    xd, wd, dld = x.double(), w.double(), d_logits.double()
    assert_fp32_accurate(logits, xd @ wd.t(), x.float() @ w.t(), magnitudes(x, w.t()), "logits")
    assert_fp32_accurate(d_w, dld.t() @ xd, d_logits.t() @ x.float(), magnitudes(d_logits.t(), x), "d_w")
    assert d_x.dtype == dtype
    check = assert_one_rounding if pieces else assert_fp32_accurate
    check(d_x, dld @ wd, d_logits @ w, magnitudes(d_logits, w), "d_x")


def test_no_tokens():
    """A rank's empty share of the tokens: empty logits and d_x, a zero weight gradient (written, not left over)."""
    x, w, d_logits = _torch_inputs(0, 8, 16, torch.float32)
    with expect_launches("_router_dw", exactly=1), expect_launches("_router_logits", "_router_dx", exactly=0):
        assert kernel_gemm.logits(x, w).shape == (0, 8)
        d_x, d_w = kernel_gemm.logits_backward(d_logits, x, w)
    assert d_x.shape == (0, 16) and torch.equal(d_w, torch.zeros(8, 16))


def test_the_accuracy_checks_catch_bf16_products():
    """Test the test: products that keep bf16 accuracy (W or d_logits not split) fail the checks above."""
    x, w, d_logits = _torch_inputs(64, 32, 256, torch.bfloat16, seed=1)
    w16 = w.bfloat16().float()
    with pytest.raises(AssertionError, match="logits"):
        assert_fp32_accurate(x.float() @ w16.t(), x.double() @ w.double().t(), x.float() @ w.t(),
                             magnitudes(x, w.t()), "logits")
    with pytest.raises(AssertionError, match="d_w"):
        assert_fp32_accurate(d_logits.bfloat16().float().t() @ x.float(), d_logits.double().t() @ x.double(),
                             d_logits.t() @ x.float(), magnitudes(d_logits.t(), x), "d_w")
    with pytest.raises(AssertionError, match="d_x"):
        assert_one_rounding((d_logits.bfloat16().float() @ w16).bfloat16(), d_logits.double() @ w.double(),
                            d_logits @ w, magnitudes(d_logits, w), "d_x")


def _paddle_run(op, dtype: str, seed: int = 0, needs: tuple[bool, bool] = (True, True)):
    rng = np.random.default_rng(seed)
    x = paddle.to_tensor(rng.standard_normal((45, 24)).astype("float32")).astype(dtype)
    w = paddle.to_tensor((rng.standard_normal((10, 24)) * 0.1).astype("float32"))
    x.stop_gradient, w.stop_gradient = not needs[0], not needs[1]
    logits = op(x, w)
    (logits * paddle.to_tensor(rng.standard_normal((45, 10)).astype("float32"))).sum().backward()
    return logits, x.grad, w.grad


@pytest.mark.parametrize("pieces", ["auto", True], ids=["interpreter_default", "gpu_pieces_path"])
def test_paddle_op_on_bf16_runs_the_kernels_and_matches_the_reference(monkeypatch, pieces):
    """bf16 Paddle tensors through the launch route; ``PIECES`` True also runs the GPU's pieces path on them (the
    Paddle bf16 pieces buffers of ``_split3``: W's twice, d_logits' once)."""
    monkeypatch.setattr(kernel_gemm, "PIECES", pieces)
    with expect_launches(*KERNELS, exactly=1), expect_launches("_split3", exactly=3 if pieces is True else 0):
        logits, d_x, d_w = _paddle_run(function.router_logits, "bfloat16")
    want_logits, want_dx, want_dw = _paddle_run(reference.router_logits, "bfloat16")
    assert logits.dtype == paddle.float32 and d_x.dtype == paddle.bfloat16 and d_w.dtype == paddle.float32
    as_torch = lambda t: torch.from_dlpack(t.detach())  # noqa: E731
    for got, want, name in ((logits, want_logits, "logits"), (d_w, want_dw, "d_w")):
        diff = float((as_torch(got) - as_torch(want)).abs().max())
        assert diff <= 1e-5 * float(as_torch(want).abs().max()), f"{name}: {diff:.3e} from the reference"
    dx_diff = (as_torch(d_x).float() - as_torch(want_dx).float()).abs()
    assert bool((dx_diff <= 2.0**-7 * as_torch(want_dx).float().abs() + 1e-6).all()), "d_x: over one bf16 rounding"


@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["hidden_only", "weight_only"])
def test_paddle_op_computes_only_the_gradients_asked_for(needs):
    """Paddle's PyLayer wants None for an input that needs no gradient; that GEMM is then not run."""
    kernels = ("_router_logits",) + (("_router_dx",) if needs[0] else ()) + (("_router_dw",) if needs[1] else ())
    skipped = tuple(k for k in KERNELS if k not in kernels)
    with expect_launches(*kernels, exactly=1), expect_launches(*skipped, exactly=0):
        _, d_x, d_w = _paddle_run(function.router_logits, "bfloat16", needs=needs)
    assert (d_x is not None, d_w is not None) == needs


def test_paddle_op_on_fp32_runs_the_kernels_and_matches_the_reference():
    with expect_launches(*KERNELS, exactly=1):
        got = _paddle_run(function.router_logits, "float32")
    for g, w, name in zip(got, _paddle_run(reference.router_logits, "float32"), ("logits", "d_x", "d_w")):
        g, w = torch.from_dlpack(g.detach()), torch.from_dlpack(w.detach())
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max()), name


def test_on_a_gpu_fp32_hidden_states_keep_the_reference_gemm(monkeypatch):
    """The GPU dispatch (``function.router_logits``): fp32 hidden states keep the reference's ops there, byte for
    byte and no launch; bf16 ones take the kernels. (The GPU is played by the interpreter claiming not to be one.)"""
    monkeypatch.setattr(function, "is_interpreted", lambda kernel: False)
    with expect_launches(*KERNELS, exactly=0):
        got = _paddle_run(function.router_logits, "float32")
    for g, w, name in zip(got, _paddle_run(reference.router_logits, "float32"), ("logits", "d_x", "d_w")):
        assert_bitwise(g, w, name)
    with expect_launches(*KERNELS, exactly=1):
        _paddle_run(function.router_logits, "bfloat16")


def test_router_layer_with_fused_logits_picks_the_same_experts():
    from fleet_ext.layers.moe import TopKRouter

    paddle.seed(0)
    router = TopKRouter(load_config(tiny_model()), layer_number=1)
    hidden = paddle.to_tensor(np.random.default_rng(5).standard_normal((2, 19, router.hidden_size)).astype("float32"))
    for dtype in ("float32", "bfloat16"):
        router.router_logits = reference.router_logits
        want_w, want_idx = router(hidden.astype(dtype))[:2]
        router.router_logits = function.router_logits
        with expect_launches("_router_logits", exactly=1):
            got_w, got_idx = router(hidden.astype(dtype))[:2]
        assert_bitwise(got_idx, want_idx, f"selected experts ({dtype})")
        np.testing.assert_allclose(got_w.numpy(), want_w.numpy(), rtol=1e-5, atol=1e-6)


# -- the tiny model, switch off vs on -------------------------------------------------------------------------
SWITCH = {"moe_router_logits_fusion": True}
MOE_LAYERS = 4  # TINY_MODEL: 4 layers, all MoE (the first hash-routed: its router computes logits too)


def _model_run(switches: dict, **overrides) -> dict[str, np.ndarray]:
    return model_step(load_config(tiny_model(**switches, hca_compress_ratio=8), **overrides), seq=38)[1]


@pytest.fixture(scope="module")
def fused_run() -> dict[str, np.ndarray]:
    with expect_launches(*KERNELS, exactly=MOE_LAYERS):
        return _model_run(SWITCH)


def test_tiny_model_matches_the_unfused_path_within_tolerance(fused_run):
    reference_run = _model_run({})
    assert fused_run.keys() == reference_run.keys()
    assert sum(k.endswith("router.weight") for k in fused_run) == MOE_LAYERS
    for key in reference_run:
        assert_close(fused_run[key], reference_run[key], "fp32", "router_logits_model", what=f"switch on vs off: {key}")


def test_tiny_model_check_catches_a_planted_error(monkeypatch):
    """Test the test: logits 1e-3 off in relative terms fail the model-level tolerance."""
    reference_run = _model_run({})
    real = function.router_logits
    monkeypatch.setattr(function, "router_logits", lambda h, w: real(h, w) * 1.001)
    planted = _model_run(SWITCH)
    with pytest.raises(AssertionError):
        for key in reference_run:
            assert_close(planted[key], reference_run[key], "fp32", "router_logits_model", what=key)


def test_tiny_model_under_recompute_is_bitwise_equal_to_no_recompute(fused_run):
    """The kernels are deterministic, so recomputing whole layers (their routers' logits GEMMs run again in the
    backward; the selective ``moe`` policy replays the routing and does not re-run it) changes no bit."""
    with expect_launches("_router_logits", exactly=2 * MOE_LAYERS):
        again = _model_run(SWITCH, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    assert again.keys() == fused_run.keys()
    for key in fused_run:
        assert_bitwise(again[key], fused_run[key], f"full recompute: {key}")


def test_registry_entry_backend_and_gate():
    from fleet_ext.models import DSv4ForCausalLM
    from fleet_ext.specs.backend import BackendProvider

    entry = FUSIONS["moe_router_logits_fusion"]
    assert entry.landed and not entry.bitwise_equal and entry.load("fused") is function.router_logits
    row = {r.switch: r for r in BackendProvider(load_config(tiny_model(**SWITCH))).resolved}["moe_router_logits_fusion"]
    assert row.backend == "Triton interpreter (CPU, slow)" and "not bitwise" in row.reason
    for switch, want in ((False, reference.router_logits), (True, function.router_logits)):
        model = DSv4ForCausalLM(load_config(tiny_model(moe_router_logits_fusion=switch)))
        routers = [layer.router for layer in model.moe_layers()]
        assert len(routers) == MOE_LAYERS and all(r.router_logits is want for r in routers)
    dense = tiny_model(moe_n_hash_layers=0, first_k_dense_replace=4, **SWITCH)
    with pytest.raises(ValueError, match=r"`moe_router_logits_fusion` = True can never run: every layer is dense"):
        load_config(dense)


@pytest.mark.parametrize("case,match", [
    ("weight_bf16", "`weight` must be float32"), ("dim_mismatch", r"`weight` must have shape \[None, 24\]"),
    ("strided_x", "`x` must be contiguous"), ("pieces_fp32", "PIECES needs bf16"),
    ("d_logits_shape", r"`d_logits` must have shape \[45, 10\]"),
])
def test_bad_inputs_raise_naming_the_tensor(monkeypatch, case, match):
    x, w, d_logits = _torch_inputs(45, 10, 24, torch.float32)
    if case == "weight_bf16":
        w = w.bfloat16()
    elif case == "dim_mismatch":
        w = torch.randn(10, 16)
    elif case == "strided_x":
        x = torch.randn(24, 45).t()
    elif case == "pieces_fp32":
        monkeypatch.setattr(kernel_gemm, "PIECES", True)
    with pytest.raises(ValueError, match=match):
        if case == "d_logits_shape":
            kernel_gemm.logits_backward(d_logits[:, :5].contiguous(), x, w)
        else:
            kernel_gemm.logits(x, w)
