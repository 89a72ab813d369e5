"""Triton sparse MQA attention with sink on the CPU (Triton interpreter, fp32): kernels and the Paddle PyLayer.

- Kernels (``kernel.sparse_attn_fwd`` / ``sparse_attn_bwd`` on torch CPU tensors) against an independent
  float64 NumPy oracle written here from dsv4_math.md §2.5 (forward) and §7 (sink backward, plus the
  gradient reaching the LSE): out, lse, dq, dkv, d_sink; rows whose indices are all -1, kv rows repeated
  within and across queries (dkv accumulation), d_qk != d_v, partial head tiles, ``topk_length``, the
  query-chunked backward, out-of-range ids skipped.
- Determinism: two backward runs give byte-identical dq, dkv, d_sink.
- Trailing bound (``kernel.row_bound``, derived by default): its values against NumPy, and results with it
  byte-identical to results without it (``derive_bound=False``), on rows with trailing -1 runs longer than
  a slot block, interior -1 holes, out-of-range ids and ``topk_length``; still equal to the oracle.
- ``function.sparse_attention_triton`` (Paddle tensors, PyLayer) against the Paddle reference
  ``reference.sparse_attention_with_sink`` (forward and autograd), including widths that need padding.
- Bad inputs raise ValueError naming the tensor.
- Band slots (``band.py``: the window's and HCA's dkv summed key-major) against the same oracle, both kernel modes.

Tolerance: fp32 ``triton_sparse_attn`` (tests/helpers/tolerances.py; relative to the largest entry of the
reference; measured errors are ~1e-7..5e-7):
- kernel vs float64 oracle: logits are <= 64-term fp32 dots, the online softmax rescales the running sums
  once per block of 16 slots, and gradients chain two such contractions plus one sum per kv row in CSR
  order: each step is a few ulps (1.2e-7), far under the bound.
- PyLayer vs Paddle reference (both fp32): the same argument for both sides; they are not bitwise equal
  because the reference sums over the whole index row at once and the kernel in blocks.
Every run counts the forward and backward kernels' launches.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, assert_close, expect_launches

from fleet_ext import capability

capability.prepare_triton()
torch = pytest.importorskip("torch")

from helpers import pack24  # noqa: E402

from fleet_ext.ops import launch  # noqa: E402
from fleet_ext.ops.sparse_attn import kernel  # noqa: E402
from fleet_ext.ops.sparse_attn.function import sparse_attention_triton  # noqa: E402
from fleet_ext.ops.sparse_attn.reference import sparse_attention_with_sink  # noqa: E402


# ------------------------------------------------------------------------------------------------------
# float64 oracle (independent of fleet_ext)
# ------------------------------------------------------------------------------------------------------
def oracle(q, kv, idx, sink, scale, d_v, d_out, d_lse, topk_length=None, abs_dkv=None):
    """Flat layout. Loss = sum(out * d_out) + sum(lse * d_lse); returns out, lse, dq, dkv, d_sink (float64);
    ``abs_dkv`` (an [N, d_qk] array), when given, collects the sum of the absolute per-pair contributions.

    P_j = exp(l_j - LSE), P_sink = exp(sink - LSE), delta = rowsum(dO * O) - dLSE;
    dl_j = P_j (dO . v_j - delta); dq = scale sum_j dl_j k_j; dkv_j += scale dl_j q (all d_qk channels)
    + P_j dO (value channels); d_sink = -sum P_sink delta.
    """
    q, kv, sink, d_out, d_lse = (np.asarray(a, np.float64) for a in (q, kv, sink, d_out, d_lse))
    num_t, heads, dim = q.shape
    n_kv = kv.shape[0]
    out, lse = np.zeros((num_t, heads, d_v)), np.zeros((num_t, heads))
    dq, dkv, d_sink = np.zeros_like(q), np.zeros_like(kv), np.zeros(heads)
    for t in range(num_t):
        row = idx[t] if topk_length is None else idx[t][: max(0, min(int(topk_length[t]), idx.shape[1]))]
        keys = [int(j) for j in row if 0 <= j < n_kv]
        k = kv[keys].reshape(len(keys), dim)
        logits = scale * q[t] @ k.T  # [H, n]
        m = np.maximum(logits.max(1) if keys else -np.inf, sink)
        e, e_sink = np.exp(logits - m[:, None]), np.exp(sink - m)
        z = e.sum(1) + e_sink
        p, p_sink = e / z[:, None], e_sink / z
        out[t], lse[t] = p @ k[:, :d_v], m + np.log(z)
        delta = (d_out[t] * out[t]).sum(1) - d_lse[t]
        dl = p * (d_out[t] @ k[:, :d_v].T - delta[:, None])
        dq[t] = scale * dl @ k
        contrib = scale * dl.T @ q[t]
        contrib[:, :d_v] += p.T @ d_out[t]
        for a, j in enumerate(keys):
            dkv[j] += contrib[a]
            if abs_dkv is not None:
                abs_dkv[j] += np.abs(contrib[a])
        d_sink -= p_sink * delta
    return out, lse, dq, dkv, d_sink


def make_case(seed, num_t, heads, d_qk, d_v, n_kv, width, *, empty_rows=2, repeats=True, out_of_range=False):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((num_t, heads, d_qk)) * 1.5).astype(np.float32)
    kv = rng.standard_normal((n_kv, d_qk)).astype(np.float32)
    idx = np.full((num_t, width), -1, dtype=np.int32)
    for t in range(num_t):
        m = rng.integers(1, min(width, n_kv) + 1)
        idx[t, rng.choice(width, m, replace=False)] = rng.choice(n_kv, m, replace=False)
    idx[:empty_rows] = -1  # rows with no valid index: out = 0, lse = sink
    if repeats:  # one kv row read by many queries, and twice within a row
        idx[empty_rows:, 0] = 3 % n_kv
        idx[-1, 1] = 3 % n_kv
    if out_of_range:
        idx[-2, -1] = n_kv + 5  # >= N: skipped like -1
        idx[-3, -1] = -7
    sink = rng.uniform(-1.0, 2.0, heads).astype(np.float32)
    d_out = rng.standard_normal((num_t, heads, d_v)).astype(np.float32)
    d_lse = (rng.standard_normal((num_t, heads)) * 0.3).astype(np.float32)
    return q, kv, idx, sink, d_out, d_lse


def run_kernels(q, kv, idx, sink, scale, d_v, d_out, d_lse, topk_length=None, derive_bound=True, **bwd_kw):
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, kv, idx, sink, d_out, d_lse)]
    tl_t = None if topk_length is None else torch.from_numpy(topk_length)
    reduce = () if bwd_kw.get("slot_bands") else ("_bwd_dkv_reduce_kernel",)  # bands over every slot: no reduce
    with expect_launches("_sparse_attn_fwd_kernel", "_bwd_dq_kernel", *reduce):
        out, lse = kernel.sparse_attn_fwd(t[0], t[1], t[2], t[3], scale, d_v=d_v, topk_length=tl_t,
                                          derive_bound=derive_bound)
        grads = kernel.sparse_attn_bwd(t[0], t[1], t[2], t[3], scale, out, lse, t[4], t[5], d_v=d_v,
                                       topk_length=tl_t, derive_bound=derive_bound, **bwd_kw)
    return [x.numpy() for x in (out, lse, *grads)]


# (num_t, heads, d_qk, d_v, n_kv, width)
CASES = {
    "latent_dqk_ne_dv": (9, 3, 48, 32, 11, 24),  # d_qk = 32 + 16 (the 512 + 64 split in miniature)
    "k_eq_v_multiblock": (6, 16, 32, 32, 40, 37),  # K not a multiple of the slot block
    "two_head_tiles_partial": (4, 70, 32, 16, 7, 6),  # 70 heads: a full 64-head tile + a masked one
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_float64_oracle(case):
    num_t, heads, d_qk, d_v, n_kv, width = CASES[case]
    q, kv, idx, sink, d_out, d_lse = make_case(list(CASES).index(case), num_t, heads, d_qk, d_v, n_kv, width,
                                               out_of_range=case == "k_eq_v_multiblock")
    scale = 1.0 / math.sqrt(d_qk)
    got = run_kernels(q, kv, idx, sink, scale, d_v, d_out, d_lse)
    ref = oracle(q, kv, idx, sink, scale, d_v, d_out, d_lse)
    for name, g, r in zip(("out", "lse", "dq", "dkv", "d_sink"), got, ref):
        assert_close(g, r, "fp32", "triton_sparse_attn", what=f"{case}: {name}")
    # rows with every index -1: out exactly 0, lse = sink, dq exactly 0
    assert np.all(got[0][:2] == 0.0) and np.all(got[2][:2] == 0.0)
    assert_close(got[1][:2], np.broadcast_to(sink, (2, heads)), "fp32", "empty_row_lse", what="empty rows: lse")
    # kv rows nobody reads get exactly zero gradient
    unread = sorted(set(range(n_kv)) - {int(j) for j in idx.ravel() if 0 <= j < n_kv})
    assert np.all(got[3][unread] == 0.0)


def test_topk_length_and_chunked_backward():
    num_t, heads, d_qk, d_v, n_kv, width = 8, 4, 48, 32, 12, 20
    q, kv, idx, sink, d_out, d_lse = make_case(7, num_t, heads, d_qk, d_v, n_kv, width)
    topk_length = np.array([0, 3, 20, 25, 7, 1, 16, 19], dtype=np.int32)  # 0, > K, block edges
    scale = 0.3
    # max_partial_bytes below one query's pair buffers: one query per chunk, chunks summed in order
    got = run_kernels(q, kv, idx, sink, scale, d_v, d_out, d_lse, topk_length, max_partial_bytes=1)
    ref = oracle(q, kv, idx, sink, scale, d_v, d_out, d_lse, topk_length)
    for name, g, r in zip(("out", "lse", "dq", "dkv", "d_sink"), got, ref):
        assert_close(g, r, "fp32", "triton_sparse_attn", what=f"topk_length: {name}")


def test_backward_is_bitwise_deterministic():
    q, kv, idx, sink, d_out, d_lse = make_case(11, 10, 5, 48, 32, 6, 16)  # 6 kv rows: heavy reuse
    first = run_kernels(q, kv, idx, sink, 0.2, 32, d_out, d_lse, max_partial_bytes=20000)
    second = run_kernels(q, kv, idx, sink, 0.2, 32, d_out, d_lse, max_partial_bytes=20000)
    for name, a, b in zip(("out", "lse", "dq", "dkv", "d_sink"), first, second):
        assert_bitwise(a, b, f"{name}, two runs")


@pytest.mark.parametrize("max_partial_bytes", [4 << 30, 7000], ids=["one_query_chunk", "query_chunks"])
def test_dkv_reduce_splits_long_rows_into_items(monkeypatch, max_partial_bytes):
    """Rows with more pairs than ``REDUCE_CHUNK`` are summed by several programs, then their parts in order
    (``_bwd_dkv_combine_kernel``): dkv within the oracle's bound, byte-identical run to run, and rows of at most
    one item byte-identical to the unsplit reduce. Negative control: items mapped with a chunk one pair longer
    than the reduce sums (a pair of every split row dropped) fail the oracle check."""
    num_t, heads, d_qk, d_v, n_kv, width = 9, 3, 48, 32, 8, 6
    q, kv, idx, sink, d_out, d_lse = make_case(31, num_t, heads, d_qk, d_v, n_kv, width, empty_rows=1)
    idx[1:, 0] = n_kv - 1  # the last kv row read by every query but the empty one (like an HCA entry)
    pairs = np.bincount(idx[(idx >= 0) & (idx < n_kv)], minlength=n_kv)
    ref = oracle(q, kv, idx, sink, 0.3, d_v, d_out, d_lse)
    whole = run_kernels(q, kv, idx, sink, 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes)
    monkeypatch.setattr(kernel, "REDUCE_CHUNK", 3)
    with expect_launches("_bwd_dkv_combine_kernel", "_csr_items_kernel"):
        split = run_kernels(q, kv, idx, sink, 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes)
    again = run_kernels(q, kv, idx, sink, 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes)
    assert pairs.max() > 3 * 2 and (pairs <= 3).any()  # rows of one item and rows of several
    for name, g, r in zip(("out", "lse", "dq", "dkv", "d_sink"), split, ref):
        assert_close(g, r, "fp32", "triton_sparse_attn", what=f"split reduce: {name}")
    for name, a, b in zip(("out", "lse", "dq", "dkv", "d_sink"), split, again):
        assert_bitwise(a, b, f"split reduce, two runs: {name}")
    if max_partial_bytes > 4000:  # one query chunk: a row's item count is its whole pair count's
        short = pairs <= 3
        assert_bitwise(split[3][short], whole[3][short], "rows of one item: split vs unsplit reduce")
    real_launch = kernel.launch

    def map_with_a_longer_chunk(fn, grid, *args, **kw):
        if fn is kernel._csr_items_kernel:
            args = (*args[:3], args[3] + 1)
        return real_launch(fn, grid, *args, **kw)

    monkeypatch.setattr(kernel, "launch", map_with_a_longer_chunk)
    planted = run_kernels(q, kv, idx, sink, 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes)
    with pytest.raises(AssertionError):
        assert_close(planted[3], ref[3], "fp32", "triton_sparse_attn", what="planted: items of 4 pairs, sums of 3")


def test_pack24_rounds_to_nearest_at_16_significant_bits():
    """Specials (signed zeros, subnormals, the largest finite value, inf, NaN), ties both ways and random values:
    normal values to their nearest 16-bit-significand neighbour (a tie to either), subnormals within 2^-141, the
    largest values, inf and NaN non-finite; truncation's and half-up rounding's oracles fail on them."""
    rng = np.random.default_rng(3)
    tie_bits = np.array([0x3F800080, 0x3F800180, 0xBF800080, 0x00000080, 0x00000180], dtype=np.uint32)
    specials = np.array([0.0, -0.0, 1e-45, -3e-44, 1.17549435e-38, 3.4028235e38, -3.4028235e38, np.inf, -np.inf,
                         np.nan, 1.0, -2.5], dtype=np.float32)
    x = np.concatenate([specials, tie_bits.view(np.float32),
                        (rng.standard_normal(200) * 10.0 ** rng.uniform(-30, 30, 200)).astype(np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):  # the interpreter's x * 257 for the largest values
        got = pack24.roundtrip(x)
    normal = np.isfinite(x) & (np.abs(x) >= 2.0 ** -126) & (np.abs(x) < 2.0 ** 128 / 257)
    assert np.all(pack24.nearest_or_tie(got[normal], x[normal]))
    tiny = np.isfinite(x) & (np.abs(x) < 2.0 ** -126)
    assert np.all(np.abs(got[tiny].astype(np.float64) - x[tiny]) < 2.0 ** -141)
    assert not np.isfinite(got[~np.isfinite(x) | (np.abs(x) >= 2.0 ** 128 / 257)]).any()
    for other in ("toward_zero", "half_up"):
        assert not np.array_equal(got[normal], pack24.round_to_16_bits(x, other)[normal]), other


def test_float24_contributions_stay_within_their_rounding_bound():
    """``partial_dtype="float24"``: out, lse, dq and d_sink byte-equal to the fp32 contributions' backward; dkv
    within 2^-16 of the summed absolute contributions (plus the fp32 sum's own rounding: the bound fails at 2^-17)
    and really rounded (some error above 2^-20 of it); byte-identical run to run, in one query chunk and in
    chunks."""
    num_t, heads, d_qk, d_v, n_kv, width = 9, 3, 48, 32, 6, 12
    q, kv, idx, sink, d_out, d_lse = make_case(41, num_t, heads, d_qk, d_v, n_kv, width)
    abs_sum = np.zeros((n_kv, d_qk))
    oracle(q, kv, idx, sink, 0.3, d_v, d_out, d_lse, abs_dkv=abs_sum)
    full = run_kernels(q, kv, idx, sink, 0.3, d_v, d_out, d_lse)
    for max_partial_bytes in (4 << 30, 9000):
        with expect_launches("_bwd_dkv_partial_kernel", "_bwd_dkv_reduce_kernel"):
            packed = run_kernels(q, kv, idx, sink, 0.3, d_v, d_out, d_lse, partial_dtype="float24",
                                 max_partial_bytes=max_partial_bytes)
        again = run_kernels(q, kv, idx, sink, 0.3, d_v, d_out, d_lse, partial_dtype="float24",
                            max_partial_bytes=max_partial_bytes)
        for name, a, b, c in zip(("out", "lse", "dq", "dkv", "d_sink"), packed, again, full):
            assert_bitwise(a, b, f"float24 contributions, two runs: {name}")
            if name != "dkv":
                assert_bitwise(a, c, f"float24 vs float32 contributions: {name}")
        err = np.abs(packed[3].astype(np.float64) - full[3])
        reads = int(np.bincount(idx[(idx >= 0) & (idx < n_kv)], minlength=n_kv).max())
        assert np.all(err <= (2.0 ** -16 + 2 * reads * 2.0 ** -24) * abs_sum), float((err / abs_sum).max())
        assert (err > 2.0 ** -20 * abs_sum).any(), "float24 contributions were not rounded"


def _bound_case(seed, num_t=12, heads=5, d_qk=48, d_v=32, n_kv=9, width=45):
    """Rows ending in -1 runs of every length (0 .. > 2 slot blocks of 16), interior holes, bad ids."""
    q, kv, idx, sink, d_out, d_lse = make_case(seed, num_t, heads, d_qk, d_v, n_kv, width, empty_rows=1,
                                               out_of_range=True)
    rng = np.random.default_rng(seed + 1)
    ends = [0, 1, 3, 16, 17, 30, 33, 44, 45, 45, 8, 40]  # last valid slot + 1 per row (0: an empty row)
    for t, end in enumerate(ends):
        idx[t] = -1
        if end:
            idx[t, :end] = rng.integers(0, n_kv, end)
            holes = rng.choice(end - 1, min(end - 1, 3), replace=False) if end > 1 else []
            idx[t, holes] = -1  # interior holes stay masked
            idx[t, end - 1] = rng.integers(0, n_kv)  # the last valid slot
    idx[5, 40:] = n_kv + 2  # out-of-range ids past the last valid slot: not valid, past the bound
    idx[7, 20] = -9  # an interior negative id that is not -1
    return q, kv, idx, sink, d_out, d_lse, ends


def test_row_bound_matches_numpy():
    n_kv = 9
    *_, idx, _, _, _, ends = _bound_case(21)
    got = kernel.row_bound(torch.from_numpy(idx), n_kv).numpy()
    assert got.dtype == np.int32
    assert got.tolist() == ends
    topk_length = np.array([5, 0, 2, 16, 100, -3, 20, 44, 45, 7, 8, 39], dtype=np.int64)
    got = kernel.row_bound(torch.from_numpy(idx.astype(np.int64)), n_kv, torch.from_numpy(topk_length)).numpy()
    for t in range(idx.shape[0]):
        lim = max(0, min(int(topk_length[t]), idx.shape[1]))
        valid = [k for k in range(lim) if 0 <= idx[t, k] < n_kv]
        assert got[t] == (valid[-1] + 1 if valid else 0), t
    assert kernel.row_bound(torch.zeros((0, 4), dtype=torch.int32), 3).shape == (0,)
    with pytest.raises(ValueError, match=r"row_bound: `idx` must be"):
        kernel.row_bound(torch.zeros(4), 3)


@pytest.mark.parametrize("with_topk_length", [False, True], ids=["no_topk_length", "topk_length"])
def test_derived_bound_is_byte_identical_and_exact(with_topk_length):
    q, kv, idx, sink, d_out, d_lse, ends = _bound_case(22 + with_topk_length)
    topk_length = np.array([3, 1, 45, 9, 60, 0, 25, 44, 12, 45, 8, 40], dtype=np.int32) if with_topk_length else None
    scale = 1.0 / math.sqrt(q.shape[-1])
    kw = {"topk_length": topk_length, "max_partial_bytes": 40000}  # several query chunks
    before = launch.LAUNCH_COUNTS["_row_bound_kernel"]
    bounded = run_kernels(q, kv, idx, sink, scale, 32, d_out, d_lse, **kw)
    assert launch.LAUNCH_COUNTS["_row_bound_kernel"] == before + 2, "forward and backward each derive the bound"
    full = run_kernels(q, kv, idx, sink, scale, 32, d_out, d_lse, derive_bound=False, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dkv", "d_sink"), bounded, full):
        assert_bitwise(a, b, f"{name}: with vs without the derived bound")
    ref = oracle(q, kv, idx, sink, scale, 32, d_out, d_lse, topk_length)
    for name, g, r in zip(("out", "lse", "dq", "dkv", "d_sink"), bounded, ref):
        assert_close(g, r, "fp32", "triton_sparse_attn", what=f"bound: {name}")


# ------------------------------------------------------------------------------------------------------
# Paddle PyLayer vs the Paddle reference
# ------------------------------------------------------------------------------------------------------
def _paddle_run(fn, q, kv, idx, sink, scale, d_v, w_out, w_lse):
    qt = paddle.to_tensor(q, stop_gradient=False)
    kvt = paddle.to_tensor(kv, stop_gradient=False)
    st = paddle.to_tensor(sink, stop_gradient=False)
    out, lse = fn(qt, kvt, paddle.to_tensor(idx), st, scale, d_v=d_v)
    loss = (out * paddle.to_tensor(w_out)).sum() + (lse * paddle.to_tensor(w_lse)).sum()
    loss.backward()
    return [x.numpy() for x in (out, lse, qt.grad, kvt.grad, st.grad)]


@pytest.mark.parametrize(
    "bsz, seq, heads, dim, d_v, n_kv, width, idx_dtype",
    [
        (2, 5, 3, 48, 32, 7, 6, "int32"),  # latent: value 32 + tail 16, two batches (remap)
        (2, 4, 4, 24, 24, 5, 5, "int64"),  # width 24: zero-padded to 32 for the kernel
        (1, 6, 2, 40, 24, 6, 4, "int32"),  # value 24 -> 32 and tail 16 (both padded)
    ],
    ids=["latent_b2", "pad_k_eq_v_int64", "pad_value_and_tail"],
)
def test_pylayer_matches_paddle_reference(bsz, seq, heads, dim, d_v, n_kv, width, idx_dtype):
    rng = np.random.default_rng(bsz * 100 + dim)
    q = rng.standard_normal((bsz, seq, heads, dim)).astype(np.float32)
    kv = rng.standard_normal((bsz, n_kv, dim)).astype(np.float32)
    idx = np.full((bsz, seq, width), -1, dtype=idx_dtype)
    for b in range(bsz):
        for t in range(seq):
            m = rng.integers(0, min(width, n_kv) + 1)
            idx[b, t, rng.choice(width, m, replace=False)] = rng.choice(n_kv, m, replace=False)
    idx[0, 0] = -1
    sink = rng.uniform(-1.0, 2.0, heads).astype(np.float32)
    w_out = rng.standard_normal((bsz, seq, heads, d_v)).astype(np.float32)
    w_lse = rng.standard_normal((bsz, seq, heads)).astype(np.float32)
    scale = 1.0 / math.sqrt(dim)
    names = ("_sparse_attn_fwd_kernel", "_bwd_dkv_reduce_kernel", "_row_bound_kernel")
    before = [launch.LAUNCH_COUNTS[n] for n in names]
    got = _paddle_run(sparse_attention_triton, q, kv, idx, sink, scale, d_v, w_out, w_lse)
    after = [launch.LAUNCH_COUNTS[n] for n in names]
    assert after[0] > before[0], "the Triton forward did not run"
    assert after[1] > before[1], "the Triton backward did not run"
    assert after[2] == before[2] + 1, "the trailing bound must be derived once (forward) and reused (backward)"
    ref = _paddle_run(sparse_attention_with_sink, q, kv, idx, sink, scale, d_v, w_out, w_lse)
    for name, g, r in zip(("out", "lse", "dq", "dkv", "d_sink"), got, ref):
        assert_close(g, r, "fp32", "triton_sparse_attn", what=f"pylayer vs reference: {name}")


def test_pylayer_frozen_sink_and_unused_lse():
    """A sink that needs no gradient gets None (Paddle requires it) and an unused lse sends no gradient."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 3, 32)).astype(np.float32)
    kv = rng.standard_normal((2, 5, 32)).astype(np.float32)
    idx = rng.integers(-1, 5, (2, 4, 6)).astype(np.int32)
    sink = paddle.to_tensor(rng.uniform(-1.0, 1.0, 3).astype(np.float32))  # stop_gradient=True
    grads = []
    for fn, launches in ((sparse_attention_triton, None), (sparse_attention_with_sink, 0)):
        qt, kvt = paddle.to_tensor(q, stop_gradient=False), paddle.to_tensor(kv, stop_gradient=False)
        with expect_launches("_sparse_attn_fwd_kernel", "_bwd_dq_kernel", exactly=launches):
            out, _ = fn(qt, kvt, paddle.to_tensor(idx), sink, 0.2)
            (out * out).sum().backward()
        assert sink.grad is None
        grads.append((qt.grad.numpy(), kvt.grad.numpy()))
    for name, g, r in zip(("dq", "dkv"), grads[0], grads[1]):
        assert_close(g, r, "fp32", "triton_sparse_attn", what=f"frozen sink: {name}")


# ------------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------------
def _good():
    return (paddle.zeros([1, 2, 3, 32]), paddle.zeros([1, 4, 32]), paddle.zeros([1, 2, 5], dtype="int32"),
            paddle.zeros([3]))


@pytest.mark.parametrize(
    "which, bad, pattern",
    [
        ("q", paddle.zeros([2, 3, 32]), r"`q` must be \[B, S, H, d\]"),
        ("q", paddle.zeros([1, 2, 3, 32], dtype="int32"), r"`q` must be float32"),
        ("kv", paddle.zeros([1, 4, 16]), r"`kv` must be \[B, N, 32\]"),
        ("kv", paddle.zeros([1, 4, 32], dtype="float64"), r"`kv` must have the dtype of `q`"),
        ("idx", paddle.zeros([1, 3, 5], dtype="int32"), r"`idx` must be \[B, S, K\]"),
        ("idx", paddle.zeros([1, 2, 5]), r"`idx` must be int32 or int64"),
        ("sink", paddle.zeros([3], dtype="float64"), r"`sink` must be fp32 \[3\]"),
        ("sink", paddle.zeros([4]), r"`sink` must be fp32 \[3\]"),
    ],
)
def test_pylayer_rejects_bad_inputs_naming_the_tensor(which, bad, pattern):
    args = dict(zip(("q", "kv", "idx", "sink"), _good()))
    args[which] = bad
    with pytest.raises(ValueError, match=pattern):
        sparse_attention_triton(args["q"], args["kv"], args["idx"], args["sink"], 0.1)
    with pytest.raises(ValueError, match=r"`d_v` must be in \[1, 32\]"):
        sparse_attention_triton(*_good(), 0.1, d_v=40)


def test_kernel_launchers_reject_bad_inputs_naming_the_tensor():
    q, kv = torch.zeros(4, 2, 32), torch.zeros(6, 32)
    idx, sink = torch.zeros(4, 3, dtype=torch.int32), torch.zeros(2)
    with pytest.raises(ValueError, match=r"sparse_attn_fwd: the value width d_v = 24"):
        kernel.sparse_attn_fwd(torch.zeros(4, 2, 24), torch.zeros(6, 24), idx, sink, 0.1)
    with pytest.raises(ValueError, match=r"`topk_length` must be int32/int64 \[4\]"):
        kernel.sparse_attn_fwd(q, kv, idx, sink, 0.1, topk_length=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`idx` must be \[T, K\] with T = 4"):
        kernel.sparse_attn_fwd(q, kv, torch.zeros(5, 3, dtype=torch.int32), sink, 0.1)
    with pytest.raises(ValueError, match=r"`q` must be contiguous"):
        kernel.sparse_attn_fwd(torch.zeros(2, 4, 32).transpose(0, 1), kv, idx, sink, 0.1)
    out, lse = kernel.sparse_attn_fwd(q, kv, idx, sink, 0.1)
    with pytest.raises(ValueError, match=r"`d_out` must be torch.float32 \[4, 2, 32\]"):
        kernel.sparse_attn_bwd(q, kv, idx, sink, 0.1, out, lse, torch.zeros(4, 2, 16))
    with pytest.raises(ValueError, match=r"`partial_dtype` must be"):
        kernel.sparse_attn_bwd(q, kv, idx, sink, 0.1, out, lse, out, partial_dtype="float16")


def test_warp_specialised_forward_is_chosen_only_where_it_runs(monkeypatch):
    """The Gluon forward (kernel_fwd_ws.py, Hopper only: tested on the H200 by tests/gpu/test_sparse_attn_gpu.py)
    is never picked here, and forcing it names why it cannot run."""
    from fleet_ext.ops.sparse_attn import kernel_config

    q, kv = torch.zeros(4, 2, 576), torch.zeros(6, 576)
    idx, sink = torch.zeros(4, 3, dtype=torch.int32), torch.zeros(2)
    assert kernel_config.ws_forward_fits("float32", 576, 512) == "not a Hopper GPU (sm90)"
    assert not kernel.use_ws_forward(q, kv, 576, 512, "sparse_attn_fwd")
    with expect_launches("_sparse_attn_fwd_kernel", exactly=1) as seen:
        kernel.sparse_attn_fwd(q, kv, idx, sink, 0.1, d_v=512)
    assert launch.LAUNCH_COUNTS["_sparse_attn_fwd_ws_kernel"] == 0, seen
    monkeypatch.setattr(kernel_config, "FWD_KERNEL", "gluon")
    with pytest.raises(ValueError, match=r"sparse_attn_fwd: kernel_config.FWD_KERNEL = 'gluon' cannot run here: "
                                         r"not a Hopper GPU \(sm90\)"):
        kernel.sparse_attn_fwd(q, kv, idx, sink, 0.1, d_v=512)


def test_warp_specialised_dq_is_chosen_only_where_it_runs(monkeypatch):
    """The Gluon dq kernel (kernel_bwd_dq_ws.py, Hopper only: tests/gpu/test_sparse_attn_gpu.py) is never picked
    here, not even under "auto", and forcing it names why it cannot run."""
    from fleet_ext.ops.sparse_attn import kernel_config

    q, kv, idx, sink, d_out, d_lse = make_case(41, 4, 3, 48, 32, 6, 5)
    assert kernel_config.ws_dq_fits("bfloat16", 576, 512, 32).startswith("not a Hopper GPU")
    monkeypatch.setattr(kernel_config, "DQ_KERNEL", "auto")
    with expect_launches("_bwd_dq_kernel", exactly=1):
        run_kernels(q, kv, idx, sink, 0.3, 32, d_out, d_lse)
    assert launch.LAUNCH_COUNTS["_bwd_dq_ws_kernel"] == 0
    monkeypatch.setattr(kernel_config, "DQ_KERNEL", "gluon")
    with pytest.raises(ValueError, match=r"sparse_attn_bwd: kernel_config.DQ_KERNEL = 'gluon' cannot run here: "
                                         r"not a Hopper GPU \(sm90\)"):
        run_kernels(q, kv, idx, sink, 0.3, 32, d_out, d_lse)


# ------------------------------------------------------------------------------------------------------
# band slots (band.py): the window's and HCA's dkv summed key-major, no per-pair contributions
# ------------------------------------------------------------------------------------------------------
def _banded_case(seed, seqs, seq, heads, d_qk, d_v, window, ratio, topk=None, halo=0):
    """A DSv4-shaped flat table: per sequence, raw rows [halo + seq] then compressed entries; slots [0, W) the
    window of query i (local keys i + halo - W + 1 + j, -1 before row 0), then either every entry in order
    (HCA: -1 where not yet visible) or ``topk`` random visible entries (CSA: -1 padded). Returns the case and
    its ``SlotBands``."""
    from fleet_ext.ops.sparse_attn.band import Band, SlotBands

    rng = np.random.default_rng(seed)
    raw, n_ent = halo + seq, (halo + seq) // ratio
    kv_rows, width = raw + n_ent, window + (n_ent if topk is None else topk)
    idx = np.full((seqs * seq, width), -1, dtype=np.int32)
    for b in range(seqs):
        for i in range(seq):
            t, visible = b * seq + i, (halo + i + 1) // ratio
            win = i + halo - window + 1 + np.arange(window)
            idx[t, :window] = np.where(win >= 0, b * kv_rows + win, -1)
            picks = np.arange(visible) if topk is None else rng.permutation(visible)[:topk]
            idx[t, window:window + len(picks)] = b * kv_rows + raw + picks
    bands = [Band(0, window, 1, halo - window + 1)] + ([Band(window, n_ent, 0, raw - window)] if topk is None else [])
    q, kv, _, sink, d_out, d_lse = make_case(seed, seqs * seq, heads, d_qk, d_v, seqs * kv_rows, width, empty_rows=0,
                                             repeats=False)
    return (q, kv, idx, sink, d_out, d_lse), SlotBands(seq, kv_rows, tuple(bands))


BAND_CASES = {  # (seqs, seq, heads, d_qk, d_v, window, ratio, topk, halo)
    "window_and_hca_entries": (2, 9, 3, 32, 32, 4, 2, None, 0),
    "window_then_csa_picks_latent": (1, 11, 5, 48, 32, 5, 3, 2, 0),
    "window_with_cp_halo": (2, 7, 18, 32, 16, 4, 4, None, 3),
}


@pytest.mark.parametrize("case", list(BAND_CASES))
@pytest.mark.parametrize("max_partial_bytes", [4 << 30, 5000], ids=["one_query_chunk", "query_chunks"])
def test_band_slots_match_the_oracle_and_leave_the_rest_byte_equal(case, max_partial_bytes, monkeypatch):
    """``slot_bands``: dkv within the oracle's bound (the band kernel ran), out, lse, dq and d_sink byte-equal to
    the backward without bands, byte-identical run to run and with or without the derived row bound; an entries band
    also in query splits (one query chunk; added in order by the combine kernel); a band one key off (its slots no
    longer hold the keys it names) fails the oracle check (NaN under the default poison mode)."""
    from fleet_ext.ops.sparse_attn import band_bwd as band_mod
    from fleet_ext.ops.sparse_attn.band import Band, SlotBands

    seqs, seq, heads, d_qk, d_v, window, ratio, topk, halo = BAND_CASES[case]
    args, bands = _banded_case(5, seqs, seq, heads, d_qk, d_v, window, ratio, topk, halo)
    q, kv, idx, sink, d_out, d_lse = args
    ref = oracle(*args[:4], 0.3, d_v, d_out, d_lse)
    plain = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes)
    covers_all = bands.contribution_slots(idx.shape[1])[0] == idx.shape[1]  # no CSR slots: no reduce at all
    with expect_launches("_bwd_dkv_band_kernel"), expect_launches(
            "_bwd_dkv_reduce_kernel", **({"exactly": 0} if covers_all else {})):
        banded = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes,
                             slot_bands=bands)
    again = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes, slot_bands=bands)
    unbounded = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes, slot_bands=bands,
                            derive_bound=False)  # no row bound: the band kernel reads every slot the dq step wrote
    assert_bitwise(unbounded[3], banded[3], f"{case}: banded dkv with and without the row bound")
    assert_close(banded[3], ref[3], "fp32", "triton_sparse_attn", what=f"{case}: banded dkv")
    for k, name in enumerate(("out", "lse", "dq", "dkv", "d_sink")):
        assert_bitwise(banded[k], again[k], f"{case}: banded, two runs: {name}")
        if name != "dkv":
            assert_bitwise(banded[k], plain[k], f"{case}: banded vs not: {name}")
    if any(b.step == 0 for b in bands.bands) and max_partial_bytes > 10000:  # one chunk: 3 queries per split
        monkeypatch.setattr(band_mod, "_SPLIT_QUERIES", 3)
        with expect_launches("_bwd_band_combine_kernel"):
            split = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes,
                                slot_bands=bands)
        assert_close(split[3], ref[3], "fp32", "triton_sparse_attn", what=f"{case}: banded dkv, query splits")
    off = SlotBands(bands.seq, bands.kv_rows, (Band(0, window, 1, bands.bands[0].base + 1), *bands.bands[1:]))
    planted = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, max_partial_bytes=max_partial_bytes, slot_bands=off)
    with pytest.raises(AssertionError):
        assert_close(planted[3], ref[3], "fp32", "triton_sparse_attn", what="planted: the window band one key off")


