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

**Host cost.** On a small tensor a fused op is bound by the host, so what a launch repeats for the same shapes is
done once (issue 16 §4):

- an op's launcher keys a :class:`PlanCache` by its tensors' :func:`layout_key` (shape, strides, dtype) and its
  flags; on a miss it validates the arguments (the same checks and messages as before) and builds a
  :class:`Plan` (grid, scalar arguments, constexprs), so a repeated call only looks the plan up;
- a plan's :class:`Bound` remembers the kernel Triton compiled for it, per device and pointer alignment. Triton's
  ``kernel[grid](...)`` re-derives the same specialisation key from every argument on every call (its binder,
  its cache key, launch metadata and empty hook chains); for a plan every scalar and constexpr is fixed, so only
  the tensors' 16-byte alignment (the one other thing Triton specialises a pointer on) and the device can
  change, and a repeat call can go straight to the compiled kernel's launcher (``BOUND_LAUNCH``; the first call
  of each (device, alignment) still goes through ``kernel[grid]``, which compiles). Nothing here reads the
  device back, so the launches can be captured in a CUDA graph;
- there, CUDA tensors' addresses go to Triton's C launcher as ints (:meth:`Bound.fire`: no per-pointer query), and
  outputs shaped like a contiguous input come from ``torch.empty_like`` (:func:`empty_same`: no shape to parse).
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from fleet_ext import capability
from fleet_ext.ops.interpreter import fix_scalar_index

LAUNCH_COUNTS: collections.Counter[str] = collections.Counter()
ROUTE_COUNTS: collections.Counter[str] = collections.Counter()
# Repeat launches of a plan straight to the compiled kernel (on the torch route; tests/gpu/test_cuda_graphs.py
# passed on the H200 on 2026-12-01: byte-identical to ``kernel[grid]``, misaligned views, CUDA-graph capture).
# The interpreter never takes it. False sends every launch through ``kernel[grid]`` (e.g. under a Triton upgrade
# whose launcher signature changed, until that test has run).
BOUND_LAUNCH = True


def is_paddle(tensor: Any) -> bool:
    cls = type(tensor)
    known = _PADDLE_TYPES.get(cls)
    if known is None:
        known = _PADDLE_TYPES[cls] = cls.__module__.startswith("paddle")
    return known


_PADDLE_TYPES: dict[type, bool] = {}  # per argument type: is it Paddle's (asked for every argument of a launch)


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
    """A new uninitialised contiguous tensor in the framework/device of ``tensor``."""
    if _PADDLE_TYPES.get(type(tensor)) is False:  # a torch tensor seen before: no further checks
        return tensor.new_empty(tensor.shape if shape is None else shape, dtype=dtype or tensor.dtype)
    if is_paddle(tensor):
        import paddle

        return paddle.empty(list(tensor.shape if shape is None else shape), dtype=dtype or tensor.dtype,
                            device=tensor.place)
    # torch: new_empty keeps the device (and the dtype unless given) and is contiguous, as torch.empty
    return tensor.new_empty(tensor.shape if shape is None else shape, dtype=dtype or tensor.dtype)


def empty_same(tensor: Any, standard: bool) -> Any:
    """A new uninitialised contiguous tensor of ``tensor``'s shape and dtype (:func:`empty_like` without a shape).

    ``standard``: the caller's plan found ``tensor``'s strides to be exactly the contiguous ones
    (:func:`is_standard`); then a torch tensor's copy comes from ``torch.empty_like``, which keeps those strides
    and parses no shape: the cheapest allocation torch has (``new_empty(tensor.shape)`` parses the ``torch.Size``
    per call: 2.4x the host time on the development CPU). Anything else takes :func:`empty_like`."""
    if standard and _PADDLE_TYPES.get(type(tensor)) is False:
        return (_EMPTY_LIKE or _torch_accessors() and _EMPTY_LIKE)[0](tensor)
    return empty_like(tensor)


def is_standard(tensor: Any) -> bool:
    """``tensor``'s element strides are exactly those of a new contiguous tensor of its shape (a plan-time check)."""
    return strides_of(tensor) == contiguous_strides(shape_of(tensor))


