"""DSv4 per-query KV index tables and the local->global KV index remap (dsv4_math.md §2.3 visibility, §2.5).

Hand-written expected tables for small cases, then properties over many shapes checked against the causal
rules directly (window: t-W < j <= t; compressed: i < (t+1)//ratio). Integer tables: exact equality.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_ext.layers.index_tables import (
    all_compressed_index_table,
    compressed_topk_to_kv_full,
    compressed_visible_count,
    full_causal_index_table,
    window_index_table,
)
from fleet_ext.ops.kv_idx_remap.reference import local_to_global_flat
from fleet_ext.parallel.layout import SequenceLayout

whole = SequenceLayout.whole


def _np(t: paddle.Tensor) -> np.ndarray:
    return t.numpy()


# --------------------------------------------------------------------------------------------------
# Hand-written tables.
# --------------------------------------------------------------------------------------------------
def test_window_table_s6_w3():
    expected = [
        [-1, -1, 0],
        [-1, 0, 1],
        [0, 1, 2],
        [1, 2, 3],
        [2, 3, 4],
        [3, 4, 5],
    ]
    got = window_index_table(whole(6), 3)
    assert got.dtype == paddle.int32, got.dtype
    np.testing.assert_array_equal(_np(got), np.array(expected), err_msg="window table s=6 W=3")


def test_window_table_window_longer_than_sequence():
    expected = [[-1, -1, -1, -1, 0], [-1, -1, -1, 0, 1]]
    np.testing.assert_array_equal(_np(window_index_table(whole(2), 5)), np.array(expected))


def test_hca_table_s9_ratio4_offset9():
    # visible counts (t+1)//4: t=0..2 -> 0, t=3..6 -> 1, t=7..8 -> 2; entries live at kv_full rows 9, 10.
    expected = [
        [-1, -1],
        [-1, -1],
        [-1, -1],
        [9, -1],
        [9, -1],
        [9, -1],
        [9, -1],
        [9, 10],
        [9, 10],
    ]
    got = all_compressed_index_table(whole(9), 4, 9)
    assert got.dtype == paddle.int32, got.dtype
    np.testing.assert_array_equal(_np(got), np.array(expected), err_msg="HCA table s=9 ratio=4 offset=9")
    np.testing.assert_array_equal(compressed_visible_count(whole(9), 4).numpy(), [0, 0, 0, 1, 1, 1, 1, 2, 2])


def test_compressed_table_empty_when_no_full_block():
    got = _np(all_compressed_index_table(whole(3), 4, 3))
    assert got.shape == (3, 0), got.shape


def test_full_causal_s4():
    expected = [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3]]
    got = full_causal_index_table(whole(4))
    assert got.dtype == paddle.int32, got.dtype
    np.testing.assert_array_equal(_np(got), np.array(expected), err_msg="full-causal table s=4")


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_compressed_topk_to_kv_full(dtype):
    topk = paddle.to_tensor([[[2, -1, 0], [-1, -1, -1]]], dtype=dtype)
    got = compressed_topk_to_kv_full(topk, offset=5)
    assert got.dtype == topk.dtype
    np.testing.assert_array_equal(_np(got), [[[7, -1, 5], [-1, -1, -1]]])


# --------------------------------------------------------------------------------------------------
# Properties over many shapes.
# --------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seq=st.integers(1, 40), window=st.integers(1, 12))
def test_window_table_causal_rule(seq, window):
    table = _np(window_index_table(whole(seq), window))
    assert table.shape == (seq, window)
    for t in range(seq):
        row = table[t]
        valid = row[row >= 0]
        assert np.all(row[row < 0] == -1), f"t={t}: invalid slots must be exactly -1, got {row}"
        assert all(t - window < j <= t for j in valid), f"t={t} W={window}: key outside (t-W, t]: {row}"
        expected = list(range(max(0, t - window + 1), t + 1))
        assert valid.tolist() == expected, f"t={t} W={window}: want every key of the window oldest first, got {row}"


@settings(max_examples=60, deadline=None)
@given(seq=st.integers(1, 48), ratio=st.integers(2, 9), offset=st.integers(0, 50))
def test_compressed_table_causal_rule(seq, ratio, offset):
    table = _np(all_compressed_index_table(whole(seq), ratio, offset))
    assert table.shape == (seq, seq // ratio)
    counts = compressed_visible_count(whole(seq), ratio).numpy()
    for t in range(seq):
        row = table[t]
        assert np.all(row[row < 0] == -1), f"t={t}: invalid slots must be exactly -1, got {row}"
        entries = row[row >= 0] - offset
        assert all(i < (t + 1) // ratio for i in entries), f"t={t} ratio={ratio}: non-causal entry in {row}"
        assert entries.tolist() == list(range((t + 1) // ratio)), f"t={t}: want every visible entry, got {row}"
        assert counts[t] == (t + 1) // ratio


@settings(max_examples=30, deadline=None)
@given(seq=st.integers(1, 30))
def test_full_causal_rule(seq):
    table = _np(full_causal_index_table(whole(seq)))
    for t in range(seq):
        assert table[t, : t + 1].tolist() == list(range(t + 1))
        assert np.all(table[t, t + 1 :] == -1)


# --------------------------------------------------------------------------------------------------
# local_to_global_flat.
# --------------------------------------------------------------------------------------------------
def _remap_loop(local: np.ndarray, seqlen_kv: int) -> np.ndarray:
    b, s, k = local.shape
    out = np.empty((b * s, k), dtype=local.dtype)
    for bi in range(b):
        for t in range(s):
            for j in range(k):
                v = local[bi, t, j]
                out[bi * s + t, j] = v + bi * seqlen_kv if v >= 0 else v
    return out


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_local_to_global_flat_matches_loop(dtype):
    rng = np.random.default_rng(0)
    n_kv = 7
    local = rng.integers(-3, n_kv, size=(3, 4, 5)).astype(dtype)
    local[0, 0, 0], local[2, 3, 4] = -1, -5  # negatives other than -1 must also pass through unchanged
    assert (local < 0).any() and (local >= 0).any()
    got = local_to_global_flat(paddle.to_tensor(local), n_kv)
    assert got.dtype == getattr(paddle, dtype), got.dtype
    assert list(got.shape) == [12, 5]
    want = _remap_loop(local, n_kv)
    np.testing.assert_array_equal(_np(got), want)
    assert _np(got)[0, 0] == -1 and _np(got)[11, 4] == -5


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((4, 5), dtype="int32"),  # rank 2
        np.zeros((1, 2, 4, 5), dtype="int64"),  # rank 4
        np.zeros((2, 4, 5), dtype="float32"),  # not an integer tensor
    ],
)
def test_local_to_global_flat_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="local_idx"):
        local_to_global_flat(paddle.to_tensor(bad), 8)
