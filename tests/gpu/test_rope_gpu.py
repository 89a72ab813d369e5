"""Fused partial RoPE on CUDA (torch tensors, bf16 and fp32): bitwise vs an independent NumPy oracle and vs eager.

Run on the GPU benchmark machine (torch + Triton, no Paddle): ``pytest tests/gpu``. Skipped without CUDA.

- NumPy oracle (independent of torch and of the kernel): the input widened to fp32, each product rounded
  to fp32 on its own (numpy never contracts ``a*b - c*d``), the difference/sum rounded to fp32, the result
  narrowed with ml_dtypes (round to nearest even), which is what Paddle's eager RoPE does op by op.
- The eager torch op sequence mirroring ``fleet_ext/ops/rope/reference.py`` (``x.float()``,
  ``even*cos - odd*sin``, stack, cast, concat): separate CUDA kernels, one rounding per op.
- An FMA-contracted rotation differs from both (asserted), so these tests would catch a kernel whose
  products the compiler had fused; the kernel uses inline-PTX ``mul.rn`` / ``sub.rn`` / ``add.rn``.
- Gradient (``kernel.rope_grad``): vs torch autograd of the eager sequence and vs the oracle's opposite
  rotation with Paddle autograd's ``-0.0 -> +0.0`` accumulation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA GPU tests (torch + Triton)")
DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernel():
    from fleet_ext.ops.rope import kernel as rope_kernel  # imported only where it will run

    assert rope_kernel.USE_PTX == (DEVICE == "cuda")
    return rope_kernel


def _ml():
    return pytest.importorskip("ml_dtypes", reason="the bf16 oracle rounds with ml_dtypes")


# ---------------------------------------------------------------------------------------------------------------
# references


def eager_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The Paddle reference's op sequence in eager torch."""
    half = cos.shape[-1]
    rope_dim = 2 * half
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if x.ndim == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if inverse:
        sin = -sin
    nope = x[..., : x.shape[-1] - rope_dim]
    rope = x[..., x.shape[-1] - rope_dim :].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rot_even = even * cos - odd * sin
    rot_odd = odd * cos + even * sin
    rotated = torch.stack([rot_even, rot_odd], dim=-1).reshape(rope.shape).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """Exact values as fp32 (bf16 widens exactly)."""
    return t.detach().float().cpu().numpy()


