"""Host cost of the fused ops' launchers (issue 16 §4), checked by structure, not by timing.

What a launch repeats for the same shapes is done once (``fleet_ext.ops.launch``): an op's launcher looks a
:class:`~fleet_ext.ops.launch.Plan` up by its tensors' layouts and flags, and builds one (checks, block sizes,
strides, default order) only on a miss; a plan's :class:`~fleet_ext.ops.launch.Bound` goes straight to the kernel
Triton compiled for it on a repeat GPU launch. Here, with a counting stub in place of the Triton launch
(``kernel[grid](...)``):

- the second call of every op with new tensors of the same layouts builds no plan, runs no argument check and
  misses no ``lru_cache`` (the third, with another shape, builds one: the control), and launches the same kernels;
- a plan never serves another layout (strided and contiguous inputs give the eager result, for real), invalid
  arguments raise the same errors on every call, and a changed tuning knob re-plans;
- plans hold only data (no tensors);
- the bound launch, on a faked GPU (Triton's driver and a compiled kernel stand in: no GPU here), passes the
  compiled kernel's launcher the arguments, the constexprs in parameter order, the device's stream, and hooks
  only when some are registered; a new pointer alignment, device or an unbindable kernel goes through
  ``kernel[grid]``.

A report of the µs per call with the launch stubbed (CPU host overhead, not the H200 figure) is printed by
``test_report_host_us_per_call`` (``pytest -s``), beside the numbers measured before the plans existed.
"""

from __future__ import annotations

import time

import paddle
import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_bitwise, expect_launches
from helpers.torch_rope import eager_rope

import fleet_ext.ops  # noqa: F401 - interpreter mode before the kernel imports
from fleet_ext import capability
from fleet_ext.capability import Capability
from fleet_ext.ops import launch
from fleet_ext.ops.inv_rope_postmix import kernel_fast as postmix
from fleet_ext.ops.kv_idx_remap import kernel as remap
from fleet_ext.ops.q_rms_norm import kernel as q_norm
from fleet_ext.ops.q_rms_norm import kernel_order
from fleet_ext.ops.qkv_prologue import kernel as prologue
from fleet_ext.ops.rope import function as rope_function
from fleet_ext.ops.rope import kernel as rope
from fleet_ext.ops.sink_grad import kernel as sink

CHECKS = [(rope, "check_args"), (remap, "check_args"), (q_norm, "check_q"), (sink, "check_args"),
          (prologue, "check_args"), (prologue, "_check_r"), (postmix, "check_fast_args")]
LRU = [rope._plan, kernel_order._torch_cuda_order]


@pytest.fixture(autouse=True)
def _bound_launch_on(monkeypatch):
    """These tests check the bound launch itself: on even if a caller turned the library default off."""
    monkeypatch.setattr(launch, "BOUND_LAUNCH", True)


def _rope_in(s: int, d: int = 16, half: int = 4) -> tuple:
    return torch.randn(1, s, 2, d), torch.randn(s, half), torch.randn(s, half)


def _kv_in(s: int) -> tuple:
    return torch.randn(1, s, 16), torch.randn(s, 4), torch.randn(s, 4), torch.rand(16) + 0.5


def _torch_order(s: int) -> kernel_order.Order:
    """Torch CUDA's order for the [1, s, 2, 16] inputs (the GPU path's, whose backward can recompute r)."""
    return kernel_order.torch_cuda_order(2 * s, 16)


def _sink_in(s: int) -> tuple:
    return torch.randn(1, s, 2, 16), torch.randn(1, s, 2, 16), torch.randn(1, s, 2), torch.randn(2)


