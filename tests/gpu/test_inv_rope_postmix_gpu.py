"""Fused inverse RoPE + ungrouped VHA postmix on CUDA (torch tensors, bf16 and fp32), bitwise vs the unfused path.

Run on the GPU benchmark machine (torch + Triton, no Paddle): ``pytest tests/gpu``. Skipped without CUDA.

The fused forward (``kernel.inv_rope_postmix_forward`` with ``torch.matmul`` as the GEMM) is
``M @ O`` plus a narrow GEMM on the inverse-rotated trailing channels; it is bitwise equal to the unfused
``torch.matmul(M, inv_rope(O))`` only while cuBLAS has the column-slice property
``matmul(M, X)[..., a:] == matmul(M, X[..., a:])`` at the split ``split_start`` picks, which is tested
directly first (if it fails for a shape, ``split_start`` must decline that shape on the GPU). The backward
pieces (rebuilt rotation, gradient rotation around torch's own matmul backward) are checked against torch
autograd of the unfused path, and the forward's peak memory against the unfused one (one full-width tensor
less).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise
from helpers.torch_rope import eager_rope

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA GPU tests (torch + Triton)")
DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernels():
    from fleet_ext.ops.inv_rope_postmix import kernel as postmix_kernel
    from fleet_ext.ops.rope import kernel as rope_kernel

    return postmix_kernel, rope_kernel


def unfused(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``reference.inv_rope_vha_postmix`` in eager torch: ``mix @ inv_rope(out)``."""
    return torch.matmul(mix.to(out.dtype), eager_rope(out, cos, sin, inverse=True))


def _problem(b, s, h, d, rope_dim, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    positions = torch.arange(s, dtype=torch.float64)[:, None] + 11
    inv_freq = 1.0 / (160000.0 ** (torch.arange(rope_dim // 2, dtype=torch.float64) / (rope_dim // 2)))
    angles = positions * inv_freq
    rank = max(1, h // 4)
    u = 0.1 * torch.randn(h, rank, generator=g)
    v = 0.1 * torch.randn(h, rank, generator=g)  # VHA's V off its zero init
    return {
        "out": torch.randn(b, s, h, d, generator=g).to(dtype).to(DEVICE),
        "cos": torch.cos(angles).float().to(DEVICE),
        "sin": torch.sin(angles).float().to(DEVICE),
        "mix": (torch.eye(h) + v @ u.T).to(DEVICE),
        "grad": torch.randn(b, s, h, d, generator=g).to(dtype).to(DEVICE),
    }


SHAPES = [  # (b, s, h, d, rope_dim)
    (1, 16384, 64, 512, 64),  # production: 64K context / CP 4
    (1, 1024, 64, 512, 64),
    (2, 512, 64, 512, 64),
    (1, 1000, 64, 512, 2),  # pe = 2: split at 504
    (2, 136, 4, 16, 8),  # the tiny CPU model's geometry
    (2, 37, 3, 24, 8),  # odd head count
    (2, 37, 3, 24, 2),
    (1, 100, 8, 64, 16),
    (1, 256, 128, 128, 64),
    (1, 333, 16, 256, 64),
]


@pytest.mark.parametrize("b,s,h,d,rope_dim", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cublas_column_slice_property_at_the_split(kernels, dtype, b, s, h, d, rope_dim):
    postmix_kernel, _ = kernels
    start = postmix_kernel.split_start(d, rope_dim)
    assert start is not None
    p = _problem(b, s, h, d, rope_dim, dtype)
    mix, x = p["mix"].to(dtype), p["out"]
    full = torch.matmul(mix, x)
    assert_bitwise(torch.matmul(mix, x[..., start:].contiguous()), full[..., start:], "split-N GEMM")
    y = x.clone()
    y[..., start:] = torch.flip(y[..., start:], dims=[-1])
    assert_bitwise(torch.matmul(mix, y)[..., :start], full[..., :start], "column independence")


@pytest.mark.parametrize("b,s,h,d,rope_dim", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_forward_is_bitwise_equal_to_the_unfused_path(kernels, dtype, b, s, h, d, rope_dim):
    postmix_kernel, _ = kernels
    p = _problem(b, s, h, d, rope_dim, dtype)
    saved = p["out"].clone()
    got = postmix_kernel.inv_rope_postmix_forward(p["out"], p["cos"], p["sin"], p["mix"].to(dtype), torch.matmul)
    assert_bitwise(got, unfused(p["out"], p["cos"], p["sin"], p["mix"]), "forward")
    assert_bitwise(p["out"], saved, "attention output untouched")


@pytest.mark.parametrize("b,s,h,d,rope_dim", [(1, 16384, 64, 512, 64), (2, 37, 3, 24, 8), (2, 136, 4, 16, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_pieces_are_bitwise_equal_to_autograd_of_the_unfused_path(kernels, dtype, b, s, h, d, rope_dim):
    """Rebuilt rotation + the matmul backward on it + the gradient rotation == autograd of the unfused path."""
    _, rope_kernel = kernels
    p = _problem(b, s, h, d, rope_dim, dtype)
    out = p["out"].clone().requires_grad_(True)
    mix = p["mix"].clone().requires_grad_(True)
    want_out, want_mix = torch.autograd.grad(unfused(out, p["cos"], p["sin"], mix), [out, mix], p["grad"])
    rotated = rope_kernel.rope(p["out"], p["cos"], p["sin"], inverse=True)
    assert_bitwise(rotated, eager_rope(p["out"], p["cos"], p["sin"], inverse=True), "rebuilt rotation")
    mix_leaf = p["mix"].clone().requires_grad_(True)
    rotated.requires_grad_(True)
    d_mix, d_rotated = torch.autograd.grad(torch.matmul(mix_leaf.to(dtype), rotated), [mix_leaf, rotated], p["grad"])
    assert_bitwise(d_mix, want_mix, "d_mix")
    assert_bitwise(rope_kernel.rope_grad(d_rotated, p["cos"], p["sin"], inverse=True), want_out, "d_out")
    assert float(d_mix.abs().max()) > 0


def test_forward_peak_memory_is_one_full_width_tensor_lower(kernels):
    """Production shape, bf16: the unfused forward holds inv_rope(O) and the result, the fused one the result
    and one pe-wide buffer."""
    postmix_kernel, _ = kernels
    p = _problem(1, 16384, 64, 512, 64, torch.bfloat16)
    mix = p["mix"].to(torch.bfloat16)
    full_width = p["out"].numel() * p["out"].element_size()

    def peak(fn) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        del result
        return torch.cuda.max_memory_allocated() - base

    unfused_peak = peak(lambda: torch.matmul(mix, eager_rope(p["out"], p["cos"], p["sin"], inverse=True)))
    fused_peak = peak(lambda: postmix_kernel.inv_rope_postmix_forward(p["out"], p["cos"], p["sin"], mix, torch.matmul))
    # unfused: inv_rope(O) + result = 2 N; fused: result + one pe-wide buffer = 1.125 N (rd / d = 1/8)
    assert fused_peak <= unfused_peak - 0.8 * full_width, (fused_peak / full_width, unfused_peak / full_width)
    assert fused_peak <= 1.2 * full_width, fused_peak / full_width


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_trailing_kernel(kernels, dtype):
    postmix_kernel, _ = kernels
    dst = torch.randn(2, 37, 3, 24, device=DEVICE).to(dtype)
    src = torch.randn(2, 37, 3, 8, device=DEVICE).to(dtype)
    want = dst.clone()
    want[..., 16:] = src
    assert_bitwise(postmix_kernel.write_trailing_(dst, src), want, "write_trailing_")
