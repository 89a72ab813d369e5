"""The fast mode of inverse RoPE + VHA postmix (``inv_rope_postmix_mode: fast``): within tolerance, deterministic.

CPU, Triton interpreter, fp32. The one-pass kernels (``kernel_fast``) sum the head and token contractions in
Triton's order, not the library GEMM's, so they are held to the fp32 ``inv_rope_postmix_fast`` tolerance
(tests/helpers/tolerances.py: relative to the sum of the magnitudes of each result's terms) against both the
pure-Paddle reference and an independent float64 NumPy oracle; a planted error (wrong rotation direction, one
token missing from ``d_mix``) must fail the same check. ``d_mix`` (split-K partials and a fixed-order
reduction) and ``d_out`` are byte-identical run to run. The half-precision path (bf16 on the GPU) runs here in
fp16 on torch CPU tensors (the interpreter's bf16 dot is unusable). The mode is also run in the whole tiny model
(logits and every gradient within the ``model_inv_rope_postmix_fast`` tolerance), selected by the config key,
with the start-up table and the config errors checked. Every fused call counts its kernels' launches.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
from fleet_ext.ops.inv_rope_postmix import function, reference  # noqa: E402
from fleet_ext.registry import FUSION_MODES, MODE_KEYS  # noqa: E402
from fleet_ext.specs.backend import BackendProvider  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FWD, BWD, REDUCE = "_postmix_fast_fwd_kernel", "_postmix_fast_bwd_kernel", "_postmix_fast_reduce_kernel"
FAST = {"apply_rope_fusion": True, "fuse_inv_rope_into_vha_postmix": True, "inv_rope_postmix_mode": "fast"}


def _problem(b: int, s: int, h: int, d: int, rope_dim: int, seed: int = 0, per_batch: bool = False
             ) -> dict[str, np.ndarray]:
    """Inputs; ``per_batch``: [b, s, rd/2] rotary tables (each sequence its own positions), else [s, rd/2]."""
    rng = np.random.default_rng(seed)
    rank = max(1, h // 4)
    positions = rng.integers(0, 3000, size=(b, s, 1) if per_batch else (s, 1))
    angles = positions * (1.0 / 10000.0 ** (np.arange(rope_dim // 2) / (rope_dim // 2)))
    u = 0.3 * rng.standard_normal((h, rank))
    v = 0.3 * rng.standard_normal((h, rank))
    return {
        "out": rng.standard_normal((b, s, h, d)).astype("float32"),
        "angles": angles,
        "cos": np.cos(angles).astype("float32"),
        "sin": np.sin(angles).astype("float32"),
        "mix": (np.eye(h) + v @ u.T).astype("float32"),  # VHA's M = I + V U^T with V off its zero init
        "grad": rng.standard_normal((b, s, h, d)).astype("float32"),
    }


def _run(fn, p: dict[str, np.ndarray], frozen_mix: bool = False, frozen_out: bool = False) -> dict[str, np.ndarray]:
    out = paddle.to_tensor(p["out"], stop_gradient=frozen_out)
    mix = paddle.to_tensor(p["mix"], stop_gradient=frozen_mix)
    y = fn(out, paddle.to_tensor(p["cos"]), paddle.to_tensor(p["sin"]), mix)
    y.backward(paddle.to_tensor(p["grad"]))
    result = {"y": y.numpy()}
    for name, t in (("d_out", out), ("d_mix", mix)):
        if t.grad is not None:
            result[name] = t.grad.numpy()
    assert_bitwise(out, p["out"], "attention output after backward")  # saved O never written
    return result


def _pair_sum(a: np.ndarray, rope_dim: int) -> np.ndarray:
    """|a| with each pe pair's two entries replaced by their sum (what a rotation can mix into one channel)."""
    a = np.abs(a).copy()
    pe = a[..., a.shape[-1] - rope_dim:]
    both = pe[..., 0::2] + pe[..., 1::2]
    pe[..., 0::2], pe[..., 1::2] = both, both
    return a