OPS = {
    "rope": lambda s: rope.rope(*_rope_in(s)),
    "rope_ (in place)": lambda s: rope.rope_(*_rope_in(s)),
    "rope_grad": lambda s: rope.rope_grad(*_rope_in(s), inverse=True),
    "rope_tail": lambda s: rope.rope_tail(*_rope_in(s), 4),
    "kv_idx_remap": lambda s: remap.local_to_global_flat(torch.randint(-1, 8, (2, s, 8), dtype=torch.int32), 64),
    "q_rms_norm stats": lambda s: q_norm.q_rms_norm_stats(torch.randn(1, s, 2, 16)),
    "q_rms_norm apply": lambda s: q_norm.q_rms_norm_apply(torch.randn(1, s, 2, 16), torch.rand(1, s, 2, 1)),
    "q_rms_norm fused": lambda s: q_norm.q_rms_norm_fused(torch.randn(1, s, 2, 16), 1e-6),
    "q_rms_norm bwd": lambda s: q_norm.q_rms_norm_bwd(torch.randn(1, s, 2, 16), torch.randn(1, s, 2, 16),
                                                      torch.rand(1, s, 2, 1), eps=1e-6),
    "sink_grad": lambda s: sink.sink_grad(*_sink_in(s)),
    "sink_grad (d_lse only)": lambda s: sink.sink_grad(None, None, *_sink_in(s)[2:], d_lse=torch.randn(1, s, 2)),
    "qkv q fused": lambda s: prologue.norm_rope_fused(_rope_in(s)[0], 1e-6, *_rope_in(s)[1:]),
    "qkv kv fused": lambda s: prologue.norm_rope_fused(_kv_in(s)[0], 1e-6, *_kv_in(s)[1:]),
    "qkv q apply": lambda s: prologue.norm_rope_apply(_rope_in(s)[0], torch.rand(1, s, 2, 1), *_rope_in(s)[1:]),
    "qkv q bwd": lambda s: prologue.norm_rope_bwd(_rope_in(s)[0], _rope_in(s)[0], torch.rand(1, s, 2, 1),
                                                  *_rope_in(s)[1:], eps=1e-6),
    # the GPU training path (torch's order): no r kept by the forward, recomputed by the backward
    "q_rms_norm fused (no r)": lambda s: q_norm.q_rms_norm_fused(torch.randn(1, s, 2, 16), 1e-6, _torch_order(s),
                                                                 keep_r=False),
    "q_rms_norm bwd (r recomputed)": lambda s: q_norm.q_rms_norm_bwd(torch.randn(1, s, 2, 16), torch.randn(1, s, 2, 16),
                                                                     None, _torch_order(s), eps=1e-6),
    "qkv q fused (no r)": lambda s: prologue.norm_rope_fused(*_rope_in(s)[:1], 1e-6, *_rope_in(s)[1:], None,
                                                             _torch_order(s), keep_r=False),
    "qkv q bwd (r recomputed)": lambda s: prologue.norm_rope_bwd(_rope_in(s)[0], _rope_in(s)[0], None,
                                                                 *_rope_in(s)[1:], order=_torch_order(s), eps=1e-6),
    "qkv kv bwd": lambda s: prologue.norm_rope_bwd(_kv_in(s)[0], *_kv_in(s)[:1], torch.rand(1, s, 1),
                                                   *_kv_in(s)[1:], eps=1e-6),
    "inv_rope_postmix fast fwd": lambda s: postmix.forward(*_rope_in(s), torch.randn(2, 2)),
    "inv_rope_postmix fast bwd": lambda s: postmix.backward(*_rope_in(s), torch.randn(2, 2),
                                                            torch.randn(1, s, 2, 16)),
}


@pytest.fixture
def stub(monkeypatch):
    """A counting stub in place of Triton's launch of an (interpreted) kernel: records (kernel name, meta)."""
    seen: list[tuple[str, dict]] = []

    def getitem(kernel, grid):
        return lambda *args, **meta: seen.append((kernel.fn.__name__, meta))

    monkeypatch.setattr(type(rope._rope_kernel), "__getitem__", getitem)
    return seen


