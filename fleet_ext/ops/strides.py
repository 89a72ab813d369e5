"""Stride arithmetic the host launchers share (plan time, plain ints; no framework import)."""

from __future__ import annotations


def uniform_row_step(shape: list[int], strides: list[int]) -> int | None:
    """The element stride between consecutive rows (the (batch, position, head) vectors) of a [b, s, h, d] tensor
    when every row is the same stride from the last, else None: a kernel can then address row ``m`` as ``m * step``
    without dividing ``m`` into its indices."""
    b, s, h, _ = shape
    s_b, s_s, s_h, _ = strides
    step = s_h if h > 1 else (s_s if s > 1 else s_b)
    if (s > 1 and s_s != step * h) or (b > 1 and s_b != step * h * s):
        return None
    return step
