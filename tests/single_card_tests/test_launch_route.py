"""The launch route (issue 9): how a Triton launch reaches the device, decided by ``fleet_ext.capability``.

What runs for real here: Triton interpreter launches through ``fleet_ext.ops.launch``; Paddle 3.3.1's torch proxy
binding Triton 3.6's driver to Paddle's current device and stream (in a subprocess: the proxy changes how
``torch`` imports resolve); Triton's binder typing Paddle tensors. What cannot exist here is faked: the machine
(``capability.override``) and a GPU runtime (``launch.PADDLE_GPU`` / ``launch.TORCH_GPU``), with a stand-in for a
compiled kernel that reads its device and stream the way Triton's ``JITFunction.run`` does.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
import torch
import triton
import triton.language as tl

from fleet_ext import capability
from fleet_ext.capability import Capability
from fleet_ext.config import load_config
from fleet_ext.ops import launch
from fleet_ext.registry import check_capability
from fleet_ext.specs.backend import BackendProvider
from fleet_ext.training.summary import triton_route_summary

ROOT = Path(__file__).resolve().parents[2]
H200 = {"triton": True, "gpu": True, "sm": (9, 0)}
PROXY = Capability(**H200, torch=False, paddle_gpu=True, paddle_proxy=True, device=0)
DLPACK = Capability(**H200, torch=True, paddle_gpu=True, torch_cuda=True, device=0,
                    proxy_problem="Paddle 3.2.0 has no Triton proxy (paddle.compat.enable_torch_proxy: Paddle >= 3.3)")
TORCH_GPU = Capability(**H200, torch=True)
NO_ROUTE = Capability(**H200, torch=True, paddle_gpu=True, device=3, proxy_problem=DLPACK.proxy_problem)
CPU = Capability(triton=True, torch=True, gpu=False, sm=None)


# -- the route each machine gets, and its name in the start-up table ------------------------------------------


@pytest.mark.parametrize("cap, route, name", [
    (CPU, "interpreter", "triton (interpreter)"),
    (TORCH_GPU, "torch", "triton (torch)"),
    (Capability(**{**PROXY.__dict__, "device": 3}), "paddle proxy", "triton (paddle proxy, cuda:3)"),
    (Capability(**{**DLPACK.__dict__, "device": 3}), "torch via DLPack",
     "triton (torch via DLPack on Paddle's stream, cuda:3)"),
    (NO_ROUTE, None, "no Triton route (Triton has no route to Paddle's GPU: Paddle 3.2.0 has no Triton proxy"),
], ids=["cpu", "gpu_torch_only", "paddle_proxy", "paddle_no_proxy_cuda_torch", "paddle_neither"])
def test_capability_chooses_and_names_the_route(cap, route, name):
    assert cap.triton_route == route
    assert cap.route_name().startswith(name), cap.route_name()


def test_this_machine_is_detected_as_the_interpreter_route():
    cap = capability.detect()
    assert (cap.gpu, cap.paddle_gpu, cap.triton_route, cap.route_name()) == (
        False, False, "interpreter", "triton (interpreter)")


def test_the_start_up_table_row_names_the_route():
    config = load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml", apply_rope_fusion=True)
    assert triton_route_summary(config, Capability(**{**PROXY.__dict__, "device": 3})) == (
        "triton (paddle proxy, cuda:3) for 1 switch(es)")
    assert triton_route_summary(load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml"), CPU) == (
        "triton (interpreter); unused (no Triton switch on)")


def test_a_paddle_gpu_without_proxy_or_cuda_torch_fails_the_gate_naming_the_fix():
    config = load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml", apply_rope_fusion=True)
    with capability.override(NO_ROUTE), pytest.raises(ValueError) as raised:
        BackendProvider(config)
    message = str(raised.value)
    assert message.startswith("config key `apply_rope_fusion` = True cannot run on this machine (Paddle GPU sm90): "
                              "Triton has no route to Paddle's GPU: Paddle 3.2.0 has no Triton proxy"), message
    assert "torch has no CUDA" in message and "install paddlepaddle-gpu >= 3.3" in message
    assert "or a CUDA build of torch" in message
    for routed in (PROXY, DLPACK):  # either route is enough
        check_capability(config, routed)
    check_capability(load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml"), NO_ROUTE)  # no Triton switch: no error


def test_the_pretraining_start_up_exits_2_before_building_a_model(tmp_path, capsys, monkeypatch):
    import paddle.distributed as dist

    from fleet_ext.models import DSv4ForCausalLM
    from fleet_ext.training.cli import main

    built = []
    monkeypatch.setattr(DSv4ForCausalLM, "__init__", lambda self, *a, **k: built.append(1))
    out = tmp_path / "run"
    with capability.override(NO_ROUTE):
        code = main(["--config", str(ROOT / "configs" / "dsv4_tiny_cpu.yaml"), "--output_dir", str(out),
                     "--max_steps", "2", "--warmup_steps", "1", "--dsv4_q_rms_norm_fusion", "true"])
    printed = capsys.readouterr()
    assert code == 2, printed.out + printed.err
    assert "`dsv4_q_rms_norm_fusion` = True cannot run on this machine (Paddle GPU sm90): Triton has no route to " \
           "Paddle's GPU" in printed.err
    assert "Traceback" not in printed.err and built == [] and not dist.is_initialized() and not out.exists()


# -- real interpreter launches ----------------------------------------------------------------------------------


@triton.jit
def _axpy_kernel(X, Y, a, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, a * tl.load(X + offs, mask=mask) + tl.load(Y + offs, mask=mask), mask=mask)


def _counts() -> tuple[int, int]:
    return launch.LAUNCH_COUNTS["_axpy_kernel"], launch.ROUTE_COUNTS["interpreter"]


@pytest.mark.parametrize("cap", [None, PROXY, TORCH_GPU], ids=["detected", "faked_paddle_proxy", "faked_torch_gpu"])
def test_an_interpreted_kernel_takes_the_interpreter_route_with_paddle_and_torch_tensors(cap):
    """Paddle tensors reach the interpreter as DLPack views (the kernel's writes land in them), torch tensors as
    they are; an interpreted kernel takes that route whatever the (faked) machine says."""
    assert launch.is_interpreted(_axpy_kernel)
    x = paddle.arange(10, dtype="float32")
    y = paddle.ones([10], dtype="float32")
    xt, yt = torch.arange(10, dtype=torch.float32), torch.ones(10)
    before = _counts()
    with capability.override(cap) if cap else contextlib.nullcontext():
        launch.launch(_axpy_kernel, (2,), x, y, 2.0, 10, BLOCK=8)
        launch.launch(_axpy_kernel, (2,), xt, yt, 3.0, 10, BLOCK=8)
    assert np.array_equal(y.numpy(), 2 * np.arange(10, dtype=np.float32) + 1)
    assert torch.equal(yt, 3 * torch.arange(10, dtype=torch.float32) + 1)
    assert _counts() == (before[0] + 2, before[1] + 2)


def test_triton_types_paddle_tensors_as_pointers():
    """Triton's binder (which the compiled routes hand Paddle tensors to) reads their dtype and data pointer."""
    from triton.runtime.jit import mangle_type

    kinds = [mangle_type(paddle.ones([2], dtype=d)) for d in ("bfloat16", "float32", "int64", "int32")]
    assert kinds == ["*bf16", "*fp32", "*i64", "*i32"]


# -- compiled routes, with the GPU runtime faked ----------------------------------------------------------------


class FakePaddleGpu:
    """Paddle GPU build with 8 GPUs, as the routes see it. ``homes`` says which GPU each tensor lives on (Paddle
    CPU tensors stand in for the data); ``paddle_device`` is Paddle's current device (the expected place),
    ``cuda_device`` the CUDA current device, ``streams`` each GPU's current Paddle stream."""

    def __init__(self, homes: dict[int, int]) -> None:
        self.homes, self.paddle_device, self.cuda_device = homes, 0, 0
        self.streams = {i: 0x7000 + i for i in range(8)}

    def device_index(self, tensor):
        return self.homes.get(id(tensor))

    @contextlib.contextmanager
    def device_guard(self, index):
        saved = self.paddle_device, self.cuda_device
        self.paddle_device = self.cuda_device = index
        try:
            yield
        finally:
            self.paddle_device, self.cuda_device = saved

    def current_stream(self, index):
        return self.streams[index]


class FakeTorchGpu:
    """torch's current device and stream (default stream 0) as the DLPack route sets them."""

    def __init__(self) -> None:
        self.device, self.stream, self.entered = 0, 0, []

    @contextlib.contextmanager
    def on(self, index, stream):
        self.entered.append((index, stream))
        saved = self.device, self.stream
        self.device, self.stream = index, stream
        try:
            yield
        finally:
            self.device, self.stream = saved


class CompiledKernel:
    """A compiled Triton kernel's launch as seen from outside: Triton 3.6's ``JITFunction.run`` asks its driver for
    ``get_current_device()`` and ``get_current_stream(device)`` and launches there. ``driver`` gives those two
    functions (Paddle's under the proxy, as ``test_paddle_proxy_binds_tritons_driver...`` shows; torch's else)."""

    __name__ = "_compiled_stand_in_kernel"

    def __init__(self, driver) -> None:
        self.driver, self.launches = driver, []

    def __getitem__(self, grid):
        def run(*args, **meta):
            device = self.driver()[0]
            self.launches.append({"device": device, "stream": self.driver()[1](device), "args": args, "meta": meta})
        return run


@pytest.fixture
def fake_gpus(monkeypatch):
    x, y = paddle.arange(6, dtype="float32"), paddle.zeros([6], dtype="float32")
    fake_paddle = FakePaddleGpu({id(x): 3, id(y): 3})
    fake_torch = FakeTorchGpu()
    monkeypatch.setattr(launch, "PADDLE_GPU", fake_paddle)
    monkeypatch.setattr(launch, "TORCH_GPU", fake_torch)
    return x, y, fake_paddle, fake_torch


def test_paddle_proxy_route_launches_on_the_tensors_gpu_and_its_paddle_stream(fake_gpus):
    x, y, gpu, _ = fake_gpus
    kernel = CompiledKernel(lambda: (gpu.paddle_device, gpu.current_stream))
    before = launch.ROUTE_COUNTS["paddle proxy"], launch.LAUNCH_COUNTS[kernel.__name__]
    with capability.override(PROXY):
        launch.launch(kernel, (1,), x, y, 6, BLOCK=8)
        restored = gpu.paddle_device, gpu.cuda_device
        gpu.streams[3] = 0x9999  # the caller switched Paddle's stream on GPU 3 (paddle.device.stream_guard)
        launch.launch(kernel, (1,), x, y, 6, BLOCK=8)
    first, second = kernel.launches
    assert (first["device"], first["stream"]) == (3, 0x7003)  # tensors on gpu:3 while Paddle's current was 0
    assert second["stream"] == 0x9999
    assert first["args"][0] is x and first["args"][1] is y and first["meta"] == {"BLOCK": 8}  # Paddle tensors as is
    assert restored == (gpu.paddle_device, gpu.cuda_device) == (0, 0)  # restored after each launch
    assert (launch.ROUTE_COUNTS["paddle proxy"], launch.LAUNCH_COUNTS[kernel.__name__]) == (
        before[0] + 2, before[1] + 2)


def test_paddle_proxy_route_sets_the_cuda_device_during_the_launch(fake_gpus):
    """Triton loads a kernel into the CUDA current device's context: the guard moves it too, for the launch only."""
    x, y, gpu, _ = fake_gpus
    kernel = CompiledKernel(lambda: (gpu.cuda_device, gpu.current_stream))
    with capability.override(PROXY):
        launch.launch(kernel, (1,), x, y, 6)
    assert kernel.launches[0]["device"] == 3 and gpu.cuda_device == 0


def test_paddle_proxy_route_refuses_tensors_on_two_gpus_or_on_the_cpu(fake_gpus):
    x, y, gpu, _ = fake_gpus
    kernel = CompiledKernel(lambda: (gpu.paddle_device, gpu.current_stream))
    gpu.homes[id(y)] = 5
    with capability.override(PROXY), pytest.raises(ValueError, match=r"_compiled_stand_in_kernel: Paddle tensor "
                                                   r"arguments on GPUs \[3, 5\].*arg 0: gpu:3, arg 1: gpu:5"):
        launch.launch(kernel, (1,), x, y, 6)
    del gpu.homes[id(y)]
    with capability.override(PROXY), pytest.raises(ValueError, match=r"argument\(s\) \[1\] are Paddle CPU tensors"):
        launch.launch(kernel, (1,), x, y, 6)
    assert kernel.launches == []


def test_dlpack_route_hands_torch_views_and_launches_on_paddles_stream(fake_gpus):
    x, y, gpu, torch_gpu = fake_gpus
    kernel = CompiledKernel(lambda: (torch_gpu.device, lambda device: torch_gpu.stream))
    with capability.override(DLPACK):
        launch.launch(kernel, (1,), x, y, 6)
    (seen,) = kernel.launches
    assert (seen["device"], seen["stream"]) == (3, 0x7003) and torch_gpu.entered == [(3, 0x7003)]
    assert all(isinstance(a, torch.Tensor) for a in seen["args"][:2]) and seen["args"][2] == 6
    assert seen["args"][1].data_ptr() == y.data_ptr()  # a view of the Paddle tensor, not a copy
    assert (torch_gpu.device, torch_gpu.stream) == (0, 0)


def test_torch_route_passes_torch_tensors_as_they_are(fake_gpus):
    _, _, _, torch_gpu = fake_gpus
    xt, yt = torch.ones(4), torch.zeros(4)
    kernel = CompiledKernel(lambda: (torch_gpu.device, lambda device: torch_gpu.stream))
    before = launch.ROUTE_COUNTS["torch"]
    with capability.override(TORCH_GPU):
        launch.launch(kernel, (1,), xt, yt, 4)
    assert kernel.launches[0]["args"][0] is xt and kernel.launches[0]["args"][1] is yt
    assert torch_gpu.entered == [] and launch.ROUTE_COUNTS["torch"] == before + 1


def test_a_compiled_kernel_without_a_gpu_route_raises_naming_the_kernel(fake_gpus):
    kernel = CompiledKernel(lambda: (0, lambda device: 0))
    for cap in (CPU, NO_ROUTE):
        with capability.override(cap), pytest.raises(RuntimeError, match="_compiled_stand_in_kernel: Triton compiled "
                                                     "this kernel for a GPU, but this process has no route"):
            launch.launch(kernel, (1,), torch.ones(2))


# -- Paddle's proxy, for real: Triton's driver bound to Paddle's device and stream --------------------------------

# Runs in a fresh interpreter: the proxy changes how `torch` imports resolve, so it must not touch the test process.
# A stand-in for Triton's CUDA driver (which needs a GPU to start) runs the same binding code: CudaDriver's
# __init__ calls GPUDriver.__init__, which imports torch and binds the device and stream queries.
_PROBE = r"""
import json, sys
case = sys.argv[1]
if case == "torch_first":
    import torch
if case == "triton_first":
    import triton
from fleet_ext import capability
import paddle


def stand_in():
    from triton.backends.driver import GPUDriver

    class StandIn(GPUDriver):
        is_active = map_python_to_cpp_type = get_current_target = get_active_torch_device = get_benchmarker = None

    return StandIn()


if case == "started_before":  # Triton's driver started through the real torch, before fleet_ext asked
    import torch
    early = stand_in()
    problem = capability.paddle_proxy_problem(start_driver=lambda: early)
    driver = early
else:
    started = []
    problem = capability.paddle_proxy_problem(start_driver=lambda: started.append(stand_in()) or started[0])
    driver = started[0]
import torch  # what the rest of the process gets afterwards
print(json.dumps({
    "problem": problem,
    "device_is_paddles": driver.get_current_device is paddle.cuda.current_device,
    "stream_is_paddles": driver.get_current_stream is paddle._C._cuda_getCurrentRawStream,
    "set_device_is_paddles": driver.set_current_device is paddle.cuda.set_device,
    "torch_afterwards": [type(torch).__name__, getattr(torch, "__version__", "")[:2]],
}))
"""


def _probe(case: str) -> dict:
    run = subprocess.run([sys.executable, "-c", _PROBE, case], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["fresh", "torch_first", "triton_first"])
def test_paddle_proxy_binds_tritons_driver_to_paddles_device_and_stream(case):
    """Paddle 3.3.1's proxy: Triton's driver reads Paddle's current device and stream, whether torch or Triton
    was imported first; code outside Triton keeps the real torch."""
    result = _probe(case)
    assert result == {"problem": None, "device_is_paddles": True, "stream_is_paddles": True,
                      "set_device_is_paddles": True, "torch_afterwards": ["module", "2."]}, result


def test_a_driver_started_through_torch_is_reported_not_bound():
    """Negative control of the check: a driver that read torch's device and stream is named, with the reason."""
    result = _probe("started_before")
    assert result["problem"] == ("Triton's driver does not read Paddle's device and stream (it was started before "
                                 "fleet_ext, through torch)"), result
    assert not result["device_is_paddles"] and not result["stream_is_paddles"]
