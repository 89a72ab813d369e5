"""Index tables and RoPE tables built once per (layout, parameters, device) (issue 9 §2).

The index tables are now built on the device (``paddle.arange`` and elementwise ops); they must be bit for bit
the tables the NumPy builders made before (the oracle below restates those formulas), for whole sequences and
for context-parallel shards with their ``first_key``. The RoPE cos/sin tables keep their values (fp32 roundings
of float64 host angles: a device fp32 computation would differ in the last bits) and are cached per
(frequencies, range, device), shared by every layer with the same frequencies. Part of the cache key is the
device: a table made for one device is not handed to another.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_ext.layers import index_tables as it
from fleet_ext.layers import rope
from fleet_ext.layers.rope import RotaryTable, plain_inv_freq, yarn_inv_freq
from fleet_ext.parallel.layout import SequenceLayout


# --------------------------------------------------------------------------------------------------
# The NumPy formulas of the host builders these replace (the oracle).
# --------------------------------------------------------------------------------------------------
def _rows(layout: SequenceLayout) -> np.ndarray:
    return np.arange(layout.offset, layout.end, dtype=np.int64)


def np_window(layout: SequenceLayout, window: int, first_key: int) -> np.ndarray | None:
    """None where the host builder raised (a key before ``first_key`` needed)."""
    t = _rows(layout)[:, None]
    j = t - window + 1 + np.arange(window)[None, :]
    if (j[j >= 0] < first_key).any():
        return None
    return np.where(j >= 0, j - first_key, -1).astype(np.int32)


def np_visible(layout: SequenceLayout, ratio: int) -> np.ndarray:
    return (_rows(layout) + 1) // ratio


def np_all_compressed(layout: SequenceLayout, ratio: int, kv_offset: int) -> np.ndarray:
    i = np.arange(layout.global_len // ratio)[None, :]
    return np.where(i < np_visible(layout, ratio)[:, None], i + kv_offset, -1).astype(np.int32)


def np_full_causal(layout: SequenceLayout) -> np.ndarray:
    t, j = _rows(layout)[:, None], np.arange(layout.global_len)[None, :]
    return np.where(j <= t, j, -1).astype(np.int32)


def _assert_same_table(got: paddle.Tensor, want: np.ndarray, what: str) -> None:
    assert got.numpy().dtype == want.dtype, f"{what}: dtype {got.numpy().dtype} != {want.dtype}"
    assert_bitwise(got.numpy(), want, what)


layouts = st.builds(
    lambda chunk, cp, rank: SequenceLayout.contiguous_shard(chunk * cp, cp, rank % cp),
    st.integers(1, 24), st.integers(1, 4), st.integers(0, 3),
)


@settings(max_examples=80, deadline=None)
@given(layout=layouts, window=st.integers(1, 40), halo=st.integers(0, 40))
def test_window_table_equals_the_host_builder(layout, window, halo):
    window = min(window, layout.global_len)
    first_key = max(layout.offset - halo, 0) if layout.cp_size > 1 else 0
    want = np_window(layout, window, first_key)
    if want is None:
        with pytest.raises(ValueError, match="first_key"):
            it.window_index_table(layout, window, first_key)
        return
    got = it.window_index_table(layout, window, first_key)
    _assert_same_table(got, want, f"window {layout} W={window} first={first_key}")


@settings(max_examples=80, deadline=None)
@given(layout=layouts, ratio=st.sampled_from([2, 3, 4, 8, 128]), kv_offset=st.integers(0, 60))
def test_compressed_tables_equal_the_host_builder(layout, ratio, kv_offset):
    visible = it.compressed_visible_count(layout, ratio)
    _assert_same_table(visible, np_visible(layout, ratio), f"visible {layout} r={ratio}")
    table = it.all_compressed_index_table(layout, ratio, kv_offset)
    want = np_all_compressed(layout, ratio, kv_offset)
    _assert_same_table(table, want, f"all-compressed {layout} r={ratio} off={kv_offset}")


@settings(max_examples=40, deadline=None)
@given(layout=layouts)
def test_full_causal_table_equals_the_host_builder(layout):
    _assert_same_table(it.full_causal_index_table(layout), np_full_causal(layout), f"full causal {layout}")


def test_negative_control_a_planted_difference_fails():
    layout = SequenceLayout.contiguous_shard(32, 2, 1)
    got = it.window_index_table(layout, 8, 9)  # rank 1 of 2 holds 16..31; its window reaches back to key 9
    want = np_window(layout, 8, 9)
    want[3, 2] += 1
    with pytest.raises(AssertionError):
        _assert_same_table(got, want, "planted")
    with pytest.raises(AssertionError):  # ids counted from 0, not from the first key held
        _assert_same_table(got, np_window(layout, 8, 0), "wrong first_key")


def test_tables_are_cached_per_layout_parameters_and_device(monkeypatch):
    it.clear_table_cache()
    layout = SequenceLayout.whole(20)
    first = it.full_causal_index_table(layout)
    builds = it.table_cache_builds()
    assert it.full_causal_index_table(SequenceLayout.whole(20)) is first  # equal layouts share the table
    assert it.table_cache_builds() == builds
    it.window_index_table(layout, 8)
    assert it.table_cache_builds() == builds + 1
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:1")  # another device: its own table
    assert it.full_causal_index_table(layout) is not first
    assert it.table_cache_builds() == builds + 2


# --------------------------------------------------------------------------------------------------
# RoPE tables: the same values as before, shared, keyed on the device.
# --------------------------------------------------------------------------------------------------
FREQS = {
    "plain": plain_inv_freq(16, 10000.0),
    "yarn": yarn_inv_freq(16, 160000.0, 16.0, 256, 32.0, 1.0),
}


@pytest.mark.parametrize("kind", list(FREQS))
@pytest.mark.parametrize("positions", [range(0, 40), range(4096, 4160), range(0, 40, 4), range(96, 16384, 128)])
def test_rope_tables_keep_the_float64_host_values(kind, positions):
    cos, sin = RotaryTable(FREQS[kind]).cos_sin(positions)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * FREQS[kind][None, :]
    assert_bitwise(cos.numpy(), np.cos(angles).astype(np.float32), f"cos {kind} {positions}")
    assert_bitwise(sin.numpy(), np.sin(angles).astype(np.float32), f"sin {kind} {positions}")


def test_rope_tables_are_shared_and_keyed_on_frequencies_range_and_device(monkeypatch):
    rope.clear_rope_cache()
    builds = rope.rope_cache_builds()
    a, b = RotaryTable(FREQS["plain"].copy()), RotaryTable(FREQS["plain"].copy())
    first = a.cos_sin(range(0, 16))[0]
    assert b.cos_sin(range(0, 16))[0] is first  # two layers, equal frequencies: one table
    assert rope.rope_cache_builds() == builds + 1
    yarn = RotaryTable(FREQS["yarn"]).cos_sin(range(0, 16))[0]
    assert not np.array_equal(yarn.numpy(), first.numpy()), "different frequencies must not share a table"
    assert a.cos_sin(range(0, 17))[0].shape[0] == 17
    assert rope.rope_cache_builds() == builds + 3
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:1")
    assert a.cos_sin(range(0, 16))[0] is not first  # the same range for another device: its own table
    assert rope.rope_cache_builds() == builds + 4