def layout_key(tensor: Any) -> tuple:
    """``(shape, strides, dtype)`` of a Paddle or torch tensor, hashable: what a launch plan depends on.

    The dtype object also tells the frameworks apart (a plan may allocate in the tensor's framework).
    """
    paddle_tensor = _PADDLE_TYPES.get(type(tensor))  # is_paddle, inlined: three of these per launch of an op
    if paddle_tensor is None:
        paddle_tensor = is_paddle(tensor)
    if paddle_tensor:
        return tuple(tensor.shape), tuple(tensor.strides), tensor.dtype
    return tensor.shape, tensor.stride(), tensor.dtype


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Element strides of a new contiguous tensor of ``shape`` (what :func:`empty_like` returns)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return strides[::-1]


class Plan:
    """One launch fixed for one key: ``grid``, the ``scalars`` after the tensor arguments, the constexprs and
    options (``meta``), the compiled kernels it resolved to (``bound``), and what else the op needs (``info``).

    ``grid`` None: nothing to launch (an empty tensor). ``standard``: see :func:`empty_same`."""

    __slots__ = ("grid", "scalars", "meta", "bound", "info", "standard")

    def __init__(self, grid: tuple[int, ...] | None, scalars: Sequence[Any] = (), meta: dict | None = None,
                 info: Any = None, standard: bool = False) -> None:
        self.grid = None if grid is None else tuple(int(g) for g in grid)
        self.scalars = tuple(scalars)
        self.meta = dict(meta or {})
        self.bound = Bound()
        self.info = info
        self.standard = standard  # the op's main input has the contiguous strides (outputs like it: empty_same)


class PlanCache(dict):
    """The plans of one op by key (:func:`layout_key` of each tensor plus the op's flags); ``builds`` counts the
    misses (a plan built). A dict, so a hit is one C lookup; cleared when full (keys are shapes: few per model)."""

    def __init__(self, name: str, maxsize: int = 512) -> None:
        super().__init__()
        self.name, self.maxsize, self.builds = name, maxsize, 0

    def add(self, key: Any, plan: Any) -> Any:
        self.builds += 1
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = plan
        return plan


PLAN_CACHES: dict[str, PlanCache] = {}


def plan_cache(name: str) -> PlanCache:
    """The plan cache named ``name`` (one per op entry point; tests read ``builds`` and clear them)."""
    return PLAN_CACHES.setdefault(name, PlanCache(name))


def clear_plans() -> None:
    """Forget every cached plan and bound kernel (after changing a module-level launch default by hand)."""
    for cache in PLAN_CACHES.values():
        cache.clear()


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
    if cap is _ROUTE_MEMO[0]:  # detect() returns one object per machine (or per override): decided once each
        return _ROUTE_MEMO[1]
    route = cap.triton_route
    if route in (None, capability.ROUTE_INTERPRETER):
        raise RuntimeError(
            f"{_kernel_name(kernel)}: Triton compiled this kernel for a GPU, but this process has no route to one "
            f"({cap.describe()}: {cap.triton_unusable_reason() or 'no GPU'}); import fleet_ext.ops before Triton "
            "so that a machine without a GPU selects the interpreter"
        )
    _ROUTE_MEMO[:] = [cap, route]
    return route


_ROUTE_MEMO: list[Any] = [None, None]  # (the capability object, its GPU route)


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


class TritonRuntime:
    """What a bound launch asks Triton for (``TRITON_RUNTIME``; tests replace it to fake a GPU): the active driver
    (``get_current_device()``, ``get_current_stream(device)``, as ``JITFunction.run`` asks it) and the launch hooks."""

    _driver: Any = None  # Triton's active driver's two getters, looked up on first use (one driver per process)
    _knobs: Any = None  # triton.knobs.runtime (holds the launch hook chains)

    def driver(self) -> Any:
        if self._driver is None:
            from triton.runtime.driver import driver

            TritonRuntime._driver = _Getters(driver.active)
        return self._driver

    def hooks(self) -> tuple[Any, Any]:
        """(enter, exit) launch hooks for the launcher: None for a hook chain with nothing in it (a profiler such as
        Proton adds to them; empty, they would only cost two calls and a metadata dict per launch)."""
        if self._knobs is None:
            from triton import knobs

            TritonRuntime._knobs = knobs.runtime
        runtime = self._knobs
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        # a HookChain is live when its list has calls; a hook set by hand (a plain callable) always is
        if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
            return enter, leave
        return None, None


