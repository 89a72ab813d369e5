"""Per-batch-local KV indices to flat-global ones (the eager op sequence a fused kernel replaces)."""

from __future__ import annotations

import paddle


def local_to_global_flat(local_idx: paddle.Tensor, seqlen_kv: int) -> paddle.Tensor:
    """``[B, S, K]`` local ids into ``kv.reshape([B*N, d])`` ids: ``idx + b*seqlen_kv`` where ``idx >= 0``.

    Negative (invalid) entries are returned unchanged. The result is ``[B*S, K]`` in the input's int dtype.
    """
    if local_idx.ndim != 3:
        raise ValueError(f"local_to_global_flat: `local_idx` must be [B, S, K], got shape {local_idx.shape}")
    if local_idx.dtype not in (paddle.int32, paddle.int64):
        raise ValueError(f"local_to_global_flat: `local_idx` must be int32 or int64, got {local_idx.dtype}")
    batch, seq, width = local_idx.shape
    offsets = (paddle.arange(batch, dtype=local_idx.dtype) * seqlen_kv).reshape([batch, 1, 1])
    remapped = paddle.where(local_idx >= 0, local_idx + offsets, local_idx)
    return remapped.reshape([batch * seq, width])
