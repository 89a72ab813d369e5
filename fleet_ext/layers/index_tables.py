"""Per-query KV index tables of DSv4 and latent-MQA attention, computed from the sequence layout.

Rows are this rank's queries (global positions ``layout.positions()``); key ids are global (see
``fleet_ext.parallel.layout``): raw keys ``0 .. global_len - 1``, compressed entries shifted by the number
of raw KV rows in front of them (``kv_offset``). ``-1`` marks an invalid slot. The tables depend only on
the layout, the layer's shape parameters and the device, so each is built once, on the device, with
``paddle.arange`` and elementwise ops (no NumPy array, no host-to-device copy; an ``s x s`` full-causal
table never exists on the host), cached per (layout, parameters, device) and shared by every layer of
a forward. The training step re-uses the device tensors; integer arithmetic, so the values are exact.
"""

from __future__ import annotations

import functools

import paddle

from fleet_ext.parallel.layout import SequenceLayout

__all__ = [
    "all_compressed_index_table",
    "clear_table_cache",
    "compressed_topk_to_kv_full",
    "compressed_visible_count",
    "full_causal_index_table",
    "table_cache_builds",
    "window_index_table",
]

_CACHE_SIZE = 128


def _device() -> str:
    """Where new tensors go (``paddle.get_device()``: ``cpu``, ``gpu:3`` ...): part of every cache key."""
    return paddle.get_device()


def _query_positions(layout: SequenceLayout) -> paddle.Tensor:
    """[s_local, 1] int64: this rank's global query positions."""
    return paddle.arange(layout.offset, layout.end, dtype="int64").unsqueeze(1)


def _invalid_where(keep: paddle.Tensor, ids: paddle.Tensor) -> paddle.Tensor:
    """int32 ``ids`` where ``keep``, else -1 (both broadcast to one shape first)."""
    shape = paddle.broadcast_shape(keep.shape, ids.shape)
    ids = ids.expand(shape)
    return paddle.where(keep.expand(shape), ids, paddle.full_like(ids, -1)).astype("int32")


def window_index_table(layout: SequenceLayout, window: int, first_key: int = 0) -> paddle.Tensor:
    """[s_local, W] int32: row for global query t holds keys t-W+1 .. t (oldest first), -1 before position 0.

    Callers pass ``W = min(window, global_len)``: a window longer than the sequence has no more keys to offer.
    Ids count from ``first_key``, the global position of the first raw row the caller holds (a context-parallel
    rank holds its halo and its chunk, from ``offset - halo``; 0 when the raw keys are the whole sequence).
    """
    # The oldest key any row needs is the first row's, max(0, offset - W + 1): checked without the table.
    if window > 0 and max(0, layout.offset - window + 1) < first_key:
        raise ValueError(f"window_index_table: keys before first_key={first_key} are needed by {layout}")
    return _window_index_table(layout, window, first_key, _device())


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _window_index_table(layout: SequenceLayout, window: int, first_key: int, device: str) -> paddle.Tensor:
    keys = _query_positions(layout) - window + 1 + paddle.arange(window, dtype="int64").unsqueeze(0)
    return _invalid_where(keys >= 0, keys - first_key)


def compressed_visible_count(layout: SequenceLayout, ratio: int) -> paddle.Tensor:
    """[s_local] int64: compressed entries global query t may use, ``floor((t + 1) / ratio)``.

    Entry i pools tokens ``i*ratio .. (i+1)*ratio - 1``; it is visible once its last token is.
    """
    return _compressed_visible_count(layout, ratio, _device())


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compressed_visible_count(layout: SequenceLayout, ratio: int, device: str) -> paddle.Tensor:
    return paddle.floor_divide(paddle.arange(layout.offset + 1, layout.end + 1, dtype="int64"),
                               paddle.full([1], ratio, dtype="int64"))


def all_compressed_index_table(layout: SequenceLayout, ratio: int, kv_offset: int) -> paddle.Tensor:
    """[s_local, global_len // ratio] int32: every visible compressed entry (HCA, or CSA in dense mode),
    shifted by ``kv_offset``."""
    return _all_compressed_index_table(layout, ratio, kv_offset, _device())


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _all_compressed_index_table(layout: SequenceLayout, ratio: int, kv_offset: int, device: str) -> paddle.Tensor:
    entries = paddle.arange(layout.global_len // ratio, dtype="int64").unsqueeze(0)
    visible = entries < compressed_visible_count(layout, ratio).unsqueeze(1)
    return _invalid_where(visible, entries + kv_offset)


def full_causal_index_table(layout: SequenceLayout) -> paddle.Tensor:
    """[s_local, global_len] int32: row for global query t holds keys 0..t, then -1 (-1 layers, latent MQA)."""
    return _full_causal_index_table(layout, _device())


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _full_causal_index_table(layout: SequenceLayout, device: str) -> paddle.Tensor:
    keys = paddle.arange(layout.global_len, dtype="int64").unsqueeze(0)
    return _invalid_where(keys <= _query_positions(layout), keys)


_BUILDERS = (_window_index_table, _compressed_visible_count, _all_compressed_index_table, _full_causal_index_table)


def table_cache_builds() -> int:
    """Tables built so far (cache misses of every builder): a forward that builds none leaves it unchanged."""
    return sum(builder.cache_info().misses for builder in _BUILDERS)


def clear_table_cache() -> None:
    """Drop every cached table (tests that count builds start from here)."""
    for builder in _BUILDERS:
        builder.cache_clear()


def compressed_topk_to_kv_full(topk_idx: paddle.Tensor, offset: int) -> paddle.Tensor:
    """Shift valid compressed ids into kv_full coordinates; keep -1."""
    return paddle.where(topk_idx >= 0, topk_idx + offset, topk_idx)