class _Getters:
    """The driver's current device and stream getters. Where the device getter is ``torch.cuda.current_device``
    (Triton's CUDA driver), torch's C getter it wraps: the wrapper re-checks CUDA's lazy initialisation on every
    call (0.47 µs on the H200's host, ``scripts/bench/probe_alloc.py``), and a bound launch follows a launch that
    initialised CUDA."""

    __slots__ = ("get_current_device", "get_current_stream")

    def __init__(self, active: Any) -> None:
        self.get_current_device, self.get_current_stream = active.get_current_device, active.get_current_stream
        torch = sys.modules.get("torch")
        c_getter = getattr(getattr(torch, "_C", None), "_cuda_getDevice", None)
        wrapper = getattr(getattr(torch, "cuda", None), "current_device", None)
        if c_getter is not None and self.get_current_device is wrapper:
            self.get_current_device = c_getter


TRITON_RUNTIME = TritonRuntime()
_NO_HOOKS = (None, None)
_TORCH = capability.ROUTE_TORCH
# torch.Tensor's is_cuda getter and data_ptr (the int fast path's per-tensor reads, as unbound C methods) and
# torch.empty_like (empty_same): looked up on first use, as this module imports no framework
_IS_CUDA: Any = None
_DATA_PTR: Any = None
_EMPTY_LIKE: list[Any] = []


def _torch_accessors() -> bool:
    global _IS_CUDA, _DATA_PTR
    if _DATA_PTR is None:
        import torch

        _IS_CUDA, _DATA_PTR = torch.Tensor.is_cuda.__get__, torch.Tensor.data_ptr
        _EMPTY_LIKE.append(torch.empty_like)
    return True


