"""Fused weightless q RMS norm on CUDA (torch tensors, bf16 and fp32): bitwise vs eager torch, and an oracle.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``.
Skipped without CUDA.

- **Bitwise claim** (what ``kernel.torch_cuda_order`` models, ``order.exact``; torch 2.11's Reduce.cuh:
  vectorised loads from d = 128, intra-warp shuffle offsets 16 .. 1): the fused forward kernel
  equals the eager op sequence that mirrors the Paddle path, ``xf = x.float(); (xf * (1 / torch.sqrt(
  xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)``, byte for byte (``y`` and the fp32 ``r``), and the
  backward kernel equals torch autograd of that sequence. This pins the emulated reduction order
  (Reduce.cuh lanes/vectors/shuffle tree), the mean's ``* factor``, the correctly rounded ``sqrt`` and
  ``1 / s`` (``sqrt_rn``, ``div_rn``), the gradient formulas (the reciprocal's and the square root's) and the
  absence of FMA contraction all at once.
- **Anti-vacuity**: the same kernel summing in Paddle CPU's sequential order differs from eager torch on
  some rows, so the bitwise match is a property of the order, not of the data.
- **Oracle** (independent NumPy float64, ml_dtypes for the bf16 rounding): ``y`` within one unit in the
  last place of the output dtype of the correctly rounded value (fp32 compute: an fp32 sum of ``d``
  squares and a correctly rounded ``1 / sqrt`` stay far below one bf16 ulp; for fp32 outputs the bound is 16 fp32
  ulps); ``dx`` within 1e-5 (fp32) / 1e-2 (bf16, the output rounding is 2^-9 relative) of the largest
  ``|dx|`` (the ``q_rms_norm_*`` entries of tests/helpers/tolerances.py).
- Determinism: two runs byte-identical.
- **r recomputed** (the training path: ``q_rms_norm_fused(.., keep_r=False)`` writes only ``y``; the backward
  given ``r=None`` recomputes ``r``): on every shape above, the backward's ``r`` (``r_out``) equals the
  forward's byte for byte and its ``dx`` equals eager torch's; a backward with another eps is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_bitwise, assert_close, expect_launches
from helpers.gpu import CUDA_ONLY

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float32]
EPS = 1e-6


@pytest.fixture(scope="module")
def kernel():
    from fleet_ext.ops.q_rms_norm import kernel as q_kernel  # imported only where it will run

    assert not q_kernel.is_interpreted()
    return q_kernel


def eager(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    xf = x.float()
    return (xf * (1 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def eager_r(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    xf = x.float()
    return 1 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def eager_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().clone().requires_grad_(True)
    eager(leaf).backward(g)
    return leaf.grad


def make(shape, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = torch.rand(shape[:-1] + (1,), generator=gen, device=DEVICE) * 10 + 0.1
    x = (torch.randn(shape, generator=gen, device=DEVICE) * scale).to(dtype)
    g = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    return x, g


# (shape, what it covers): rows >= 16 give 32 lanes; one or two rows give 128 / 256 lanes (shared-memory
# halving); d < 128 is the unvectorised path (4 accumulators by step); 576 = the latent MQA key width.
SHAPES = [
    ((2, 64, 16, 512), "DSv4 head, vec4"),
    ((1, 128, 8, 64), "unvectorised, 2 steps"),
    ((1, 16, 4, 128), "vec4 from d = 128, one step"),
    ((4, 64, 8, 128), "vec4 from d = 128, many rows"),
    ((3, 5, 7, 33), "unvectorised with a tail"),
    ((2, 32, 4, 192), "vec4, partial second step"),
    ((1, 64, 16, 576), "vec4, 576"),
    ((1, 1, 1, 512), "one row: 128 lanes"),
    ((1, 1, 2, 4096), "two rows: 256 lanes"),
    ((1, 4, 3, 7), "4 lanes"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, what", SHAPES)
def test_forward_and_backward_bitwise_vs_eager_torch(kernel, shape, what, dtype):
    x, g = make(shape, dtype, seed=sum(shape))
    rows = int(np.prod(shape[:-1]))
    order = kernel.default_order(x)
    assert order == kernel.torch_cuda_order(rows, shape[-1]) and order.exact, what
    y, r = kernel.q_rms_norm_fused(x, EPS)
    assert_bitwise(r, eager_r(x), f"r {what} {dtype}")
    assert_bitwise(y, eager(x), f"y {what} {dtype}")
    dx = kernel.q_rms_norm_bwd(g, x, r, eps=EPS)
    dx_eager = eager_grad(x, g)
    assert_bitwise(dx, dx_eager, f"dx {what} {dtype}")
    _check_recomputed_r(kernel, x, g, y, r, dx_eager, f"{what} {dtype}")


def _check_recomputed_r(kernel, x, g, y, r, dx_eager, what: str) -> None:
    """The training path: the forward without ``r`` (same ``y``, launched once), the backward recomputing it: its
    ``r`` is the forward's byte for byte, its ``dx`` eager torch's; a planted eps in the backward is caught."""
    assert kernel.recomputes_r(x.shape[-1], kernel.default_order(x)), what
    with expect_launches("_q_rms_norm_fwd_kernel", "_q_rms_norm_bwd_kernel", exactly=1):
        y_no_r, no_r = kernel.q_rms_norm_fused(x, EPS, keep_r=False)
        r_bwd = torch.full_like(r, -1.0)  # poisoned: every row must be written
        dx = kernel.q_rms_norm_bwd(g, x, None, eps=EPS, r_out=r_bwd)
    assert no_r is None, what
    assert_bitwise(y_no_r, y, f"y without r {what}")
    assert_bitwise(r_bwd, r, f"the backward's recomputed r vs the forward's {what}")
    assert_bitwise(dx, dx_eager, f"dx, r recomputed {what}")
    planted = torch.full_like(r, -1.0)
    kernel.q_rms_norm_bwd(g, x, None, eps=1e-2, r_out=planted)
    with pytest.raises(AssertionError):
        assert_bitwise(planted, r, f"planted: another eps {what}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_production_shape_bitwise(kernel, dtype):
    """The DSv4 query at sq 16384: [1, 16384, 64, 512] (1 GiB in bf16)."""
    x, g = make((1, 16384, 64, 512), dtype, seed=7)
    y, r = kernel.q_rms_norm_fused(x, EPS)
    assert_bitwise(y, eager(x), "y production")
    dx = kernel.q_rms_norm_bwd(g, x, r, eps=EPS)
    dx_eager = eager_grad(x, g)
    assert_bitwise(dx, dx_eager, "dx production")
    _check_recomputed_r(kernel, x, g, y, r, dx_eager, "production")


def test_the_order_matters(kernel):
    """Anti-vacuity: summing in Paddle CPU's sequential order gives other bits on some rows."""
    x, _ = make((1, 256, 16, 512), torch.float32, seed=3)
    seq_order = kernel.paddle_cpu_order()
    ms = kernel.q_rms_norm_stats(x, seq_order)
    eager_ms = x.pow(2).mean(-1, keepdim=True)
    torch_order = kernel.torch_cuda_order(256 * 16, 512)
    ms_torch = kernel.q_rms_norm_stats(x, torch_order)
    assert (ms_torch.view(torch.int32) == eager_ms.view(torch.int32)).all()
    differs = (ms.view(torch.int32) != eager_ms.view(torch.int32)).sum().item()
    assert differs > 0, "the sequential order happens to match torch on every row: the test data is too easy"


