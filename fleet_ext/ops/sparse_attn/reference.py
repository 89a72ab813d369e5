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
    slot_bands: tuple = (),
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """q [B, S, H, d], kv [B, N, d], idx [B, S, K] int (-1 invalid), sink [H] fp32 -> (out [B,S,H,d_v], lse [B,S,H]).

    ``slot_bands`` (``band.Band``s: where the table holds keys by position) serves the Triton backward; the
    reference reads the table alone.

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


def causal_attention_probs(
    q: paddle.Tensor,
    kv: paddle.Tensor,
    lse: paddle.Tensor,
    scale: float,
    q_offset: int = 0,
    n_cols: int | None = None,
    d_v: int | None = None,
) -> paddle.Tensor:
    """Head-summed causal attention probabilities [B, S, n_cols] fp32, no gradient (the DSA indexer warm-up KL's
    target): ``sum_h exp(scale q_{t,h} . kv_j - lse_{t,h})`` for key j <= ``q_offset + t``, else 0.

    q [B, S, H, d], kv [B, N, d], lse [B, S, H] (the attention's, sink-inclusive); ``n_cols`` (default N) leading
    keys. Builds the [B, S, H, n_cols] logits (the reference; ``function.causal_probs_triton`` does not). ``d_v``
    is accepted for the slot's signature (the sum runs over every channel).
    """
    batch, seq = q.shape[0], q.shape[1]
    n_cols = kv.shape[1] if n_cols is None else int(n_cols)
    if not 0 <= q_offset <= kv.shape[1] - seq or not 0 <= n_cols <= kv.shape[1] or list(lse.shape) != q.shape[:3]:
        raise ValueError(
            f"causal_attention_probs: need 0 <= q_offset <= N - S, 0 <= n_cols <= N (N = {kv.shape[1]}, S = {seq}) "
            f"and `lse` {q.shape[:3]}, got q_offset={q_offset}, n_cols={n_cols}, lse {lse.shape}"
        )
    with paddle.no_grad():
        keys = kv[:, :n_cols] if n_cols < kv.shape[1] else kv
        logits = paddle.matmul(q.astype("float32"), keys.astype("float32").unsqueeze(1), transpose_y=True) * scale
        per_head = paddle.exp(logits - lse.astype("float32").unsqueeze(-1))  # [B, S, H, n_cols]
        positions = paddle.arange(q_offset, q_offset + seq, dtype="int64").unsqueeze(1)
        valid = (paddle.arange(n_cols, dtype="int64").unsqueeze(0) <= positions).unsqueeze(0)
        valid = valid.expand([batch, seq, n_cols])
        return paddle.where(valid.unsqueeze(2), per_head, paddle.zeros_like(per_head)).sum(axis=2)
