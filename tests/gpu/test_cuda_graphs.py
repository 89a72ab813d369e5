"""Every fused op captured in a CUDA graph and replayed (issue 16 §4), and the bound launch on a real GPU.

Run on the GPU benchmark machine (torch + Triton, no Paddle): ``pytest tests/gpu/test_cuda_graphs.py``. Skipped
without CUDA.

Capture: each op runs eagerly twice (Triton compiles, then the plan's bound launch is used), once more on a
side stream (torch's recipe), then inside ``torch.cuda.graph``, which records the launches (the launch counter
proves the fused kernel was the one recorded) and allocates the outputs from the graph's private pool. Nothing
on the host path reads the device back, or capture would fail. Replay is checked twice: on the capture-time
inputs, and after new values are copied into the same input storage, each time byte for byte against an eager
call on those values (the ops are deterministic); the two eager results differ, so a replay that did not
re-run the kernels would fail.

Bound launch: repeat launches of a plan skip Triton's ``kernel[grid]`` and call the compiled kernel's launcher
(``fleet_ext.ops.launch.Bound``). Triton specialises a pointer on its 16-byte alignment, which the plan's key
(shape, strides, dtype) does not see, so a view off that alignment must get its own compiled kernel: checked
with the same layout at an aligned and a misaligned address, and against the unbound launch.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_bitwise, expect_launches
from helpers.gpu import CUDA_ONLY
from helpers.torch_rope import eager_rope

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEV = "cuda"
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _bound_launch_on(monkeypatch):
    """These tests check the bound launch itself: on even if a caller turned the library default off."""
    from fleet_ext.ops import launch

    monkeypatch.setattr(launch, "BOUND_LAUNCH", True)


def _ops():
    from fleet_ext.ops.inv_rope_postmix import kernel as postmix_bitwise
    from fleet_ext.ops.inv_rope_postmix import kernel_fast as postmix
    from fleet_ext.ops.kv_idx_remap import kernel as remap
    from fleet_ext.ops.mhc import kernel as mhc
    from fleet_ext.ops.q_rms_norm import kernel as q_norm
    from fleet_ext.ops.qkv_prologue import kernel as prologue
    from fleet_ext.ops.rope import kernel as rope
    from fleet_ext.ops.sink_grad import kernel as sink
    from fleet_ext.ops.sparse_attn import kernel as sparse

    return postmix_bitwise, postmix, remap, q_norm, prologue, rope, sink, sparse, mhc


MHC_PRE = ["_mhc_fn_pieces", "_mhc_proj_gluon", "_mhc_pre_fwd", "_mhc_gates_bwd", "_mhc_pre_bwd", "_mhc_dx_streams",
           "_mhc_params_bwd"]  # kernel.GPU_CONFIG's Hopper defaults


def _mhc_case(mhc, combine: bool):
    """The mHC pre op forward + backward (its seven launches; the Gluon kernels on Hopper) or the combine both ways,
    64 tokens x 4 streams x 512, bf16."""
    t, n, d, nout = 64, 4, 512, 24
    x, g_y, f = torch.randn(t, n, d, device=DEV).to(BF16), *(torch.randn(t, d, device=DEV).to(BF16) for _ in range(2))
    fn, base = 0.02 * torch.randn(nout, n * d, device=DEV), 0.5 * torch.randn(nout, device=DEV)
    scale = torch.tensor([0.7, 1.3, 2.0], device=DEV)
    g_post, g_comb = torch.randn(t, n, device=DEV), torch.randn(t, n, n, device=DEV)
    if combine:
        post, comb = (v.clone() for v in mhc.pre_forward(x, fn, base, scale, 20, 1e-6, 1e-6)[:2])
        g_out = torch.randn_like(x)
        return [x, f, g_out], lambda: (mhc.combine_forward(x, f, post, comb),
                                       *mhc.combine_backward(x, f, post, comb, g_out))

    def step():
        post, comb, y, mix, r = mhc.pre_forward(x, fn, base, scale, 20, 1e-6, 1e-6)
        return (post, comb, y, *mhc.pre_backward(x, fn, base, scale, mix, r, g_post, g_comb, g_y, 20, 1e-6))

    return [x, g_y], step


def _tables(seq: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(seq, dtype=torch.float64, device=DEV)[:, None]
    angles = pos / (10000.0 ** (torch.arange(half, dtype=torch.float64, device=DEV) / half))
    return torch.cos(angles).float(), torch.sin(angles).float()


SINK = ["_sink_grad_partial_kernel", "_sink_grad_reduce_kernel"]


def _sink_case(sink, b: int, s: int, h: int, d: int, d_lse_only: bool):
    out, d_out = (torch.randn(b, s, h, d, device=DEV).to(BF16) for _ in range(2))
    sink_t = torch.randn(h, device=DEV)
    lse = sink_t + torch.rand(b, s, h, device=DEV) * 3
    d_lse = torch.randn(b, s, h, device=DEV)
    if d_lse_only:
        return [d_lse], lambda: sink.sink_grad(None, None, lse, sink_t, d_lse=d_lse)
    return [out, d_out], lambda: sink.sink_grad(d_out, out, lse, sink_t)


def _sparse_case(sparse, backward: bool):
    t, n_kv, heads, d_qk, d_v, topk = 64, 96, 16, 64, 32, 32
    q = torch.randn(t, heads, d_qk, device=DEV).to(BF16)
    kv = torch.randn(n_kv, d_qk, device=DEV).to(BF16)
    idx = torch.randint(-1, n_kv, (t, topk), device=DEV, dtype=torch.int32)
    sink_t = torch.randn(heads, device=DEV)
    scale = 1.0 / math.sqrt(d_qk)
    if not backward:
        return [q, kv], lambda: sparse.sparse_attn_fwd(q, kv, idx, sink_t, scale, d_v=d_v)
    out, lse = (o.clone() for o in sparse.sparse_attn_fwd(q, kv, idx, sink_t, scale, d_v=d_v))
    d_out = torch.randn(t, heads, d_v, device=DEV).to(BF16)
    return [d_out], lambda: sparse.sparse_attn_bwd(q, kv, idx, sink_t, scale, out, lse, d_out, d_v=d_v)


def _remap_case(remap, s: int):
    idx = torch.randint(-1, 64, (4, s, 640), device=DEV, dtype=torch.int32)
    return [idx], lambda: remap.local_to_global_flat(idx, 64)


def _cases() -> dict:
    """name -> (kernels it launches, builder of (inputs to refresh, the call))."""
    postmix_bitwise, postmix, remap, q_norm, prologue, rope, sink, sparse, mhc = _ops()
    b, s, h, d, half = 2, 24, 8, 512, 32
    cos, sin = _tables(s, half)

    def x4():
        return torch.randn(b, s, h, d, device=DEV).to(BF16)

    def kv3():
        return torch.randn(b, s, d, device=DEV).to(BF16)

    def rope_inplace():
        src, work = x4(), x4()
        return [src], lambda: rope.rope_(work.copy_(src), cos, sin)

    def q_bwd():
        q, dy = x4(), x4()
        r = q_norm.q_rms_norm_fused(q, 1e-6)[1].clone()
        return [q, dy], lambda: q_norm.q_rms_norm_bwd(dy, q, r, eps=1e-6)

    def prologue_bwd(kv: bool):
        x, dy = (kv3(), kv3()) if kv else (x4(), x4())
        w = (torch.rand(d, device=DEV) + 0.5) if kv else None
        r = prologue.norm_rope_fused(x, 1e-6, cos, sin, w)[1].clone()
        return [x, dy], lambda: prologue.norm_rope_bwd(dy, x, r, cos, sin, w, eps=1e-6)

    def q_bwd_recomputed():  # the training path: no r kept, the backward recomputes it from q
        q, dy = x4(), x4()
        return [q, dy], lambda: q_norm.q_rms_norm_bwd(dy, q, None, eps=1e-6)

    def prologue_bwd_recomputed(kv: bool):
        x, dy = (kv3(), kv3()) if kv else (x4(), x4())
        w = (torch.rand(d, device=DEV) + 0.5) if kv else None
        return [x, dy], lambda: prologue.norm_rope_bwd(dy, x, None, cos, sin, w, eps=1e-6)

    def postmix_case(backward: bool):
        out, grad = x4(), x4()
        mix = torch.eye(h, device=DEV) + 0.1 * torch.randn(h, h, device=DEV)
        if backward:
            return [out, grad], lambda: postmix.backward(out, cos, sin, mix, grad)
        return [out], lambda: postmix.forward(out, cos, sin, mix)

    def postmix_bitwise_case():
        out = x4()
        mix = (torch.eye(h, device=DEV) + 0.1 * torch.randn(h, h, device=DEV)).to(BF16)
        return [out], lambda: postmix_bitwise.inv_rope_postmix_forward(out, cos, sin, mix, torch.matmul)

    def simple(make, call):
        def build():
            t = make()
            return [t], lambda: call(t)
        return build

    return {
        "rope": (["_rope_kernel"], simple(x4, lambda x: rope.rope(x, cos, sin))),
        "rope_ (in place)": (["_rope_kernel"], rope_inplace),
        "rope_grad": (["_rope_kernel"], simple(x4, lambda g: rope.rope_grad(g, cos, sin, inverse=True))),
        "rope_tail": (["_rope_kernel"], simple(x4, lambda x: rope.rope_tail(x, cos, sin, d - 2 * half - 8))),
        "kv_idx_remap": (["_kv_idx_remap_kernel"], lambda: _remap_case(remap, s)),
        "q_rms_norm fwd": (["_q_rms_norm_fwd_kernel"], simple(x4, lambda x: q_norm.q_rms_norm_fused(x, 1e-6))),
        "q_rms_norm bwd": (["_q_rms_norm_bwd_kernel"], q_bwd),
        "q_rms_norm fwd (no r)": (["_q_rms_norm_fwd_kernel"], simple(x4, lambda x: q_norm.q_rms_norm_fused(
            x, 1e-6, keep_r=False))),
        "q_rms_norm bwd (r recomputed)": (["_q_rms_norm_bwd_kernel"], q_bwd_recomputed),
        "sink_grad": (SINK, lambda: _sink_case(sink, b, s, h, d, False)),
        "sink_grad (d_lse)": (SINK, lambda: _sink_case(sink, b, s, h, d, True)),
        "qkv q fwd": (["_norm_rope_fwd_kernel"], simple(x4, lambda x: prologue.norm_rope_fused(x, 1e-6, cos, sin))),
        "qkv kv fwd": (["_norm_rope_fwd_kernel"], simple(kv3, lambda x: prologue.norm_rope_fused(
            x, 1e-6, cos, sin, torch.ones(d, device=DEV)))),
        "qkv q bwd": (["_norm_rope_bwd_kernel"], lambda: prologue_bwd(False)),
        "qkv kv bwd": (["_norm_rope_bwd_kernel", "_dw_reduce_kernel"], lambda: prologue_bwd(True)),
        "qkv kv fwd (no r)": (["_norm_rope_fwd_kernel"], simple(kv3, lambda x: prologue.norm_rope_fused(
            x, 1e-6, cos, sin, torch.ones(d, device=DEV), keep_r=False))),
        "qkv q bwd (r recomputed)": (["_norm_rope_bwd_kernel"], lambda: prologue_bwd_recomputed(False)),
        "qkv kv bwd (r recomputed)": (["_norm_rope_bwd_kernel", "_dw_reduce_kernel"],
                                      lambda: prologue_bwd_recomputed(True)),
        "inv_rope_postmix fast fwd": (["_postmix_fast_fwd_kernel"], lambda: postmix_case(False)),
        "inv_rope_postmix fast bwd": (["_postmix_fast_bwd_kernel", "_postmix_fast_reduce_kernel"],
                                      lambda: postmix_case(True)),
        "inv_rope_postmix bitwise fwd": (["_rope_kernel", "_write_trailing_kernel"], postmix_bitwise_case),
        "sparse_attn fwd": (["_row_bound_kernel", "_sparse_attn_fwd_kernel"], lambda: _sparse_case(sparse, False)),
        "sparse_attn bwd": (["_bwd_dq_kernel", "_bwd_dkv_reduce_kernel"], lambda: _sparse_case(sparse, True)),
        "mhc pre fwd+bwd": (MHC_PRE, lambda: _mhc_case(mhc, False)),
        "mhc combine fwd+bwd": (["_mhc_combine_fwd", "_mhc_combine_bwd"], lambda: _mhc_case(mhc, True)),
    }


CASES = [  # _cases()'s names (listed here so that collection builds no tensor)
    "rope", "rope_ (in place)", "rope_grad", "rope_tail", "kv_idx_remap", "q_rms_norm fwd", "q_rms_norm bwd",
    "q_rms_norm fwd (no r)", "q_rms_norm bwd (r recomputed)",
    "sink_grad", "sink_grad (d_lse)", "qkv q fwd", "qkv kv fwd", "qkv q bwd", "qkv kv bwd", "qkv kv fwd (no r)",
    "qkv q bwd (r recomputed)", "qkv kv bwd (r recomputed)",
    "inv_rope_postmix fast fwd", "inv_rope_postmix fast bwd", "inv_rope_postmix bitwise fwd", "sparse_attn fwd",
    "sparse_attn bwd", "mhc pre fwd+bwd", "mhc combine fwd+bwd",
]


def _outputs(result) -> list[torch.Tensor]:
    items = result if isinstance(result, (tuple, list)) else [result]
    return [t for t in items if t is not None]


def _snapshot(result) -> list[torch.Tensor]:
    return [t.clone() for t in _outputs(result)]


def _compare(got, want, label: str) -> None:
    for i, (a, b) in enumerate(zip(_outputs(got), want)):
        assert_bitwise(a, b, f"{label}, output {i}")


@pytest.mark.parametrize("name", CASES)
def test_captured_and_replayed_equals_eager(name):
    torch.manual_seed(0)
    kernels, build = _cases()[name]
    inputs, call = build()
    call(), call()  # compile, then the bound launch
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with expect_launches(*kernels), torch.cuda.graph(graph):
        static = call()
    want_first = _snapshot(call())  # eager on the capture-time inputs
    _replay(graph, static)
    _compare(static, want_first, f"{name}: replay on the capture-time inputs")
    for t in inputs:  # new values, same storage
        t.copy_(torch.randn_like(t.float()).to(t.dtype) if t.is_floating_point() else t.roll(1, 0))
    want_second = _snapshot(call())
    assert any(not torch.equal(a, b) for a, b in zip(want_first, want_second)), "the refresh changed nothing"
    _replay(graph, static)
    _compare(static, want_second, f"{name}: replay on new inputs")


def _replay(graph: torch.cuda.CUDAGraph, static) -> None:
    """Zero the graph's outputs (an eager call may share their storage: the in-place RoPE), then replay."""
    for t in _outputs(static):
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()


