"""The one Triton launch adapter: Paddle or torch tensors in, each launch on the right device and stream.

Triton takes the device and stream of a launch from its driver, not from the tensors; the route
(``fleet_ext.capability``: decided from what is installed) says how that driver reaches the device:

- ``interpreter`` (no GPU): Triton's interpreter needs torch CPU tensors, so Paddle tensors are bridged with
  DLPack, zero copy (the kernel's writes land in the Paddle tensor). Chosen for every interpreted kernel.
- ``paddle proxy`` (a Paddle GPU build): Paddle tensors go as they are; Triton's driver was started through
  Paddle's torch proxy and reads Paddle's current device and stream, so the launch runs under a Paddle
  device guard set to the tensors' GPU and on that device's current Paddle stream (ordered with Paddle's ops).
- ``torch via DLPack`` (a Paddle GPU build without a working proxy, torch with CUDA): Paddle tensors become
  torch views (DLPack) and the launch runs with torch's current device set to theirs and Paddle's current
  stream as torch's current stream.
- ``torch`` (a GPU without Paddle): tensors as they are, torch's current device and stream.

Torch tensors go as they are on every route. Outputs are allocated like their input (same framework, device
and dtype). Every launch is counted per kernel name (``LAUNCH_COUNTS``, so tests can assert that a fused kernel
really ran) and per route (``ROUTE_COUNTS``). Kernel modules import neither Paddle nor torch; this module
imports them lazily, and reaches Paddle's and torch's GPU runtime only through ``PADDLE_GPU`` / ``TORCH_GPU``
(tests replace them to fake a GPU).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from fleet_ext import capability

LAUNCH_COUNTS: collections.Counter[str] = collections.Counter()
ROUTE_COUNTS: collections.Counter[str] = collections.Counter()


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


def torch_view(tensor: Any) -> Any:
    """A torch view of a Paddle tensor (DLPack, zero copy); torch tensors and scalars as they are."""
    if not is_paddle(tensor):
        return tensor
    import torch

    return torch.from_dlpack(detached(tensor))


def empty_like(tensor: Any, shape: Sequence[int] | None = None, dtype: Any = None) -> Any:
    """A new uninitialised tensor in the framework/device of ``tensor``."""
    shape = list(tensor.shape if shape is None else shape)
    if is_paddle(tensor):
        import paddle

        return paddle.empty(shape, dtype=dtype or tensor.dtype, device=tensor.place)
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


class PaddleGpu:
    """The Paddle GPU runtime calls the routes make (``PADDLE_GPU``; tests replace it to fake a Paddle GPU build)."""

    def device_index(self, tensor: Any) -> int | None:
        """The GPU a Paddle tensor lives on (None for a CPU tensor)."""
        place = tensor.place
        return int(place.gpu_device_id()) if place.is_gpu_place() else None

    @contextlib.contextmanager
    def device_guard(self, index: int) -> Iterator[None]:
        """GPU ``index`` as Paddle's current device (what Triton's proxied driver reads) and as the CUDA current
        device (whose context Triton loads the kernel into) for the block; both restored after."""
        import paddle

        core = paddle.base.core  # CUDA builds have these (paddle.incubate.multiprocessing uses them)
        get, set_ = (getattr(core, f"{op}_cuda_current_device_id", None) for op in ("get", "set"))
        previous = int(get()) if get and set_ else index
        with paddle.device.device_guard(f"gpu:{index}"):
            if previous != index:
                set_(index)
            try:
                yield
            finally:
                if previous != index:
                    set_(previous)

    def current_stream(self, index: int) -> int:
        """The raw CUDA stream Paddle's ops on GPU ``index`` run on now (``paddle.device.stream_guard`` included)."""
        import paddle

        return int(paddle.device.current_stream(f"gpu:{index}").stream_base.cuda_stream)


