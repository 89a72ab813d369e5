"""Sparse MQA attention with a learnable per-head sink: the reference gather-softmax path.

For query t, head h and the index set S_t (entries of ``idx[b, t]`` that are >= 0):
``p_j = exp(l_j) / (sum_k exp(l_k) + exp(sink_h))``, ``l_j = scale * q_{t,h} . kv_j``, output
``sum_j p_j kv_j[:d_v]``. The sink is a value-less softmax column; a row with no valid index returns 0.
Autograd gives the backward, including ``d_sink``.
"""

from __future__ import annotations

import paddle

from fleet_ext.ops.kv_idx_remap.reference import local_to_global_flat


def sparse_attention_with_sink(
    q: paddle.Tensor,
    kv: paddle.Tensor,
    idx: paddle.Tensor,
    sink: paddle.Tensor,
    scale: float,
    remap=local_to_global_flat,
    d_v: int | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """q [B, S, H, d], kv [B, N, d], idx [B, S, K] int (-1 invalid), sink [H] fp32 -> (out [B,S,H,d_v], lse [B,S,H]).

    ``lse`` includes the sink. ``remap`` turns local ids into flat ids (swappable by a fused kernel).
    ``d_v`` (default d) keeps the first ``d_v`` channels as the value: K = V for DSv4 (d_v = d = 512), the
    latent MQA of -2 layers reads keys of 576 and values of their first 512 channels.
    """
    if q.ndim != 4:
        raise ValueError(f"sparse_attention_with_sink: `q` must be [B, S, H, d], got shape {q.shape}")
    if kv.ndim != 3 or kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"sparse_attention_with_sink: `kv` must be [B, N, {q.shape[-1]}] with B={q.shape[0]}, got shape {kv.shape}"
        )
    if idx.ndim != 3 or tuple(idx.shape[:2]) != tuple(q.shape[:2]):
        raise ValueError(
            f"sparse_attention_with_sink: `idx` must be [B, S, K] with B, S = {q.shape[:2]}, got shape {idx.shape}"
        )
    if idx.dtype not in (paddle.int32, paddle.int64):
        raise ValueError(f"sparse_attention_with_sink: `idx` must be int32 or int64, got {idx.dtype}")
    if sink.shape != [q.shape[2]] or sink.dtype != paddle.float32:
        raise ValueError(
            f"sparse_attention_with_sink: `sink` must be fp32 [{q.shape[2]}], got {sink.dtype} {sink.shape}"
        )
    batch, seq, heads, dim = q.shape
    n_kv, width = kv.shape[1], idx.shape[2]
    flat_idx = remap(idx, n_kv)  # [B*S, K]
    valid = flat_idx >= 0
    gathered = paddle.gather(
        kv.reshape([batch * n_kv, dim]), paddle.where(valid, flat_idx, paddle.zeros_like(flat_idx)).reshape([-1])
    )
    gathered = gathered.reshape([batch, seq, width, dim]).astype("float32")
    qf = q.astype("float32")
    logits = paddle.matmul(qf, gathered, transpose_y=True) * scale  # [B, S, H, K]
    valid_slots = valid.reshape([batch, seq, 1, width]).expand(logits.shape)
    logits = paddle.where(valid_slots, logits, paddle.full_like(logits, float("-inf")))
    sink_col = sink.reshape([1, 1, heads, 1]).expand([batch, seq, heads, 1])
    row_max = paddle.maximum(logits.max(axis=-1, keepdim=True), sink_col).detach()
    # exp(-inf) is a denormal (not 0) in Paddle's vectorised CPU exp: zero invalid slots explicitly so an
    # empty row outputs exactly 0 and unread kv rows get exactly 0 gradient.
    weights = paddle.where(valid_slots, paddle.exp(logits - row_max), paddle.zeros_like(logits))
    denom = weights.sum(axis=-1, keepdim=True) + paddle.exp(sink_col - row_max)
    probs = weights / denom
    values = gathered if d_v is None else gathered[..., :d_v]
    out = paddle.matmul(probs, values).astype(q.dtype)  # [B, S, H, d_v]
    lse = (paddle.log(denom) + row_max).squeeze(-1)
    return out, lse
