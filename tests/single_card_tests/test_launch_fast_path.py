"""The host fast path of a bound launch (issue 16 §4): data pointers as ints, and outputs from ``torch.empty_like``.

On a faked GPU (Triton's driver and a compiled kernel stand in: no GPU here; CPU tensors play CUDA tensors by
swapping the ``is_cuda`` read of :mod:`fleet_ext.ops.launch`), a repeat :func:`~fleet_ext.ops.launch.fire` hands
Triton's C launcher each tensor's address as an int (the launcher then skips its per-pointer ``data_ptr()`` call and
driver query), and keeps the tensors themselves for anything it cannot vouch for: a tensor that is not on the GPU
(Triton's own check then raises, as before), a 16-byte-misaligned pointer (its own compiled variant, still ints).
:func:`~fleet_ext.ops.launch.empty_same` gives the exact layout of ``new_empty(shape)`` (what it replaces).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import fleet_ext.ops  # noqa: F401 - interpreter mode before the kernel imports
from fleet_ext import capability
from fleet_ext.capability import Capability
from fleet_ext.ops import launch


def _device_code(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pass  # never compiled: the stand-in below plays the compiled kernel


class Launcher:
    """Triton's launcher of a compiled kernel: its C ``launch`` (recorded) and the flags it passes on."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, False

    def __init__(self) -> None:
        self.direct: list[tuple] = []

    def __call__(self, *args):
        raise AssertionError("the Python launcher: only with hooks or scratch buffers")

    def launch(self, *args):
        self.direct.append(args)


class Compiled:
    function, packed_metadata = 0xF00, "packed"

    def __init__(self) -> None:
        self.run = Launcher()


class JITFunction(triton.runtime.jit.JITFunction):
    """Triton's JITFunction by name (what the bound launch accepts), its parameters real; its
    ``kernel[grid](...)`` compiles nothing and returns the stand-in."""

    def __init__(self, fn) -> None:
        super().__init__(fn)
        self.slow = 0
        self.compiled = Compiled()

    def run(self, *args, grid, warmup, **kwargs):
        self.slow += 1
        return self.compiled


class Runtime:
    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0x5000 + device

    def driver(self):
        return self.Driver()

    def hooks(self):
        return None, None


@pytest.fixture
def gpu(monkeypatch):
    """A faked GPU on which CPU tensors count as CUDA tensors (``on_gpu``: the tensors that do)."""
    on_gpu: set[int] = set()
    monkeypatch.setattr(launch, "TRITON_RUNTIME", Runtime())
    monkeypatch.setattr(launch, "BOUND_LAUNCH", True)
    launch._torch_accessors()
    monkeypatch.setattr(launch, "_IS_CUDA", lambda t: id(t) in on_gpu)
    with capability.override(Capability(triton=True, torch=True, gpu=True, sm=(9, 0))):
        yield on_gpu


def test_a_repeat_launch_passes_the_addresses_as_ints(gpu):
    kernel, plan = JITFunction(_device_code), launch.Plan((2,), (7,), dict(BLOCK=4))
    x, y = torch.ones(8), torch.zeros(8)
    gpu.update({id(x), id(y)})
    for _ in range(3):
        launch.fire(kernel, plan, x, y)
    assert kernel.slow == 1  # the first launch compiles (through kernel[grid]); the next two go straight
    head = (2, 1, 1, 0x5000, 0xF00, False, False, None, None, "packed", None, None, None)
    assert kernel.compiled.run.direct == [(*head, x.data_ptr(), y.data_ptr(), 7, 4)] * 2
    off = torch.ones(9)[1:]  # 4 bytes past a 16-byte boundary: Triton compiles that pointer apart
    gpu.add(id(off))
    launch.fire(kernel, plan, off, y), launch.fire(kernel, plan, off, y)
    assert kernel.slow == 2 and set(plan.bound.compiled) == {(0, 0), (0, 1)}
    assert kernel.compiled.run.direct[-1] == (*head, off.data_ptr(), y.data_ptr(), 7, 4)


def test_a_tensor_off_the_gpu_is_handed_over_as_a_tensor(gpu):
    """The control: the int path only for tensors on the GPU; else Triton gets the tensor (and its own check)."""
    kernel, plan = JITFunction(_device_code), launch.Plan((1,), (7,), dict(BLOCK=4))
    x, y, cpu = torch.ones(8), torch.zeros(8), torch.zeros(8)
    gpu.update({id(x), id(y)})
    launch.fire(kernel, plan, x, y), launch.fire(kernel, plan, x, cpu)
    assert kernel.compiled.run.direct[-1][-4:] == (x, cpu, 7, 4)  # tensors, not ints
    launch.fire(kernel, plan, x, y)
    assert kernel.compiled.run.direct[-1][-4:] == (x.data_ptr(), y.data_ptr(), 7, 4)


@pytest.mark.parametrize("make", [lambda: torch.randn(2, 3, 4), lambda: torch.randn(1, 3, 1, 4),
                                  lambda: torch.randn(4, 3).t(), lambda: torch.randn(2, 6)[:, ::2],
                                  lambda: torch.randn(3, 1, 4).as_strided((3, 1, 4), (4, 99, 1))])
def test_empty_same_gives_the_layout_of_new_empty(make):
    """``torch.empty_like`` where the plan found the contiguous strides, ``new_empty(shape)`` elsewhere: the same
    shape, dtype and strides either way (a transposed, a strided and an odd size-1 stride fall back)."""
    x = make()
    got, want = launch.empty_same(x, launch.is_standard(x)), x.new_empty(x.shape)
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
    assert launch.is_standard(x) == (x.stride() == want.stride())
