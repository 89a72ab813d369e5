"""Core attention of every DSv4 layer kind: builds ``kv_full`` and the per-query index table, then runs
sparse attention with a per-head sink.

Per layer kind (``fleet_ext.layer_kinds``):
- ``WINDOW``: window only (keys t-W+1..t);
- ``CSA``: window + the indexer's top-k of the overlapping compressor's entries, or all visible entries
  when ``csa_dense_mode``;
- ``HCA``: window + all visible entries of the non-overlapping compressor;
- ``FULL_CAUSAL``: every key 0..t (full-causal MQA).
``kv_full = [raw KV | compressed entries (global_len // ratio rows)]``; K = V (MQA). Query positions and
visibility come from the sequence layout.

CSA indexer training (``dsa_indexer_loss_coeff > 0``, training with gradients enabled): the KL between the
indexer's scores over each query's picks (softmax over the picked entries, -1 slots excluded) and the main
attention's mass on those entries (per-head probabilities under the sparse attention's sink-inclusive lse, summed
over heads, L1-normalised over the picks, without gradient), averaged over the kept rows (padding rows skipped)
and attached to the output at ``coeff`` x the main loss's backward scale (``DSAIndexerLossAutoScaler``, shared
with the -2 layers; ``indexer_kl_loss`` divides by the kept rows of the whole sequence under context
parallelism). The indexer's inputs are detached, so the KL trains only the indexer (its projections and its own
compressor); ``indexer_loss`` holds the detached value for the metrics (set once per step under recompute).

Context parallelism (``layout.cp_size > 1``, contiguous chunks): the raw KV rows are this rank's chunk behind a
halo of the previous rank's last ``W - 1`` rows (window kinds), or the whole all-gathered sequence (full-causal);
the compressed entries are all-gathered in rank order. With one rank the raw rows are the sequence itself.
"""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.layer_kinds import LayerAttention, LayerKind
from fleet_ext.layers import index_tables
from fleet_ext.layers.compressor import Compressor
from fleet_ext.layers.csa_indexer import CSAIndexer
from fleet_ext.layers.dsa_indexer import DSAIndexerLossAutoScaler, gather_rows, indexer_kl_loss
from fleet_ext.ops.sparse_attn.band import Band
from fleet_ext.parallel.cp_collectives import gather_sequence, halo_from_previous
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import recording, replayed


