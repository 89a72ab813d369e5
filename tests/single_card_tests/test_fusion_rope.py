"""Fused partial RoPE (``apply_rope_fusion``) vs the pure-Paddle reference, bitwise (CPU, Triton interpreter, fp32).

Forward against ``reference.apply_partial_rope``, backward against Paddle autograd's backward of that
reference (signed zeros included: autograd accumulates sliced gradients into zeros, so ``-0.0`` comes back
as ``+0.0``), inverse, in place vs out of place, odd shapes, non-contiguous inputs, per-batch tables, bad
inputs. The rotation's closeness to the exact maths is covered by test_rope.py's float64 oracle. Every test
of the fused function counts the RoPE kernel's launches.
"""

from __future__ import annotations

import inspect

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, expect_launches

pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")
pytest.importorskip("torch", reason="the Triton interpreter needs torch (installed by the `test` extra)")

from fleet_ext import capability  # noqa: E402

capability.prepare_triton()

from fleet_ext.ops.rope import function, kernel, reference  # noqa: E402

KERNEL = "_rope_kernel"


def _tables(batch: int, seq: int, half: int, per_batch: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, 4000, size=(batch, seq)) if per_batch else np.arange(seq) + 5
    inv_freq = 1.0 / (10000.0 ** (np.arange(half) / half))
    angles = positions[..., None] * inv_freq
    return paddle.to_tensor(np.cos(angles).astype("float32")), paddle.to_tensor(np.sin(angles).astype("float32"))