class Bound:
    """The compiled kernels one :class:`Plan` resolved to, by (device, mask of pointer arguments off 16 bytes).

    The plan fixes every non-tensor argument and every constexpr and option, and the tensors' dtypes (its key),
    so Triton's specialisation of a launch can differ only in the pointers' 16-byte alignment (``*fp32`` with or
    without ``D``) and the device. ``misses`` counts the launches that went through ``kernel[grid]``. What a
    repeat launch does not redo from ``JITFunction.run``: its pre-run hooks (none on these kernels), its check that
    the kernel's global variables kept their compile-time values, and a re-read of the debug knobs.

    Once a launch on the torch route has bound (``ready``: the capability it was decided under), :func:`fire`
    skips the route decision and the keyword plumbing of :func:`launch` too (the plan's grid, scalars and
    constexprs are already known): one alignment mask, one dict lookup, the device's stream, the launcher.
    """

    __slots__ = ("tail", "slots", "compiled", "misses", "ready", "name", "grid3", "rest", "pointers")

    def __init__(self) -> None:
        self.tail: tuple | None = None  # the constexprs after the positional arguments, in parameter order
        self.slots: tuple[int, ...] = ()  # positions of the pointer (tensor) arguments
        self.compiled: dict[tuple[int, int], Any] = {}
        self.misses = 0
        self.ready: Any = None  # the capability under which the torch route bound this plan (for fire)
        self.name = ""  # the kernel's name (launch counter)
        self.grid3: tuple[int, int, int] = (1, 1, 1)
        self.rest: tuple | None = None  # the plan's scalars then ``tail``: what follows the tensors in fire
        self.pointers = False  # every tensor fire passes is a pointer argument (the int fast path applies)

    def launch(self, kernel: Any, grid: Sequence[int], args: Sequence[Any], meta: dict) -> None:
        if self.tail is None:
            self.tail, self.slots = _layout(kernel, args, meta)
            self.grid3 = (*grid, 1, 1)[:3]
        if self.tail is False:  # not a kernel this knows how to bind
            self.misses += 1
            kernel[grid](*args, **meta)
            return
        if not self._send(args, (*args, *self.tail)):  # the first launch here (Triton compiles) or unbindable
            self.misses += 1
            compiled = kernel[grid](*args, **meta)
            key = self._key(TRITON_RUNTIME.driver(), args)
            if key not in self.compiled:
                self.compiled[key] = _entry(compiled)

    def fire(self, tensors: Sequence[Any], scalars: Sequence[Any]) -> bool:
        """Launch on ``tensors`` (then the plan's ``scalars``) straight through the compiled kernel; False when
        this device and alignment have no compiled kernel yet (the caller takes :func:`launch`).

        The common case (every tensor a CUDA tensor, no hooks, no scratch buffers) reads each data pointer once,
        for the alignment and for the launcher: the C launcher takes an int as the address itself, where for a
        tensor it would call ``data_ptr()`` again and ask the driver whether the address is a device one
        (``cuPointerGetAttribute``, per pointer and launch). ``is_cuda`` stands in for that check: anything else
        (a CPU tensor with a bound plan's layout) takes the tensors as they are, so Triton raises as it did."""
        rest = self.rest
        if rest is None:
            rest = self.rest = (*scalars, *self.tail)
            self.pointers = self.slots == tuple(range(len(tensors))) and _torch_accessors()
        if self.pointers:
            try:
                ptrs = tuple(map(_DATA_PTR, tensors))
                on_gpu = all(map(_IS_CUDA, tensors))
            except TypeError:  # not torch tensors
                on_gpu = False
            if on_gpu:
                mask = 0
                for ptr in ptrs:
                    if ptr & 15:  # some pointer off 16 bytes: the mask of which (as _key)
                        mask = sum(1 << i for i, p in enumerate(ptrs) if p & 15)
                        break
                runtime = TRITON_RUNTIME
                driver = runtime.driver()
                device = driver.get_current_device()
                entry = self.compiled.get((device, mask))
                if not entry:
                    return False
                direct = entry.direct
                if direct is not None and runtime.hooks() == _NO_HOOKS:
                    raw, function, cooperative, pdl, packed = direct
                    g = self.grid3
                    raw(g[0], g[1], g[2], driver.get_current_stream(device), function, cooperative, pdl, None, None,
                        packed, None, None, None, *ptrs, *rest)
                    return True
        return self._send(tensors, (*tensors, *rest))

    def _key(self, driver: Any, args: Sequence[Any]) -> tuple[int, int]:
        align = 0
        for i in self.slots:
            if args[i].data_ptr() & 15:
                align |= 1 << i
        return driver.get_current_device(), align

    def _send(self, args: Sequence[Any], full: tuple) -> bool:
        """Hand ``full`` (every kernel argument, constexprs last) to the compiled kernel's launcher; False when
        there is none for this device and alignment."""
        runtime = TRITON_RUNTIME
        driver = runtime.driver()
        key = self._key(driver, args)
        entry = self.compiled.get(key)
        if not entry:
            return False
        stream = driver.get_current_stream(key[0])
        enter, leave = runtime.hooks()
        g = self.grid3
        if enter is None and leave is None:
            if entry.direct is not None:  # no scratch buffers to allocate: the C launcher itself
                raw, function, cooperative, pdl, packed = entry.direct
                raw(g[0], g[1], g[2], stream, function, cooperative, pdl, None, None, packed, None, None, None, *full)
            else:
                entry.run(g[0], g[1], g[2], stream, entry.function, entry.packed, None, None, None, *full)
            return True
        metadata = entry.compiled.launch_metadata(g, stream, *full)
        entry.run(g[0], g[1], g[2], stream, entry.function, entry.packed, metadata, enter, leave, *full)
        return True


class _Compiled:
    """What a bound launch needs of one compiled kernel: its launcher (``run``), function handle and packed
    metadata, and ``direct``: the C launcher with its fixed flags when the kernel needs no scratch buffers
    (Triton's Python launcher would only decide that again on every call), else None."""

    __slots__ = ("run", "function", "packed", "compiled", "direct")

    def __init__(self, compiled: Any) -> None:
        self.run, self.function, self.packed, self.compiled = (
            compiled.run, compiled.function, compiled.packed_metadata, compiled)
        launcher = self.run
        raw = getattr(launcher, "launch", None)
        scratch = (getattr(launcher, "global_scratch_size", 1), getattr(launcher, "profile_scratch_size", 1))
        flags = (getattr(launcher, "launch_cooperative_grid", None), getattr(launcher, "launch_pdl", None))
        usable = callable(raw) and scratch == (0, 0) and None not in flags
        self.direct = (raw, self.function, *flags, self.packed) if usable else None


