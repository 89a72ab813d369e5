"""Fused KV index remap on CUDA (torch int32/int64 tensors): exact vs an independent NumPy oracle and eager torch.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``.
Skipped without CUDA. Integer arithmetic: every comparison is exact (``torch.equal`` plus dtype/shape).
Production tables: [16384, 640] and [16384, 2176] with seqlen_kv = 65536 + 512, for B = 1 (the CP-local
query block) and B = 4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.gpu import CUDA_ONLY

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"
SEQLEN_KV = 65536 + 512


@pytest.fixture(scope="module")
def kernel():
    from fleet_ext.ops.kv_idx_remap import kernel as remap_kernel  # imported only where it will run

    return remap_kernel


def eager(local_idx: torch.Tensor, seqlen_kv: int) -> torch.Tensor:
    """The reference's op sequence (fleet_ext/ops/kv_idx_remap/reference.py) in eager torch."""
    batch, seq, width = local_idx.shape
    offsets = (torch.arange(batch, dtype=local_idx.dtype, device=local_idx.device) * seqlen_kv).view(batch, 1, 1)
    return torch.where(local_idx >= 0, local_idx + offsets, local_idx).reshape(batch * seq, width)


def oracle(local_idx: np.ndarray, seqlen_kv: int) -> np.ndarray:
    """int64 NumPy (values stay far below 2**63), range-checked into the table dtype."""
    batch, seq, width = local_idx.shape
    wide = local_idx.astype(np.int64)
    offsets = (np.arange(batch, dtype=np.int64) * seqlen_kv)[:, None, None]
    flat = np.where(wide >= 0, wide + offsets, wide).reshape(batch * seq, width)
    info = np.iinfo(local_idx.dtype)
    assert flat.min() >= info.min and flat.max() <= info.max
    return flat.astype(local_idx.dtype)


def make(shape, seqlen_kv, dtype, seed=0, neg_frac=0.3):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    idx = torch.randint(0, seqlen_kv, shape, generator=gen, device=DEVICE, dtype=torch.int64)
    neg = torch.rand(shape, generator=gen, device=DEVICE) < neg_frac
    idx = torch.where(neg, torch.full_like(idx, -1), idx)
    idx[..., :1] = -5  # negatives other than -1 come back unchanged too
    return idx.to(dtype)


def check(kernel, idx: torch.Tensor, seqlen_kv: int) -> None:
    out = kernel.local_to_global_flat(idx, seqlen_kv)
    assert out.device == idx.device and out.dtype == idx.dtype and out.is_contiguous()
    assert out.shape == (idx.shape[0] * idx.shape[1], idx.shape[2])
    assert torch.equal(out, eager(idx, seqlen_kv))
    np.testing.assert_array_equal(out.cpu().numpy(), oracle(idx.cpu().numpy(), seqlen_kv))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(1, 16384, 640), (1, 16384, 2176), (4, 4096, 640), (3, 7, 5), (2, 37, 130),
                                   (5, 1, 129), (1, 1, 1)])
def test_exact_vs_eager_and_oracle(kernel, shape, dtype):
    check(kernel, make(shape, SEQLEN_KV, dtype, seed=sum(shape)), SEQLEN_KV)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_non_contiguous(kernel, dtype):
    base = make((6, 4096, 192), SEQLEN_KV, dtype, seed=1)
    for view in (base.transpose(0, 1), base[:, :, ::3], base[1:5, 7:, 2:150], base.permute(2, 0, 1)):
        assert not view.is_contiguous()
        check(kernel, view, SEQLEN_KV)


@pytest.mark.parametrize("block_bytes", [64, 4096, 16384])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_flat_path_block_sizes(kernel, monkeypatch, block_bytes, dtype):
    """The contiguous (flat 1-D) path with batch boundaries inside and across programs."""
    monkeypatch.setitem(kernel.TUNE, "flat_block_bytes", block_bytes)
    for shape in ((3, 37, 130), (4, 4096, 640), (2, 5, 200), (1, 7, 3)):
        check(kernel, make(shape, SEQLEN_KV, dtype, seed=block_bytes + sum(shape)), SEQLEN_KV)


def test_int32_limits(kernel):
    seqlen_kv = 2**30
    fits = torch.tensor([[[0, seqlen_kv - 1, -1]], [[seqlen_kv - 1, 0, -(2**31)]]], dtype=torch.int32, device=DEVICE)
    out = kernel.local_to_global_flat(fits, seqlen_kv)  # B * seqlen_kv == 2**31: largest id is int32 max
    assert out.max().item() == 2**31 - 1
    np.testing.assert_array_equal(out.cpu().numpy(), oracle(fits.cpu().numpy(), seqlen_kv))
    too_big = torch.zeros((3, 1, 2), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"`local_idx` is int32 .* wrap around; pass int64"):
        kernel.local_to_global_flat(too_big, seqlen_kv)
    big64 = torch.tensor([[[5, -1]], [[2**40, 3]]], dtype=torch.int64, device=DEVICE)
    np.testing.assert_array_equal(kernel.local_to_global_flat(big64, 3 * 2**40).cpu().numpy(),
                                  oracle(big64.cpu().numpy(), 3 * 2**40))


def test_deterministic_and_fresh(kernel):
    idx = make((1, 16384, 640), SEQLEN_KV, torch.int32, seed=4)
    a = kernel.local_to_global_flat(idx, SEQLEN_KV)
    b = kernel.local_to_global_flat(idx, SEQLEN_KV)
    assert torch.equal(a, b) and a.data_ptr() != idx.data_ptr()