def _oracle(p: dict[str, np.ndarray], inverse: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """float64 (value, sum of the magnitudes of its terms) of y, d_out and d_mix."""
    rope_dim = 2 * p["angles"].shape[-1]
    m, grad = orc.f64(p["mix"]), orc.f64(p["grad"])
    rotated = orc.rope(p["out"], p["angles"][..., None, :], inverse=inverse)
    terms = _pair_sum(p["out"], rope_dim)  # |rotated| <= this, channel by channel: the rotation's own terms
    d_rotated = np.einsum("hk,bshd->bskd", m, grad)
    return {
        "y": (np.einsum("hk,bskd->bshd", m, rotated), np.einsum("hk,bskd->bshd", np.abs(m), terms)),
        "d_out": (orc.rope(d_rotated, p["angles"][..., None, :]),
                  _pair_sum(np.einsum("hk,bshd->bskd", np.abs(m), np.abs(grad)), rope_dim)),
        "d_mix": (np.einsum("bshd,bskd->hk", grad, rotated), np.einsum("bshd,bskd->hk", np.abs(grad), terms)),
    }


def _assert_within(got: dict, want: dict, oracle: dict, what: str) -> None:
    for key in got:
        assert_close(got[key], want[key], "fp32", "inv_rope_postmix_fast", what=f"{what} {key} vs reference",
                     scale=oracle[key][1])
        assert_close(got[key], oracle[key][0], "fp32", "inv_rope_postmix_fast", what=f"{what} {key} vs float64",
                     scale=oracle[key][1])


SHAPES = [  # (b, s, h, d, rope_dim)
    (2, 5, 3, 24, 8),  # odd head count, d not a power of two
    (2, 5, 3, 24, 2),  # pe = 2
    (2, 7, 4, 16, 8),  # the tiny model's geometry
    (1, 6, 8, 64, 16),
    (1, 3, 20, 40, 6),  # pe pairs straddle no block boundary, heads padded to 32
    (1, 2, 64, 512, 64),  # production head geometry
]


@pytest.mark.parametrize("b,s,h,d,rope_dim", SHAPES)
def test_forward_and_gradients_within_tolerance_of_reference_and_oracle(b, s, h, d, rope_dim):
    p = _problem(b, s, h, d, rope_dim)
    want = _run(reference.inv_rope_vha_postmix, p)
    with expect_launches(FWD, BWD, REDUCE, exactly=1):
        got = _run(function.inv_rope_vha_postmix_fast, p)
    assert sorted(got) == sorted(want) == ["d_mix", "d_out", "y"]
    _assert_within(got, want, _oracle(p), f"{(b, s, h, d, rope_dim)}")


def test_per_batch_rotary_tables():
    """[b, s, rd/2] tables (a batch stride on cos/sin), and a row count that leaves the last program part-empty."""
    p = _problem(3, 23, 4, 24, 8, seed=5, per_batch=True)
    want = _run(reference.inv_rope_vha_postmix, p)
    with expect_launches(FWD, BWD, REDUCE, exactly=1):
        got = _run(function.inv_rope_vha_postmix_fast, p)
    _assert_within(got, want, _oracle(p), "per-batch tables")


def test_low_precision_path_in_fp16():
    """The bf16 path's roundings (M and the rotated tile narrowed before the dot, one rounding of each result) in
    fp16, the half-precision dtype the interpreter's dot handles: torch CPU tensors, fp32 M as the layer passes it,
    vs float64 fed the reference's fp16 operands (eager torch's rotated tensor, M cast to fp16)."""
    import torch
    from helpers.torch_rope import eager_rope

    from fleet_ext.ops.inv_rope_postmix import kernel_fast

    p = _problem(2, 9, 16, 64, 16, seed=7)
    out, grad = (torch.from_numpy(p[k]).half() for k in ("out", "grad"))
    cos, sin, mix = (torch.from_numpy(p[k]) for k in ("cos", "sin", "mix"))
    with expect_launches(FWD, BWD, REDUCE, exactly=1):
        y = kernel_fast.forward(out, cos, sin, mix)
        d_out, d_mix = kernel_fast.backward(out, cos, sin, mix, grad)
    assert y.dtype == d_out.dtype == torch.float16 and d_mix.dtype == torch.float32
    m16 = mix.half().double().numpy()
    rotated = eager_rope(out, cos, sin, inverse=True).double().numpy()
    g = grad.double().numpy()
    terms = _pair_sum(out.double().numpy(), 16)
    want = {
        "y": (np.einsum("hk,bskd->bshd", m16, rotated), np.einsum("hk,bskd->bshd", np.abs(m16), terms)),
        "d_out": (orc.rope(np.einsum("hk,bshd->bskd", m16, g), p["angles"][..., None, :]),
                  _pair_sum(np.einsum("hk,bshd->bskd", np.abs(m16), np.abs(g)), 16)),
        "d_mix": (np.einsum("bshd,bskd->hk", g, rotated), np.einsum("bshd,bskd->hk", np.abs(g), np.abs(rotated))),
    }
    for key, got in (("y", y), ("d_out", d_out), ("d_mix", d_mix)):
        assert_close(got, want[key][0], "fp16" if key != "d_mix" else "fp32", "inv_rope_postmix_fast", what=key,
                     scale=want[key][1])
    with pytest.raises(AssertionError, match="inv_rope_postmix_fast"):  # an M not rounded as the reference does
        assert_close(y, np.einsum("hk,bskd->bshd", orc.f64(p["mix"]), rotated), "fp16", "inv_rope_postmix_fast",
                     scale=want["y"][1])


@pytest.mark.parametrize("frozen", ["mix", "out"])
def test_frozen_inputs_skip_their_gradient(frozen):
    """Only the gradients that flow are computed: no d_mix partials or reduction for a frozen mix."""
    p = _problem(2, 4, 8, 24, 8)
    kwargs = {"frozen_mix": frozen == "mix", "frozen_out": frozen == "out"}
    want = _run(reference.inv_rope_vha_postmix, p, **kwargs)
    with expect_launches(FWD, BWD, exactly=1), expect_launches(REDUCE, exactly=int(frozen == "out")):
        got = _run(function.inv_rope_vha_postmix_fast, p, **kwargs)
    assert sorted(got) == sorted(want) == (["d_out", "y"] if frozen == "mix" else ["d_mix", "y"])
    _assert_within(got, want, _oracle(p), f"frozen {frozen}")


def test_backward_is_byte_identical_run_to_run():
    p = _problem(2, 9, 16, 64, 16, seed=3)
    with expect_launches(BWD, REDUCE, exactly=3):
        runs = [_run(function.inv_rope_vha_postmix_fast, p) for _ in range(3)]
    for later in runs[1:]:
        for key in runs[0]:
            assert_bitwise(later[key], runs[0][key], f"{key}, run to run")


def test_the_tolerance_catches_planted_errors():
    """Negative controls: the same checks fail for a wrong rotation direction and for one token left out of d_mix."""
    p = _problem(1, 6, 8, 64, 16)
    with expect_launches(FWD, BWD, REDUCE, exactly=1):
        got = _run(function.inv_rope_vha_postmix_fast, p)
    oracle = _oracle(p)
    wrong = _oracle(p, inverse=False)
    with pytest.raises(AssertionError, match="outside fp32 'inv_rope_postmix_fast'"):
        assert_close(got["y"], wrong["y"][0], "fp32", "inv_rope_postmix_fast", scale=oracle["y"][1])
    short = {**p, "grad": p["grad"].copy()}
    short["grad"][:, -1] = 0.0  # d_mix without the last token's terms
    with pytest.raises(AssertionError, match="outside fp32 'inv_rope_postmix_fast'"):
        assert_close(got["d_mix"], _oracle(short)["d_mix"][0], "fp32", "inv_rope_postmix_fast",
                     scale=oracle["d_mix"][1])


def test_bad_inputs_raise_naming_the_tensor_and_the_fix():
    p = _problem(2, 5, 4, 16, 8)
    out, cos, sin, mix = (paddle.to_tensor(p[k]) for k in ("out", "cos", "sin", "mix"))
    for args in [(out[0], cos, sin, mix), (out, cos, sin, mix[:3, :3]), (out, cos[:4], sin[:4], mix)]:
        with pytest.raises(ValueError) as want:
            reference.inv_rope_vha_postmix(*args)
        with pytest.raises(ValueError) as got:
            function.inv_rope_vha_postmix_fast(*args)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="`out` must be one of float32.*set `inv_rope_postmix_mode: bitwise`"):
        function.inv_rope_vha_postmix_fast(out.astype("float64"), cos, sin, mix)
    odd = paddle.to_tensor(np.zeros((2, 5, 4, 15), "float32"))  # pass-through width 7
    with pytest.raises(ValueError, match="pass-through width d - rd must be even"):
        function.inv_rope_vha_postmix_fast(odd, cos, sin, mix)