def _data(shape, seed: int = 1, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _fwd_bwd(fn, x: np.ndarray, cos, sin, inverse: bool, grad: np.ndarray):
    xt = paddle.to_tensor(x, stop_gradient=False)
    y = fn(xt, cos, sin, inverse=inverse)
    (gx,) = paddle.grad(y, [xt], paddle.to_tensor(grad))
    return y, gx


CASES = [  # (shape, rope_dim): heads, no heads, odd head count / width, pe = 2, nope odd, all rope, one head
    ((2, 5, 3, 24), 8),
    ((2, 5, 3, 24), 2),
    ((2, 7, 24), 8),
    ((2, 7, 24), 2),
    ((1, 6, 4, 16), 8),
    ((2, 3, 5, 9), 8),
    ((2, 4, 3, 8), 8),
    ((1, 5, 1, 24), 8),
    ((1, 3, 64, 512), 64),
]


@pytest.mark.parametrize("per_batch", [False, True], ids=["shared_cos", "per_batch_cos"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("shape,rope_dim", CASES, ids=[f"{s}-rd{r}" for s, r in CASES])
def test_forward_and_backward_are_bitwise_equal_to_the_reference(shape, rope_dim, inverse, per_batch):
    cos, sin = _tables(shape[0], shape[1], rope_dim // 2, per_batch)
    x = _data(shape)
    grad = _data(shape, seed=2)
    grad[..., ::5] = -0.0  # autograd turns these into +0.0; the kernel must too
    want_y, want_g = _fwd_bwd(reference.apply_partial_rope, x, cos, sin, inverse, grad)
    with expect_launches(KERNEL, exactly=2):  # forward and backward each launch the RoPE kernel once
        got_y, got_g = _fwd_bwd(function.apply_partial_rope, x, cos, sin, inverse, grad)
    assert_bitwise(got_y, want_y, "forward")
    assert_bitwise(got_g, want_g, "backward")
    nope = shape[-1] - rope_dim
    assert np.abs(want_y.numpy()[..., nope:] - x[..., nope:]).max() > 1e-3, "the rotation must move the channels"
    if nope:  # autograd accumulated the sliced gradient into zeros: the -0.0 entries came back as +0.0
        zeros = grad[..., :nope] == 0
        assert zeros.any() and not np.signbit(want_g.numpy()[..., :nope][zeros]).any()


def test_shared_table_with_a_leading_batch_of_one_broadcasts():
    cos, sin = _tables(1, 6, 4, per_batch=False)
    cos3, sin3 = cos.unsqueeze(0), sin.unsqueeze(0)  # [1, s, rd/2] against b = 3
    x = paddle.to_tensor(_data((3, 6, 2, 16)))
    with expect_launches(KERNEL, exactly=1):
        got = function.apply_partial_rope(x, cos3, sin3)
    assert_bitwise(got, reference.apply_partial_rope(x, cos3, sin3), "fwd")


def test_forward_does_not_touch_its_input_and_returns_a_new_contiguous_tensor():
    cos, sin = _tables(2, 5, 4, per_batch=False)
    x_np = _data((2, 5, 3, 24))
    x = paddle.to_tensor(x_np)
    with expect_launches(KERNEL, exactly=1):
        y = function.apply_partial_rope(x, cos, sin, inverse=True)
    assert y.data_ptr() != x.data_ptr() and y.is_contiguous() and y.shape == x.shape and y.dtype == x.dtype
    assert_bitwise(x, x_np, "input after the out-of-place forward")


def test_float64_input_is_rotated_in_fp32_like_the_reference():
    cos, sin = _tables(2, 5, 4, per_batch=True)
    x = _data((2, 5, 3, 24), dtype="float64")
    grad = _data((2, 5, 3, 24), seed=2, dtype="float64")
    grad[..., ::5] = -0.0
    want_y, want_g = _fwd_bwd(reference.apply_partial_rope, x, cos, sin, True, grad)
    with expect_launches(KERNEL, exactly=2):
        got_y, got_g = _fwd_bwd(function.apply_partial_rope, x, cos, sin, True, grad)
    assert_bitwise(got_y, want_y, "fp64 forward")
    assert_bitwise(got_g, want_g, "fp64 backward")


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("shape,rope_dim", [((2, 5, 3, 24), 8), ((2, 7, 24), 2), ((1, 4, 64, 512), 64)])
def test_in_place_equals_out_of_place_and_keeps_the_storage(shape, rope_dim, inverse):
    cos, sin = _tables(shape[0], shape[1], rope_dim // 2, per_batch=True)
    x_np = _data(shape)
    want = reference.apply_partial_rope(paddle.to_tensor(x_np), cos, sin, inverse=inverse)
    x = paddle.to_tensor(x_np)
    ptr = x.data_ptr()
    with expect_launches(KERNEL, exactly=1):
        result = function.apply_partial_rope_(x, cos, sin, inverse=inverse)
    assert result is x and x.data_ptr() == ptr
    assert_bitwise(x, want, "in place")
    nope = shape[-1] - rope_dim
    assert_bitwise(x.numpy()[..., :nope], x_np[..., :nope], "nope channels in place")


def test_in_place_on_a_strided_view_rotates_only_that_views_rope_channels():
    cos, sin = _tables(2, 5, 4, per_batch=False)
    base_np = _data((2, 5, 3, 40))
    base = paddle.to_tensor(base_np)
    view = base[..., 8:32]  # [2, 5, 3, 24], channel stride 1, head stride 40: not contiguous
    assert not view.is_contiguous()
    want = reference.apply_partial_rope(paddle.to_tensor(base_np[..., 8:32]), cos, sin)
    with expect_launches(KERNEL, exactly=1):
        function.apply_partial_rope_(view, cos, sin)
    got = base.numpy()
    assert_bitwise(got[..., 8:32], want.numpy(), "view channels")
    assert_bitwise(got[..., :8], base_np[..., :8], "left of the view")
    assert_bitwise(got[..., 32:], base_np[..., 32:], "right of the view")


@pytest.mark.parametrize("layout", ["transposed", "sliced", "strided_tables"])
def test_non_contiguous_inputs(layout):
    cos, sin = _tables(2, 6, 4, per_batch=True)
    x_np = _data((2, 6, 3, 24))
    if layout == "transposed":  # heads-major storage seen as [b, s, h, d]
        x = paddle.to_tensor(np.ascontiguousarray(x_np.transpose(0, 2, 1, 3))).transpose([0, 2, 1, 3])
    elif layout == "sliced":  # every other head of a wider tensor
        wide = np.zeros((2, 6, 6, 24), dtype="float32")
        wide[:, :, ::2] = x_np
        x = paddle.to_tensor(wide)[:, :, ::2]
    else:  # contiguous x, tables that are column slices of wider tables
        x = paddle.to_tensor(x_np)
        cos = paddle.concat([cos, paddle.zeros_like(cos)], axis=-1)[..., :4]
        sin = paddle.concat([sin, paddle.zeros_like(sin)], axis=-1)[..., :4]
        assert not cos.is_contiguous()
    if layout != "strided_tables":
        assert not x.is_contiguous()
    grad = _data((2, 6, 3, 24), seed=3)
    want_y, want_g = _fwd_bwd(reference.apply_partial_rope, x_np, cos, sin, True, grad)
    xt = x.detach()
    xt.stop_gradient = False
    grad_view = paddle.to_tensor(np.ascontiguousarray(grad.transpose(0, 2, 1, 3))).transpose([0, 2, 1, 3])
    assert not grad_view.is_contiguous()  # the upstream gradient is strided too
    with expect_launches(KERNEL, exactly=2):
        got_y = function.apply_partial_rope(xt, cos, sin, inverse=True)
        (got_g,) = paddle.grad(got_y, [xt], grad_view)
    assert_bitwise(got_y, want_y, f"{layout} forward")
    assert_bitwise(got_g, want_g, f"{layout} backward")


def test_kernel_gradient_and_tail_launchers():
    """rope_grad is the reference's autograd backward; rope_tail is a trailing slice of the rotation."""
    cos, sin = _tables(2, 5, 4, per_batch=True)
    x_np, g_np = _data((2, 5, 3, 24)), _data((2, 5, 3, 24), seed=4)
    for inverse in (False, True):
        _, want_g = _fwd_bwd(reference.apply_partial_rope, x_np, cos, sin, inverse, g_np)
        assert_bitwise(kernel.rope_grad(paddle.to_tensor(g_np), cos, sin, inverse=inverse), want_g, "rope_grad")
        full = reference.apply_partial_rope(paddle.to_tensor(x_np), cos, sin, inverse=inverse).numpy()
        for start in (0, 5, 8, 16):
            tail = kernel.rope_tail(paddle.to_tensor(x_np), cos, sin, start, inverse=inverse)
            assert tail.shape == [2, 5, 3, 24 - start] and tail.is_contiguous()
            assert_bitwise(tail, full[..., start:], f"rope_tail({start})")
    with pytest.raises(ValueError, match="`start` must be in"):
        kernel.rope_tail(paddle.to_tensor(x_np), cos, sin, 17)


@pytest.mark.parametrize("wide", [False, True], ids=["int32_index", "int64_index"])
def test_gpu_tiling_for_small_inputs_gives_the_same_bits(monkeypatch, wide):
    """The GPU's small-input launch (one program per pass-through block or rotation, grid axis 1; uniformly
    strided rows without index division; int32 index arithmetic, or int64 where an offset could pass 2**31)
    run in the interpreter: every entry point bitwise the reference, contiguous and strided."""
    from fleet_ext.ops import launch

    gpu_plan = kernel._plan.__wrapped__
    monkeypatch.setattr(kernel, "_plan", lambda total, d, half, start, use_ptx, split: gpu_plan(
        total, d, half, start, True, split))
    if wide:  # as if a tensor spanned more than 2**31 elements
        monkeypatch.setattr(kernel, "_extent", lambda shape, strides, rows: 2**31)
    launch.clear_plans()
    cos, sin = _tables(2, 5, 8, per_batch=True)
    x_np, g_np = _data((2, 5, 3, 40)), _data((2, 5, 3, 40), seed=4)
    strided = paddle.to_tensor(np.ascontiguousarray(x_np.transpose(0, 2, 1, 3))).transpose([0, 2, 1, 3])
    try:
        for x in (paddle.to_tensor(x_np), strided):
            want = reference.apply_partial_rope(paddle.to_tensor(x_np), cos, sin, inverse=True).numpy()
            with expect_launches(KERNEL, exactly=4):
                assert_bitwise(kernel.rope(x, cos, sin, inverse=True), want, "rope")
                _, want_g = _fwd_bwd(reference.apply_partial_rope, x_np, cos, sin, False, g_np)
                assert_bitwise(kernel.rope_grad(paddle.to_tensor(g_np), cos, sin), want_g, "rope_grad")
                assert_bitwise(kernel.rope_tail(x, cos, sin, 8, inverse=True), want[..., 8:], "rope_tail")
                work = paddle.to_tensor(x_np)
                assert_bitwise(kernel.rope_(work, cos, sin, inverse=True), want, "rope_")
        plans = list(kernel._PLANS.values())
        split = [p for p in plans if p.meta["SPLIT"]]
        assert len(split) == 5 and all(p.grid[1] == 2 for p in split)  # 24 pass-through channels: one block
        assert {p.meta["FLAT"] for p in split} == {True, False} and {p.meta["WIDE"] for p in plans} == {wide}
    finally:
        launch.clear_plans()


def test_interpreted_kernel_uses_plain_arithmetic_and_a_gpu_build_uses_ptx():
    assert capability.detect().interpreter and kernel.USE_PTX is False
    for fn, op in ((kernel._mul_rn, "mul"), (kernel._add_rn, "add"), (kernel._sub_rn, "sub")):
        assert f"{op}.rn.f32" in inspect.getsource(fn.fn)


def _bad_inputs():
    cos, sin = _tables(2, 5, 4, per_batch=False)
    x = paddle.to_tensor(_data((2, 5, 3, 24)))
    return [
        (paddle.to_tensor(_data((5, 24))), cos, sin),  # x 2-D
        (x, cos.reshape([1, 1, 5, 4]), sin.reshape([1, 1, 5, 4])),  # cos 4-D
        (x, paddle.to_tensor(np.zeros((3, 5, 4), "float32")), paddle.to_tensor(np.zeros((3, 5, 4), "float32"))),
        (paddle.to_tensor(_data((2, 5, 3, 6))), cos, sin),  # narrower than the rope width
        (x, cos, sin[:, :2]),  # cos/sin differ
        (paddle.to_tensor(_data((2, 4, 3, 24))), cos, sin),  # positions differ
    ]


@pytest.mark.parametrize("case", range(6))
def test_bad_inputs_raise_the_references_errors(case):
    x, cos, sin = _bad_inputs()[case]
    with pytest.raises(ValueError) as want:
        reference.apply_partial_rope(x, cos, sin)
    with pytest.raises(ValueError) as got:
        function.apply_partial_rope(x, cos, sin)
    assert str(got.value) == str(want.value)
    assert "`x`" in str(got.value) or "`cos`" in str(got.value)
    with pytest.raises(ValueError, match="apply_partial_rope_"):
        function.apply_partial_rope_(x, cos, sin)


def test_inputs_only_the_fused_path_rejects_name_the_tensor():
    cos, sin = _tables(2, 5, 4, per_batch=False)
    x = paddle.to_tensor(_data((2, 5, 3, 24)))
    with pytest.raises(ValueError, match="`cos` must be float32"):
        function.apply_partial_rope(x, cos.astype("float64"), sin)
    with pytest.raises(ValueError, match="`sin` must be float32"):
        function.apply_partial_rope(x, cos, sin.astype("float64"))
    with pytest.raises(ValueError, match="`x` must be a floating tensor"):
        function.apply_partial_rope(x.astype("int32"), cos, sin)
    trainable = cos.detach()
    trainable.stop_gradient = False
    with pytest.raises(ValueError, match="`cos` requires a gradient"):
        function.apply_partial_rope(x, trainable, sin)
    leaf = x.detach()
    leaf.stop_gradient = False
    with pytest.raises(ValueError, match="`x` requires a gradient"):
        function.apply_partial_rope_(leaf, cos, sin)
    with paddle.no_grad():
        function.apply_partial_rope_(leaf, cos, sin)  # allowed without autograd
