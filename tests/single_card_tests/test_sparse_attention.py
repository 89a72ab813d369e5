"""Sparse MQA attention with a per-head sink vs the float64 oracle (dsv4_math.md §2.5 forward, §7 backward).

Tolerances (tests/helpers/tolerances.py, fp32): the reference vs the float64 oracle. Logits are contractions
of d <= 16 O(1) terms and the softmax and weighted sum keep relative error at a few ulps: ``oracle`` for
outputs and lse; gradients chain two such contractions (measured ~1e-7): ``oracle_grad``, relative to the
largest entry of each gradient; d_sink vs central differences of the float64 oracle: the same entry (FD
error ~1e-10). An empty row's lse is the sink: ``empty_row_lse_rel``.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, assert_close
from helpers import oracles as orc

from fleet_ext.ops.sparse_attn.reference import sparse_attention_with_sink

# (B, S, H, d, N, K)
SHAPES = [(2, 5, 3, 8, 7, 4), (1, 6, 4, 16, 6, 6), (3, 2, 1, 4, 3, 2)]


def make_idx(rng, bsz, seq, n_kv, width, dtype="int32", duplicates=False):
    """Random rows of distinct ids (or with repeats), -1 at random slots; row (0,0) all -1, row (-1,-1) full."""
    idx = np.full((bsz, seq, width), -1, dtype=np.int64)
    for b in range(bsz):
        for t in range(seq):
            m = rng.integers(0, min(width, n_kv) + 1)
            if duplicates:
                ids = rng.integers(0, n_kv, size=m)
            else:
                ids = rng.choice(n_kv, size=m, replace=False)
            slots = rng.choice(width, size=m, replace=False)
            idx[b, t, slots] = ids
    idx[0, 0] = -1
    idx[-1, -1] = -1
    full = min(width, n_kv)
    idx[-1, -1, :full] = rng.choice(n_kv, size=full, replace=False)
    return idx.astype(dtype)


def make_inputs(shape, seed, dtype="int32", duplicates=False):
    bsz, seq, heads, dim, n_kv, width = shape
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((bsz, seq, heads, dim)) * 1.5).astype("float32")
    kv = rng.standard_normal((bsz, n_kv, dim)).astype("float32")
    idx = make_idx(rng, bsz, seq, n_kv, width, dtype, duplicates)
    sink = rng.uniform(-1.0, 2.0, heads).astype("float32")
    return q, kv, idx, sink, 1.0 / math.sqrt(dim), rng


def run(q, kv, idx, sink, scale, d_out=None, d_lse=None):
    qt = paddle.to_tensor(q, stop_gradient=False)
    kvt = paddle.to_tensor(kv, stop_gradient=False)
    st = paddle.to_tensor(sink, stop_gradient=False)
    out, lse = sparse_attention_with_sink(qt, kvt, paddle.to_tensor(idx), st, scale)
    if d_out is None:
        return out.numpy(), lse.numpy()
    loss = (out * paddle.to_tensor(d_out)).sum()
    if d_lse is not None:
        loss = loss + (lse * paddle.to_tensor(d_lse)).sum()
    loss.backward()
    return out.numpy(), lse.numpy(), qt.grad.numpy(), kvt.grad.numpy(), st.grad.numpy()


def assert_grad_close(got, want, name):
    scale = np.abs(want).max()
    assert scale > 1e-3, f"{name}: oracle gradient is ~0, the comparison would be vacuous"
    assert_close(got, want, "fp32", "oracle_grad", what=name)


@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("shape", SHAPES, ids=["B2S5H3d8", "B1S6H4d16", "B3S2H1d4"])
def test_forward_matches_oracle(shape, idx_dtype):
    q, kv, idx, sink, scale, _ = make_inputs(shape, seed=sum(shape))
    out, lse = run(q, kv, idx, sink, scale)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert out.dtype == np.float32 and lse.dtype == np.float32
    want_out, want_lse = orc.sparse_attention_fwd(q, kv, idx, sink, scale)
    assert_close(out, want_out, "fp32", "oracle", what="out")
    assert_close(lse, want_lse, "fp32", "oracle", what="lse")
    # The sink must matter: without it the oracle output differs.
    no_sink_out, _ = orc.sparse_attention_fwd(q, kv, idx, np.full(sink.shape, -1e30), scale)
    assert np.abs(no_sink_out - want_out).max() > 1e-2


def test_rows_without_any_valid_index_are_exactly_zero_and_finite():
    # Paddle CPU's vectorised exp returns 2.9e-39, not 0, for -inf: masking by a -inf logit alone is not enough.
    q, kv, idx, sink, scale, rng = make_inputs(SHAPES[0], seed=11)
    idx[1, 2] = -1
    out, lse, dq, dkv, dsink = run(q, kv, idx, sink, scale, d_out=rng.standard_normal(q.shape).astype("float32"))
    for b, t in ((0, 0), (1, 2)):
        assert np.all(idx[b, t] == -1)
        assert np.all(out[b, t] == 0.0), f"row ({b},{t}) with no valid key must output exactly 0, got {out[b, t]}"
        assert np.all(dq[b, t] == 0.0), f"row ({b},{t}) with no valid key must get dq exactly 0, got {dq[b, t]}"
        assert_close(lse[b, t], sink, "fp32", "empty_row_lse_rel", what="empty row: lse = sink")
    for name, arr in (("out", out), ("lse", lse), ("dq", dq), ("dkv", dkv), ("dsink", dsink)):
        assert np.all(np.isfinite(arr)), f"{name} has non-finite values"


def test_kv_rows_never_read_get_exactly_zero_gradient():
    q, kv, idx, sink, scale, rng = make_inputs(SHAPES[0], seed=11)
    idx[idx == 0] = -1  # nobody reads kv row 0 (the row the reference gathers for invalid slots)
    assert (idx == -1).any(axis=(1, 2)).all()
    _, _, _, dkv, _ = run(q, kv, idx, sink, scale, d_out=rng.standard_normal(q.shape).astype("float32"))
    for b in range(idx.shape[0]):
        unused = np.setdiff1d(np.arange(kv.shape[1]), idx[b][idx[b] >= 0])
        assert np.all(dkv[b, unused] == 0.0), f"batch {b}: kv rows {unused} are never read but got {dkv[b, unused]}"


@pytest.mark.parametrize("with_lse_grad", [False, True], ids=["dO_only", "dO_and_dlse"])
@pytest.mark.parametrize("shape", SHAPES, ids=["B2S5H3d8", "B1S6H4d16", "B3S2H1d4"])
def test_backward_matches_analytic_oracle(shape, with_lse_grad):
    q, kv, idx, sink, scale, rng = make_inputs(shape, seed=7 + sum(shape))
    d_out = rng.standard_normal(q.shape).astype("float32")
    d_lse = rng.standard_normal(q.shape[:3]).astype("float32") if with_lse_grad else None
    _, _, dq, dkv, dsink = run(q, kv, idx, sink, scale, d_out=d_out, d_lse=d_lse)
    want_dq, want_dkv, want_dsink = orc.sparse_attention_bwd(q, kv, idx, sink, scale, d_out, d_lse)
    assert_grad_close(dq, want_dq, "dq")
    assert_grad_close(dkv, want_dkv, "dkv")
    assert_grad_close(dsink, want_dsink, "d_sink")


def test_backward_with_duplicate_indices():
    """A repeated id is two softmax columns over the same row; both contributions land in dkv."""
    q, kv, idx, sink, scale, rng = make_inputs((2, 4, 2, 8, 3, 5), seed=5, duplicates=True)
    idx[0, 1] = [2, 2, -1, 0, 2]
    d_out = rng.standard_normal(q.shape).astype("float32")
    out, lse, dq, dkv, dsink = run(q, kv, idx, sink, scale, d_out=d_out)
    want_out, want_lse = orc.sparse_attention_fwd(q, kv, idx, sink, scale)
    assert_close(out, want_out, "fp32", "oracle", what="out")
    assert_close(lse, want_lse, "fp32", "oracle", what="lse")
    want_dq, want_dkv, want_dsink = orc.sparse_attention_bwd(q, kv, idx, sink, scale, d_out)
    assert_grad_close(dq, want_dq, "dq")
    assert_grad_close(dkv, want_dkv, "dkv")
    assert_grad_close(dsink, want_dsink, "d_sink")


def test_d_sink_vs_finite_differences():
    q, kv, idx, sink, scale, rng = make_inputs(SHAPES[0], seed=21)
    d_out = rng.standard_normal(q.shape).astype("float32")
    d_lse = rng.standard_normal(q.shape[:3]).astype("float32")
    *_, dsink = run(q, kv, idx, sink, scale, d_out=d_out, d_lse=d_lse)
    sink64 = sink.astype(np.float64)

    def loss():
        out, lse = orc.sparse_attention_fwd(q, kv, idx, sink64, scale)
        return float((out * d_out).sum() + (lse * d_lse).sum())

    fd = orc.central_fd(loss, sink64, list(range(sink.size)))
    assert_grad_close(dsink, fd, "d_sink vs finite differences")
    # And the closed form of §7 without the lse term: d_sink = -sum P_sink * Delta.
    *_, dsink_o = run(q, kv, idx, sink, scale, d_out=d_out)
    out64, lse64 = orc.sparse_attention_fwd(q, kv, idx, sink64, scale)
    delta = (d_out * out64).sum(-1)
    closed = -(np.exp(sink64[None, None, :] - lse64) * delta).sum(axis=(0, 1))
    assert_grad_close(dsink_o, closed, "d_sink closed form")


def test_two_runs_are_byte_identical():
    q, kv, idx, sink, scale, rng = make_inputs(SHAPES[1], seed=3)
    d_out = rng.standard_normal(q.shape).astype("float32")
    first = run(q, kv, idx, sink, scale, d_out=d_out)
    second = run(q, kv, idx, sink, scale, d_out=d_out)
    for name, a, b in zip(("out", "lse", "dq", "dkv", "dsink"), first, second):
        assert_bitwise(a, b, f"{name}, two identical runs")


# --------------------------------------------------------------------------------------------------
# Bad inputs.
# --------------------------------------------------------------------------------------------------
def _bad_case(which):
    q = paddle.zeros([2, 3, 4, 8])
    kv = paddle.zeros([2, 5, 8])
    idx = paddle.zeros([2, 3, 2], dtype="int32")
    sink = paddle.zeros([4])
    if which == "q_rank":
        q = paddle.zeros([2, 3, 8])
    elif which == "kv_rank":
        kv = paddle.zeros([10, 8])
    elif which == "kv_batch":
        kv = paddle.zeros([3, 5, 8])
    elif which == "kv_dim":
        kv = paddle.zeros([2, 5, 6])
    elif which == "idx_rank":
        idx = paddle.zeros([6, 2], dtype="int32")
    elif which == "idx_seq":
        idx = paddle.zeros([2, 4, 2], dtype="int32")
    elif which == "idx_dtype":
        idx = paddle.zeros([2, 3, 2], dtype="float32")
    elif which == "sink_dtype":
        sink = paddle.zeros([4], dtype="float64")
    elif which == "sink_len":
        sink = paddle.zeros([3])
    elif which == "sink_rank":
        sink = paddle.zeros([1, 4])
    return q, kv, idx, sink


@pytest.mark.parametrize(
    "which,pattern",
    [("q_rank", "`q`"), ("kv_rank", "`kv`"), ("kv_batch", "`kv`"), ("kv_dim", "`kv`"), ("idx_rank", "`idx`"),
     ("idx_seq", "`idx`"), ("sink_dtype", "`sink`"), ("sink_len", "`sink`"), ("sink_rank", "`sink`"),
     ("idx_dtype", "idx`")],  # checked by the remap op, whose message says `local_idx`
)
def test_bad_inputs_raise_naming_the_tensor(which, pattern):
    q, kv, idx, sink = _bad_case(which)
    with pytest.raises(ValueError, match=pattern):
        sparse_attention_with_sink(q, kv, idx, sink, 0.5)


def test_good_inputs_of_bad_case_builder_run():
    """The builder's baseline is valid, so each failure above is caused by the one change it makes."""
    out, lse = sparse_attention_with_sink(*_bad_case("none"), 0.5)
    assert list(out.shape) == [2, 3, 4, 8] and list(lse.shape) == [2, 3, 4]
