"""Inverse RoPE fused into the ungrouped VHA postmix: host composition and the trailing-column write kernel.

The reference computes ``M @ inv_rope(O)`` over the head axis (``reference.py``), materialising the
full-width rotated ``inv_rope(O)``. RoPE touches only the trailing ``rd`` channels while the GEMM
contracts heads, so the channel axis is a pure N dimension of the GEMM and the result can be assembled:

    Y = M @ O                           full width, on the unrotated output (columns < start are final)
    Y[..., start:] = M @ T              T = channels start: of O, the rope ones inverse-rotated (narrow)

with ``start`` the pass-through width ``d - rd`` rounded down to a multiple of ``SPLIT_ALIGN``. Two
library-GEMM properties make this bitwise equal to the reference: a GEMM's column depends only on that
column of the right operand (columns ``< start`` of ``M @ O`` and ``M @ inv_rope(O)`` agree), and the
column-slice property ``matmul(M, X)[..., a:] == matmul(M, X[..., a:])``. The latter is NOT universal
for the batched ``[h,h] @ [b,s,h,d]`` form on the MKL CPU build: it holds when ``a`` and ``d`` are
multiples of 8 and fails for many unaligned starts or widths not a multiple of 8 (pinned by
``tests/single_card_tests/test_gemm_slice_property.py``; on cuBLAS by ``tests/gpu/``). Hence the
aligned ``start`` and :func:`split_start` returning None (use the unfused composition, bitwise by
definition) when ``d`` is not a multiple of 8 or the aligned start is 0 (nothing to save).

Forward HBM traffic at the production shape (d=512, rd=64): GEMM 2N, narrow slice + rotation N/4,
narrow GEMM N/4, trailing write N/4 = 2.75N against 4N unfused; at the peak, besides O, the result Y and
one pe-wide buffer (N/8) instead of the two full-width tensors ``inv_rope(O)`` and Y.

Framework-agnostic: the GEMM is passed in (``paddle.matmul`` / ``torch.matmul``, the very op the unfused
path uses); no Paddle or torch import here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import detached, launch, strides_of
from fleet_ext.ops.rope import kernel as rope_kernel

SPLIT_ALIGN = 8


@triton.jit
def _write_trailing_kernel(
    dst_ptr, src_ptr, TOTAL, H,
    d_sb, d_sh, d_sd,
    s_sb, s_sh, s_sd,
    START: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """dst[r, h, START + c] = src[r, h, c] for c < WIDTH, over (r, h) flattened into BLOCK_M vectors."""
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < TOTAL
    r = m // H
    h = m % H
    c = tl.arange(0, BLOCK_W)
    mask = m_mask[:, None] & (c < WIDTH)[None, :]
    v = tl.load(src_ptr + (r * s_sb + h * s_sh)[:, None] + (c * s_sd)[None, :], mask=mask)
    tl.store(dst_ptr + (r * d_sb + h * d_sh)[:, None] + ((START + c) * d_sd)[None, :], v, mask=mask)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _rows_heads(t: Any) -> tuple[int, int, list[int]]:
    """[b, s, h, w] -> (b*s, h, [row stride, head stride, channel stride]); b and s must fold."""
    b, s, h, _ = (int(n) for n in t.shape)
    sb, ss, sh, sd = strides_of(t)
    if b > 1 and s > 1 and sb != ss * s:
        raise ValueError(f"write_trailing_: tensor of shape {list(t.shape)} with strides {[sb, ss, sh, sd]} "
                         "cannot fold its batch and sequence axes")
    return b * s, h, [ss if s > 1 else sb, sh, sd]


def write_trailing_(dst: Any, src: Any) -> Any:
    """``dst[..., d - w:] = src`` for ``dst`` [b, s, h, d] and ``src`` [b, s, h, w]; returns ``dst``."""
    if dst.ndim != 4 or src.ndim != 4 or list(dst.shape[:3]) != list(src.shape[:3]) or src.shape[3] > dst.shape[3]:
        raise ValueError(f"write_trailing_: `dst` [b, s, h, d] and `src` [b, s, h, w <= d] expected, got "
                         f"{list(dst.shape)} and {list(src.shape)}")
    if str(dst.dtype) != str(src.dtype):
        raise ValueError(f"write_trailing_: `dst` is {dst.dtype} but `src` is {src.dtype}")
    rows, h, d_strides = _rows_heads(dst)
    _, _, s_strides = _rows_heads(src)
    width, total = int(src.shape[3]), rows * h
    if total == 0 or width == 0:
        return dst
    block_w = _pow2(width)
    budget = 8192 if rope_kernel.USE_PTX else 1 << 17
    block_m = min(_pow2(total), max(1, _pow2(budget // block_w + 1) // 2))
    launch(
        _write_trailing_kernel, (triton.cdiv(total, block_m),),
        detached(dst), detached(src), total, h, *d_strides, *s_strides,
        START=int(dst.shape[3]) - width, WIDTH=width, BLOCK_M=block_m, BLOCK_W=block_w,
    )
    return dst


def split_start(d: int, rope_dim: int) -> int | None:
    """First channel of the narrow GEMM, or None when the split is not known to be exact (or saves nothing)."""
    start = (d - rope_dim) // SPLIT_ALIGN * SPLIT_ALIGN
    if d % SPLIT_ALIGN or start == 0:
        return None
    return start


def inv_rope_postmix_forward(out: Any, cos: Any, sin: Any, mix: Any, matmul: Callable[[Any, Any], Any]) -> Any:
    """``mix @ inv_rope(out)`` [b, s, h, d] without a full-width rotated intermediate (see the module doc).

    ``mix`` must already have ``out``'s dtype; ``matmul`` is the framework's GEMM (the unfused path's op).
    Falls back to the unfused composition (Triton RoPE out of place + one GEMM) where :func:`split_start`
    says the split is not known to be exact.
    """
    rope_kernel.check_args(out, cos, sin)
    start = split_start(int(out.shape[-1]), 2 * int(cos.shape[-1]))
    if start is None:
        return matmul(mix, rope_kernel.rope(out, cos, sin, inverse=True))
    # Narrow part first, so the pe-wide rotated slice is freed before the full-width result exists:
    # peak = O + Y + one pe-wide buffer (1.125 N at rd/d = 1/8) against O + inv_rope(O) + Y unfused.
    tail = rope_kernel.rope_tail(out, cos, sin, start, inverse=True)
    narrow = matmul(mix, tail)
    del tail
    return write_trailing_(matmul(mix, out), narrow)
