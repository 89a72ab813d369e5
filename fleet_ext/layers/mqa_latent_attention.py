"""Core attention of -2 layers in absorbed (latent MQA) form, with the DSA indexer phases (PaddleFleet
``MQALatentAttention``).

Inputs: query [b, s, h, kv_lora + rope] (``q_nope W_UK`` absorbed, then ``q_pe``) for this rank's queries, one
latent key [b, S, kv_lora + rope] (``c_kv`` then ``k_pe``) for every position of the sequence (S = s without
context parallelism; under it the caller all-gathers the keys, and the DSA indexer's keys are gathered here);
the value is the first ``kv_lora`` channels of the key. The output [b, s, h, kv_lora] is still latent:
``MLASelfAttention`` de-absorbs it through the value up-projection. Every phase calls the sparse attention
through the backend's ``sparse_attn(q, kv, idx, sink, scale, d_v=...)``; the dense phases pass ``idx=None`` and
``q_offset`` (the dense causal mode: the Triton backend runs it without an index table, the reference backend
through the layout's full-causal table, ``dense_causal_through_table``).

Phases (``_phase``):
- ``full_causal`` (``hybrid_mla_attention: mqa_full_causal``): every key 0..t (the dense causal mode).
- ``warmup`` (``mqa_dsa``, ``dsa_indexer_use_sparse_loss: false``): the same dense attention; the indexer is
  trained by the KL over the whole causal set (pair it with ``train_indexer_only``). The KL's target, the
  attention's probabilities summed over heads [b, s, n], comes from the backend's ``causal_probs`` (the Triton
  one never builds the [b, s, h, n] logits).
- ``sparse`` (``mqa_dsa``, ``dsa_indexer_use_sparse_loss: true``): indexer top-k (+ the forced window unless
  ``dsa_indexer_force_window: false``); the KL runs over the top-k picks only (the forced window and the sink are
  outside the indexer's choice, as in PaddleFleet).
The KL loss is computed while training with gradients enabled and ``dsa_indexer_loss_coeff > 0``; ``indexer_loss``
then holds its (detached, unscaled) value for the metrics, else None.

Context parallelism: this rank's queries are scored against the keys before its chunk's end only
(``DSAIndexer.scores(..., end)``, for the top-k and the warm-up KL's student), so rank r of cp scores
``(r + 1) / cp`` of the keys. With
``mqa_indexer_cp_mode: dualchunk_p2p`` the sparse phase's top-k selection (no gradient) is rebalanced as in
PaddleFleet: each rank keeps the first half of its chunk's queries, trades the second half's indexer inputs
(q, w) with the mirror rank ``cp - 1 - r`` (``exchange_with_mirror``), scores the mirror's late half and sends
the picks back, so every rank scores one early and one late half-chunk (the middle rank of an odd group scores
its own two halves). The picks are those of contiguous (each query row sees the same scores; bitwise on CPU,
``tests/multi_card_tests/test_context_parallel.py``). The KL loss's student scores are not moved (autograd).
"""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.config.parallel import MQA_INDEXER_CP_MODES
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.layers import index_tables
from fleet_ext.layers.dsa_indexer import (
    DSAIndexer,
    DSAIndexerLossAutoScaler,
    causal_key_count,
    gather_rows,
    indexer_kl_from_mass,
    indexer_kl_loss,
    indexer_topk,
    topk_width,
    with_forced_window,
)
from fleet_ext.ops.sparse_attn.reference import causal_attention_probs
from fleet_ext.parallel.cp_collectives import exchange_with_mirror, gather_sequence, mirror_rank
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import recording, replayed

__all__ = ["MQALatentAttention", "dense_causal_through_table", "indexer_work_per_rank"]


