"""Core attention of -2 layers in absorbed (latent MQA) form, with the DSA indexer phases (PaddleFleet
``MQALatentAttention``).

Inputs: query [b, s, h, kv_lora + rope] (``q_nope W_UK`` absorbed, then ``q_pe``), one latent key
[b, s, kv_lora + rope] (``c_kv`` then ``k_pe``); the value is the first ``kv_lora`` channels of the key. The output
[b, s, h, kv_lora] is still latent: ``MLASelfAttention`` de-absorbs it through the value up-projection. Every
phase calls the sparse attention through the backend's ``sparse_attn(q, kv, idx, sink, scale, d_v=...)``.

Phases (``_phase``):
- ``full_causal`` (``hybrid_mla_attention: mqa_full_causal``): every key 0..t (a full-causal index table).
- ``warmup`` (``mqa_dsa``, ``dsa_indexer_use_sparse_loss: false``): the same dense attention; the indexer is
  trained by the KL over the whole causal set (pair it with ``train_indexer_only``).
- ``sparse`` (``mqa_dsa``, ``dsa_indexer_use_sparse_loss: true``): indexer top-k (+ the forced window unless
  ``dsa_indexer_force_window: false``); the KL runs over the top-k picks only (the forced window and the sink are
  outside the indexer's choice, as in PaddleFleet).
The KL loss is computed while training with gradients enabled and ``dsa_indexer_loss_coeff > 0``; ``indexer_loss``
then holds its (detached, unscaled) value for the metrics, else None.
"""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.layers import index_tables
from fleet_ext.layers.dsa_indexer import (
    DSAIndexer,
    DSAIndexerLossAutoScaler,
    dsa_index_table,
    gather_rows,
    indexer_kl_loss,
)
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import recording, replayed


class MQALatentAttention(FleetLayer):
    """query [b, s, h, L + r], key [b, s, L + r], sink [h] -> latent output [b, s, h, L] (L = kv_lora_rank)."""

    def __init__(self, config: ModelConfig, sparse_attn: Callable, softmax_scale: float) -> None:
        super().__init__()
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
                scores = DSAIndexer.scores(*self.indexer(x, q_latent, cos, sin))
                return dsa_index_table(scores, self.topk, self.window, layout)

        return replayed("DSAIndexer", pick)[0]  # recompute replays the forward's top-k

    @staticmethod
    def _full_causal_table(batch: int, layout: SequenceLayout) -> paddle.Tensor:
        table = index_tables.full_causal_index_table(layout)
        return table.unsqueeze(0).expand([batch, *table.shape])

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
        if key.ndim != 3 or key.shape[-1] != query.shape[-1] or key.shape[:2] != [batch, seq]:
            raise ValueError(
                f"MQALatentAttention: `key` must be [b, s, {query.shape[-1]}] matching `query` {query.shape}, "
                f"got {key.shape}"
            )
        if loss_mask is not None and list(loss_mask.shape) != [batch, seq]:
            raise ValueError(f"MQALatentAttention: `loss_mask` must be [{batch}, {seq}], got {loss_mask.shape}")
        layout = SequenceLayout.resolve(layout, "MQALatentAttention", "query", seq)
        if recording():
            self.indexer_loss = None
        with_loss = self.indexer is not None and self.loss_coeff > 0 and self.training and paddle.is_grad_enabled()
        if self.phase == "sparse":
            return self._forward_sparse(query, key, sink, x, q_latent, cos, sin, layout, loss_mask, with_loss)
        idx = self._full_causal_table(batch, layout)
        out, lse = self._sparse_attn(query, key, idx, sink, self.scale, d_v=self.kv_lora_rank)
        if self.phase == "full_causal" or not with_loss:
            return out
        # Warm-up: KL over the whole causal set (dense on both sides, no top-k).
        q_i, k_i, w_i = self.indexer(x, q_latent, cos, sin)
        student = DSAIndexer.scores(q_i, k_i, w_i)  # [b, s, s]
        causal = idx >= 0
        with paddle.no_grad():
            attn_logits = paddle.matmul(query.astype("float32"), key.astype("float32").unsqueeze(1), transpose_y=True)
            attn_logits = attn_logits * self.scale  # [b, s, h, s]
        return self._attach(out, student, attn_logits, lse, causal, loss_mask)

    def _forward_sparse(
        self, query, key, sink, x, q_latent, cos, sin, layout: SequenceLayout, loss_mask, with_loss: bool
    ) -> paddle.Tensor:
        if not with_loss:
            idx, _ = self.select(x, q_latent, cos, sin, layout)
            out, _ = self._sparse_attn(query, key, idx, sink, self.scale, d_v=self.kv_lora_rank)
            return out
        q_i, k_i, w_i = self.indexer(x, q_latent, cos, sin)
        with paddle.no_grad():
            idx, k_top = replayed(
                "DSAIndexer", lambda: dsa_index_table(DSAIndexer.scores(q_i, k_i, w_i), self.topk, self.window, layout)
            )[0]
        out, lse = self._sparse_attn(query, key, idx, sink, self.scale, d_v=self.kv_lora_rank)
        if k_top == 0:  # the forced window covers every key: the indexer chose nothing
            return out
        picked = idx[:, :, :k_top]
        student = DSAIndexer.gathered_scores(q_i, k_i, w_i, picked)  # [b, s, k_top]
        with paddle.no_grad():
            keys = gather_rows(key.astype("float32"), picked)  # [b, s, k_top, L + r]
            attn_logits = paddle.matmul(query.astype("float32"), keys, transpose_y=True) * self.scale
        return self._attach(out, student, attn_logits, lse, picked >= 0, loss_mask)

    def _attach(self, out, student, attn_logits, lse, valid, loss_mask) -> paddle.Tensor:
        kl = indexer_kl_loss(student, attn_logits, lse, valid, loss_mask)
        if recording():  # the logged value is the forward's, not set again by a recompute re-run
            self.indexer_loss = kl.detach()
        return DSAIndexerLossAutoScaler.apply(out, kl * self.loss_coeff, self.loss_backward_scale)