def _ml():
    return pytest.importorskip("ml_dtypes", reason="the bf16 oracle rounds with ml_dtypes")


def _oracle(x: torch.Tensor, g: torch.Tensor):
    x64 = x.float().cpu().numpy().astype(np.float64)
    g64 = g.float().cpu().numpy().astype(np.float64)
    r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)
    y = x64 * r
    d = x64.shape[-1]
    dx = g64 * r - x64 * (r**3) * (g64 * x64).sum(-1, keepdims=True) / d
    return y, dx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 8, 4, 512), (1, 5, 3, 100), (2, 3, 2, 130)])
def test_vs_numpy_oracle(kernel, shape, dtype):
    x, g = make(shape, dtype, seed=11)
    y, r = kernel.q_rms_norm_fused(x, EPS)
    dx = kernel.q_rms_norm_bwd(g, x, r, eps=EPS)
    y64, dx64 = _oracle(x, g)
    table = "bf16" if dtype == torch.bfloat16 else "fp32"
    if dtype == torch.bfloat16:  # against the correctly rounded bf16 value
        y64 = y64.astype(_ml().bfloat16).astype(np.float64)
    assert_close(y, y64, table, "q_rms_norm_y", what="y")
    assert_close(dx, dx64, table, "q_rms_norm_dx", what="dx")


@pytest.mark.parametrize("dtype", DTYPES)
def test_not_modelled_configuration_is_still_close(kernel, dtype):
    """d = 130 (a vector tail: not modelled, so no bitwise claim): within the oracle bounds of eager torch."""
    x, g = make((2, 8, 4, 130), dtype, seed=5)
    assert not kernel.default_order(x).exact
    y, r = kernel.q_rms_norm_fused(x, EPS)
    table = "bf16" if dtype == torch.bfloat16 else "fp32"
    assert_close(y, eager(x), table, "q_rms_norm_y_vs_eager", what="y, order not modelled")


def test_non_contiguous_input(kernel):
    x, g = make((2, 16, 8, 256), torch.bfloat16, seed=2)
    xt = x.transpose(1, 2)  # [2, 8, 16, 256], not contiguous
    gt = g.transpose(1, 2)
    y, r = kernel.q_rms_norm_fused(xt, EPS)
    assert y.is_contiguous()
    y_c, r_c = kernel.q_rms_norm_fused(xt.contiguous(), EPS)
    assert_bitwise(y, y_c, "y non-contiguous")
    assert_bitwise(kernel.q_rms_norm_bwd(gt, xt, r, eps=EPS),
                   kernel.q_rms_norm_bwd(gt.contiguous(), xt.contiguous(), r_c, eps=EPS), "dx")


def test_one_pass_equals_streamed(kernel, monkeypatch):
    """The one-pass kernels (row in registers) and the streamed ones (row read twice) give the same bits."""
    x, g = make((2, 64, 16, 512), torch.bfloat16, seed=13)
    y, r = kernel.q_rms_norm_fused(x, EPS)
    dx = kernel.q_rms_norm_bwd(g, x, r, eps=EPS)
    monkeypatch.setattr(kernel, "MAX_TILES", 0)
    assert not kernel._one_pass(512, kernel.default_order(x))
    y2, r2 = kernel.q_rms_norm_fused(x, EPS)
    assert_bitwise(r2, r, "r streamed")
    assert_bitwise(y2, y, "y streamed")
    assert_bitwise(kernel.q_rms_norm_bwd(g, x, r2, eps=EPS), dx, "dx streamed")


def test_deterministic(kernel):
    x, g = make((1, 512, 16, 512), torch.bfloat16, seed=9)
    y1, r1 = kernel.q_rms_norm_fused(x, EPS)
    y2, r2 = kernel.q_rms_norm_fused(x, EPS)
    assert_bitwise(y1, y2, "y")
    assert_bitwise(kernel.q_rms_norm_bwd(g, x, r1, eps=EPS), kernel.q_rms_norm_bwd(g, x, r2, eps=EPS), "dx")
