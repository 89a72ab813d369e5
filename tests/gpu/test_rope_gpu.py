"""Fused partial RoPE on CUDA (torch tensors, bf16 and fp32): bitwise vs an independent NumPy oracle and vs eager.

Run on the GPU benchmark machine (torch + Triton, no Paddle): ``pytest tests/gpu``. Skipped without CUDA.

- NumPy oracle (independent of torch and of the kernel): the input widened to fp32, each product rounded
  to fp32 on its own (numpy never contracts ``a*b - c*d``), the difference/sum rounded to fp32, the result
  narrowed with ml_dtypes (round to nearest even), which is what Paddle's eager RoPE does op by op.
- The eager torch op sequence mirroring ``fleet_ext/ops/rope/reference.py`` (``x.float()``,
  ``even*cos - odd*sin``, stack, cast, concat; tests/helpers/torch_rope.py): separate CUDA kernels, one
  rounding per op.
- An FMA-contracted rotation differs from both (asserted), so these tests would catch a kernel whose
  products the compiler had fused; the kernel uses inline-PTX ``mul.rn`` / ``sub.rn`` / ``add.rn``.
- The sm90 build's PTX (production configuration) holds no ``fma.`` while the same kernel with plain
  operators does (the control), every product is a ``mul.rn.f32``, loads are 16-byte vectors.
- Gradient (``kernel.rope_grad``): vs torch autograd of the eager sequence and vs the oracle's opposite
  rotation with Paddle autograd's ``-0.0 -> +0.0`` accumulation.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch
import triton
from helpers import assert_bitwise
from helpers.gpu import CUDA_ONLY
from helpers.torch_rope import eager_rope

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
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
    assert_bitwise(got, eager_rope(x, cos, sin, inverse), "vs eager torch")
    assert_bitwise(got, oracle_rope(_to_numpy(x), cos_np, sin_np, inverse, dtype), "vs NumPy oracle")
    assert got.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_production_q_shape(kernel, dtype, inverse):
    """q [1, 16384, 64, 512]: the whole tensor vs eager, the first 512 positions vs the oracle."""
    cos_np, sin_np, cos, sin = _tables(1, 16384, 32, per_batch=False)
    x = _randn((1, 16384, 64, 512), dtype, seed=2)
    got = kernel.rope(x, cos, sin, inverse=inverse)
    assert_bitwise(got, eager_rope(x, cos, sin, inverse), "vs eager torch")
    want = oracle_rope(_to_numpy(x[:, :512]), cos_np[:512], sin_np[:512], inverse, dtype)
    assert_bitwise(got[:, :512], want, "vs NumPy oracle")
    inplace = x.clone()
    assert kernel.rope_(inplace, cos, sin, inverse=inverse) is inplace
    assert_bitwise(inplace, got, "in place vs out of place")


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("shape,rope_dim", [((2, 37, 3, 24), 8), ((2, 37, 24), 2), ((1, 64, 64, 512), 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_is_bitwise_equal_to_autograd_and_oracle(kernel, dtype, shape, rope_dim, inverse):
    cos_np, sin_np, cos, sin = _tables(shape[0], shape[1], rope_dim // 2, per_batch=True)
    x = _randn(shape, dtype, seed=3).requires_grad_(True)
    grad = _randn(shape, dtype, seed=4)
    (want,) = torch.autograd.grad(eager_rope(x, cos, sin, inverse), [x], grad)
    got = kernel.rope_grad(grad, cos, sin, inverse=inverse)
    assert_bitwise(got, want, "vs torch autograd")
    assert_bitwise(got, oracle_rope(_to_numpy(grad), cos_np, sin_np, inverse, dtype, grad=True), "vs oracle")
    zeros = grad.clone()
    zeros[..., ::3] = -0.0  # Paddle autograd returns these as +0.0 (accumulated into zeros); so must the kernel
    got = kernel.rope_grad(zeros, cos, sin, inverse=inverse)
    assert_bitwise(got, oracle_rope(_to_numpy(zeros), cos_np, sin_np, inverse, dtype, grad=True), "signed zeros")
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
    assert_bitwise(base[..., 8:32], want, "rotated view")
    assert_bitwise(base[..., :24], original[..., :24], "nope channels and the left margin untouched")
    assert_bitwise(base[..., 32:], original[..., 32:], "right margin untouched")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(kernel, dtype):
    cos_np, sin_np, cos, sin = _tables(2, 37, 4, per_batch=True)
    x = _randn((2, 3, 37, 24), dtype, seed=6).transpose(1, 2)  # heads-major storage seen as [b, s, h, d]
    wide_cos = torch.cat([cos, torch.zeros_like(cos)], dim=-1)[..., :4]  # strided table
    wide_sin = torch.cat([sin, torch.zeros_like(sin)], dim=-1)[..., :4]
    assert not x.is_contiguous() and not wide_cos.is_contiguous()
    got = kernel.rope(x, wide_cos, wide_sin, inverse=False)
    assert got.is_contiguous()
    assert_bitwise(got, eager_rope(x, cos, sin), "vs eager torch")
    assert_bitwise(got, oracle_rope(_to_numpy(x), cos_np, sin_np, False, dtype), "vs oracle")


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
    assert_bitwise(got, want, "kernel vs oracle")


def _production_ptx(kernel, dtype: str, use_ptx: bool) -> str:
    """PTX of the RoPE kernel compiled for sm90 in the production configuration (q [1, 16384, 64, 512], pe 64).

    Pointers and row strides carry the 16-byte divisibility Triton specialises them with for such tensors,
    so the vector width is the production one.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel._rope_kernel
    names = list(inspect.signature(fn.fn).parameters)
    blocks = dict(kernel._plan(16384 * 64, 512, 32, 0, True))
    assert blocks.pop("NCOPY") == 0 and not blocks["SPLIT"]  # a large input: one program per row block
    consts = dict(COPY_START=0, NOPE=448, SHIFT=0, HALF=32, INVERSE=True, ZERO_FIX=dtype == "bf16",
                  DOWNCAST=dtype == "bf16", USE_PTX=use_ptx, FLAT=True, WIDE=False, ONE_BATCH=True, HEADS_LOG2=6,
                  x_sd=1, o_sd=1, c_sk=1, n_sk=1, **blocks)
    ptrs = {"x_ptr": "*" + dtype, "out_ptr": "*" + dtype, "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in names
                           if n in ptrs or n[1:] in ("_sb", "_ss", "_sh")})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_compiled_sm90_kernel_has_no_fma_and_rounds_every_product(kernel, dtype):
    """The sm90 build contracts nothing into an FMA: every product is its own ``mul.rn`` (eager's rounding).

    Control (non-vacuity): the same kernel built with plain operators (``USE_PTX=False``, what the
    interpreter runs) does get FMAs from the compiler, so a PTX without ``fma.`` means the explicit
    rounding modes did their job, not that there was nothing to contract.
    """
    assert kernel.USE_PTX, "on a GPU the kernel must take the inline-PTX route"
    ptx = _production_ptx(kernel, dtype, use_ptx=True)
    assert len(re.findall(r"\bfma\.", ptx)) == 0
    assert ptx.count("mul.rn.f32") > 0
    assert len(re.findall(r"ld\.global\.v4", ptx)) > 0  # 16-byte accesses
    if dtype == "bf16":
        assert len(re.findall(r"cvt\.rn\.bf16", ptx)) > 0  # round-to-nearest-even narrowing
    control = _production_ptx(kernel, dtype, use_ptx=False)
    assert len(re.findall(r"\bfma\.", control)) > 0, "plain operators were not contracted: the check is vacuous"
