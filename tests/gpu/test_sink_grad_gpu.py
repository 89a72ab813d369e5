"""Deterministic attention-sink gradient on CUDA (torch tensors, bf16 and fp32) vs a NumPy float64 oracle.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``.
Skipped without CUDA.

``d_sink[h] = sum_{b,t} exp(sink_h - lse) * (d_lse - rowsum(dO * O))``. Not bitwise against eager (a fixed
blocked summation order), so: within ``1e-5 * scale[h]`` of the float64 oracle computed from the very same
(bf16 or fp32) inputs, ``scale[h] = sum p_sink * (sum_d |dO*O| + |d_lse|)`` — the sum of the magnitudes of
all terms, the natural bound of a float sum with cancellation. fp32 accumulation of products that are
exact in fp32 for bf16 inputs: measured errors are ~1e-7 of the scale; the bound is the ``sink_grad`` entry
(1e-5 of the scale) of tests/helpers/tolerances.py, the oracle ``helpers.oracles.sink_grad``. The eager torch
op sequence is held to the same bound (it is a different order, not a reference to match bit for bit).
Determinism: repeated runs byte-identical (no atomics), at the production shape too
(dO/O [1, 16384, 64, 512] bf16, lse [1, 16384, 64] fp32).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bitwise, assert_close, expect_launches
from helpers import oracles as orc
from helpers.gpu import CUDA_ONLY

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"


@pytest.fixture(scope="module")
def kernel():
    from fleet_ext.ops.sink_grad import kernel as sink_kernel  # imported only where it will run

    return sink_kernel


def eager(d_out, out, lse, sink, d_lse=None):
    delta = (d_out.float() * out.float()).sum(-1)
    weight = -delta if d_lse is None else d_lse - delta
    return (torch.exp(sink - lse) * weight).sum((0, 1))


oracle = orc.sink_grad  # float64 NumPy from the same (rounded) inputs: (d_sink, scale), tokens in chunks


def make(shape, dtype, seed=0, with_dlse=False):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    bsz, seq, heads, _ = shape
    out = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    d_out = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    sink = torch.rand(heads, generator=gen, device=DEVICE) * 3 - 1
    lse = sink + torch.rand((bsz, seq, heads), generator=gen, device=DEVICE) * 3  # p_sink in (e^-3, 1]
    out[0, 0] = 0  # a query with no valid index: out = 0, lse = sink
    lse[0, 0] = sink
    d_lse = torch.randn((bsz, seq, heads), generator=gen, device=DEVICE) if with_dlse else None
    return d_out, out, lse, sink, d_lse


def assert_within(got, want, scale, what):
    assert_close(got, want, "fp32", "sink_grad", scale=scale, what=what)  # d_sink is summed in fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048, 64, 512), (2, 100, 3, 33), (1, 17, 128, 576), (3, 1, 1, 1)])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_vs_oracle_and_eager(kernel, shape, dtype, with_dlse):
    d_out, out, lse, sink, d_lse = make(shape, dtype, seed=sum(shape), with_dlse=with_dlse)
    got = kernel.sink_grad(d_out, out, lse, sink, d_lse=d_lse)
    assert got.device == out.device and got.dtype == torch.float32 and got.shape == (shape[2],)
    want, scale = oracle(d_out, out, lse, sink, d_lse)
    assert_within(got, want, scale, "kernel vs oracle")
    assert_within(eager(d_out, out, lse, sink, d_lse), want, scale, "eager torch vs oracle")


def test_production_shape_deterministic(kernel):
    d_out, out, lse, sink, _ = make((1, 16384, 64, 512), torch.bfloat16, seed=1)
    first = kernel.sink_grad(d_out, out, lse, sink)
    for _ in range(4):
        assert_bitwise(kernel.sink_grad(d_out, out, lse, sink), first, "run after run")
    want, scale = oracle(d_out, out, lse, sink)
    assert_within(first, want, scale, "production")


def test_only_d_lse(kernel):
    _, out, lse, sink, d_lse = make((2, 300, 8, 64), torch.bfloat16, seed=3, with_dlse=True)
    got = kernel.sink_grad(None, None, lse, sink, d_lse=d_lse)
    want, scale = oracle(torch.zeros_like(out), out, lse, sink, d_lse)
    assert_within(got, want, scale, "d_lse only")


def test_non_contiguous(kernel):
    d_out, out, lse, sink, _ = make((4, 256, 16, 128), torch.bfloat16, seed=5)
    views = (d_out.transpose(0, 1).contiguous().transpose(0, 1), out.transpose(0, 1).contiguous().transpose(0, 1),
             lse.transpose(0, 1).contiguous().transpose(0, 1))
    assert not any(v.is_contiguous() for v in views)
    got = kernel.sink_grad(*views, sink)
    want, scale = oracle(d_out, out, lse, sink)
    assert_within(got, want, scale, "non-contiguous")


def test_empty_rows_contribute_zero(kernel):
    shape = (2, 64, 8, 128)
    sink = torch.linspace(-1, 2, 8, device=DEVICE)
    out = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    d_out = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    lse = sink.expand(2, 64, 8).contiguous()
    assert torch.equal(kernel.sink_grad(d_out, out, lse, sink), torch.zeros(8, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4, 8, 512), (2, 2, 4, 512), (2, 3, 2, 1000)])
def test_small_input_in_one_step_has_the_bits_of_one_token_a_step(kernel, shape, dtype):
    """A small input takes all its tokens in one step ([heads, tokens, d], tokens added in order): byte-identical
    to one token a step (``TINY_ONE_STEP`` off), with and without d_lse, and within the oracle's bound."""
    from fleet_ext.ops import launch

    d_out, out, lse, sink, d_lse = make(shape, dtype, seed=sum(shape), with_dlse=True)
    got = {}
    try:
        for one_step in (True, False):
            kernel.TINY_ONE_STEP = one_step
            launch.clear_plans()
            assert kernel.config(shape[0] * shape[1], shape[2], shape[3]).get("IN_ORDER", False) == one_step
            with expect_launches("_sink_grad_partial_kernel", exactly=2):
                got[one_step] = [kernel.sink_grad(d_out, out, lse, sink, d_lse=dl) for dl in (None, d_lse)]
    finally:
        kernel.TINY_ONE_STEP = True
        launch.clear_plans()
    for i, dl in enumerate((None, d_lse)):
        assert_bitwise(got[True][i], got[False][i], f"one step vs one token a step, d_lse {dl is not None}")
        want, scale = oracle(d_out, out, lse, sink, dl)
        assert_within(got[True][i], want, scale, "one step vs oracle")