@pytest.fixture
def checks(monkeypatch):
    """Counts the calls of every argument check of the ops (the launchers call them by module attribute)."""
    calls: list[str] = []
    for module, name in CHECKS:
        original = getattr(module, name)

        def counted(*args, _original=original, _name=f"{module.__name__}.{name}", **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def _builds() -> int:
    return sum(cache.builds for cache in launch.PLAN_CACHES.values())


def _lru_misses() -> list[int]:
    return [fn.cache_info().misses for fn in LRU]


@pytest.mark.parametrize("op", list(OPS))
def test_a_repeat_call_builds_nothing_checks_nothing_and_launches_the_same_kernels(op, stub, checks):
    launch.clear_plans()
    before = _builds()
    OPS[op](5)
    first, first_checks = list(stub), list(checks)
    assert first and first_checks and _builds() > before, (first, first_checks)
    stub.clear(), checks.clear()
    builds, misses = _builds(), _lru_misses()
    names = sorted({name for name, _ in first})
    with expect_launches(*names, exactly=None):
        OPS[op](5)  # new tensors, same layouts
    assert stub == first  # the same kernels with the same constexprs
    assert (checks, _builds(), _lru_misses()) == ([], builds, misses)
    OPS[op](6)  # the control: another shape is another plan
    assert _builds() > builds and checks


def test_the_paddle_wrapper_checks_once_per_layout(stub, checks):
    x, cos, sin = (paddle.to_tensor(t.numpy()) for t in _rope_in(5))
    rope_function.apply_partial_rope(x, cos, sin)
    assert checks
    checks.clear()
    with expect_launches("_rope_kernel", exactly=1):
        rope_function.apply_partial_rope(x * 2, cos, sin)
    assert checks == []


def test_a_plan_never_serves_another_layout():
    """Real interpreter launches: a strided view of the same shape and a transposed table take their own plans."""
    x, cos, sin = _rope_in(6)
    wide = torch.randn(1, 6, 2, 40)
    strided = wide[..., 8:24]  # same shape as x, other strides (and a data pointer off x's alignment)
    cos3, sin3 = cos.unsqueeze(0), sin.t().contiguous().t().unsqueeze(0)  # [1, s, half], sin non-contiguous
    with expect_launches("_rope_kernel", exactly=4):
        got = [rope.rope(x, cos, sin), rope.rope(strided, cos, sin), rope.rope(strided, cos3, sin3),
               rope.rope(x, cos, sin)]
    want = [eager_rope(x, cos, sin), eager_rope(strided, cos, sin), eager_rope(strided, cos, sin),
            eager_rope(x, cos, sin)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise(a, b, f"call {i}")
    with pytest.raises(AssertionError):  # the comparison can fail: x's rotation is not the strided view's
        assert_bitwise(got[0], want[1], "control")


def test_invalid_arguments_raise_the_same_error_on_every_call():
    x, cos, sin = _rope_in(4)
    rope.rope(x, cos, sin)  # a valid plan for these layouts exists
    for _ in range(2):
        with pytest.raises(ValueError, match=r"apply_partial_rope: `cos` .* and `sin` .* differ"):
            rope.rope(x, cos, sin[:, :3])
        with pytest.raises(ValueError, match=r"rope_tail: `start` must be in \[0, 8\]"):
            rope.rope_tail(x, cos, sin, 9)
        with pytest.raises(ValueError, match=r"beyond the int32 range: they would wrap around; pass int64"):
            remap.local_to_global_flat(torch.zeros(2, 3, 4, dtype=torch.int32), 2**30 + 1)
        with pytest.raises(ValueError, match=r"`seqlen_kv` must be an int, got bool True"):
            remap.local_to_global_flat(torch.zeros(2, 3, 4, dtype=torch.int32), True)


def test_a_changed_tuning_knob_re_plans(stub, monkeypatch):
    idx = torch.randint(-1, 8, (1, 64, 8), dtype=torch.int32)  # one batch: the flat path by default
    remap.local_to_global_flat(idx, 64)
    builds = _builds()
    monkeypatch.setitem(remap.TUNE, "force_2d", True)
    remap.local_to_global_flat(idx, 64)
    assert _builds() == builds + 1 and [m["FLAT"] for _, m in stub] == [True, False]


def test_plans_hold_only_data():
    """A plan keeps ints, floats, strings and dtypes, never a tensor (it outlives every call)."""
    for op in OPS.values():
        op(3)
    for cache in launch.PLAN_CACHES.values():
        for plan in cache.values():
            values = [*plan.scalars, *plan.meta.values()]
            assert all(isinstance(v, (int, float, str, bool)) for v in values), (cache.name, values)


# -- the bound launch, on a faked GPU ---------------------------------------------------------------------------


def _device_code(x_ptr, y_ptr, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):
    pass  # never compiled: the stand-in below returns a compiled kernel's stand-in


class FakeCompiled:
    """What ``kernel[grid]`` returns on a GPU: a launcher, the loaded function, packed metadata."""

    function, packed_metadata = 0xF00, "packed"

    def __init__(self) -> None:
        self.launched: list[tuple] = []

    def run(self, *args):
        self.launched.append(args)

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid, "stream": stream, "args": args}


class JITFunction(triton.runtime.jit.JITFunction):
    """Triton's JITFunction (real parameters) whose ``run`` (what ``kernel[grid](...)`` calls) compiles nothing."""

    def __init__(self, fn) -> None:
        super().__init__(fn)
        self.slow: list[tuple] = []
        self.compiled = FakeCompiled()

    def run(self, *args, grid, warmup, **kwargs):
        self.slow.append((grid, args, kwargs))
        return self.compiled


class FakeRuntime:
    def __init__(self) -> None:
        self.device, self.hook = 0, None

    def driver(self):
        runtime = self

        class Driver:
            def get_current_device(self):
                return runtime.device

            def get_current_stream(self, device):
                return 0x5000 + device

        return Driver()

    def hooks(self):
        return (self.hook, self.hook) if self.hook else (None, None)


@pytest.fixture
def fake_gpu(monkeypatch):
    runtime = FakeRuntime()
    monkeypatch.setattr(launch, "TRITON_RUNTIME", runtime)
    with capability.override(Capability(triton=True, torch=True, gpu=True, sm=(9, 0))):
        yield runtime


def test_a_repeat_launch_goes_straight_to_the_compiled_kernel(fake_gpu):
    kernel, bound = JITFunction(_device_code), launch.Bound()
    x, y = torch.ones(8), torch.zeros(8)
    before = launch.LAUNCH_COUNTS["_device_code"], launch.ROUTE_COUNTS["torch"]
    for _ in range(3):
        launch.launch(kernel, (2,), x, y, 7, bound=bound, BLOCK=4, num_warps=2)
    assert [s[0] for s in kernel.slow] == [(2,)] and bound.misses == 1  # compiled once
    assert kernel.compiled.launched == [(2, 1, 1, 0x5000, 0xF00, "packed", None, None, None, x, y, 7, 4, True)] * 2
    assert (launch.LAUNCH_COUNTS["_device_code"], launch.ROUTE_COUNTS["torch"]) == (before[0] + 3, before[1] + 3)


def test_alignment_device_hooks_and_the_switch_are_honoured(fake_gpu, monkeypatch):
    kernel, bound = JITFunction(_device_code), launch.Bound()
    x, y = torch.ones(8), torch.zeros(8)
    off = torch.ones(9)[1:]  # 4 bytes past a 16-byte boundary: Triton specialises the pointer differently

    def go(a):
        launch.launch(kernel, (3, 2), a, y, 7, bound=bound, BLOCK=4)

    go(x), go(off), go(off)
    assert bound.misses == 2 and len(kernel.compiled.launched) == 1  # the off-alignment variant compiled apart
    fake_gpu.device = 1
    go(x)
    assert bound.misses == 3 and set(bound.compiled) == {(0, 0), (0, 1), (1, 0)}
    fake_gpu.hook = "hook chain"
    go(x)
    launched = kernel.compiled.launched[-1]
    assert launched[:3] == (3, 2, 1) and launched[3] == 0x5001 and launched[7:9] == ("hook chain", "hook chain")
    assert launched[6]["args"] == (x, y, 7, 4, True)  # launch metadata built only with a hook
    monkeypatch.setattr(launch, "BOUND_LAUNCH", False)
    n = len(kernel.slow)
    go(x)
    assert len(kernel.slow) == n + 1  # switched off: through kernel[grid]


def test_tritons_hook_chains_are_handed_on_only_when_something_is_registered():
    """The real ``TritonRuntime.hooks``: Triton 3.6's chains are never None, so an empty one must read as none."""
    from triton import knobs

    runtime, chain = launch.TritonRuntime(), knobs.runtime.launch_enter_hook
    assert runtime.hooks() == (None, None)
    chain.add(print)
    try:
        assert runtime.hooks() == (chain, knobs.runtime.launch_exit_hook)
    finally:
        chain.remove(print)
    assert runtime.hooks() == (None, None)


class Autotuner(JITFunction):
    """Not a plain JITFunction (Triton's autotuner / heuristics wrap one): its launches pick their own meta."""


def test_an_unbindable_kernel_always_takes_kernel_grid(fake_gpu):
    kernel, bound = Autotuner(_device_code), launch.Bound()
    x, y = torch.ones(8), torch.zeros(8)
    for _ in range(2):
        launch.launch(kernel, (1,), x, y, 7, bound=bound, BLOCK=4)
    assert len(kernel.slow) == 2 and kernel.compiled.launched == [] and bound.tail is False


def test_a_runtime_parameter_by_keyword_is_bound_in_parameter_order(fake_gpu):
    kernel, bound = JITFunction(_device_code), launch.Bound()
    x, y = torch.ones(8), torch.zeros(8)
    for _ in range(2):
        launch.launch(kernel, (1,), x, y, bound=bound, BLOCK=4, n=7)
    assert kernel.compiled.launched == [(1, 1, 1, 0x5000, 0xF00, "packed", None, None, None, x, y, 7, 4, True)]


class FakeLauncher:
    """Triton's Python launcher of a compiled kernel on a GPU: its C ``launch`` and the flags it passes on."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self) -> None:
        self.direct: list[tuple] = []
        self.via_python: list[tuple] = []

    def __call__(self, *args):
        self.via_python.append(args)

    def launch(self, *args):
        self.direct.append(args)


def test_fire_sends_a_bound_plan_straight_to_the_c_launcher(fake_gpu, monkeypatch):
    """The ops' fast path: after the first launch of a plan, ``fire`` hands the C launcher the grid, the stream,
    no scratch buffers and no hooks, then the tensors, the plan's scalars and the constexprs in parameter order."""
    kernel = JITFunction(_device_code)
    launcher = kernel.compiled.run = FakeLauncher()
    plan = launch.Plan((2, 3), (7,), dict(BLOCK=4, num_warps=2))
    x, y = torch.ones(8), torch.zeros(8)
    before = launch.LAUNCH_COUNTS["_device_code"], launch.ROUTE_COUNTS["torch"]
    for _ in range(3):
        launch.fire(kernel, plan, x, y)
    assert len(kernel.slow) == 1 and plan.bound.misses == 1 and launcher.via_python == []
    assert launcher.direct == [(2, 3, 1, 0x5000, 0xF00, False, True, None, None, "packed", None, None, None,
                                x, y, 7, 4, True)] * 2
    assert (launch.LAUNCH_COUNTS["_device_code"], launch.ROUTE_COUNTS["torch"]) == (before[0] + 3, before[1] + 3)
    fake_gpu.hook = "hook chain"  # a profiler's hooks: through Triton's Python launcher, with launch metadata
    launch.fire(kernel, plan, x, y)
    assert len(launcher.via_python) == 1 and launcher.via_python[0][7:9] == ("hook chain", "hook chain")
    fake_gpu.hook = None
    with capability.override(Capability(triton=True, torch=True, gpu=True, sm=(9, 0))):
        launch.fire(kernel, plan, x, y)  # another capability: the route is decided again (same compiled kernel)
    assert len(kernel.slow) == 1 and len(launcher.direct) == 3
    monkeypatch.setattr(launch, "BOUND_LAUNCH", False)
    launch.fire(kernel, plan, x, y)
    assert len(kernel.slow) == 2  # switched off: through kernel[grid]


def test_a_kernel_with_scratch_buffers_keeps_tritons_python_launcher(fake_gpu):
    kernel = JITFunction(_device_code)
    launcher = kernel.compiled.run = FakeLauncher()
    launcher.global_scratch_size = 64  # Triton allocates it per launch: its launcher must do that
    plan = launch.Plan((1,), (7,), dict(BLOCK=4))
    x, y = torch.ones(8), torch.zeros(8)
    for _ in range(2):
        launch.fire(kernel, plan, x, y)
    assert launcher.direct == [] and launcher.via_python == [(1, 1, 1, 0x5000, 0xF00, "packed", None, None, None,
                                                              x, y, 7, 4, True)]


# -- the report (printed, not asserted) -------------------------------------------------------------------------

# µs per call with the launch stubbed, measured on this CPU before plans existed (same shapes as below; the
# machine is shared, so these move by ~20 % run to run): benchmarks/RESULTS.md, "Launch host overhead".
BEFORE_US = {"rope out of place": 61.7, "rope in place": 51.0, "kv remap": 19.8, "q rms norm fwd": 40.7,
             "sink grad": 57.0, "qkv prologue q fwd": 43.4, "qkv prologue kv fwd": 42.5,
             "inv-rope-postmix fast fwd": 64.1}


def report_ops() -> dict:
    """The reported ops at tiny shapes (GPU-path orders for the norms), as the 'before' numbers were taken."""
    x, kv = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 64)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    idx = torch.randint(-1, 4, (1, 4, 8), dtype=torch.int32)
    out, d_out, lse, sink_t = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2), torch.randn(2)
    w, mix = torch.randn(64), torch.randn(2, 2)
    order, order_kv = kernel_order.torch_cuda_order(8, 64), kernel_order.torch_cuda_order(4, 64)
    return {
        "rope out of place": lambda: rope.rope(x, cos, sin),
        "rope in place": lambda: rope.rope_(x, cos, sin),
        "kv remap": lambda: remap.local_to_global_flat(idx, 4),
        "q rms norm fwd": lambda: q_norm.q_rms_norm_fused(x, 1e-6, order),
        "sink grad": lambda: sink.sink_grad(d_out, out, lse, sink_t),
        "qkv prologue q fwd": lambda: prologue.norm_rope_fused(x, 1e-6, cos, sin, None, order),
        "qkv prologue kv fwd": lambda: prologue.norm_rope_fused(kv, 1e-6, cos, sin, w, order_kv),
        "inv-rope-postmix fast fwd": lambda: postmix.forward(x, cos, sin, mix),
    }


