"""Accuracy checks for GEMMs that claim fp32 accuracy without being bitwise (``moe_router.kernel_gemm``).

No GEMM of another summation order can be bitwise against a library's, so the claim is measured against float64:
an fp32 result's largest error is at most 4x that of the fp32 library GEMM on the same values (``library``; where
that is exact, as on a tiny case, one fp32 unit of the largest sum of term magnitudes); a result
rounded to a narrow dtype is within one rounding of the float64 value plus 2^-14 of its terms' magnitudes (products
that keep ~2^-16 of each term). Torch tensors (CPU or CUDA); imports torch (``from helpers.fp32_gemm import ...``).
"""

from __future__ import annotations

import torch


def magnitudes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a| @ |b| in float64: each result element's sum of term magnitudes."""
    return a.double().abs() @ b.double().abs()


def max_err(got: torch.Tensor, want64: torch.Tensor) -> float:
    return float((got.double() - want64).abs().max())


def assert_fp32_accurate(got: torch.Tensor, want64: torch.Tensor, library: torch.Tensor, mags: torch.Tensor,
                         what: str) -> None:
    """got's largest error vs float64 <= 4x the fp32 library GEMM's (``library``); 2^-24 of max(mags) if that is 0."""
    ours, lib = max_err(got, want64), max_err(library, want64)
    bound = 4 * lib if lib > 0 else 2.0**-24 * float(mags.max())
    assert ours <= bound, f"{what}: max error {ours:.3e} > {bound:.3e} (4 x the fp32 library's {lib:.3e})"


def assert_one_rounding(got: torch.Tensor, want64: torch.Tensor, library: torch.Tensor, mags: torch.Tensor,
                        what: str) -> None:
    """got within one rounding of its dtype of the float64 result, plus 2^-14 of ``mags`` and 4x the fp32 library
    GEMM's largest error."""
    bound = torch.finfo(got.dtype).eps * want64.abs() + 2.0**-14 * mags + 4 * max_err(library, want64)
    bad = (got.double() - want64).abs() > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements more than one rounding from float64"
