"""The one Triton launch adapter: Paddle or torch tensors in, kernels see torch views or raw tensors.

- In interpreter mode (no GPU) Triton needs torch CPU tensors: Paddle tensors are bridged with DLPack,
  zero copy, so writes by the kernel land in the Paddle tensor.
- On a GPU, tensors are passed as they are (anything with ``data_ptr()``).
Outputs are allocated like their input (same framework, device and dtype). Every launch is counted
per kernel name, so tests can assert that a fused kernel really ran.

Kernel modules import neither Paddle nor torch; this module imports them lazily.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from fleet_ext import capability

LAUNCH_COUNTS: collections.Counter[str] = collections.Counter()


def is_paddle(tensor: Any) -> bool:
    return type(tensor).__module__.startswith("paddle")


def dtype_name(tensor: Any) -> str:
    """'float32', 'bfloat16', 'int64', ... for a Paddle or torch tensor."""
    return str(tensor.dtype).rsplit(".", 1)[-1]


def shape_of(tensor: Any) -> list[int]:
    return [int(n) for n in tensor.shape]


def strides_of(tensor: Any) -> list[int]:
    """Element strides of a Paddle (``strides`` attribute) or torch (``stride()`` method) tensor."""
    strides = getattr(tensor, "strides", None)
    return [int(s) for s in (strides if strides is not None and not callable(strides) else tensor.stride())]


def detached(tensor: Any) -> Any:
    """The same storage without autograd (Paddle refuses to DLPack-export a tensor that requires grad)."""
    needs_grad = getattr(tensor, "stop_gradient", True) is False or getattr(tensor, "requires_grad", False)
    return tensor.detach() if needs_grad else tensor


def kernel_arg(tensor: Any) -> Any:
    """What a Triton kernel receives for ``tensor``: a torch view in interpreter mode, else the tensor."""
    if not capability.detect().interpreter or not is_paddle(tensor):
        return tensor
    import torch

    return torch.from_dlpack(detached(tensor))


def empty_like(tensor: Any, shape: Sequence[int] | None = None, dtype: Any = None) -> Any:
    """A new uninitialised tensor in the framework/device of ``tensor``."""
    shape = list(tensor.shape if shape is None else shape)
    if is_paddle(tensor):
        import paddle

        return paddle.empty(shape, dtype=dtype or tensor.dtype)
    import torch

    return torch.empty(shape, dtype=dtype or tensor.dtype, device=tensor.device)


def _fix_interpreter_scalar_index() -> None:
    """Let run-time scalars bound loops in the Triton interpreter.

    Triton 3.6's interpreter holds a scalar as a shape-(1,) NumPy array and turns it into a ``range`` bound
    with ``int(array)``, which NumPy 2.4 rejects ("only 0-dimensional arrays can be converted"); compiled
    kernels are unaffected. Wrap its tensor patching so ``__index__`` reads the single element instead.
    The interpreter applies its patching at every run, so wrapping it before the first interpreted launch
    is enough; idempotent.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_scalar_index_fixed", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._scalar_index_fixed = True
    interpreter._patch_lang_tensor = patched


def is_interpreted(kernel: Any) -> bool:
    """True when Triton built ``kernel`` for its interpreter (``TRITON_INTERPRET=1`` when it was decorated)."""
    return type(kernel).__name__ == "InterpretedFunction"


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Run ``kernel[grid](*args, **meta)`` with tensor args adapted; count the launch.

    Decided here, at launch and not at import (kernel modules import without Paddle or torch): an
    interpreted kernel gets the interpreter's scalar-index fix first.
    """
    if is_interpreted(kernel):
        _fix_interpreter_scalar_index()
    adapted = [kernel_arg(a) if hasattr(a, "shape") and hasattr(a, "dtype") else a for a in args]
    kernel[grid](*adapted, **meta)
    LAUNCH_COUNTS[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1
