"""Capability gates: what the fused kernels can use on this machine, and how Triton launches reach the device.

- ``triton``: Triton importable.
- ``gpu`` / ``sm``: a CUDA device (through Paddle if installed, else torch) and its compute capability.
- ``interpreter``: no GPU, so Triton kernels run in interpreter mode (``TRITON_INTERPRET=1``, set by
  :func:`prepare_triton` before any kernel module is imported) on torch CPU tensors bridged by DLPack.
- ``torch``: torch importable (the interpreter needs it; the DLPack bridge hands kernels torch views).
- ``triton_route``: how a compiled launch finds its device and stream. Triton asks its driver, which it builds
  on torch; on a Paddle GPU build that would be torch's device 0 and torch's stream, unordered with Paddle's.
  So there the driver is started through Paddle 3.3's torch proxy (``paddle.compat``), and reads Paddle's
  current device and stream (:data:`ROUTE_PADDLE_PROXY`); without a working proxy, torch with CUDA is the
  fallback (:data:`ROUTE_TORCH_DLPACK`: Paddle tensors as torch views, launched on Paddle's stream); with
  neither, every Triton switch fails the gate naming the fix.

Tests fake a machine with :func:`override`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ROUTE_INTERPRETER = "interpreter"  # CPU: the Triton interpreter on torch CPU views of the tensors (DLPack)
ROUTE_TORCH = "torch"  # a GPU without Paddle: torch tensors as they are, torch's current device and stream
ROUTE_PADDLE_PROXY = "paddle proxy"  # Paddle GPU: Paddle tensors as they are, Paddle's current device and stream
ROUTE_TORCH_DLPACK = "torch via DLPack"  # Paddle GPU without the proxy: torch views, launched on Paddle's stream

_ROUTE_FIX = (
    "install paddlepaddle-gpu >= 3.3 (its paddle.compat torch proxy serves Triton; no torch needed), "
    "or a CUDA build of torch"
)


@dataclass(frozen=True)
class Capability:
    """What this process can run."""

    triton: bool
    torch: bool
    gpu: bool
    sm: tuple[int, int] | None
    paddle_gpu: bool = False  # the GPU was found through a Paddle GPU build (Paddle tensors live there)
    paddle_proxy: bool = False  # Triton's driver reads Paddle's current device and stream (Paddle's proxy)
    torch_cuda: bool = False  # torch with CUDA: the fallback route on a Paddle GPU build
    device: int | None = None  # the current GPU when detected (Paddle's on a Paddle build, else torch's)
    proxy_problem: str | None = None  # why Paddle's proxy does not serve Triton here (for the error)

    @property
    def interpreter(self) -> bool:
        return not self.gpu

    @property
    def triton_route(self) -> str | None:
        """How Triton launches reach the device here (a ``ROUTE_*``), or None when nothing can launch them."""
        if not self.gpu:
            return ROUTE_INTERPRETER if self.torch else None
        if not self.paddle_gpu:
            return ROUTE_TORCH if self.torch else None
        if self.paddle_proxy:
            return ROUTE_PADDLE_PROXY
        return ROUTE_TORCH_DLPACK if self.torch_cuda else None

    def route_name(self) -> str:
        """The route for the start-up table: ``triton (paddle proxy, cuda:3)``, ``triton (interpreter)``, ..."""
        route = self.triton_route
        if route is None:
            return f"no Triton route ({self.triton_unusable_reason()})"
        where = f", cuda:{self.device}" if self.paddle_gpu and self.device is not None else ""
        extra = " on Paddle's stream" if route == ROUTE_TORCH_DLPACK else ""
        return f"triton ({route}{extra}{where})"

    def triton_unusable_reason(self) -> str | None:
        """Why Triton kernels cannot run here, or None when they can (compiled on GPU, interpreted on CPU)."""
        if not self.triton:
            return "Triton is not installed (pip install triton==3.6.0)"
        if not self.gpu and not self.torch:
            return "no GPU, and the Triton interpreter needs torch (pip install torch==2.13.0)"
        if self.gpu and self.sm is not None and self.sm < (8, 0):
            return f"GPU compute capability sm{self.sm[0]}{self.sm[1]} is below sm80"
        if self.triton_route is None and self.paddle_gpu:
            proxy = self.proxy_problem or "Paddle's Triton proxy is not working"
            torch_state = "torch has no CUDA" if self.torch else "torch is not installed"
            return f"Triton has no route to Paddle's GPU: {proxy}, and {torch_state}; {_ROUTE_FIX}"
        if self.triton_route is None:
            return "a GPU without Paddle launches Triton through torch, which is not installed (pip install torch)"
        return None

    def describe(self) -> str:
        if self.gpu:
            kind = "Paddle GPU" if self.paddle_gpu else "GPU"
            return f"{kind} sm{self.sm[0]}{self.sm[1]}" if self.sm else kind
        return "CPU (Triton interpreter)" if self.triton and self.torch else "CPU"


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _paddle_gpu() -> tuple[bool, tuple[int, int] | None, int | None]:
    """(a Paddle GPU build with a device, its compute capability, Paddle's current device index)."""
    import paddle

    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        return True, tuple(paddle.device.cuda.get_device_capability()), int(paddle.device.get_device().split(":")[-1])
    return False, None, None


def _torch_cuda() -> bool:
    if not _has("torch"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _attribute(module: str, name: str) -> Any:
    """``module.name``, or None when either is missing (an older Paddle)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


_PROXY_ENABLED: list[bool] = []


def _start_triton_driver() -> Any:
    from triton.runtime import driver

    return driver.active


def paddle_proxy_problem(start_driver: Callable[[], Any] = _start_triton_driver) -> str | None:
    """Start Triton's driver through Paddle's torch proxy; None when it then reads Paddle's device and stream.

    Triton binds its device and stream queries when its driver starts (``torch.cuda.current_device`` and
    ``torch._C._cuda_getCurrentRawStream``, Triton 3.6 ``backends/driver.py``). Paddle's proxy scoped to Triton
    (``paddle.compat.enable_torch_proxy(scope={"triton"})``) makes Triton's ``import torch`` yield Paddle; the
    driver is started inside ``use_torch_proxy_guard``, so the binding holds even if torch or Triton were
    imported first, and code outside Triton keeps the real torch. Returns why not, for the gate's error.
    ``start_driver`` is Triton's (tests pass a driver that needs no GPU).
    """
    import paddle

    compat = getattr(paddle, "compat", None)
    if not all(hasattr(compat, f) for f in ("enable_torch_proxy", "use_torch_proxy_guard")):
        return f"Paddle {paddle.__version__} has no Triton proxy (paddle.compat.enable_torch_proxy: Paddle >= 3.3)"
    if not _PROXY_ENABLED:  # once: each call re-inserts Paddle's import hook
        compat.enable_torch_proxy(scope={"triton"}, silent=True)
        _PROXY_ENABLED.append(True)
    try:
        with compat.use_torch_proxy_guard(enable=True, silent=True):
            active = start_driver()
    except Exception as exc:  # any failure means "no proxy route"; the message goes into the gate's error
        return f"Triton's driver did not start through Paddle's proxy ({type(exc).__name__}: {exc})"
    want = {"device": ("paddle.cuda", "current_device"), "stream": ("paddle._C", "_cuda_getCurrentRawStream")}
    found = {what: _attribute(module, name) for what, (module, name) in want.items()}
    missing = [".".join(want[what]) for what, fn in found.items() if fn is None]
    if missing:
        return f"Paddle {paddle.__version__} has no {' or '.join(missing)}, which the proxy hands Triton"
    wrong = [what for what, fn in found.items() if getattr(active, f"get_current_{what}", None) is not fn]
    if wrong:
        return (f"Triton's driver does not read Paddle's {' and '.join(wrong)} "
                "(it was started before fleet_ext, through torch)")
    return None


@functools.cache
def _detect() -> Capability:
    triton, torch = _has("triton"), _has("torch")
    if _has("paddle"):
        gpu, sm, device = _paddle_gpu()
        if not gpu:
            return Capability(triton=triton, torch=torch, gpu=False, sm=None)
        problem = paddle_proxy_problem() if triton else "Triton is not installed"
        return Capability(triton=triton, torch=torch, gpu=True, sm=sm, paddle_gpu=True, paddle_proxy=problem is None,
                          torch_cuda=problem is not None and _torch_cuda(), device=device, proxy_problem=problem)
    if _torch_cuda():
        import torch as torch_module

        sm = tuple(torch_module.cuda.get_device_capability())
        return Capability(triton=triton, torch=True, gpu=True, sm=sm, device=torch_module.cuda.current_device())
    return Capability(triton=triton, torch=torch, gpu=False, sm=None)


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


_FORCED_INTERPRETER: list[bool] = []  # an explicit choice of prepare_triton, kept for its later default calls


def prepare_triton(interpreter: bool | None = None) -> None:
    """Select Triton's interpreter mode where kernels cannot be compiled; call before any kernel import.

    Triton reads ``TRITON_INTERPRET`` when a kernel (or one of ``triton.language``'s own jitted helpers)
    is decorated, so this must run before Triton and the kernel modules are imported:
    ``fleet_ext.ops`` calls it on import. ``interpreter`` forces the choice (the backend provider passes
    its capability's); by default it follows the presence of an NVIDIA driver, or the last forced choice (so a
    CPU process that compiles kernels for sm90 without a GPU calls ``prepare_triton(interpreter=False)`` before
    importing them). The variable is an internal detail, not a user interface.
    """
    if interpreter is not None:
        _FORCED_INTERPRETER[:] = [interpreter]
    elif _FORCED_INTERPRETER:
        interpreter = _FORCED_INTERPRETER[0]
    else:
        interpreter = not _cuda_driver_present()
    if interpreter:
        os.environ["TRITON_INTERPRET"] = "1"