class TorchGpu:
    """The torch CUDA calls of the DLPack route (``TORCH_GPU``; tests replace it to fake a GPU)."""

    @contextlib.contextmanager
    def on(self, index: int, stream: int) -> Iterator[None]:
        """torch's current device ``index`` and current stream the external (Paddle) ``stream`` for the block."""
        import torch

        with torch.cuda.device(index), torch.cuda.stream(torch.cuda.ExternalStream(stream, device=f"cuda:{index}")):
            yield


PADDLE_GPU = PaddleGpu()
TORCH_GPU = TorchGpu()


def _kernel_name(kernel: Any) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


def route_of(kernel: Any) -> str:
    """The route of a launch of ``kernel``: the interpreter for an interpreted kernel, else the machine's."""
    if is_interpreted(kernel):
        return capability.ROUTE_INTERPRETER
    cap = capability.detect()
    route = cap.triton_route
    if route in (None, capability.ROUTE_INTERPRETER):
        raise RuntimeError(
            f"{_kernel_name(kernel)}: Triton compiled this kernel for a GPU, but this process has no route to one "
            f"({cap.describe()}: {cap.triton_unusable_reason() or 'no GPU'}); import fleet_ext.ops before Triton "
            "so that a machine without a GPU selects the interpreter"
        )
    return route


def _device_of(kernel: Any, args: Sequence[Any]) -> int | None:
    """The one GPU of the Paddle tensor arguments (None when there are none); raises on a CPU tensor or a mix."""
    devices = {i: PADDLE_GPU.device_index(a) for i, a in enumerate(args) if is_paddle(a) and hasattr(a, "place")}
    on_cpu = [i for i, d in devices.items() if d is None]
    if on_cpu:
        raise ValueError(f"{_kernel_name(kernel)}: argument(s) {on_cpu} are Paddle CPU tensors; the kernel runs on "
                         "the GPU: move them to the GPU of the other arguments")
    found = sorted(set(devices.values()))
    if len(found) > 1:
        raise ValueError(f"{_kernel_name(kernel)}: Paddle tensor arguments on GPUs {found}; one launch needs them on "
                         "one GPU: {" + ", ".join(f"arg {i}: gpu:{d}" for i, d in devices.items()) + "}")
    return found[0] if found else None


def _is_tensor(arg: Any) -> bool:
    return hasattr(arg, "shape") and hasattr(arg, "dtype")


@contextlib.contextmanager
def _routed(route: str, kernel: Any, args: Sequence[Any]) -> Iterator[list[Any]]:
    """The arguments the kernel gets on ``route``, inside the device / stream context the route needs."""
    if route == capability.ROUTE_INTERPRETER:
        yield [torch_view(a) if _is_tensor(a) else a for a in args]
    elif route == capability.ROUTE_TORCH:
        yield list(args)
    elif route == capability.ROUTE_PADDLE_PROXY:
        device = _device_of(kernel, args)
        with PADDLE_GPU.device_guard(device) if device is not None else contextlib.nullcontext():
            yield list(args)
    elif route == capability.ROUTE_TORCH_DLPACK:
        device = _device_of(kernel, args)
        on_device = contextlib.nullcontext()
        if device is not None:
            on_device = TORCH_GPU.on(device, PADDLE_GPU.current_stream(device))
        with on_device:  # DLPack inside: torch's current stream is Paddle's during the export
            yield [torch_view(a) if _is_tensor(a) else a for a in args]
    else:
        raise ValueError(f"{_kernel_name(kernel)}: unknown Triton route {route!r}")


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Run ``kernel[grid](*args, **meta)`` on the route of this machine (see the module docstring); count it.

    Decided here, at launch and not at import (kernel modules import without Paddle or torch): an
    interpreted kernel gets the interpreter's scalar-index fix first.
    """
    route = route_of(kernel)
    if route == capability.ROUTE_INTERPRETER:
        _fix_interpreter_scalar_index()
    with _routed(route, kernel, args) as adapted:
        kernel[grid](*adapted, **meta)
    LAUNCH_COUNTS[_kernel_name(kernel)] += 1
    ROUTE_COUNTS[route] += 1