# -- the bound launch on a real GPU -----------------------------------------------------------------------------


def test_bound_launch_specialises_on_pointer_alignment_and_matches_the_unbound_launch(monkeypatch):
    rope = _ops()[5]
    from fleet_ext.ops import launch

    launch.clear_plans()
    s, h, d, half = 16, 8, 512, 32
    cos, sin = _tables(s, half)
    flat = torch.randn(1 * s * h * d + 8, device=DEV).to(BF16)
    aligned = flat[:s * h * d].view(1, s, h, d)
    misaligned = flat[1:1 + s * h * d].view(1, s, h, d)  # same shape and strides, 2 bytes off
    assert aligned.stride() == misaligned.stride() and misaligned.data_ptr() % 16
    plan = rope._planned(aligned, cos, sin, rope._ROPE, 0, False)
    assert plan is rope._planned(misaligned, cos, sin, rope._ROPE, 0, False)  # one plan: the layouts are equal
    outs = {}
    with expect_launches("_rope_kernel", exactly=6):
        for label, x in (("aligned", aligned), ("misaligned", misaligned)):
            outs[label] = [rope.rope(x, cos, sin) for _ in range(3)]  # compile, bound, bound
    assert len(plan.bound.compiled) == 2  # one compiled kernel per alignment
    monkeypatch.setattr(launch, "BOUND_LAUNCH", False)
    for label, x in (("aligned", aligned), ("misaligned", misaligned)):
        unbound = rope.rope(x, cos, sin)
        want = eager_rope(x, cos, sin)
        for i, got in enumerate(outs[label]):
            assert_bitwise(got, want, f"{label} call {i} vs eager")
        assert_bitwise(unbound, want, f"{label} unbound vs eager")


def test_bound_launch_follows_the_current_stream():
    rope = _ops()[5]
    cos, sin = _tables(8, 16)
    x = torch.randn(1, 8, 4, 64, device=DEV).to(BF16)
    rope.rope(x, cos, sin), rope.rope(x, cos, sin)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        big = torch.randn(1, 8, 4, 64, device=DEV).to(BF16)
        torch.cuda._sleep(10_000_000)  # keep the side stream busy: a launch on another stream would race ahead
        got = rope.rope(big, cos, sin)
        want = eager_rope(big, cos, sin)
    torch.cuda.synchronize()
    assert_bitwise(got, want, "bound launch on a side stream")
