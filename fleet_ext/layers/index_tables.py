"""Per-query KV index tables of DSv4 and latent-MQA attention, computed from the sequence layout.

Rows are this rank's queries (global positions ``layout.positions()``); key ids are global (see
``fleet_ext.parallel.layout``): raw keys ``0 .. global_len - 1``, compressed entries shifted by the number
of raw KV rows in front of them (``kv_offset``). ``-1`` marks an invalid slot. The tables depend only on
the layout and the layer's shape parameters, so they are built once with NumPy, moved to the device
once, and cached (keyed on the immutable layout); the training step re-uses the device tensors.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle

from fleet_ext.parallel.layout import SequenceLayout

__all__ = [
    "all_compressed_index_table",
    "compressed_topk_to_kv_full",
    "compressed_visible_count",
    "full_causal_index_table",
    "window_index_table",
]

_CACHE_SIZE = 128


def _query_positions(layout: SequenceLayout) -> np.ndarray:
    return np.arange(layout.offset, layout.end, dtype=np.int64)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def window_index_table(layout: SequenceLayout, window: int) -> paddle.Tensor:
    """[s_local, W] int32: row for global query t holds keys t-W+1 .. t (oldest first), -1 before position 0.

    Callers pass ``W = min(window, global_len)``: a window longer than the sequence has no more keys to offer.
    """
    t = _query_positions(layout)[:, None]
    j = t - window + 1 + np.arange(window)[None, :]
    return paddle.to_tensor(np.where(j >= 0, j, -1).astype(np.int32))


def _visible_counts(layout: SequenceLayout, ratio: int) -> np.ndarray:
    return (_query_positions(layout) + 1) // ratio


@functools.lru_cache(maxsize=_CACHE_SIZE)
def compressed_visible_count(layout: SequenceLayout, ratio: int) -> paddle.Tensor:
    """[s_local] int64: compressed entries global query t may use, ``floor((t + 1) / ratio)``.

    Entry i pools tokens ``i*ratio .. (i+1)*ratio - 1``; it is visible once its last token is.
    """
    return paddle.to_tensor(_visible_counts(layout, ratio))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def all_compressed_index_table(layout: SequenceLayout, ratio: int, kv_offset: int) -> paddle.Tensor:
    """[s_local, global_len // ratio] int32: every visible compressed entry (HCA, or CSA in dense mode),
    shifted by ``kv_offset``."""
    i = np.arange(layout.global_len // ratio)[None, :]
    visible = i < _visible_counts(layout, ratio)[:, None]
    return paddle.to_tensor(np.where(visible, i + kv_offset, -1).astype(np.int32))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def full_causal_index_table(layout: SequenceLayout) -> paddle.Tensor:
    """[s_local, global_len] int32: row for global query t holds keys 0..t, then -1 (-1 layers, latent MQA)."""
    t = _query_positions(layout)[:, None]
    j = np.arange(layout.global_len)[None, :]
    return paddle.to_tensor(np.where(j <= t, j, -1).astype(np.int32))


def compressed_topk_to_kv_full(topk_idx: paddle.Tensor, offset: int) -> paddle.Tensor:
    """Shift valid compressed ids into kv_full coordinates; keep -1."""
    return paddle.where(topk_idx >= 0, topk_idx + offset, topk_idx)
