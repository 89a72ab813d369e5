"""Capability gates: what the fused kernels can use on this machine. Cached; no Paddle import at load.

- ``triton``: Triton importable.
- ``gpu`` / ``sm``: a CUDA device (through Paddle if installed, else torch) and its compute capability.
- ``interpreter``: no GPU, so Triton kernels run in interpreter mode (``TRITON_INTERPRET=1``, set by
  :func:`prepare_triton` before any kernel module is imported) on torch CPU tensors bridged by DLPack.
- ``torch``: torch importable (the interpreter needs it; the DLPack bridge hands kernels torch views).

Tests fake a machine with :func:`override`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Capability:
    """What this process can run."""

    triton: bool
    torch: bool
    gpu: bool
    sm: tuple[int, int] | None

    @property
    def interpreter(self) -> bool:
        return not self.gpu

    def triton_unusable_reason(self) -> str | None:
        """Why Triton kernels cannot run here, or None when they can (compiled on GPU, interpreted on CPU)."""
        if not self.triton:
            return "Triton is not installed (pip install triton==3.6.0)"
        if not self.gpu and not self.torch:
            return "no GPU, and the Triton interpreter needs torch (pip install torch==2.13.0)"
        if self.gpu and self.sm is not None and self.sm < (8, 0):
            return f"GPU compute capability sm{self.sm[0]}{self.sm[1]} is below sm80"
        return None

    def describe(self) -> str:
        if self.gpu:
            return f"GPU sm{self.sm[0]}{self.sm[1]}" if self.sm else "GPU"
        return "CPU (Triton interpreter)" if self.triton and self.torch else "CPU"


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _gpu_and_sm() -> tuple[bool, tuple[int, int] | None]:
    if _has("paddle"):
        import paddle

        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            return True, tuple(paddle.device.cuda.get_device_capability())
        return False, None
    if _has("torch"):
        import torch

        if torch.cuda.is_available():
            return True, tuple(torch.cuda.get_device_capability())
    return False, None


@functools.cache
def _detect() -> Capability:
    gpu, sm = _gpu_and_sm()
    return Capability(triton=_has("triton"), torch=_has("torch"), gpu=gpu, sm=sm)


_OVERRIDE: list[Capability] = []


def detect() -> Capability:
    """The capability of this process (or the innermost :func:`override`)."""
    return _OVERRIDE[-1] if _OVERRIDE else _detect()


@contextlib.contextmanager
def override(capability: Capability) -> Iterator[Capability]:
    """Pretend to run on another machine (tests of the gates: SM80 / SM90 / SM100, no Triton, ...)."""
    _OVERRIDE.append(capability)
    try:
        yield capability
    finally:
        _OVERRIDE.pop()


def _cuda_driver_present() -> bool:
    """An NVIDIA driver on this machine (checked without importing Paddle, torch or Triton)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def prepare_triton(interpreter: bool | None = None) -> None:
    """Select Triton's interpreter mode where kernels cannot be compiled; call before any kernel import.

    Triton reads ``TRITON_INTERPRET`` when a kernel (or one of ``triton.language``'s own jitted helpers)
    is decorated, so this must run before Triton and the kernel modules are imported:
    ``fleet_ext.ops`` calls it on import. ``interpreter`` forces the choice (the backend provider passes
    its capability's); by default it follows the presence of an NVIDIA driver. The variable is an
    internal detail, not a user interface.
    """
    if interpreter is None:
        interpreter = not _cuda_driver_present()
    if interpreter:
        os.environ["TRITON_INTERPRET"] = "1"
