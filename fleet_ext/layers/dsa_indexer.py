"""DSA indexer of the -2 (hybrid-MLA) layers (DeepSeek-V3.2 sparse attention) and its KL training loss.

Score of key j for query t (``dsv4_math.md`` §6.1):
``I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j])`` with
- ``q = H(rope(c_Q W_q))`` per indexer head (``c_Q`` the MLA query latent), ``k = H(rope(LayerNorm(x W_k)))`` one
  key shared by the heads, ``w = x W_w * n_heads^-1/2 * head_dim^-1/2``;
- RoPE on the *leading* ``hybrid_mla_qk_rope_head_dim`` channels (``[pe | nope]``), rotate-half (non-interleaved,
  unlike the MLA itself) unless ``dsa_indexer_rotary_interleaved``;
- ``H`` the normalised Hadamard transform (``d^-1/2`` Sylvester matrix, a pure-Paddle butterfly). It is orthogonal,
  so without the FP8 quantisation it follows in the official code it changes scores by rounding only (HF
  transformers skips it for that reason; we keep it so the FP8 path can slot in).
Query t sees keys j <= t. The sparse phase keeps the top ``dsa_index_topk`` keys and, when
``dsa_indexer_force_window``, the last ``csa_window_size`` keys (the top-k then picks among the older ones,
PaddleFleet's ``valid_range``); ``-1`` marks an empty slot.

Causal scoring: a block of queries ending at global position ``end - 1`` never sees keys at or past ``end``, so it
is scored against keys ``0 .. causal_key_count(end) - 1`` only (``end`` rounded up to a multiple of
``KEY_ALIGN``, where the CPU GEMM gives the same bits as the columns of the all-keys product; pinned in
``tests/single_card_tests/test_dsa_indexer.py``); the top-k still runs on full-width rows (``indexer_topk``).
Without context parallelism the block is the whole sequence and nothing changes; under it the scoring grows with
the rank (the last one scores the most), which the dual-chunk rebalance of ``MQALatentAttention`` evens out.
``SCORE_ENTRIES`` counts the entries scored (queries x keys).

Training (§6.3): the indexer's inputs are detached, so the LM loss never reaches it and its KL loss never reaches
the backbone. The KL target is the main attention's probabilities summed over heads, L1-normalised over the
candidate set (the whole causal set in the warm-up, the top-k picks in the sparse phase); the student is the
softmax of the index scores over the same set. ``DSAIndexerLossAutoScaler`` attaches ``coeff * KL`` to the attention
output: the forward value is unchanged, the backward adds the loss gradient (Megatron's ``DSAIndexerLossAutoScaler``).
"""

from __future__ import annotations

import collections

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.aux_loss import AuxLossAutoScaler
from fleet_ext.framework.layer import FleetLayer, normal_init
from fleet_ext.layers.index_tables import window_index_table
from fleet_ext.parallel.cp_collectives import sum_over_sequence
from fleet_ext.parallel.layout import SequenceLayout

__all__ = [
    "KEY_ALIGN",
    "SCORE_ENTRIES",
    "DSAIndexer",
    "DSAIndexerLossAutoScaler",
    "causal_key_count",
    "dsa_index_table",
    "gather_rows",
    "hadamard_transform",
    "indexer_kl_from_mass",
    "indexer_kl_loss",
    "indexer_rope",
    "indexer_topk",
    "topk_width",
    "with_forced_window",
]

# Finite stand-in for -inf in the student logits: keeps log-softmax and its gradient NaN-free on empty rows.
_MASKED_LOGIT = -1.0e30
# Scored key counts are rounded up to this: the CPU fp32 GEMM's columns then carry the bits of the all-keys
# product (a count off the multiple of 8 can fall into another remainder block and round differently).
KEY_ALIGN = 8
# Index-score entries computed (batch x queries x keys): "causal" by DSAIndexer.scores (the dense causal
# scoring, the part that is unbalanced under context parallelism), "picked" by DSAIndexer.gathered_scores.
SCORE_ENTRIES: collections.Counter = collections.Counter()