def host_us_per_call(fn, calls: int = 500, repeats: int = 5) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def test_report_host_us_per_call(stub):
    lines = ["CPU host overhead, launch stubbed (us per call; not the H200 figure):",
             f"{'op':28} {'before':>8} {'now':>8}"]
    for name, fn in report_ops().items():
        lines.append(f"{name:28} {BEFORE_US[name]:8.1f} {host_us_per_call(fn):8.1f}")
    print("\n" + "\n".join(lines))
    assert stub  # the stub, not the interpreter, took the launches


def test_the_bound_launch_reads_the_device_through_torchs_c_getter(monkeypatch):
    """Triton's CUDA driver asks ``torch.cuda.current_device`` (a Python wrapper around torch's C getter); the bound
    launch takes the C getter itself, and any other driver's getters as they are."""

    class Active:
        get_current_device = staticmethod(torch.cuda.current_device)

        @staticmethod
        def get_current_stream(device):
            return 0x5000 + device

    def c_getter():
        return 3

    monkeypatch.setattr(torch._C, "_cuda_getDevice", c_getter, raising=False)
    getters = launch._Getters(Active())
    assert getters.get_current_device is c_getter and getters.get_current_stream(1) == 0x5001
    Active.get_current_device = staticmethod(lambda: 0)  # another driver's getter (a proxy, a fake): kept
    assert launch._Getters(Active()).get_current_device() == 0