# -- the mode key: config, start-up table, registry ------------------------------------------------------------


def test_mode_key_needs_its_switch_and_names_allowed_values():
    base = tiny_model(use_vha_attention=True)
    with pytest.raises(ValueError, match=r"`inv_rope_postmix_mode` = 'fast' can never run: it picks how "
                                         r"`fuse_inv_rope_into_vha_postmix` runs.*Fix: set "
                                         r"`fuse_inv_rope_into_vha_postmix: true` or `inv_rope_postmix_mode: bitwise`"):
        load_config({**base, "inv_rope_postmix_mode": "fast"})
    with pytest.raises(ValueError, match=r"`inv_rope_postmix_mode` = 'quick' is invalid: allowed one of "
                                         r"\['bitwise', 'fast'\]"):
        load_config({**base, **FAST, "inv_rope_postmix_mode": "quick"})
    assert load_config(base).fusion.inv_rope_postmix_mode == "bitwise"


def test_start_up_table_and_the_resolved_op():
    base = tiny_model(use_vha_attention=True)
    fast = BackendProvider(load_config({**base, **FAST}))
    rows = {r.switch: r for r in fast.resolved}
    assert rows["inv_rope_postmix_mode"].value == "fast"
    assert rows["inv_rope_postmix_mode"].backend == "Triton interpreter (CPU, slow)"
    assert "not bitwise (CPU fp32: no, GPU (torch): no" in rows["inv_rope_postmix_mode"].reason
    assert "byte-identical run to run: yes (CPU fp32)" in rows["inv_rope_postmix_mode"].reason
    assert fast.attention_ops.inv_rope_postmix.func is function.inv_rope_vha_postmix_fast
    bitwise = BackendProvider(load_config({**base, **FAST, "inv_rope_postmix_mode": "bitwise"}))
    assert bitwise.attention_ops.inv_rope_postmix.func is function.inv_rope_vha_postmix
    assert {r.switch: r for r in bitwise.resolved}["inv_rope_postmix_mode"].reason.startswith("default mode")