def causal_key_count(end: int, n_keys: int) -> int:
    """How many leading keys (of ``n_keys``) a block of queries ending before global position ``end`` is scored
    against: ``end`` rounded up to a multiple of ``KEY_ALIGN``, at most ``n_keys``."""
    return min(n_keys, -(-end // KEY_ALIGN) * KEY_ALIGN)


def topk_width(topk: int, window: int, n_keys: int) -> int:
    """``k_top``: the indexer's picks per query, ``min(topk, max(0, n_keys - window))`` (``n_keys`` global)."""
    return min(topk, max(0, n_keys - window))


def hadamard_transform(x: paddle.Tensor) -> paddle.Tensor:
    """``x @ H / sqrt(d)`` over the last axis (Sylvester Hadamard, d a power of two), fp32 butterfly, cast back."""
    width = x.shape[-1]
    if width < 1 or width & (width - 1):
        raise ValueError(f"hadamard_transform: last dim of `x` must be a power of two, got shape {x.shape}")
    lead = list(x.shape[:-1])
    y = x.astype("float32").reshape([-1, width])
    span = 1
    while span < width:
        y = y.reshape([-1, width // (2 * span), 2, span])
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = paddle.stack([a + b, a - b], axis=2)
        span *= 2
    return (y.reshape(lead + [width]) * width**-0.5).astype(x.dtype)


def indexer_rope(
    x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, interleaved: bool = False
) -> paddle.Tensor:
    """Rotate the *leading* ``2 * cos.shape[-1]`` channels of x [b, s, d] or [b, s, h, d] ([pe | nope] layout).

    Rotate-half pairs channel i with i + rd/2 (DeepSeek-V3.2 indexer, HF ``apply_rotary_pos_emb``); interleaved
    pairs 2i with 2i+1. cos/sin are [s, rd/2].
    """
    if x.ndim not in (3, 4) or cos.ndim != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[1]:
        raise ValueError(
            f"indexer_rope: `x` must be [b, s, (h,) d] and cos/sin [s, rd/2] with s = {x.shape[1] if x.ndim else '?'}, "
            f"got x {x.shape}, cos {cos.shape}, sin {sin.shape}"
        )
    half = cos.shape[-1]
    rope_dim = 2 * half
    if rope_dim > x.shape[-1]:
        raise ValueError(f"indexer_rope: rope width {rope_dim} exceeds the head width {x.shape[-1]}")
    cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if x.ndim == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    pe = x[..., :rope_dim].astype("float32")
    if interleaved:
        even, odd = pe[..., 0::2], pe[..., 1::2]
        rotated = paddle.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(pe.shape)
    else:
        first, second = pe[..., :half], pe[..., half:]
        rotated = paddle.concat([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return paddle.concat([rotated.astype(x.dtype), x[..., rope_dim:]], axis=-1)


def gather_rows(rows: paddle.Tensor, idx: paddle.Tensor) -> paddle.Tensor:
    """rows [b, n, d], idx [b, s, K] (-1 allowed; those slots read row 0) -> [b, s, K, d]."""
    batch, n_rows, width = rows.shape
    seq, slots = idx.shape[1], idx.shape[2]
    offset = (paddle.arange(batch, dtype="int64") * n_rows).reshape([batch, 1, 1])
    flat = paddle.clip(idx.astype("int64"), min=0) + offset
    return paddle.gather(rows.reshape([batch * n_rows, width]), flat.reshape([-1])).reshape(
        [batch, seq, slots, width]
    )


def indexer_topk(scores: paddle.Tensor, first_row: int, k_top: int, window: int, n_keys: int) -> paddle.Tensor:
    """The top ``k_top`` candidate keys [b, rows, k_top] (int32, best first, -1 empty) of a block of queries.

    ``scores`` [b, rows, n]: queries at global positions ``first_row ..`` against keys ``0 .. n - 1`` of the
    ``n_keys`` (n past the block's last query: every later key is in the future of every row). The candidates
    of query t are ``j <= t - window``. The top-k runs on the ``n_keys``-wide row, the unscored keys ``-inf``:
    Paddle's CPU top-k (``nth_element`` unless k is tiny) breaks ties between equal scores (ReLU makes exact
    zeros common) differently on a shorter row, so only the full width gives the whole-sequence picks.
    """
    batch, rows, scored = scores.shape
    if not first_row + rows <= scored <= n_keys:
        raise ValueError(
            f"indexer_topk: queries {first_row}..{first_row + rows - 1} need the scores of keys 0 up to their last "
            f"position (at most {n_keys}), got {scored} keys (`scores` {scores.shape})"
        )
    if scored < n_keys:
        pad = paddle.full([batch, rows, n_keys - scored], float("-inf"), dtype=scores.dtype)
        scores = paddle.concat([scores, pad], axis=-1)
    queries = paddle.arange(first_row, first_row + rows, dtype="int64")
    last_candidate = (queries - window).reshape([1, rows, 1])  # j <= t - window
    keys = paddle.arange(n_keys, dtype="int64").reshape([1, 1, n_keys])
    masked = paddle.where(keys <= last_candidate, scores, paddle.full_like(scores, float("-inf")))
    top = paddle.topk(masked, k=k_top, axis=-1).indices
    return paddle.where(top <= last_candidate, top, paddle.full_like(top, -1)).astype("int32")


def with_forced_window(picks: paddle.Tensor | None, window: int, layout: SequenceLayout, batch: int) -> paddle.Tensor:
    """The sparse-phase table of this rank's queries: ``picks`` [b, s, k_top] (None when ``k_top`` is 0), then
    the forced window ``t - W + 1 .. t`` (``min(window, S)`` columns, when ``window``)."""
    if picks is None and not window:
        raise ValueError("with_forced_window: no picks and no window: the table would be empty")
    parts = [] if picks is None else [picks]
    if window:
        table = window_index_table(layout, min(window, layout.global_len))
        parts.append(table.unsqueeze(0).expand([batch, layout.local_len, table.shape[1]]).astype("int32"))
    return paddle.concat(parts, axis=-1)


def dsa_index_table(
    scores: paddle.Tensor, topk: int, window: int, layout: SequenceLayout | None = None
) -> tuple[paddle.Tensor, int]:
    """Sparse-phase KV table [b, s, k_top + min(window, S)] (int32, -1 invalid) and k_top.

    ``scores`` [b, s, n]: this rank's s queries (global positions t from ``layout``, default the whole
    sequence) against the first n of the S keys, ``layout.end <= n <= S`` (``causal_key_count``; keys past n
    are in the future of every query). Columns ``[:k_top]``: the indexer's top
    ``k_top = min(topk, max(0, S - window))`` keys among the candidates j <= t - window (all j <= t when
    ``window`` is 0), best first; then the forced window t-W+1 .. t.
    """
    if scores.ndim != 3:
        raise ValueError(f"dsa_index_table: `scores` must be [b, s, n], got shape {scores.shape}")
    layout = layout or SequenceLayout.whole(scores.shape[1])
    if scores.shape[1] != layout.local_len or not layout.end <= scores.shape[2] <= layout.global_len:
        raise ValueError(
            f"dsa_index_table: `scores` must be [b, {layout.local_len}, {layout.global_len}] for the layout {layout} "
            f"(or [b, {layout.local_len}, n], {layout.end} <= n: the keys before the chunk's end), got shape "
            f"{scores.shape}"
        )
    if topk <= 0 or window < 0:
        raise ValueError(f"dsa_index_table: need topk > 0 and window >= 0, got topk={topk}, window={window}")
    k_top = topk_width(topk, window, layout.global_len)
    picks = indexer_topk(scores, layout.offset, k_top, window, layout.global_len) if k_top else None
    return with_forced_window(picks, window, layout, scores.shape[0]), k_top


def indexer_kl_loss(
    index_logits: paddle.Tensor,
    attn_logits: paddle.Tensor,
    attn_lse: paddle.Tensor,
    valid: paddle.Tensor,
    row_mask: paddle.Tensor | None = None,
    layout: SequenceLayout | None = None,
) -> paddle.Tensor:
    """Mean over kept rows of ``KL(target || softmax(index_logits))`` on each row's candidate set.

    Under context parallelism (``layout``) this rank's rows are summed and divided by the kept rows of the
    whole sequence, so the ranks' values add up to the sequence's mean (and so do their gradients).

    index_logits [b, s, K] (the indexer scores, differentiable); attn_logits [b, s, h, K] (scaled main-attention
    logits) and attn_lse [b, s, h] (its sink-inclusive log-sum-exp) give the per-head probabilities, summed over
    heads and L1-normalised over the valid slots into the target (no gradient). valid [b, s, K] bool; row_mask
    [b, s] bool (False: padding row, skipped). Rows without a valid slot are skipped.
    """
    with paddle.no_grad():
        per_head = paddle.exp(attn_logits.astype("float32") - attn_lse.astype("float32").unsqueeze(-1))
        mass = paddle.where(valid.unsqueeze(2), per_head, paddle.zeros_like(per_head)).sum(axis=2)  # [b, s, K]
    return indexer_kl_from_mass(index_logits, mass, valid, row_mask, layout)


def indexer_kl_from_mass(
    index_logits: paddle.Tensor,
    mass: paddle.Tensor,
    valid: paddle.Tensor,
    row_mask: paddle.Tensor | None = None,
    layout: SequenceLayout | None = None,
) -> paddle.Tensor:
    """``indexer_kl_loss`` from the head-summed attention probabilities ``mass`` [b, s, K] (no gradient; 0 off the
    valid slots) instead of the [b, s, h, K] logits: the warm-up's dense target comes from the attention backend
    (``AttentionOps.mqa_causal_probs``) so the per-head logits never exist."""
    with paddle.no_grad():
        mass = mass.astype("float32")
        total = mass.sum(axis=-1, keepdim=True)
        target = mass / paddle.clip(total, min=1e-30)
        keep = total.squeeze(-1) > 0
        if row_mask is not None:
            keep = paddle.logical_and(keep, row_mask)
        keep = keep.astype("float32")
        positive = target > 0
        log_target = paddle.log(paddle.where(positive, target, paddle.ones_like(target)))
    logits = paddle.where(valid, index_logits.astype("float32"), paddle.full_like(index_logits, _MASKED_LOGIT))
    log_student = logits - paddle.logsumexp(logits, axis=-1, keepdim=True)
    terms = paddle.where(positive, target * (log_target - log_student), paddle.zeros_like(log_student))
    per_row = terms.sum(axis=-1)
    kept_rows = keep.sum() if layout is None else sum_over_sequence(keep.sum(), layout)
    return (per_row * keep).sum() / paddle.clip(kept_rows, min=1.0)


# The indexers attach their KL loss to the attention output with the shared auto-scaler (Megatron's name).
DSAIndexerLossAutoScaler = AuxLossAutoScaler


class DSAIndexer(FleetLayer):
    """DSA lightning indexer of one -2 layer: ``linear_wq_b``, ``linear_wk``, ``k_norm``, ``linear_weights_proj``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.dsa_index_n_heads
        self.head_dim = config.dsa_index_head_dim
        self.interleaved = config.dsa_indexer_rotary_interleaved
        std = config.init_method_std
        self.linear_wq_b = paddle.nn.Linear(
            config.hybrid_mla_q_lora_rank, self.n_heads * self.head_dim, weight_attr=normal_init(std), bias_attr=False
        )
        self.linear_wk = paddle.nn.Linear(
            config.hidden_size, self.head_dim, weight_attr=normal_init(std), bias_attr=False
        )
        self.k_norm = paddle.nn.LayerNorm(self.head_dim, epsilon=1e-6)  # LayerNorm, not RMSNorm (V3.2)
        self.linear_weights_proj = paddle.nn.Linear(
            config.hidden_size, self.n_heads, weight_attr=normal_init(std), bias_attr=False
        )

    def forward(
        self, x: paddle.Tensor, q_latent: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """(q [b, s, h, d], k [b, s, d], w [b, s, h]) in fp32 from detached x [b, s, D] and q_latent [b, s, r]."""
        x, q_latent = x.detach(), q_latent.detach()
        batch, seq, _ = x.shape
        q = self.linear_wq_b(q_latent).reshape([batch, seq, self.n_heads, self.head_dim]).astype("float32")
        q = hadamard_transform(indexer_rope(q, cos, sin, self.interleaved))
        k = self.k_norm(self.linear_wk(x).astype("float32"))
        k = hadamard_transform(indexer_rope(k, cos, sin, self.interleaved))
        w = self.linear_weights_proj(x).astype("float32") * (self.n_heads**-0.5 * self.head_dim**-0.5)
        return q, k, w

    @staticmethod
    def scores(q: paddle.Tensor, k: paddle.Tensor, w: paddle.Tensor, end: int | None = None) -> paddle.Tensor:
        """Index scores [b, s, n] (no causal mask): ``sum_h w * ReLU(q_h . k)`` of the s queries against the
        first ``n = causal_key_count(end, s_k)`` keys (all ``s_k`` when ``end`` is None); ``end``: one past the
        queries' last global position (no query sees a key from there on)."""
        if end is not None and causal_key_count(end, k.shape[1]) < k.shape[1]:
            k = k[:, : causal_key_count(end, k.shape[1])]
        SCORE_ENTRIES["causal"] += q.shape[0] * q.shape[1] * k.shape[1]
        logits = paddle.matmul(q, k.unsqueeze(1), transpose_y=True)  # [b, s, h, n]
        return (paddle.nn.functional.relu(logits) * w.unsqueeze(-1)).sum(axis=2)

    @staticmethod
    def gathered_scores(q: paddle.Tensor, k: paddle.Tensor, w: paddle.Tensor, idx: paddle.Tensor) -> paddle.Tensor:
        """Index scores [b, s, K] of the keys in idx [b, s, K] (-1 slots hold garbage; mask them)."""
        SCORE_ENTRIES["picked"] += idx.shape[0] * idx.shape[1] * idx.shape[2]
        keys = gather_rows(k, idx)  # [b, s, K, d]
        logits = paddle.matmul(q, keys, transpose_y=True)  # [b, s, h, K]
        return (paddle.nn.functional.relu(logits) * w.unsqueeze(-1)).sum(axis=2)
