"""Core attention of DSv4 layers: builds ``kv_full`` and the per-query index table, then runs sparse
attention with a per-head sink.

Per layer kind (``csa_compress_ratios`` entry):
- ``0``: window only (keys t-W+1..t);
- ``2..127``: window + the indexer's top-k of the overlapping compressor's entries (CSA), or all visible
  entries when ``csa_dense_mode``;
- ``128``: window + all visible entries of the non-overlapping compressor (HCA);
- ``-1``: every key 0..t (full-causal MQA).
``kv_full = [raw KV (s rows) | compressed entries (s // ratio rows)]``; K = V (MQA).
"""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.config import FULL_CAUSAL_MQA, HCA_RATIO, ModelConfig
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.layers import index_tables
from fleet_ext.layers.compressor import Compressor
from fleet_ext.layers.indexer import CSAIndexer


class CompressedSparseAttention(FleetLayer):
    """q [b, s, h, d], kv [b, s, d] (+ x and the q latent for the compressor/indexer) -> [b, s, h, d]."""

    def __init__(self, config: ModelConfig, ratio: int, sparse_attn: Callable, rope_apply: Callable) -> None:
        super().__init__()
        self.ratio = ratio
        self.window = config.csa_window_size
        self.scale = config.v_head_dim**-0.5
        self._sparse_attn = sparse_attn
        self.attn_sink = self.create_parameter(
            [config.num_attention_heads], dtype="float32", default_initializer=paddle.nn.initializer.Constant(0.0)
        )
        self.compressor = Compressor(config, ratio, config.v_head_dim, rope_apply) if ratio > 1 else None
        use_indexer = 1 < ratio < HCA_RATIO and not config.csa_dense_mode
        self.indexer = CSAIndexer(config, ratio, rope_apply) if use_indexer else None

    def index_table(self, x: paddle.Tensor, q_latent: paddle.Tensor) -> paddle.Tensor:
        """[b, s, K] int32 ids into kv_full (-1 invalid)."""
        batch, seq = x.shape[0], x.shape[1]
        if self.ratio == FULL_CAUSAL_MQA:
            table = index_tables.full_causal_index_table(seq)
            return table.unsqueeze(0).expand([batch, seq, table.shape[1]])
        window = index_tables.window_index_table(seq, min(self.window, seq))
        window = window.unsqueeze(0).expand([batch, seq, window.shape[1]])
        if self.compressor is None or seq // self.ratio == 0:
            return window
        if self.indexer is not None:
            compressed = index_tables.compressed_topk_to_kv_full(self.indexer(x, q_latent), offset=seq)
        else:
            table = index_tables.all_compressed_index_table(seq, self.ratio, offset=seq)
            compressed = table.unsqueeze(0).expand([batch, seq, table.shape[1]])
        return paddle.concat([window, compressed], axis=-1)

    def forward(
        self, query: paddle.Tensor, kv: paddle.Tensor, x: paddle.Tensor, q_latent: paddle.Tensor
    ) -> paddle.Tensor:
        kv_full = kv
        if self.compressor is not None:
            kv_full = paddle.concat([kv, self.compressor(x).astype(kv.dtype)], axis=1)
        out, _ = self._sparse_attn(query, kv_full, self.index_table(x, q_latent), self.attn_sink, self.scale)
        return out
