"""Tests of the shared test helpers (tests/helpers): each check must fail on a planted difference.

``assert_bitwise`` on one ulp (fp32, float64, bf16; NumPy, Paddle, torch), a signed zero, a dtype or shape
change; ``assert_close`` just over its bound for each kind of entry (elementwise, relative to a scale, norm)
and just inside it; ``expect_launches`` around the reference op (no launch) and the fused one; the tables'
shape (every dtype has an exact entry, no negative bound, unknown names raise).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
import torch
from helpers import (
    TOLERANCES,
    assert_bitwise,
    assert_close,
    expect_launches,
    tiny_model,
    tolerance,
)
from helpers import oracles as orc
from helpers.torch_rope import eager_rope

from fleet_ext.ops.kv_idx_remap import function as fused_remap
from fleet_ext.ops.kv_idx_remap import reference as ref_remap


def _data(dtype=np.float32, shape=(3, 4, 5)) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _one_ulp_up(a: np.ndarray, index) -> np.ndarray:
    b = a.copy()
    b[index] = np.nextafter(b[index], np.inf, dtype=b.dtype)
    return b


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("framework", ["numpy", "paddle", "torch"])
def test_bitwise_passes_on_equal_and_fails_on_one_ulp(framework, dtype):
    wrap = {"numpy": lambda a: a, "paddle": paddle.to_tensor, "torch": torch.from_numpy}[framework]
    a = _data(dtype)
    assert_bitwise(wrap(a), wrap(a.copy()), "equal")
    planted = _one_ulp_up(a, (1, 2, 3))
    with pytest.raises(AssertionError) as info:
        assert_bitwise(wrap(planted), wrap(a), "planted")
    message = str(info.value)
    assert "planted: 1 of 60 elements differ; first at (1, 2, 3)" in message
    assert f"max |diff| {abs(float(planted[1, 2, 3]) - float(a[1, 2, 3])):.3e}" in message


def test_bitwise_across_frameworks_and_on_bf16():
    a = _data()
    assert_bitwise(paddle.to_tensor(a), a)
    assert_bitwise(torch.from_numpy(a), a)  # a NumPy oracle for a torch result
    x = torch.from_numpy(a).to(torch.bfloat16)
    y = x.clone()
    y.view(torch.int16)[0, 0, 0] += 1  # one bf16 ulp
    assert_bitwise(x, x.clone())
    with pytest.raises(AssertionError, match="1 of 60 elements differ; first at \\(0, 0, 0\\)"):
        assert_bitwise(y, x)
    with pytest.raises(AssertionError, match="not exactly representable in torch.bfloat16"):
        assert_bitwise(x, a)  # fp32 values that bf16 cannot hold: no silent rounding of the oracle


def test_bitwise_sees_signed_zeros_dtypes_and_shapes():
    a = np.zeros(4, np.float32)
    b = a.copy()
    b[2] = -0.0
    with pytest.raises(AssertionError, match="only signs of zero"):
        assert_bitwise(b, a)
    with pytest.raises(AssertionError, match="got float64\\[4\\], want float32\\[4\\]"):
        assert_bitwise(a.astype(np.float64), a)
    with pytest.raises(AssertionError, match="got float32\\[2, 2\\], want float32\\[4\\]"):
        assert_bitwise(a.reshape(2, 2), a)
    ints = np.arange(6, dtype=np.int64)
    assert_bitwise(paddle.to_tensor(ints), ints)
    with pytest.raises(AssertionError, match="first at \\(5,\\)"):
        assert_bitwise(ints + (ints == 5), ints)


def _just(bound: float, inside: bool) -> float:
    return bound * (1 - 1e-6 if inside else 1 + 1e-6)


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "just_over"])
def test_close_elementwise_bound(inside):
    tol = tolerance("fp32", "oracle")  # atol + rtol * |want|
    want = np.array([0.0, 2.0, -3.0])
    got = want.copy()
    got[2] -= _just(tol.atol + tol.rtol * 3.0, inside)
    if inside:
        assert_close(got, want, "fp32", "oracle")
    else:
        with pytest.raises(AssertionError, match=r"1 of 3 elements outside fp32 'oracle'.*worst at \(2,\)"):
            assert_close(got, want, "fp32", "oracle", what="planted")


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "just_over"])
def test_close_bound_relative_to_the_largest_entry_or_a_given_scale(inside):
    tol = tolerance("fp32", "triton_sparse_attn")  # of_scale * max |want|
    want = np.array([[0.5, -4.0], [1e-3, 0.0]], np.float32)
    got = want.astype(np.float64)
    got[1, 0] += _just(tol.of_scale * 4.0, inside)
    scale = np.array([1.0, 10.0])  # per column: the bound of column 0 is of_scale * 1
    if inside:
        assert_close(got, want, "fp32", "triton_sparse_attn")
        with pytest.raises(AssertionError):  # the same difference against a smaller given scale
            assert_close(got, want, "fp32", "triton_sparse_attn", scale=scale)
    else:
        with pytest.raises(AssertionError, match="outside fp32 'triton_sparse_attn'"):
            assert_close(got, want, "fp32", "triton_sparse_attn")


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "just_over"])
def test_close_norm_bound(inside):
    tol = tolerance("bf16", "sparse_attn_out")  # ||got - want|| <= rtol ||want||
    want = torch.tensor([3.0, 4.0])  # norm 5
    got = want.double().clone()
    got[0] += _just(tol.rtol * 5.0, inside)
    if inside:
        assert_close(got, want, "bf16", "sparse_attn_out")
    else:
        with pytest.raises(AssertionError, match="bf16 'sparse_attn_out'"):
            assert_close(got, want, "bf16", "sparse_attn_out")


def test_close_rejects_nan_infinities_and_shapes():
    want = np.ones(3)
    with pytest.raises(AssertionError, match="NaN in got"):
        assert_close(np.array([1.0, np.nan, 1.0]), want, "fp32", "oracle")
    with pytest.raises(AssertionError, match="non-finite mismatch"):
        assert_close(np.array([1.0, np.inf, 1.0]), want, "fp32", "oracle")
    with pytest.raises(AssertionError, match="got shape \\[3\\], want \\[1, 3\\]"):
        assert_close(want, want[None], "fp32", "oracle")
    assert_close(np.full(3, np.inf), np.inf, "fp32", "oracle")  # a scalar want broadcasts; inf == inf
    with pytest.raises(KeyError, match="no fp32 tolerance named 'orcale'"):
        assert_close(want, want, "fp32", "orcale")


def test_tables_have_exact_entries_and_no_negative_bound():
    assert set(TOLERANCES) == {"fp32", "bf16", "fp16", "float64"}
    for dtype, table in TOLERANCES.items():
        assert table["exact"].exact, dtype
        for name, tol in table.items():
            assert min(tol.rtol, tol.atol, tol.of_scale) >= 0, (dtype, name)
            assert not tol.norm or not tol.of_scale, (dtype, name)
    with pytest.raises(KeyError, match="no tolerance table for dtype 'fp8'"):
        tolerance("fp8", "exact")


def test_expect_launches_fails_when_the_reference_runs_instead():
    idx = paddle.to_tensor(np.array([[[1, -1]], [[2, 0]]], dtype="int32"))
    with pytest.raises(AssertionError, match="_kv_idx_remap_kernel: launched 0 times.*did not run"):
        with expect_launches("_kv_idx_remap_kernel"):
            ref_remap.local_to_global_flat(idx, 5)
    with expect_launches("_kv_idx_remap_kernel", exactly=1) as seen:
        out = fused_remap.local_to_global_flat(idx, 5)
    assert seen == {"_kv_idx_remap_kernel": 1}
    assert_bitwise(out, ref_remap.local_to_global_flat(idx, 5))
    with pytest.raises(AssertionError, match="expected exactly 2"):
        with expect_launches("_kv_idx_remap_kernel", exactly=2):
            fused_remap.local_to_global_flat(idx, 5)
    with expect_launches(["_rope_kernel", "_kv_idx_remap_kernel"]):  # a collection counts together
        fused_remap.local_to_global_flat(idx, 5)


def test_tiny_model_copies_and_the_shared_rope_agree_with_the_oracle():
    a, b = tiny_model(), tiny_model(num_hidden_layers=2)
    a["csa_compress_ratios"].append(0)
    assert tiny_model()["csa_compress_ratios"] == [0, 4, 128, -1] and b["num_hidden_layers"] == 2
    x = _data(np.float32, (2, 5, 3, 12))
    angles = orc.rope_angles(np.arange(5), orc.plain_inv_freq(8, 10000.0))
    cos, sin = torch.from_numpy(np.cos(angles).astype("float32")), torch.from_numpy(np.sin(angles).astype("float32"))
    for inverse in (False, True):
        got = eager_rope(torch.from_numpy(x), cos, sin, inverse=inverse)
        assert_close(got, orc.rope(x, angles[:, None, :], inverse), "fp32", "oracle_rope")