def dense_causal_through_table(sparse_attn: Callable) -> Callable:
    """``sparse_attn`` with the dense causal mode (``idx=None``, ``q_offset=``) served by an index table: the
    layout's full-causal table (``index_tables.full_causal_index_table``, cached, [s, S] int32) expanded over the
    batch. The reference backend's dense mode (its results are those of the table path, bit for bit); the Triton
    backend has a table-free kernel instead."""

    def attention(q, kv, idx, sink, scale, d_v=None, q_offset=0, **kwargs):
        if idx is None:
            seq, keys = q.shape[1], kv.shape[1]
            if seq < 1 or keys % seq or q_offset % seq:
                raise ValueError(f"dense causal attention through a table: `q_offset` ({q_offset}) and the key count "
                                 f"({keys}) must be multiples of the query count ({seq}) (contiguous chunks)")
            layout = SequenceLayout(offset=q_offset, local_len=seq, global_len=keys, cp_size=keys // seq,
                                    cp_rank=q_offset // seq)
            table = index_tables.full_causal_index_table(layout)
            idx = table.unsqueeze(0).expand([q.shape[0], *table.shape])
        elif q_offset:
            raise ValueError(f"sparse attention: `q_offset` ({q_offset}) belongs to the dense causal mode (idx=None)")
        return sparse_attn(q, kv, idx, sink, scale, d_v=d_v, **kwargs)

    return attention


def indexer_work_per_rank(global_len: int, cp: int, mode: str = "contiguous") -> list[int]:
    """Index-score entries (queries x keys) each context-parallel rank computes for one sequence's top-k in one
    layer (what ``SCORE_ENTRIES["causal"]`` counts per sequence): contiguous, rank r scores its chunk against the
    keys before the chunk's end; ``dualchunk_p2p``, its first half-chunk and the mirror's second half-chunk."""
    if mode not in MQA_INDEXER_CP_MODES or cp < 1 or global_len % cp:
        raise ValueError(f"indexer_work_per_rank: need a mode of {MQA_INDEXER_CP_MODES} and cp dividing the length, "
                         f"got mode={mode!r}, cp={cp}, global_len={global_len}")
    chunk = global_len // cp
    half = chunk // 2
    if mode == "contiguous" or cp == 1:
        return [chunk * causal_key_count((r + 1) * chunk, global_len) for r in range(cp)]
    return [half * causal_key_count(r * chunk + half, global_len)
            + (chunk - half) * causal_key_count((cp - r) * chunk, global_len) for r in range(cp)]


class MQALatentAttention(FleetLayer):
    """query [b, s, h, L + r], key [b, s, L + r], sink [h] -> latent output [b, s, h, L] (L = kv_lora_rank)."""

    def __init__(
        self, config: ModelConfig, sparse_attn: Callable, softmax_scale: float, indexer_cp_mode: str = "contiguous",
        causal_probs: Callable | None = None,
    ) -> None:
        """``sparse_attn``: the backend's slot (``AttentionOps.mqa_sparse_attn``); ``causal_probs``: its warm-up KL
        target (``AttentionOps.mqa_causal_probs``, default the reference)."""
        super().__init__()
        if indexer_cp_mode not in MQA_INDEXER_CP_MODES:
            raise ValueError(
                f"MQALatentAttention: `mqa_indexer_cp_mode` must be one of {list(MQA_INDEXER_CP_MODES)}, "
                f"got {indexer_cp_mode!r}"
            )
        self.indexer_cp_mode = indexer_cp_mode
        if config.hybrid_mla_attention not in ("mqa_full_causal", "mqa_dsa"):
            raise ValueError(
                "MQALatentAttention: `hybrid_mla_attention` must be 'mqa_full_causal' or 'mqa_dsa', "
                f"got {config.hybrid_mla_attention!r} (the 'mha' core is MLASelfAttention's dense path)"
            )
        self.kv_lora_rank = config.hybrid_mla_kv_lora_rank
        self.scale = softmax_scale
        self.topk = config.dsa_index_topk
        self.window = config.csa_window_size if config.dsa_indexer_force_window else 0
        self.loss_coeff = config.dsa_indexer_loss_coeff
        self._sparse_attn = sparse_attn
        self._causal_probs = causal_probs or causal_attention_probs
        if config.hybrid_mla_attention == "mqa_full_causal":
            self.phase = "full_causal"
            self.indexer = None
        else:
            self.phase = "sparse" if config.dsa_indexer_use_sparse_loss else "warmup"
            self.indexer = DSAIndexer(config)
        self.indexer_loss: paddle.Tensor | None = None
        self.loss_backward_scale = 1.0  # the main loss's backward scale (set through the model)

    def set_aux_loss_backward_scale(self, scale: float) -> None:
        """Backward scale of the indexer-loss gradient: the main loss's (loss scale / micro-batches)."""
        self.loss_backward_scale = float(scale)

    # -- index tables -----------------------------------------------------------------------------------
    def select(
        self, x: paddle.Tensor, q_latent: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, layout: SequenceLayout
    ) -> tuple[paddle.Tensor, int]:
        """Sparse-phase KV table [b, s, k_top + W] (int32, -1 invalid) and k_top, without gradient."""
        if self.indexer is None:
            raise ValueError("MQALatentAttention.select: this layer has no indexer (hybrid_mla_attention != mqa_dsa)")
        def pick() -> tuple[paddle.Tensor, int]:
            with paddle.no_grad():
                return self._table(*self._index_inputs(x, q_latent, cos, sin, layout), layout)

        return replayed("DSAIndexer", pick)[0]  # recompute replays the forward's top-k

    def _table(
        self, q: paddle.Tensor, k: paddle.Tensor, w: paddle.Tensor, layout: SequenceLayout
    ) -> tuple[paddle.Tensor, int]:
        """Top-k picks and forced window of this rank's queries (call without gradient): the KV table and k_top."""
        k_top = topk_width(self.topk, self.window, layout.global_len)
        picks = None
        if k_top and self.indexer_cp_mode == "dualchunk_p2p" and layout.cp_size > 1:
            picks = self._dualchunk_picks(q, k, w, layout, k_top)
        elif k_top:
            scores = DSAIndexer.scores(q, k, w, end=layout.end)
            picks = indexer_topk(scores, layout.offset, k_top, self.window, layout.global_len)
        return with_forced_window(picks, self.window, layout, q.shape[0]), k_top

    def _dualchunk_picks(
        self, q: paddle.Tensor, k: paddle.Tensor, w: paddle.Tensor, layout: SequenceLayout, k_top: int
    ) -> paddle.Tensor:
        """This rank's picks [b, s, k_top], the late half's scored by the mirror rank (and the mirror's by us)."""
        if layout.local_len < 2:
            raise ValueError(
                f"MQALatentAttention: `mqa_indexer_cp_mode: dualchunk_p2p` splits each rank's chunk in two halves, "
                f"but this rank holds {layout.local_len} token(s); use `mqa_indexer_cp_mode: contiguous` or a longer "
                "max_seq_len"
            )
        batch, heads, width = q.shape[0], q.shape[2], q.shape[3]
        half, chunk, mirror = layout.local_len // 2, layout.local_len, mirror_rank(layout)
        late = paddle.concat([q[:, half:].reshape([batch, chunk - half, heads * width]), w[:, half:]], axis=-1)
        theirs = exchange_with_mirror(late, layout)  # the mirror's late-half queries (q | w)
        q_m = theirs[..., : heads * width].reshape([batch, chunk - half, heads, width])
        w_m = theirs[..., heads * width :]
        first_m, end_m = mirror * chunk + half, (mirror + 1) * chunk
        n_keys = layout.global_len
        early = DSAIndexer.scores(q[:, :half], k, w[:, :half], end=layout.offset + half)
        early = indexer_topk(early, layout.offset, k_top, self.window, n_keys)
        for_mirror = indexer_topk(DSAIndexer.scores(q_m, k, w_m, end=end_m), first_m, k_top, self.window, n_keys)
        return paddle.concat([early, exchange_with_mirror(for_mirror, layout)], axis=1)

    def _index_inputs(
        self, x: paddle.Tensor, q_latent: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, layout: SequenceLayout
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """The indexer's (q, k, w) with the keys of the whole sequence (all-gathered under context parallelism)."""
        q, k, w = self.indexer(x, q_latent, cos, sin)
        return q, gather_sequence(k, layout), w

    # -- forward ----------------------------------------------------------------------------------------
    def forward(
        self,
        query: paddle.Tensor,
        key: paddle.Tensor,
        sink: paddle.Tensor,
        x: paddle.Tensor,
        q_latent: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        loss_mask: paddle.Tensor | None = None,
        layout: SequenceLayout | None = None,
    ) -> paddle.Tensor:
        """``layout``: the global positions of this rank's queries (default: the whole sequence)."""
        batch, seq = query.shape[0], query.shape[1]
        layout = SequenceLayout.resolve(layout, "MQALatentAttention", "query", seq)
        keys = layout.global_len
        if key.ndim != 3 or key.shape[-1] != query.shape[-1] or key.shape[:2] != [batch, keys]:
            raise ValueError(
                f"MQALatentAttention: `key` must be [b, {keys}, {query.shape[-1]}] (every position of the sequence) "
                f"matching `query` {query.shape}, got {key.shape}"
            )
        if loss_mask is not None and list(loss_mask.shape) != [batch, seq]:
            raise ValueError(f"MQALatentAttention: `loss_mask` must be [{batch}, {seq}], got {loss_mask.shape}")
        if recording():
            self.indexer_loss = None
        with_loss = self.indexer is not None and self.loss_coeff > 0 and self.training and paddle.is_grad_enabled()
        if self.phase == "sparse":
            return self._forward_sparse(query, key, sink, x, q_latent, cos, sin, layout, loss_mask, with_loss)
        # Dense causal: query t sees keys 0 .. t (no index table on the Triton backend).
        out, lse = self._sparse_attn(query, key, None, sink, self.scale, d_v=self.kv_lora_rank, q_offset=layout.offset)
        if self.phase == "full_causal" or not with_loss:
            return out
        # Warm-up: KL over the whole causal set (dense on both sides, no top-k).
        q_i, k_i, w_i = self._index_inputs(x, q_latent, cos, sin, layout)
        student = DSAIndexer.scores(q_i, k_i, w_i, end=layout.end)  # [b, s, n]: keys before this chunk's end
        n_keys = student.shape[2]  # under context parallelism later keys are in every local query's future
        mass = self._causal_probs(query, key, lse, self.scale, layout.offset, n_keys, d_v=self.kv_lora_rank)
        positions = paddle.arange(layout.offset, layout.end, dtype="int64").unsqueeze(1)
        causal = (paddle.arange(n_keys, dtype="int64").unsqueeze(0) <= positions).unsqueeze(0)
        causal = causal.expand([batch, seq, n_keys])
        kl = indexer_kl_from_mass(student, mass, causal, loss_mask, layout)
        return self._attach(out, kl)

    def _forward_sparse(
        self, query, key, sink, x, q_latent, cos, sin, layout: SequenceLayout, loss_mask, with_loss: bool
    ) -> paddle.Tensor:
        if not with_loss:
            idx, _ = self.select(x, q_latent, cos, sin, layout)
            out, _ = self._sparse_attn(query, key, idx, sink, self.scale, d_v=self.kv_lora_rank)
            return out
        q_i, k_i, w_i = self._index_inputs(x, q_latent, cos, sin, layout)
        with paddle.no_grad():
            idx, k_top = replayed("DSAIndexer", lambda: self._table(q_i, k_i, w_i, layout))[0]
        out, lse = self._sparse_attn(query, key, idx, sink, self.scale, d_v=self.kv_lora_rank)
        if k_top == 0:  # the forced window covers every key: the indexer chose nothing
            return out
        picked = idx[:, :, :k_top]
        student = DSAIndexer.gathered_scores(q_i, k_i, w_i, picked)  # [b, s, k_top]
        with paddle.no_grad():
            keys = gather_rows(key.astype("float32"), picked)  # [b, s, k_top, L + r]
            attn_logits = paddle.matmul(query.astype("float32"), keys, transpose_y=True) * self.scale
        return self._attach(out, indexer_kl_loss(student, attn_logits, lse, picked >= 0, loss_mask, layout))

    def _attach(self, out: paddle.Tensor, kl: paddle.Tensor) -> paddle.Tensor:
        """``out`` carrying ``coeff * kl``'s gradient; the logged loss is the forward's."""
        if recording():  # the logged value is the forward's, not set again by a recompute re-run
            self.indexer_loss = kl.detach()
        return DSAIndexerLossAutoScaler.apply(out, kl * self.loss_coeff, self.loss_backward_scale)