def _test_functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.FunctionDef)}


def test_every_mode_claim_names_tests_that_exist():
    assert set(MODE_KEYS) == {key for key, _ in FUSION_MODES}
    for mode in FUSION_MODES.values():
        claims = [("cpu_fp32", mode.bitwise.cpu_fp32), ("gpu", mode.bitwise.gpu), (None, mode.deterministic)]
        assert mode.tolerance and mode.bitwise.cpu_fp32.verdict == "no"
        for platform, claim in claims:
            for test in claim.tests:
                file, _, name = test.partition("::")
                assert name in _test_functions(ROOT / file), test
                if platform is not None:
                    assert file.startswith("tests/gpu/" if platform == "gpu" else "tests/single_card_tests/"), test


# -- the tiny model with the fast mode on -----------------------------------------------------------------------

SEQ = 38  # past the window (8), every compressed kind with entries (HCA pooling 8); 136 took 2.4x the time


def _model_run(switches: dict) -> dict[str, np.ndarray]:
    return model_step({**tiny_model(use_vha_attention=True, hca_compress_ratio=8), **switches}, seq=SEQ)[1]


def test_tiny_model_with_the_fast_mode_matches_within_tolerance():
    reference_run = _model_run({})
    layers = len(tiny_model()["csa_compress_ratios"])
    with expect_launches(FWD, BWD, REDUCE, exactly=layers):  # one forward and one backward per layer
        fast = _model_run(FAST)
    assert fast.keys() == reference_run.keys()
    assert any("vha_postmix_V" in k for k in fast) and np.abs(fast["grad:layers.0.self_attention.postmix."
                                                                     "vha_postmix_V"]).max() > 0
    for key in reference_run:
        gain = "mhc" in key and key.endswith(".scale")  # cancelling sums: their own, looser entry
        assert_close(fast[key], reference_run[key], "fp32",
                     "model_inv_rope_postmix_fast" + ("_mhc_gain" if gain else ""), what=key)
