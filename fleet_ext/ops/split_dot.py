"""Tile products at fp32 accuracy on bf16 tensor cores, shared by the kernels that need them (mHC, the MoE router's
logits GEMMs).

A bf16 tensor-core product of fp32 operands would keep 8 significant bits; an operand split into three bf16 pieces
``hi + mid + lo`` keeps ~24, so a few bf16 products of the pieces give an fp32-accurate result at a fraction of the
cost of IEEE fp32 products (which run on the CUDA cores). ``_dot`` chooses how, by a constexpr the host picks:
the interpreter multiplies in IEEE fp32 (numpy). Device code only: imports Triton, no Paddle or torch.
"""

from __future__ import annotations

import triton
import triton.language as tl

# How a tile product keeps its accuracy (``_dot``): fp32 (IEEE, TF32X3, BF16X3 with one bf16-exact operand,
# BF16X6), or ~2^-16 relative (BF16X3_ROUNDED: both operands split, three products; for a result rounded to bf16).
DOT_IEEE, DOT_TF32X3, DOT_BF16X3, DOT_BF16X6, DOT_BF16X3_ROUNDED = 0, 1, 2, 3, 4


@triton.jit
def _bf16_pieces(v):
    """fp32 ``v`` as three bf16 pieces ``hi + mid + lo`` (together ~24 significant bits)."""
    hi = v.to(tl.bfloat16)
    rest = v - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _dot3(a, b_hi, b_mid, b_lo):
    """``a @ (b_hi + b_mid + b_lo)`` for bf16 ``a``: three bf16 products, smallest first, in a fresh accumulator."""
    part = tl.dot(a, b_lo)
    part = tl.dot(a, b_mid, part)
    return tl.dot(a, b_hi, part)


@triton.jit
def _dot6(a_hi, a_mid, a_lo, b_hi, b_mid, b_lo):
    """``a @ b`` from both operands' bf16 pieces: the six products down to 2^-16 of each other (the three left
    out are ~2^-24 of the result), smallest first, in a fresh accumulator."""
    part = tl.dot(a_lo, b_hi)
    part = tl.dot(a_mid, b_mid, part)
    part = tl.dot(a_hi, b_lo, part)
    part = tl.dot(a_mid, b_hi, part)
    part = tl.dot(a_hi, b_mid, part)
    return tl.dot(a_hi, b_hi, part)


@triton.jit
def _dot_split(a_hi, a_mid, a_lo, b_hi, b_mid, b_lo, DOT: tl.constexpr):
    """``a @ b`` from both operands' bf16 pieces: ``_dot6`` (DOT_BF16X6), or the three largest products, smallest
    first (DOT_BF16X3_ROUNDED: ~2^-16 of the result, for a result rounded to bf16)."""
    if DOT == 3:
        part = _dot6(a_hi, a_mid, a_lo, b_hi, b_mid, b_lo)
    else:
        part = tl.dot(a_mid, b_hi)
        part = tl.dot(a_hi, b_mid, part)
        part = tl.dot(a_hi, b_hi, part)
    return part


@triton.jit
def _dot(a, b, DOT: tl.constexpr, EXACT: tl.constexpr):
    """``a @ b`` at fp32 accuracy, returned in a fresh fp32 accumulator: callers add each tile's product to
    their running sum with an fp32 add. (Handing the running sum to the tensor cores as the accumulator instead
    lets them drop the low bits of every small product against it: a bias that grows with the number of tiles.)

    ``DOT_IEEE``: fp32 products (the interpreter: numpy). ``DOT_TF32X3``: Triton's three TF32 products.
    ``DOT_BF16X3``: the operand ``EXACT`` names (1: ``a``, 2: ``b``) holds bf16 values (mHC's bf16 streams), so
    only the other one is split into bf16 pieces: three bf16 products. ``DOT_BF16X6`` / ``DOT_BF16X3_ROUNDED``:
    both split (``_dot_split``).
    """
    if DOT == 2:
        if EXACT == 1:
            hi, mid, lo = _bf16_pieces(b.to(tl.float32))
            part = _dot3(a.to(tl.bfloat16), hi, mid, lo)
        else:
            hi, mid, lo = _bf16_pieces(a.to(tl.float32))
            other = b.to(tl.bfloat16)
            part = tl.dot(lo, other)
            part = tl.dot(mid, other, part)
            part = tl.dot(hi, other, part)
    elif DOT >= 3:
        a_hi, a_mid, a_lo = _bf16_pieces(a.to(tl.float32))
        b_hi, b_mid, b_lo = _bf16_pieces(b.to(tl.float32))
        part = _dot_split(a_hi, a_mid, a_lo, b_hi, b_mid, b_lo, DOT)
    elif DOT == 1:
        part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return part