class CompressedSparseAttention(FleetLayer):
    """q [b, s, h, d], kv [b, s, d] (+ x and the q latent for the compressor/indexer) -> [b, s, h, d]."""

    def __init__(
        self, config: ModelConfig, attention: LayerAttention, sparse_attn: Callable, rope_apply: Callable
    ) -> None:
        super().__init__()
        if attention.kind is LayerKind.HYBRID_MLA:
            raise ValueError("CompressedSparseAttention: -2 (hybrid-MLA) layers use MQALatentAttention")
        self.kind = attention.kind
        self.ratio = attention.compress_ratio
        self.window = attention.window
        self.scale = config.v_head_dim**-0.5
        self._sparse_attn = sparse_attn
        self.attn_sink = self.create_parameter(
            [config.num_attention_heads], dtype="float32", default_initializer=paddle.nn.initializer.Constant(0.0)
        )
        self.compressor = (
            Compressor(config, attention, config.v_head_dim, rope_apply) if attention.has_compressor else None
        )
        use_indexer = attention.has_csa_indexer(config.csa_dense_mode)
        self.indexer = CSAIndexer(config, attention, rope_apply) if use_indexer else None
        self.loss_coeff = config.dsa_indexer_loss_coeff if use_indexer else 0.0
        self.indexer_loss: paddle.Tensor | None = None
        self.loss_backward_scale = 1.0  # the main loss's backward scale (set through the model)

    def set_aux_loss_backward_scale(self, scale: float) -> None:
        """Backward scale of the indexer-loss gradient: the main loss's (loss scale / micro-batches)."""
        self.loss_backward_scale = float(scale)

    def halo_rows(self, layout: SequenceLayout) -> int:
        """Raw KV rows this rank needs from the previous one: ``W - 1`` under context parallelism, else 0."""
        if layout.cp_size == 1 or self.kind is LayerKind.FULL_CAUSAL:
            return 0
        return min(self.window, layout.global_len) - 1

    def raw_keys(self, kv: paddle.Tensor, layout: SequenceLayout) -> paddle.Tensor:
        """The raw KV rows this rank attends over: [halo | chunk] (window kinds), the whole sequence (full causal)."""
        if layout.cp_size == 1:
            return kv
        if self.kind is LayerKind.FULL_CAUSAL:
            return gather_sequence(kv, layout)
        halo = self.halo_rows(layout)
        return paddle.concat([halo_from_previous(kv, halo, layout), kv], axis=1) if halo else kv

    def slot_bands(self, layout: SequenceLayout) -> tuple[Band, ...]:
        """Where ``index_table`` puts keys by position (``band.Band``): the window in slots [0, W) and HCA's entries
        in order after it; the Triton backward sums their dkv key-major (the reference ignores this). HCA layers only,
        as measured on the H200 at s 16384 (benchmarks/RESULTS.md): HCA 7.70 -> 5.69 ms; beside CSA's picks the window
        band gains nothing (19.32 -> 19.25); window-only layers not measured yet (``bench_sparse_attn.py --shapes
        v4win_s16384 --band-ab``), so they keep the CSR path."""
        entries = layout.global_len // self.ratio if self.compressor is not None else 0
        if self.kind is LayerKind.FULL_CAUSAL or self.indexer is not None or entries == 0:
            return ()
        halo = self.halo_rows(layout)
        first_key = layout.offset - halo if layout.cp_size > 1 else 0
        width = min(self.window, layout.global_len)
        bands = (Band(0, width, 1, layout.offset - first_key - width + 1),) if width > 0 else ()
        raw_keys = halo + layout.local_len if layout.cp_size > 1 else layout.global_len
        return bands + (Band(width, entries, 0, raw_keys - width),)  # entry c in slot W + c, kv_full row raw_keys + c

    def index_table(
        self, x: paddle.Tensor, q_latent: paddle.Tensor, layout: SequenceLayout, picked: paddle.Tensor | None = None
    ) -> paddle.Tensor:
        """[b, s, K] int32 ids into kv_full (-1 invalid); ``picked``: the indexer's picks when already made."""
        batch, seq = x.shape[0], x.shape[1]
        if self.kind is LayerKind.FULL_CAUSAL:
            table = index_tables.full_causal_index_table(layout)
            return table.unsqueeze(0).expand([batch, seq, table.shape[1]])
        halo = self.halo_rows(layout)
        first_key = layout.offset - halo if layout.cp_size > 1 else 0
        window = index_tables.window_index_table(layout, min(self.window, layout.global_len), first_key)
        window = window.unsqueeze(0).expand([batch, seq, window.shape[1]])
        if self.compressor is None or layout.global_len // self.ratio == 0:
            return window
        raw_keys = halo + seq if layout.cp_size > 1 else layout.global_len  # kv_full rows before the entries
        if self.indexer is not None:
            if picked is None:  # recompute replays the forward's picks: the backward uses the forward's support
                picked, _ = replayed("CSAIndexer", lambda: self.indexer(x, q_latent, layout))
            compressed = index_tables.compressed_topk_to_kv_full(picked, offset=raw_keys)
        else:
            table = index_tables.all_compressed_index_table(layout, self.ratio, raw_keys)
            compressed = table.unsqueeze(0).expand([batch, seq, table.shape[1]])
        return paddle.concat([window, compressed], axis=-1)

    def forward(
        self,
        query: paddle.Tensor,
        kv: paddle.Tensor,
        x: paddle.Tensor,
        q_latent: paddle.Tensor,
        layout: SequenceLayout,
        loss_mask: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """``loss_mask`` [b, s] bool (False: a padding row, skipped by the indexer KL; default every row)."""
        kv_full = self.raw_keys(kv, layout)
        entries = None
        if self.compressor is not None:
            entries = gather_sequence(self.compressor(x, layout), layout).astype(kv.dtype)
            kv_full = paddle.concat([kv_full, entries], axis=1)
        if recording():
            self.indexer_loss = None
        if self._trains_indexer(layout):
            return self._forward_with_indexer_loss(query, kv_full, entries, x, q_latent, layout, loss_mask)
        table = self.index_table(x, q_latent, layout)
        out, _ = self._sparse_attn(query, kv_full, table, self.attn_sink, self.scale,
                                   slot_bands=self.slot_bands(layout))
        return out

    def _trains_indexer(self, layout: SequenceLayout) -> bool:
        """The KL runs while training with gradients, with ``dsa_indexer_loss_coeff > 0`` and entries to pick."""
        return (
            self.indexer is not None and self.loss_coeff > 0 and self.training and paddle.is_grad_enabled()
            and layout.global_len // self.ratio > 0
        )

    def _forward_with_indexer_loss(self, query, kv_full, entries, x, q_latent, layout, loss_mask) -> paddle.Tensor:
        """The same attention as ``forward``'s, with the indexer KL over the picked entries attached to it."""
        if loss_mask is not None and list(loss_mask.shape) != list(query.shape[:2]):
            raise ValueError(
                f"CompressedSparseAttention: `loss_mask` must be [b, s] = {list(query.shape[:2])}, "
                f"got {loss_mask.shape}"
            )
        # One scoring pass: the picks (no gradient, replayed under recompute) and the student come from it.
        q_i, k_i, w_i = self.indexer.parts(x.detach(), q_latent.detach(), layout)
        picked, _ = replayed("CSAIndexer", lambda: self.indexer.select(q_i, k_i, w_i, layout))
        table = self.index_table(x, q_latent, layout, picked)
        out, lse = self._sparse_attn(query, kv_full, table, self.attn_sink, self.scale,
                                     slot_bands=self.slot_bands(layout))
        student = self.indexer.gathered_scores(q_i, k_i, w_i, picked)  # [b, s, k]
        with paddle.no_grad():  # the teacher's logits at the picks: the rows of kv_full the attention read
            chosen = gather_rows(entries.astype("float32"), picked)  # [b, s, k, d]
            attn_logits = paddle.matmul(query.astype("float32"), chosen, transpose_y=True) * self.scale
        kl = indexer_kl_loss(student, attn_logits, lse, picked >= 0, loss_mask, layout)
        if recording():  # the logged value is the forward's, not set again by a recompute re-run
            self.indexer_loss = kl.detach()
        return DSAIndexerLossAutoScaler.apply(out, kl * self.loss_coeff, self.loss_backward_scale)
