"""Deterministic attention-sink gradient (Triton, interpreter on CPU), alone and inside the sparse attention.

Bitwise claims: ``sparse_attention_fused_sink_grad`` returns out/lse and gives dq/dkv byte-identical to the
reference (the sink's branch never feeds q or kv). ``d_sink`` is not bitwise (a fixed blocked summation
order instead of autograd's), so it is compared within the fp32 ``sink_grad`` tolerance (tests/helpers/
tolerances.py), and it must be byte-identical from run to run. Every test of the fused path checks that the
kernels ran (launch counters).

``sink_grad``: ``|d_sink - exact| <= 1e-5 * scale[h]`` with ``scale[h] = sum_{b,t} p_sink * (sum_d |dO*O| +
|d_lse|)`` (the float64 oracle's magnitude sum), the natural bound of a float sum, cancellation included.
Each term carries a few fp32 roundings (product, d-term sum, exp, weighting) and the sums over d and over
tokens add ~log2(n) more with blocked/pairwise orders: measured at most 5.4e-8 here; any missing or extra
term is O(1) of scale.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import pytest
import torch
from helpers import assert_bitwise, assert_close, expect_launches
from helpers import oracles as orc
from test_sparse_attention import make_inputs

from fleet_ext import capability

capability.prepare_triton()

from fleet_ext.ops.kv_idx_remap import function as fused_remap  # noqa: E402
from fleet_ext.ops.sink_grad import function as fused  # noqa: E402
from fleet_ext.ops.sink_grad import kernel  # noqa: E402
from fleet_ext.ops.sink_grad import reference as ref  # noqa: E402
from fleet_ext.ops.sparse_attn.reference import sparse_attention_with_sink  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

PARTIAL, REDUCE = "_sink_grad_partial_kernel", "_sink_grad_reduce_kernel"
F32 = np.float32
oracle_d_sink = orc.sink_grad  # float64: (d_sink, the magnitude scale)


def assert_within(got, exact, scale, what):
    assert_close(got, exact, "fp32", "sink_grad", scale=scale, what=what)


def make_case(rng, shape, empty_rows=True):
    bsz, seq, heads, dim = shape
    out = rng.standard_normal(shape).astype(F32)
    d_out = rng.standard_normal(shape).astype(F32)
    sink = rng.uniform(-1, 2, heads).astype(F32)
    lse = (sink + rng.uniform(0.0, 3.0, (bsz, seq, heads))).astype(F32)  # lse >= sink: p_sink <= 1
    if empty_rows and seq > 1:
        out[0, 0] = 0.0  # a query with no valid index: out = 0, lse = sink, p_sink = 1
        lse[0, 0] = sink
    return d_out, out, lse, sink


def to_pd(*arrays):
    return [paddle.to_tensor(a) for a in arrays]


SHAPES = [(1, 1, 1, 1), (2, 5, 3, 8), (3, 7, 5, 33), (1, 70, 4, 16), (2, 3, 64, 24)]


def test_one_token_block_writes_d_sink_directly_with_the_reduces_bits():
    """A single token block skips the reduce launch (its partial row is d_sink); the bits equal the two-launch path
    (partials, then the reduce, run here by hand on the same plan); more blocks launch the reduce once."""
    from fleet_ext.ops.launch import fire

    rng = np.random.default_rng(3)
    for shape, blocks in [((2, 5, 3, 8), 1), ((1, 70, 4, 16), 2)]:
        d_out, out, lse, sink = (torch.from_numpy(a) for a in make_case(rng, shape))
        with expect_launches(PARTIAL, exactly=1), expect_launches(REDUCE, exactly=blocks - 1):
            got = kernel.sink_grad(d_out, out, lse, sink)
        plan = kernel._PLANS[(*(kernel._key(t) for t in (d_out, out, lse, sink, None)), kernel.is_interpreted())]
        partials = torch.empty(plan.info[0])
        fire(kernel._sink_grad_partial_kernel, plan, d_out, out, lse, lse, sink, partials)
        reduce = plan.info[1] or kernel._prepare_reduce(blocks, shape[2])
        by_hand = torch.empty_like(sink)
        fire(kernel._sink_grad_reduce_kernel, reduce, partials, by_hand)
        assert_bitwise(got, by_hand, f"{shape}: d_sink vs partials + reduce")


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_vs_oracle_and_reference(shape, with_dlse):
    rng = np.random.default_rng(sum(shape) + with_dlse)
    d_out, out, lse, sink = make_case(rng, shape)
    d_lse = rng.standard_normal(shape[:3]).astype(F32) if with_dlse else None
    with expect_launches(PARTIAL, exactly=1):
        got = kernel.sink_grad(*to_pd(d_out, out, lse, sink),
                               d_lse=None if d_lse is None else paddle.to_tensor(d_lse))
    assert got.dtype == paddle.float32 and got.shape == [shape[2]]
    exact, scale = oracle_d_sink(d_out, out, lse, sink, d_lse)
    assert_within(got.numpy(), exact, scale, "kernel vs float64 oracle")
    want = ref.sink_grad(*to_pd(d_out, out, lse, sink), d_lse=None if d_lse is None else paddle.to_tensor(d_lse))
    assert_within(want.numpy(), exact, scale, "reference vs float64 oracle")  # the reference is right too
    assert np.abs(exact).max() > 1e-3  # not trivially zero


def test_only_d_lse_flows():
    rng = np.random.default_rng(2)
    d_out, out, lse, sink = make_case(rng, (2, 9, 3, 4))
    d_lse = rng.standard_normal((2, 9, 3)).astype(F32)
    with expect_launches(PARTIAL, exactly=1):
        got = kernel.sink_grad(None, None, *to_pd(lse, sink), d_lse=paddle.to_tensor(d_lse))
    exact, scale = oracle_d_sink(np.zeros_like(out), out, lse, sink, d_lse)
    assert_within(got.numpy(), exact, scale, "d_lse only")


def test_rows_with_no_valid_index_contribute_exactly_zero():
    shape = (2, 4, 3, 8)
    rng = np.random.default_rng(3)
    sink = rng.uniform(-1, 2, 3).astype(F32)
    out = np.zeros(shape, F32)  # every row empty: out = 0
    d_out = rng.standard_normal(shape).astype(F32)
    lse = np.broadcast_to(sink, shape[:3]).copy()  # lse = sink: p_sink = exp(0) = 1
    with expect_launches(PARTIAL, exactly=1):
        got = kernel.sink_grad(*to_pd(d_out, out, lse, sink))
    assert_bitwise(got, np.zeros(3, F32), "d_sink of empty rows")


def test_non_contiguous_inputs():
    rng = np.random.default_rng(4)
    d_out, out, lse, sink = make_case(rng, (5, 3, 4, 12), empty_rows=False)
    # views: [B, S] swapped (dO, O, lse), and O read with a head-dim stride of 2 from a wider tensor
    d_out_v = paddle.to_tensor(np.ascontiguousarray(d_out.transpose(1, 0, 2, 3))).transpose([1, 0, 2, 3])
    wide = np.zeros((5, 3, 4, 24), F32)
    wide[..., ::2] = out
    out_v = paddle.to_tensor(wide)[..., ::2]
    lse_v = paddle.to_tensor(np.ascontiguousarray(lse.transpose(1, 0, 2))).transpose([1, 0, 2])
    assert not (d_out_v.is_contiguous() or out_v.is_contiguous() or lse_v.is_contiguous())
    with expect_launches(PARTIAL, exactly=2):
        got = kernel.sink_grad(d_out_v, out_v, lse_v, paddle.to_tensor(sink))
        contiguous = kernel.sink_grad(*to_pd(d_out, out, lse, sink))
    assert_bitwise(got, contiguous, "strided vs contiguous")
    exact, scale = oracle_d_sink(d_out, out, lse, sink)
    assert_within(got.numpy(), exact, scale, "non-contiguous")


def test_torch_tensors_work_too():
    rng = np.random.default_rng(6)
    arrays = make_case(rng, (2, 6, 3, 10))
    with expect_launches(PARTIAL, exactly=1):
        got = kernel.sink_grad(*(torch.from_numpy(a) for a in arrays))
    assert isinstance(got, torch.Tensor)
    exact, scale = oracle_d_sink(*arrays)
    assert_within(got.numpy(), exact, scale, "torch")


def test_deterministic_run_after_run():
    rng = np.random.default_rng(8)
    args = to_pd(*make_case(rng, (2, 75, 5, 20)))  # two partial blocks
    with expect_launches(PARTIAL, exactly=3):
        first = kernel.sink_grad(*args)
        for _ in range(2):
            assert_bitwise(kernel.sink_grad(*args), first, "run after run")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: {**a, "out": a["out"][0]}, r"`out` must be \[B, S, H, d\] float"),
        (lambda a: {**a, "d_out": a["d_out"][:, :, :, :3]}, r"`d_out` must be float with out's shape"),
        (lambda a: {**a, "lse": a["lse"].astype("float64")}, r"`lse` must be float32 \[2, 3, 4\]"),
        (lambda a: {**a, "lse": a["lse"][:, :2]}, r"`lse` must be float32 \[2, 3, 4\]"),
        (lambda a: {**a, "sink": a["sink"][:3]}, r"`sink` must be float32 \[4\]"),
        (lambda a: {**a, "d_lse": a["lse"].astype("float16")}, r"`d_lse` must be float32"),
        (lambda a: {**a, "out": a["out"].astype("int32")}, r"`out` must be \[B, S, H, d\] float"),
    ],
)
def test_bad_inputs_raise_naming_the_tensor(mutate, match):
    rng = np.random.default_rng(1)
    d_out, out, lse, sink = to_pd(*make_case(rng, (2, 3, 4, 5)))
    args = mutate(dict(d_out=d_out, out=out, lse=lse, sink=sink, d_lse=None))
    with pytest.raises(ValueError, match="sink_grad: " + match):
        kernel.sink_grad(**args)


# --------------------------------------------------------------------------------------------------------
# Inside the sparse attention
# --------------------------------------------------------------------------------------------------------
ATTN_SHAPES = [(2, 5, 3, 8, 7, 4), (1, 6, 4, 16, 6, 6), (3, 2, 1, 4, 3, 2)]


def run_attention(fn, q, kv, idx, sink, scale, d_out, d_lse=None, sink_grad=True, d_v=None):
    qt = paddle.to_tensor(q, stop_gradient=False)
    kvt = paddle.to_tensor(kv, stop_gradient=False)
    st = paddle.to_tensor(sink, stop_gradient=not sink_grad)
    out, lse = fn(qt, kvt, paddle.to_tensor(idx), st, scale, d_v=d_v)
    loss = (out * paddle.to_tensor(d_out)).sum()
    if d_lse is not None:
        loss = loss + (lse * paddle.to_tensor(d_lse)).sum()
    loss.backward()
    return dict(out=out.numpy(), lse=lse.numpy(), dq=qt.grad.numpy(), dkv=kvt.grad.numpy(),
                d_sink=None if st.grad is None else st.grad.numpy(), out_t=out, lse_t=lse)


@pytest.mark.parametrize("use_lse", [False, True])
@pytest.mark.parametrize("duplicates", [False, True])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_attention_bitwise_except_d_sink_and_d_sink_vs_oracle(shape, duplicates, use_lse):
    q, kv, idx, sink, scale, rng = make_inputs(shape, seed=sum(shape), duplicates=duplicates)
    assert (idx[0, 0] < 0).all()  # a query with every index -1
    d_out = rng.standard_normal(q.shape[:3] + (q.shape[3],)).astype(F32)
    d_lse = rng.standard_normal(q.shape[:3]).astype(F32) if use_lse else None
    want = run_attention(sparse_attention_with_sink, q, kv, idx, sink, scale, d_out, d_lse)
    with expect_launches(PARTIAL, exactly=2 if use_lse else 1):  # out's PyLayer, and lse's when used
        got = run_attention(fused.sparse_attention_fused_sink_grad, q, kv, idx, sink, scale, d_out, d_lse)
    for key in ("out", "lse", "dq", "dkv"):
        assert_bitwise(got[key], want[key], key)
    # d_sink: the float64 oracle (independent code), and autograd of the reference
    _, _, exact = orc.sparse_attention_bwd(q, kv, idx, sink, scale, d_out, d_lse)
    o64, lse64 = orc.sparse_attention_fwd(q, kv, idx, sink, scale)
    _, scale_h = oracle_d_sink(d_out, o64, lse64, sink, d_lse)
    assert_within(got["d_sink"], exact, scale_h, "fused d_sink vs float64 oracle")
    assert_within(want["d_sink"], exact, scale_h, "reference d_sink vs float64 oracle")
    # the gradient the sink received is the kernel's on the forward's own out/lse, to the byte
    kernel_only = kernel.sink_grad(paddle.to_tensor(d_out), got["out_t"].detach(), got["lse_t"].detach(),
                                   paddle.to_tensor(sink))
    if use_lse:
        kernel_only = kernel_only + kernel.sink_grad(None, None, got["lse_t"].detach(), paddle.to_tensor(sink),
                                                     d_lse=paddle.to_tensor(d_lse))
    assert_bitwise(got["d_sink"], kernel_only, "d_sink vs the kernel alone")


def test_attention_d_v_option_matches_reference():
    q, kv, idx, sink, scale, rng = make_inputs((2, 4, 3, 12, 5, 3), seed=5)
    d_out = rng.standard_normal((2, 4, 3, 8)).astype(F32)
    want = run_attention(sparse_attention_with_sink, q, kv, idx, sink, scale, d_out, d_v=8)
    with expect_launches(PARTIAL, exactly=1):
        got = run_attention(fused.sparse_attention_fused_sink_grad, q, kv, idx, sink, scale, d_out, d_v=8)
    for key in ("out", "lse", "dq", "dkv"):
        assert_bitwise(got[key], want[key], key)
    exact, scale_h = oracle_d_sink(d_out, want["out"], want["lse"], sink)
    assert_within(got["d_sink"], exact, scale_h, "d_v")


def test_frozen_sink_runs_no_kernel_and_matches():
    q, kv, idx, sink, scale, rng = make_inputs((2, 3, 2, 8, 5, 3), seed=9)
    d_out = rng.standard_normal((2, 3, 2, 8)).astype(F32)
    want = run_attention(sparse_attention_with_sink, q, kv, idx, sink, scale, d_out, sink_grad=False)
    with expect_launches(PARTIAL, exactly=0):
        got = run_attention(fused.sparse_attention_fused_sink_grad, q, kv, idx, sink, scale, d_out, sink_grad=False)
    assert got["d_sink"] is None
    for key in ("out", "lse", "dq", "dkv"):
        assert_bitwise(got[key], want[key], key)


def test_attention_deterministic_and_registry_wiring():
    entry = FUSIONS["dsa_sink_grad_fusion"]
    assert entry.load("fused") is fused.sparse_attention_fused_sink_grad
    assert entry.load("reference") is sparse_attention_with_sink
    attn = functools.partial(entry.load("fused"), remap=fused_remap.local_to_global_flat)  # as the provider wires it
    q, kv, idx, sink, scale, rng = make_inputs((2, 70, 2, 8, 9, 5), seed=12)
    d_out = rng.standard_normal((2, 70, 2, 8)).astype(F32)
    with expect_launches(PARTIAL, REDUCE, "_kv_idx_remap_kernel", exactly=2):
        runs = [run_attention(attn, q, kv, idx, sink, scale, d_out) for _ in range(2)]
    for key in ("out", "lse", "dq", "dkv", "d_sink"):
        assert_bitwise(runs[0][key], runs[1][key], f"{key}, two runs")


def test_attention_bad_sink_raises_like_the_reference():
    q, kv, idx, sink, scale, _ = make_inputs((1, 2, 3, 4, 3, 2), seed=1)
    with pytest.raises(ValueError, match=r"`sink` must be fp32 \[3\]"):
        fused.sparse_attention_fused_sink_grad(*to_pd(q, kv, idx), paddle.to_tensor(sink[:2]), scale)
    with pytest.raises(ValueError, match=r"sparse_attention_fused_sink_grad: `sink` must be a paddle.Tensor"):
        fused.sparse_attention_fused_sink_grad(*to_pd(q, kv, idx), sink, scale)


def test_gpu_launch_geometry_in_the_interpreter(monkeypatch):
    """One token per step, 16 tokens per program, 64-head blocks, 128-wide d steps: same maths."""
    monkeypatch.setattr(kernel, "is_interpreted", lambda: False)
    cfg = kernel.config(20, 64, 300)
    assert (cfg["TOK"], cfg["BLOCK_T"], cfg["BLOCK_H"], cfg["BLOCK_D"]) == (16, 1, 64, 128)
    rng = np.random.default_rng(13)
    arrays = make_case(rng, (1, 20, 64, 300))
    d_lse = rng.standard_normal((1, 20, 64)).astype(F32)
    with expect_launches(PARTIAL, exactly=2):
        got = kernel.sink_grad(*to_pd(*arrays), d_lse=paddle.to_tensor(d_lse))
        again = kernel.sink_grad(*to_pd(*arrays), d_lse=paddle.to_tensor(d_lse))
    assert_bitwise(got, again, "two runs")
    exact, scale = oracle_d_sink(*arrays, d_lse)
    assert_within(got.numpy(), exact, scale, "GPU geometry")


@pytest.mark.parametrize("shape", [(1, 3, 8, 256), (2, 2, 5, 300)])
def test_gpu_small_input_takes_all_tokens_in_one_step_with_the_same_bits(monkeypatch, shape):
    """The GPU's small-input launch ([heads, tokens, d] in one step, tokens added in order) gives the bits of one
    token per step (the GPU tests check the same on the H200), and holds to the oracle."""
    from fleet_ext.ops import launch

    monkeypatch.setattr(kernel, "is_interpreted", lambda: False)
    rng = np.random.default_rng(17)
    arrays = make_case(rng, shape)
    arrays[0][..., :3] = 0.0  # -0.0 and +0.0 terms among the others
    arrays[1][..., :3] = -1.0
    d_lse = rng.standard_normal(shape[:3]).astype(F32)
    got = {}
    try:
        for one_step in (True, False):
            monkeypatch.setattr(kernel, "TINY_ONE_STEP", one_step)
            launch.clear_plans()
            assert kernel.config(shape[0] * shape[1], shape[2], shape[3]).get("IN_ORDER", False) == one_step
            with expect_launches(PARTIAL, exactly=2), expect_launches(REDUCE, exactly=0):
                got[one_step] = [kernel.sink_grad(*to_pd(*arrays), d_lse=dl) for dl in (None, paddle.to_tensor(d_lse))]
    finally:
        launch.clear_plans()
    for i, dl in enumerate((None, d_lse)):
        assert_bitwise(got[True][i], got[False][i], f"one step vs one token a step, d_lse {dl is not None}")
        exact, scale = oracle_d_sink(*arrays, dl)
        assert_within(got[True][i].numpy(), exact, scale, "one step")
