"""The float24 contributions' packing (``kernel_bwd._pack24_pairs`` / ``_unpack24``) round trip as a test kernel, and
its float64 rounding oracle; the CPU tests run it in the interpreter, ``tests/gpu`` on the H200 (which also shows
why the contribution kernel is compiled without FMA contraction). Imports torch and Triton: import it explicitly,
after ``capability.prepare_triton()``."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from fleet_ext.ops.sparse_attn.kernel_bwd import _pack24_pairs, _unpack24


@triton.jit
def _roundtrip_kernel(X, HI, LO, Y, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)[None, :]
    pairs = tl.arange(0, BLOCK // 2)[None, :]
    hi, lo = _pack24_pairs(tl.load(X + offs))
    tl.store(HI.to(tl.pointer_type(tl.uint32)) + pairs, hi)
    tl.store(LO.to(tl.pointer_type(tl.uint16)) + pairs, lo)
    tl.store(Y + offs, _unpack24(tl.load(HI + offs), tl.load(LO + offs)))


def roundtrip(x: np.ndarray, device: str = "cpu", enable_fp_fusion: bool = False) -> np.ndarray:
    """fp32 ``x`` packed to 24 bits and read back (one program; padded with zeros to a power of two)."""
    block = triton.next_power_of_2(max(x.size, 2))
    xt = torch.from_numpy(np.concatenate([x, np.zeros(block - x.size, np.float32)])).to(device)
    hi, lo = torch.empty(block, dtype=torch.int16, device=device), torch.empty(block, dtype=torch.uint8, device=device)
    y = torch.empty_like(xt)
    _roundtrip_kernel[(1,)](xt, hi, lo, y, BLOCK=block, enable_fp_fusion=enable_fp_fusion)
    return y.cpu().numpy()[: x.size]


def round_to_16_bits(x: np.ndarray, how: str) -> np.ndarray:
    """Oracle: x rounded to a 16-bit significand (quantum 2^(e - 16) for x = m 2^e, m in [0.5, 1); fp32's
    subnormals keep their fixed quantum 2^-141) in float64, ``how`` = "nearest_even", "toward_zero" or "half_up",
    then to fp32 (2^128 overflows to inf)."""
    x64 = x.astype(np.float64)
    finite = np.isfinite(x64)
    _, e = np.frexp(np.where(finite, x64, 1.0))
    quantum = np.ldexp(1.0, np.maximum(e - 16, -141))
    scaled = np.where(finite, x64, 0.0) / quantum
    rounded = {"nearest_even": np.round, "toward_zero": np.trunc, "half_up": lambda v: np.floor(v + 0.5)}[how](scaled)
    with np.errstate(over="ignore"):
        return np.where(finite, rounded * quantum, x64).astype(np.float32)


def is_tie(x: np.ndarray) -> np.ndarray:
    """fp32 values exactly halfway between two 16-bit-significand neighbours (low 8 bits 0x80)."""
    return (x.view(np.uint32) & 0xFF) == 0x80


def nearest_or_tie(got: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per value: ``got`` is x's nearest 16-bit-significand neighbour (either one at a tie)."""
    even, up = round_to_16_bits(x, "nearest_even"), round_to_16_bits(x, "half_up")
    return (got == even) | ((got == up) & is_tie(x))
