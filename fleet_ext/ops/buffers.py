"""New tensors for launch plans, made at the cost of the cheapest allocation the framework has (issue 16 §4).

An op of several kernels allocates its outputs and its scratch buffers on every call; on a small tensor those
allocations, not the kernels, set its host cost. Measured on the H200's host (``scripts/bench/probe_alloc.py``,
2026-12-02): ``x.new_empty([4, 32], dtype=...)`` 4.7 µs, ``torch.empty(shape, dtype=, device=)`` 6.3,
``torch.empty_like(x)`` 3.6, ``torch.empty_like`` of a one-element tensor expanded to the shape 2.2 (no shape or
dtype to parse, no strides to keep: an expanded tensor is not dense, so the copy is contiguous), a view
(``split_with_sizes`` of one buffer into four) 3.7 in all. So a plan keeps, per tensor it makes, a :func:`maker`
(the expanded template on torch), and an op's scratch buffers of one dtype come from one :class:`Scratch`: one
allocation carved into 1-D views. A plan that keeps makers holds a device: its key must hold :func:`device_key`.

On Paddle (its GPU path unverified here, no Paddle GPU build) a maker calls ``paddle.empty`` and a scratch makes
each buffer on its own: ``paddle.split`` may copy, and the kernels must write into the buffers the op reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from fleet_ext.ops.launch import is_paddle

ALIGN = 16  # bytes: each carved buffer starts 16-byte aligned, as an allocation does (Triton specialises on it)
_ITEM_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}


def device_key(tensor: Any) -> Any:
    """The device of a Paddle or torch tensor, hashable and cheap: part of the key of a plan that keeps makers."""
    if is_paddle(tensor):
        return str(tensor.place)
    return tensor.get_device()  # -1 on the CPU


def maker(like: Any, shape: Sequence[int], dtype: Any = None) -> Callable[[], Any]:
    """A function of no arguments that returns a new uninitialised contiguous tensor of ``shape`` and ``dtype``
    (default: ``like``'s) on ``like``'s device, in its framework. Keeps no reference to ``like``."""
    shape = [int(s) for s in shape]
    dtype = dtype or like.dtype
    if is_paddle(like):
        import paddle

        return partial(paddle.empty, shape, dtype=dtype, device=like.place)
    if 0 in shape:  # an expanded template would give an empty tensor zero strides
        return partial(like.new_empty, shape, dtype=dtype)
    import torch

    return partial(torch.empty_like, like.new_empty([1], dtype=dtype).expand(shape))


class Scratch:
    """An op's scratch buffers of one dtype for one call: 1-D tensors of ``sizes`` elements (rounded up to
    :data:`ALIGN` bytes), on torch views of one allocation. The kernels see pointers only, so the shapes the op
    describes them by live in its plan (the kernels' constexprs and scalars), not in these tensors."""

    __slots__ = ("sizes", "make", "apart")

    def __init__(self, like: Any, sizes: Sequence[int], dtype: Any = None) -> None:
        dtype = dtype or like.dtype
        step = ALIGN // _ITEM_BYTES[str(dtype).rsplit(".", 1)[-1]]
        self.sizes = [max(step, -(-int(n) // step) * step) for n in sizes]
        self.apart = is_paddle(like)
        self.make = ([maker(like, [n], dtype) for n in self.sizes] if self.apart
                     else maker(like, [sum(self.sizes)], dtype))

    def __call__(self) -> tuple[Any, ...]:
        if self.apart:
            return tuple(make() for make in self.make)
        return self.make().split_with_sizes(self.sizes)


__all__ = ["ALIGN", "Scratch", "device_key", "maker"]