_BINDABLE = ("JITFunction", "GluonJITFunction")


def _layout(kernel: Any, args: Sequence[Any], meta: dict) -> tuple[Any, tuple[int, ...]]:
    """(the constexpr values after ``args`` in parameter order, the pointer positions), or (False, ()) when
    ``kernel`` is not a plain Triton ``JITFunction`` (or Gluon's, which compiles to the same launcher) launched with
    positional arguments then keyword constexprs (it is then always launched through ``kernel[grid]``)."""
    params = getattr(kernel, "params", None)
    if type(kernel).__name__ not in _BINDABLE or params is None or len(args) > len(params):
        return False, ()
    if any(p.name in meta for p in params[:len(args)]):
        return False, ()
    tail = []
    for p in params[len(args):]:
        if p.name in meta:
            tail.append(meta[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return False, ()
    return tuple(tail), tuple(i for i, a in enumerate(args) if hasattr(a, "data_ptr"))


def _entry(compiled: Any) -> _Compiled | bool:
    """What a bound launch needs of a compiled kernel, or False if it lacks a launcher or a loaded function."""
    try:
        entry = _Compiled(compiled)
    except AttributeError:
        return False
    return entry if entry.function is not None else False


def _run(kernel: Any, grid: Sequence[int], args: Sequence[Any], meta: dict, bound: Bound | None) -> None:
    if bound is not None and BOUND_LAUNCH:
        bound.launch(kernel, grid, args, meta)
    else:
        kernel[grid](*args, **meta)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, bound: Bound | None = None, **meta: Any) -> None:
    """Run ``kernel[grid](*args, **meta)`` on the route of this machine (see the module docstring); count it.

    Decided here, at launch and not at import (kernel modules import without Paddle or torch): an
    interpreted kernel gets the interpreter's scalar-index fix first. ``bound`` (a :class:`Plan`'s) lets a
    compiled kernel be launched directly on a repeat call; the caller promises that every non-tensor argument,
    the constexprs and the tensors' dtypes are the same at every launch with it.
    """
    route = route_of(kernel)
    if route == capability.ROUTE_INTERPRETER:
        fix_scalar_index()
        kernel[grid](*[torch_view(a) if is_paddle(a) and _is_tensor(a) else a for a in args], **meta)
    elif route == capability.ROUTE_TORCH:
        _run(kernel, grid, args, meta, bound)
        if bound is not None and bound.ready is None and isinstance(bound.tail, tuple):
            bound.ready, bound.name = capability.detect(), _kernel_name(kernel)
    else:
        with _routed(route, kernel, args) as adapted:
            _run(kernel, grid, adapted, meta, bound)
    LAUNCH_COUNTS[_kernel_name(kernel)] += 1
    ROUTE_COUNTS[route] += 1


def fire(kernel: Any, plan: Plan, *tensors: Any) -> None:
    """Launch ``plan`` (the op's plan for these tensors' layouts) on ``tensors``, its scalars after them.

    The host's fast path for a repeat call (issue 16 §4): once the plan has bound on the torch route under the
    current capability, the launch goes straight to the compiled kernel (:meth:`Bound.fire`); anything else (the
    first call, another route, the interpreter, a new device or alignment) goes through :func:`launch`.
    """
    bound = plan.bound
    ready = bound.ready  # None until the plan launched once on the torch route (never for an empty grid)
    if ready is not None and ready is capability.detect() and BOUND_LAUNCH:
        if bound.fire(tensors, plan.scalars):
            LAUNCH_COUNTS[bound.name] += 1
            ROUTE_COUNTS[_TORCH] += 1
            return
    if plan.grid is None:
        return
    launch(kernel, plan.grid, *tensors, *plan.scalars, bound=bound, **plan.meta)
