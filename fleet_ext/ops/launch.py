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


def _is_paddle(tensor: Any) -> bool:
    return type(tensor).__module__.startswith("paddle")


def kernel_arg(tensor: Any) -> Any:
    """What a Triton kernel receives for ``tensor``: a torch view in interpreter mode, else the tensor."""
    if not capability.detect().interpreter or not _is_paddle(tensor):
        return tensor
    import torch

    return torch.from_dlpack(tensor.detach())  # Paddle refuses to export a tensor that requires grad


def empty_like(tensor: Any, shape: Sequence[int] | None = None, dtype: Any = None) -> Any:
    """A new uninitialised tensor in the framework/device of ``tensor``."""
    shape = list(tensor.shape if shape is None else shape)
    if _is_paddle(tensor):
        import paddle

        return paddle.empty(shape, dtype=dtype or tensor.dtype)
    import torch

    return torch.empty(shape, dtype=dtype or tensor.dtype, device=tensor.device)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Run ``kernel[grid](*args, **meta)`` with tensor args adapted; count the launch."""
    adapted = [kernel_arg(a) if hasattr(a, "shape") and hasattr(a, "dtype") else a for a in args]
    kernel[grid](*adapted, **meta)
    LAUNCH_COUNTS[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1
