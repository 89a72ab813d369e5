"""The router's logits GEMM and its backward on CUDA (``moe_router.kernel_gemm``), torch bf16 / fp32 hidden states.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``. Skipped
without CUDA.

The claim is fp32 accuracy, not bitwise equality (``helpers.fp32_gemm``): each fp32 result's largest error against
float64 is at most 4x that of torch's fp32 GEMM (TF32 off) on the same values, which is what the layer's reference
path runs. ``d_x`` (rounded to x's dtype) is within one rounding of the float64 result, plus 2^-14 of the sum of
its terms' magnitudes (for bf16 x its products keep ~2^-16 of each term: the dropped pieces' products are at most
3 x 2^-16), plus 4x that library error. A product that kept only bf16 accuracy (W or d_logits not split into
pieces) fails these checks (``test_the_accuracy_check_catches_bf16_products``). The weight gradient's token splits
add in a fixed order: byte-identical run to run.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise
from helpers.fp32_gemm import assert_fp32_accurate, assert_one_rounding, magnitudes
from helpers.gpu import CUDA_ONLY
from helpers.launches import expect_launches

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"
CASES = [(1000, 256, 4096), (777, 20, 320), (16384, 32, 4096), (64, 256, 4096)]  # (T, E, D): tails, splits


@pytest.fixture(scope="module")
def kg():
    from fleet_ext.ops.moe_router import kernel_gemm  # imported only where it will run

    torch.backends.cuda.matmul.allow_tf32 = False
    return kernel_gemm


def make(tokens, experts, dim, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen, device=DEVICE).to(dtype)
    w = torch.randn(experts, dim, generator=gen, device=DEVICE) * 0.02
    d_logits = torch.randn(tokens, experts, generator=gen, device=DEVICE) * 1e-3
    return x, w, d_logits


def oracles(x, w, d_logits):
    return x.double() @ w.double().t(), d_logits.double() @ w.double(), d_logits.double().t() @ x.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,experts,dim", CASES)
def test_logits_and_backward_are_fp32_accurate(kg, tokens, experts, dim, dtype):
    x, w, d_logits = make(tokens, experts, dim, dtype)
    want_logits, want_dx, want_dw = oracles(x, w, d_logits)
    with expect_launches("_router_logits", "_router_dx", "_router_dw", exactly=1):
        logits = kg.logits(x, w)
        d_x, d_w = kg.logits_backward(d_logits, x, w)
    assert logits.dtype == torch.float32 and d_w.dtype == torch.float32 and d_x.dtype == dtype
    assert_fp32_accurate(logits, want_logits, x.float() @ w.t(), magnitudes(x, w.t()), "logits")
    assert_fp32_accurate(d_w, want_dw, d_logits.t() @ x.float(), magnitudes(d_logits.t(), x), "d_w")
    if dtype == torch.float32:  # TF32x3 products: fp32 accurate
        assert_fp32_accurate(d_x, want_dx, d_logits @ w, magnitudes(d_logits, w), "d_x")
    else:
        assert_one_rounding(d_x, want_dx, d_logits @ w, magnitudes(d_logits, w), "d_x")


def test_weight_gradient_splits_are_deterministic(kg):
    x, w, d_logits = make(16384, 32, 4096, torch.bfloat16, seed=1)
    with expect_launches("_sum_splits", min=1):  # this shape splits the tokens over programs
        first = kg.logits_backward(d_logits, x, w)
    for _ in range(2):
        again = kg.logits_backward(d_logits, x, w)
        assert_bitwise(again[1], first[1], "d_w run to run")
        assert_bitwise(again[0], first[0], "d_x run to run")
    assert_bitwise(kg.logits(x, w), kg.logits(x, w), "logits run to run")


def test_the_accuracy_check_catches_bf16_products(kg):
    """Test the test: products with W (or d_logits) rounded to bf16 fail the checks the kernels pass."""
    x, w, d_logits = make(1000, 256, 4096, torch.bfloat16, seed=2)
    want_logits, want_dx, want_dw = oracles(x, w, d_logits)
    w16 = w.bfloat16().float()
    with pytest.raises(AssertionError, match="logits"):
        assert_fp32_accurate(x.float() @ w16.t(), want_logits, x.float() @ w.t(), magnitudes(x, w.t()), "logits")
    with pytest.raises(AssertionError, match="d_w"):
        assert_fp32_accurate(d_logits.bfloat16().float().t() @ x.float(), want_dw, d_logits.t() @ x.float(),
                             magnitudes(d_logits.t(), x), "d_w")
    with pytest.raises(AssertionError, match="d_x"):
        assert_one_rounding((d_logits.bfloat16().float() @ w16).bfloat16(), want_dx, d_logits @ w,
                            magnitudes(d_logits, w), "d_x")