def test_poisoned_band_slots_load_unmasked_and_mark_a_broken_band(monkeypatch):
    """``POISON`` (the band kernel's default mode): P / dS loaded as the dq step wrote them (exact zeros on invalid
    slots inside a row's bound), no per-row select; dkv within the oracle's bound and byte-equal to the select mode
    here (the same products in the same order); a band one key off makes exactly the keys whose slots hold another
    key NaN, never a silently wrong gradient (the select mode drops those slots instead: finite, wrong)."""
    from fleet_ext.ops.sparse_attn import band_bwd
    from fleet_ext.ops.sparse_attn.band import Band, SlotBands

    seqs, seq, heads, d_qk, d_v, window, ratio, topk, halo = BAND_CASES["window_and_hca_entries"]
    args, bands = _banded_case(5, seqs, seq, heads, d_qk, d_v, window, ratio, topk, halo)
    q, kv, idx, sink, d_out, d_lse = args
    ref = oracle(*args[:4], 0.3, d_v, d_out, d_lse)
    off = SlotBands(bands.seq, bands.kv_rows, (Band(0, window, 1, bands.bands[0].base + 1), *bands.bands[1:]))
    monkeypatch.setitem(band_bwd._BAND_CONFIG_INTERP, "POISON", False)
    selected = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, slot_bands=bands)
    assert np.isfinite(run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, slot_bands=off)[3]).all()
    monkeypatch.setitem(band_bwd._BAND_CONFIG_INTERP, "POISON", True)
    poisoned = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, slot_bands=bands)
    assert_close(poisoned[3], ref[3], "fp32", "triton_sparse_attn", what="poison mode: dkv")
    assert_bitwise(poisoned[3], selected[3], "poison vs select mode: dkv")
    broken = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, slot_bands=off)
    nan_rows = np.isnan(broken[3]).any(1)
    # the keys the shifted band names: local rows base + 1 .. seq - 1 + base + W of each sequence's raw keys whose
    # named slot holds a valid other key for some query
    named = np.zeros(len(nan_rows), bool)
    for t in range(idx.shape[0]):
        b, i = divmod(t, seq)
        for j in range(window):
            r = i + off.bands[0].base + j
            if 0 <= r < off.kv_rows and idx[t, j] >= 0 and idx[t, j] != b * off.kv_rows + r:
                named[b * off.kv_rows + r] = True
    assert named.any() and np.array_equal(nan_rows, named)


