"""Per-query KV index tables of DSv4 attention, built on the host once per shape.

All tables index into ``kv_full = [raw KV (s rows) | compressed KV (s // ratio rows)]`` and use -1 for
an invalid slot. They depend only on shapes, so they are cached.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle


@functools.lru_cache(maxsize=64)
def _window_np(seq_len: int, window: int) -> np.ndarray:
    t = np.arange(seq_len)[:, None]
    j = t - window + 1 + np.arange(window)[None, :]
    return np.where(j >= 0, j, -1).astype(np.int32)


def window_index_table(seq_len: int, window: int) -> paddle.Tensor:
    """[s, W]: row t holds keys t-W+1 .. t (oldest first), -1 before the sequence start."""
    return paddle.to_tensor(_window_np(seq_len, window))


def compressed_visible_count(seq_len: int, ratio: int) -> np.ndarray:
    """Number of compressed entries query t may use: ``floor((t + 1) / ratio)``."""
    return (np.arange(seq_len) + 1) // ratio


@functools.lru_cache(maxsize=64)
def _all_compressed_np(seq_len: int, ratio: int, offset: int) -> np.ndarray:
    n_comp = seq_len // ratio
    i = np.arange(n_comp)[None, :]
    visible = i < compressed_visible_count(seq_len, ratio)[:, None]
    return np.where(visible, i + offset, -1).astype(np.int32)


def all_compressed_index_table(seq_len: int, ratio: int, offset: int) -> paddle.Tensor:
    """[s, s // ratio]: every visible compressed entry (HCA, or CSA in dense mode), shifted by ``offset``."""
    return paddle.to_tensor(_all_compressed_np(seq_len, ratio, offset))


@functools.lru_cache(maxsize=16)
def _full_causal_np(seq_len: int) -> np.ndarray:
    t = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    return np.where(j <= t, j, -1).astype(np.int32)


def full_causal_index_table(seq_len: int) -> paddle.Tensor:
    """[s, s]: row t holds 0..t, then -1 (the -1 'full-causal MQA' layers)."""
    return paddle.to_tensor(_full_causal_np(seq_len))


def compressed_topk_to_kv_full(topk_idx: paddle.Tensor, offset: int) -> paddle.Tensor:
    """Shift valid compressed ids into kv_full coordinates; keep -1."""
    return paddle.where(topk_idx >= 0, topk_idx + offset, topk_idx)
