"""Fused inverse RoPE + ungrouped VHA postmix (``fuse_inv_rope_into_vha_postmix``) vs the reference, bitwise.

CPU, Triton interpreter, fp32. The forward is ``M @ O`` plus a narrow GEMM on the inverse-rotated trailing
channels; the backward rebuilds the rotated tensor and takes both gradients from ``matmul_grad``. Checked:
output, d_out and the gradients of the postmix factors U, V (``M = I + V U^T``, V moved off its zero init
so d_M is not trivially structured) byte for byte, the saved attention output untouched by backward, the
forward structurally free of a full-width rotated intermediate (what the RoPE kernel writes and what the
GEMMs multiply), the bitwise fallback for shapes without an exact split, frozen factors, bad inputs.
The GEMM property the split rests on is pinned in test_gemm_slice_property.py. Every test of the fused
function counts its kernels' launches.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, expect_launches

pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")
pytest.importorskip("torch", reason="the Triton interpreter needs torch (installed by the `test` extra)")

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

from fleet_ext.ops import launch as launch_module  # noqa: E402
from fleet_ext.ops.inv_rope_postmix import function, kernel, reference  # noqa: E402
from fleet_ext.ops.rope import function as rope_function  # noqa: E402
from fleet_ext.ops.rope import reference as rope_reference  # noqa: E402


def _problem(b: int, s: int, h: int, d: int, rope_dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    rank = max(1, h // 4)
    angles = rng.integers(0, 3000, size=(s, 1)) * (1.0 / 10000.0 ** (np.arange(rope_dim // 2) / (rope_dim // 2)))
    return {
        "out": rng.standard_normal((b, s, h, d)).astype("float32"),
        "cos": np.cos(angles).astype("float32"),
        "sin": np.sin(angles).astype("float32"),
        "U": (0.3 * rng.standard_normal((h, rank))).astype("float32"),
        "V": (0.3 * rng.standard_normal((h, rank))).astype("float32"),  # off its zero init: d_M non-trivial
        "grad": rng.standard_normal((b, s, h, d)).astype("float32"),
    }


def _run(fn, p: dict[str, np.ndarray], frozen_mix: bool = False, frozen_out: bool = False):
    out = paddle.to_tensor(p["out"], stop_gradient=frozen_out)
    u = paddle.to_tensor(p["U"], stop_gradient=frozen_mix)
    v = paddle.to_tensor(p["V"], stop_gradient=frozen_mix)
    mix = paddle.eye(u.shape[0], dtype="float32") + paddle.matmul(v, u, transpose_y=True)  # VHAPostmix's M
    y = fn(out, paddle.to_tensor(p["cos"]), paddle.to_tensor(p["sin"]), mix)
    y.backward(paddle.to_tensor(p["grad"]))
    result = {"y": y.numpy()}
    for name, t in (("d_out", out), ("d_U", u), ("d_V", v)):
        if t.grad is not None:
            result[name] = t.grad.numpy()
    assert_bitwise(out, p["out"], "attention output after backward")  # saved O never written
    return result


SHAPES = [  # (b, s, h, d, rope_dim)
    (2, 5, 3, 24, 8),  # odd head count
    (2, 5, 3, 24, 2),  # pe = 2: narrow GEMM over channels 16: (6 pass-through + 2 rotated)
    (2, 7, 4, 16, 8),  # the tiny model's geometry
    (1, 6, 8, 64, 16),
    (1, 3, 128, 40, 2),  # h >= 128: unaligned splits would differ, the aligned one is exact
    (1, 2, 64, 512, 64),  # production head geometry
]


@pytest.mark.parametrize("b,s,h,d,rope_dim", SHAPES)
def test_forward_and_gradients_are_bitwise_equal_to_the_reference(b, s, h, d, rope_dim):
    p = _problem(b, s, h, d, rope_dim)
    want = _run(reference.inv_rope_vha_postmix, p)
    assert sorted(want) == ["d_U", "d_V", "d_out", "y"]
    for key in ("d_U", "d_V"):
        assert np.abs(want[key]).max() > 0, f"{key} is zero: the comparison would be vacuous"
    with expect_launches("_write_trailing_kernel", exactly=1):  # the split forward
        got = _run(function.inv_rope_vha_postmix, p)
    for key in want:
        assert_bitwise(got[key], want[key], key)


def test_as_wired_by_the_backend_provider():
    """backend.py: partial(inv_rope_vha_postmix, rope=<the resolved RoPE>); either RoPE is accepted."""
    p = _problem(2, 5, 4, 16, 8)
    want = _run(reference.inv_rope_vha_postmix, p)
    for rope in (rope_function.apply_partial_rope, rope_reference.apply_partial_rope):
        with expect_launches("_write_trailing_kernel", exactly=1):
            got = _run(functools.partial(function.inv_rope_vha_postmix, rope=rope), p)
        for key in want:
            assert_bitwise(got[key], want[key], key)


@pytest.mark.parametrize("frozen", ["mix", "out"])
def test_frozen_inputs(frozen):
    p = _problem(1, 4, 8, 24, 8)
    want = _run(reference.inv_rope_vha_postmix, p, frozen_mix=frozen == "mix", frozen_out=frozen == "out")
    with expect_launches("_write_trailing_kernel", exactly=1):
        got = _run(function.inv_rope_vha_postmix, p, frozen_mix=frozen == "mix", frozen_out=frozen == "out")
    assert sorted(got) == sorted(want) == (["d_out", "y"] if frozen == "mix" else ["d_U", "d_V", "y"])
    for key in want:
        assert_bitwise(got[key], want[key], key)


@pytest.mark.parametrize("b,s,h,d,rope_dim", [(2, 3, 5, 26, 8), (1, 4, 3, 12, 8), (2, 3, 4, 8, 8)])
def test_shapes_without_an_exact_split_fall_back_bitwise(b, s, h, d, rope_dim):
    """d % 8 != 0, or no aligned pass-through block to split off: the unfused composition, still the kernel."""
    assert kernel.split_start(d, rope_dim) is None
    p = _problem(b, s, h, d, rope_dim)
    want = _run(reference.inv_rope_vha_postmix, p)
    with expect_launches("_rope_kernel", exactly=3), expect_launches("_write_trailing_kernel", exactly=0):
        got = _run(function.inv_rope_vha_postmix, p)
    for key in want:
        assert_bitwise(got[key], want[key], key)


class _Recorder:
    """Records every Triton launch (kernel, output shape) and every paddle.matmul (operand shapes, identity)."""

    def __init__(self, monkeypatch):
        self.launches: list[tuple[str, list[int]]] = []
        self.matmuls: list[tuple[list[int], list[int], int]] = []
        real_launch, real_matmul = launch_module.launch, paddle.matmul

        def launch(k, grid, *args, **meta):
            self.launches.append((k.fn.__name__, list(args[1].shape) if k.fn.__name__ == "_rope_kernel" else []))
            return real_launch(k, grid, *args, **meta)

        def matmul(x, y, *args, **kwargs):
            self.matmuls.append((list(x.shape), list(y.shape), y.data_ptr()))
            return real_matmul(x, y, *args, **kwargs)

        for module in (launch_module, kernel):  # rope fires its plans through launch_module's own launch
            monkeypatch.setattr(module, "launch", launch)
        monkeypatch.setattr(paddle, "matmul", matmul)


@pytest.mark.parametrize("d,rope_dim,start", [(64, 16, 48), (24, 2, 16), (512, 64, 448)])
def test_forward_never_materialises_a_full_width_rotated_tensor(monkeypatch, d, rope_dim, start):
    p = _problem(1, 3, 4, d, rope_dim)
    out = paddle.to_tensor(p["out"], stop_gradient=False)
    mix = paddle.to_tensor(np.eye(4, dtype="float32") + p["V"] @ p["U"].T, stop_gradient=False)
    rec = _Recorder(monkeypatch)
    y = function.inv_rope_vha_postmix(out, paddle.to_tensor(p["cos"]), paddle.to_tensor(p["sin"]), mix)
    # The only RoPE launch writes channels start: (d - start < d); the wide GEMM multiplies O itself.
    assert rec.launches == [("_rope_kernel", [1, 3, 4, d - start]), ("_write_trailing_kernel", [])]
    operands = [(m[1], m[2] == out.data_ptr()) for m in rec.matmuls]
    assert operands == [([1, 3, 4, d - start], False), ([1, 3, 4, d], True)]
    rec.launches.clear()
    y.backward(paddle.to_tensor(p["grad"]))
    # Backward: the rotated tensor is rebuilt once (full width), then the gradient rotation.
    assert rec.launches == [("_rope_kernel", [1, 3, 4, d]), ("_rope_kernel", [1, 3, 4, d])]


def test_bad_inputs_raise_the_references_errors():
    p = _problem(2, 5, 4, 16, 8)
    out, cos, sin = (paddle.to_tensor(p[k]) for k in ("out", "cos", "sin"))
    mix = paddle.eye(4, dtype="float32")
    cases = [
        (out[0], cos, sin, mix),  # out 3-D
        (out, cos, sin, paddle.eye(3, dtype="float32")),  # mix of another head count
        (out, cos[:4], sin[:4], mix),  # positions differ (raised by the RoPE)
        (out[..., :6], cos, sin, mix),  # narrower than the rope width
    ]
    for args in cases:
        with pytest.raises(ValueError) as want:
            reference.inv_rope_vha_postmix(*args)
        with pytest.raises(ValueError) as got:
            function.inv_rope_vha_postmix(*args)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="`rope` must be fleet_ext.ops.rope's apply_partial_rope"):
        function.inv_rope_vha_postmix(out, cos, sin, mix, rope=lambda x, c, s, inverse=False: x)


def test_write_trailing_kernel_and_its_errors():
    rng = np.random.default_rng(5)
    dst_np = rng.standard_normal((2, 3, 4, 24)).astype("float32")
    src_np = rng.standard_normal((2, 3, 4, 8)).astype("float32")
    dst = paddle.to_tensor(dst_np)
    assert kernel.write_trailing_(dst, paddle.to_tensor(src_np)) is dst
    want = dst_np.copy()
    want[..., 16:] = src_np
    assert_bitwise(dst, want, "write_trailing_")
    with pytest.raises(ValueError, match="`dst` \\[b, s, h, d\\] and `src`"):
        kernel.write_trailing_(dst, paddle.to_tensor(src_np[:1]))
    with pytest.raises(ValueError, match="`dst` is"):
        kernel.write_trailing_(dst, paddle.to_tensor(src_np.astype("float64")))
