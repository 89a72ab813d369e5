"""Core attention of every DSv4 layer kind: builds ``kv_full`` and the per-query index table, then runs
sparse attention with a per-head sink.

Per layer kind (``fleet_ext.layer_kinds``):
- ``WINDOW``: window only (keys t-W+1..t);
- ``CSA``: window + the indexer's top-k of the overlapping compressor's entries, or all visible entries
  when ``csa_dense_mode``;
- ``HCA``: window + all visible entries of the non-overlapping compressor;
- ``FULL_CAUSAL``: every key 0..t (full-causal MQA).
``kv_full = [raw KV (s rows) | compressed entries (s // ratio rows)]``; K = V (MQA). Query positions and
visibility come from the sequence layout.
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
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import replayed


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

    def index_table(self, x: paddle.Tensor, q_latent: paddle.Tensor, layout: SequenceLayout) -> paddle.Tensor:
        """[b, s, K] int32 ids into kv_full (-1 invalid)."""
        batch, seq = x.shape[0], x.shape[1]
        if self.kind is LayerKind.FULL_CAUSAL:
            table = index_tables.full_causal_index_table(layout)
            return table.unsqueeze(0).expand([batch, seq, table.shape[1]])
        window = index_tables.window_index_table(layout, min(self.window, layout.global_len))
        window = window.unsqueeze(0).expand([batch, seq, window.shape[1]])
        if self.compressor is None or layout.global_len // self.ratio == 0:
            return window
        raw_keys = layout.global_len  # kv_full rows in front of the compressed entries
        if self.indexer is not None:
            # Recompute replays the forward's picks: the backward uses the forward's exact support.
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
    ) -> paddle.Tensor:
        kv_full = kv
        if self.compressor is not None:
            kv_full = paddle.concat([kv, self.compressor(x, layout).astype(kv.dtype)], axis=1)
        table = self.index_table(x, q_latent, layout)
        out, _ = self._sparse_attn(query, kv_full, table, self.attn_sink, self.scale)
        return out