def _narrow(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 -> dtype with round-to-nearest-even, returned as the fp32 values of the narrowed numbers."""
    if dtype == torch.float32:
        return values.astype(np.float32)
    return values.astype(_ml().bfloat16).astype(np.float32)


def oracle_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool, dtype: torch.dtype,
                grad: bool = False) -> np.ndarray:
    """NumPy oracle; ``grad=True``: the backward (opposite rotation, then autograd's ``+ 0.0`` accumulation)."""
    x = x.astype(np.float32)
    half = cos.shape[-1]
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    if x.ndim == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    if inverse != grad:
        sin = -sin
    nope = x.shape[-1] - 2 * half
    even, odd = x[..., nope::2], x[..., nope + 1 :: 2]
    out = x.copy()
    out[..., nope::2] = np.subtract(np.multiply(even, cos), np.multiply(odd, sin))
    out[..., nope + 1 :: 2] = np.add(np.multiply(odd, cos), np.multiply(even, sin))
    out = _narrow(out, dtype)
    if grad:
        out = out + np.float32(0.0)  # -0.0 -> +0.0 (exact otherwise)
    return out


def _tables(batch: int, seq: int, half: int, per_batch: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, 60000, size=(batch, seq)) if per_batch else np.arange(seq) + 7
    inv_freq = 1.0 / (160000.0 ** (np.arange(half) / half))
    angles = positions[..., None] * inv_freq
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return cos, sin, torch.from_numpy(cos).to(DEVICE), torch.from_numpy(sin).to(DEVICE)


def _randn(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(DEVICE)


def _assert_bitwise(got: torch.Tensor, want, what: str) -> None:
    if isinstance(want, np.ndarray):
        want = torch.from_numpy(want).to(got.device).to(got.dtype)  # exact: the oracle's values are representable
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{list(got.shape)}"
    int_type = torch.int16 if got.element_size() == 2 else torch.int32
    same = got.contiguous().view(int_type) == want.contiguous().view(int_type)
    if not bool(same.all()):
        diff = (got.float() - want.float()).abs().max().item()
        raise AssertionError(f"{what}: {int((~same).sum())} of {same.numel()} differ, max |diff| {diff:.3e}")


# ---------------------------------------------------------------------------------------------------------------
# tests

CASES = [  # (shape, rope_dim)
    ((2, 37, 3, 24), 8),  # odd heads / width
    ((2, 37, 3, 24), 2),  # pe = 2
    ((2, 37, 24), 8),  # [b, s, d]
    ((2, 19, 5, 9), 8),  # nope = 1
    ((1, 256, 64, 512), 64),  # production q geometry, short sequence
    ((1, 16384, 512), 64),  # production kv
]


@pytest.mark.parametrize("per_batch", [False, True], ids=["shared_cos", "per_batch_cos"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("shape,rope_dim", CASES, ids=[f"{s}-rd{r}" for s, r in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_bitwise_equal_to_oracle_and_eager(kernel, dtype, shape, rope_dim, inverse, per_batch):
    cos_np, sin_np, cos, sin = _tables(shape[0], shape[1], rope_dim // 2, per_batch)
    x = _randn(shape, dtype, seed=1)
    got = kernel.rope(x, cos, sin, inverse=inverse)
    _assert_bitwise(got, eager_rope(x, cos, sin, inverse), "vs eager torch")
    _assert_bitwise(got, oracle_rope(_to_numpy(x), cos_np, sin_np, inverse, dtype), "vs NumPy oracle")
    assert got.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_production_q_shape(kernel, dtype, inverse):
    """q [1, 16384, 64, 512]: the whole tensor vs eager, the first 512 positions vs the oracle."""
    cos_np, sin_np, cos, sin = _tables(1, 16384, 32, per_batch=False)
    x = _randn((1, 16384, 64, 512), dtype, seed=2)
    got = kernel.rope(x, cos, sin, inverse=inverse)
    _assert_bitwise(got, eager_rope(x, cos, sin, inverse), "vs eager torch")
    want = oracle_rope(_to_numpy(x[:, :512]), cos_np[:512], sin_np[:512], inverse, dtype)
    _assert_bitwise(got[:, :512], want, "vs NumPy oracle")
    inplace = x.clone()
    assert kernel.rope_(inplace, cos, sin, inverse=inverse) is inplace
    _assert_bitwise(inplace, got, "in place vs out of place")


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("shape,rope_dim", [((2, 37, 3, 24), 8), ((2, 37, 24), 2), ((1, 64, 64, 512), 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_is_bitwise_equal_to_autograd_and_oracle(kernel, dtype, shape, rope_dim, inverse):
    cos_np, sin_np, cos, sin = _tables(shape[0], shape[1], rope_dim // 2, per_batch=True)
    x = _randn(shape, dtype, seed=3).requires_grad_(True)
    grad = _randn(shape, dtype, seed=4)
    (want,) = torch.autograd.grad(eager_rope(x, cos, sin, inverse), [x], grad)
    got = kernel.rope_grad(grad, cos, sin, inverse=inverse)
    _assert_bitwise(got, want, "vs torch autograd")
    _assert_bitwise(got, oracle_rope(_to_numpy(grad), cos_np, sin_np, inverse, dtype, grad=True), "vs oracle")
    zeros = grad.clone()
    zeros[..., ::3] = -0.0  # Paddle autograd returns these as +0.0 (accumulated into zeros); so must the kernel
    got = kernel.rope_grad(zeros, cos, sin, inverse=inverse)
    _assert_bitwise(got, oracle_rope(_to_numpy(zeros), cos_np, sin_np, inverse, dtype, grad=True), "signed zeros")
    assert not bool(torch.signbit(got[..., : shape[-1] - rope_dim][zeros[..., : shape[-1] - rope_dim] == 0]).any())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_keeps_storage_and_nope_channels(kernel, dtype):
    cos_np, sin_np, cos, sin = _tables(2, 37, 4, per_batch=True)
    base = _randn((2, 37, 3, 40), dtype, seed=5)
    original = base.clone()
    view = base[..., 8:32]  # non-contiguous [2, 37, 3, 24]
    want = eager_rope(view.contiguous(), cos, sin, inverse=True)
    ptr = base.data_ptr()
    kernel.rope_(view, cos, sin, inverse=True)
    assert base.data_ptr() == ptr
    _assert_bitwise(base[..., 8:32], want, "rotated view")
    _assert_bitwise(base[..., :24], original[..., :24], "nope channels and the left margin untouched")
    _assert_bitwise(base[..., 32:], original[..., 32:], "right margin untouched")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(kernel, dtype):
    cos_np, sin_np, cos, sin = _tables(2, 37, 4, per_batch=True)
    x = _randn((2, 3, 37, 24), dtype, seed=6).transpose(1, 2)  # heads-major storage seen as [b, s, h, d]
    wide_cos = torch.cat([cos, torch.zeros_like(cos)], dim=-1)[..., :4]  # strided table
    wide_sin = torch.cat([sin, torch.zeros_like(sin)], dim=-1)[..., :4]
    assert not x.is_contiguous() and not wide_cos.is_contiguous()
    got = kernel.rope(x, wide_cos, wide_sin, inverse=False)
    assert got.is_contiguous()
    _assert_bitwise(got, eager_rope(x, cos, sin), "vs eager torch")
    _assert_bitwise(got, oracle_rope(_to_numpy(x), cos_np, sin_np, False, dtype), "vs oracle")


def test_an_fma_contracted_rotation_would_be_caught(kernel):
    """Non-vacuity: with one rounding fewer (FMA), fp32 results differ from the oracle the kernel matches."""
    cos_np, sin_np, cos, sin = _tables(1, 256, 32, per_batch=False)
    x = _randn((1, 256, 8, 128), torch.float32, seed=7)
    got = kernel.rope(x, cos, sin)
    x_np = _to_numpy(x)
    want = oracle_rope(x_np, cos_np, sin_np, False, torch.float32)
    even, odd = x_np[..., 64::2].astype(np.float64), x_np[..., 65::2]
    fma = (even * cos_np[None, :, None].astype(np.float64) - np.multiply(odd, sin_np[None, :, None])).astype(np.float32)
    assert (fma != want[..., 64::2]).any(), "FMA and separate rounding agree everywhere: the test is vacuous"
    _assert_bitwise(got, want, "kernel vs oracle")
