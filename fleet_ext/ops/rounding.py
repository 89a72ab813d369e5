"""fp32 multiply / add / subtract rounded one op at a time, for kernels that must match eager bit for bit.

Eager runs ``a*b - c*d`` as separate kernels, each rounding its result to fp32. A compiled Triton kernel would
contract such an expression into an FMA (one rounding fewer), so its bits would differ. With ``USE_PTX`` (a
compiled kernel) every op here is an inline-PTX ``mul.rn`` / ``add.rn`` / ``sub.rn``: explicit rounding modifiers
are never contracted and never flushed. The interpreter (numpy, one rounding per op, no inline asm) takes the plain
operators; the caller passes ``USE_PTX`` as a constexpr. Device code only: imports Triton, no Paddle or torch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mul_rn(a, b, USE_PTX: tl.constexpr):
    """a * b rounded to fp32 on its own (never contracted into an FMA)."""
    if USE_PTX:
        r = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = a * b
    return r


@triton.jit
def _add_rn(a, b, USE_PTX: tl.constexpr):
    """a + b rounded to fp32 on its own (never contracted with a preceding multiply)."""
    if USE_PTX:
        r = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = a + b
    return r


@triton.jit
def _sub_rn(a, b, USE_PTX: tl.constexpr):
    """a - b rounded to fp32 on its own (never contracted with a preceding multiply)."""
    if USE_PTX:
        r = tl.inline_asm_elementwise("sub.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = a - b
    return r


@triton.jit
def _plus_zero(v, USE_PTX: tl.constexpr):
    """``v + 0.0`` in fp32 (fp64 for fp64): -0.0 -> +0.0, every other value unchanged (exact).

    ``tl.full``, not ``tl.zeros_like``: the latter is a jit function of triton.language.standard, which the
    interpreter cannot call when Triton was imported before TRITON_INTERPRET was set.
    """
    if v.dtype == tl.float64:
        r = v + tl.full(v.shape, 0.0, tl.float64)
    else:
        w = v.to(tl.float32)
        r = _add_rn(w, tl.full(w.shape, 0.0, tl.float32), USE_PTX)
    return r