@pytest.mark.parametrize("case", list(BAND_CASES))
def test_band_slots_two_queries_per_step(case, monkeypatch):
    """``QPS = 2`` (the poison mode's products over two queries' (query, head) rows, an odd query count per program
    included): dkv within the oracle's bound, byte-identical run to run, a shifted band NaN."""
    from fleet_ext.ops.sparse_attn import band_bwd
    from fleet_ext.ops.sparse_attn.band import Band, SlotBands

    seqs, seq, heads, d_qk, d_v, window, ratio, topk, halo = BAND_CASES[case]
    args, bands = _banded_case(5, seqs, seq, heads, d_qk, d_v, window, ratio, topk, halo)
    q, kv, idx, sink, d_out, d_lse = args
    monkeypatch.setitem(band_bwd._BAND_CONFIG_INTERP, "QPS", 2)
    with expect_launches("_bwd_dkv_band_kernel"):
        got = run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, slot_bands=bands)
    assert_close(got[3], oracle(*args[:4], 0.3, d_v, d_out, d_lse)[3], "fp32", "triton_sparse_attn",
                 what=f"{case}: two queries per step")
    assert_bitwise(got[3], run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, slot_bands=bands)[3], "two runs")
    off = SlotBands(bands.seq, bands.kv_rows, (Band(0, window, 1, bands.bands[0].base + 1), *bands.bands[1:]))
    assert np.isnan(run_kernels(*args[:4], 0.3, d_v, d_out, d_lse, slot_bands=off)[3]).any()


@pytest.mark.parametrize("bands, pattern", [
    (((0, 4, 1, -3), (2, 3, 0, 10)), "overlap at slot 2"),
    (((0, 2, 1, -1), (4, 2, 0, 10), (7, 1, 0, 20)), "one contiguous range"),
    (((0, 2, 2, -1),), "step 0 or 1"),
    (((6, 3, 0, 10),), r"inside \[0, 8\)"),
])
def test_slot_bands_reject_what_they_cannot_serve(bands, pattern):
    from fleet_ext.ops.sparse_attn.band import Band, SlotBands

    with pytest.raises(ValueError, match=pattern):
        SlotBands(4, 20, tuple(Band(*b) for b in bands)).contribution_slots(8)
    with pytest.raises(ValueError, match="do not fit"):
        SlotBands(4, 20, ()).check(10, 60)
