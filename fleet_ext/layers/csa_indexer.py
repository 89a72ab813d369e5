"""CSA lightning indexer: picks, per query, the top-k visible compressed entries.

Score ``I[t, i] = sum_h w[t, h] * ReLU(q[t, h] . k[i]) / sqrt(d_I)`` with ``w = x W_w / sqrt(n_I)``,
``q = c_Q W_q`` (roped at t) and ``k`` from the indexer's own overlapping compressor. Entry i is visible
to query t iff ``i < floor((t + 1) / ratio)``; picks beyond the visible set come back as -1.

The indexer's inputs are detached: it never sends gradient into the backbone (its KL loss trains it).
The official code also applies a Hadamard rotation to q and k before FP4 fake-quant; without the
quantisation that rotation leaves every score unchanged (it is orthogonal), so it is omitted here.
"""

from __future__ import annotations

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.layers.compressor import Compressor, _normal
from fleet_ext.layers.index_tables import compressed_visible_count
from fleet_ext.layers.rope import RotaryTable


class CSAIndexer(FleetLayer):
    """Top-k compressed-entry selection for one CSA layer."""

    def __init__(self, config: ModelConfig, ratio: int, rope_apply) -> None:
        super().__init__()
        self.ratio = ratio
        self.n_heads = config.dsa_index_n_heads
        self.head_dim = config.dsa_index_head_dim
        self.topk = config.dsa_index_topk
        std = config.init_method_std
        self.linear_wq_b = paddle.nn.Linear(
            config.q_lora_rank, self.n_heads * self.head_dim, weight_attr=_normal(std), bias_attr=False
        )
        self.linear_weights_proj = paddle.nn.Linear(
            config.hidden_size, self.n_heads, weight_attr=_normal(std), bias_attr=False
        )
        self.compressor = Compressor(config, ratio, self.head_dim, rope_apply)
        self.rope_table = RotaryTable.for_layer(config, ratio)
        self._rope = rope_apply

    def scores(self, x: paddle.Tensor, q_latent: paddle.Tensor) -> paddle.Tensor:
        """Index scores [b, s, n_comp] before masking (fp32)."""
        batch, seq, _ = x.shape
        keys = self.compressor(x).astype("float32")  # [b, n, d_I]
        q = self.linear_wq_b(q_latent).reshape([batch, seq, self.n_heads, self.head_dim])
        cos, sin = self.rope_table.cos_sin(range(seq))
        q = self._rope(q, cos, sin).astype("float32")
        logits = paddle.matmul(q, keys.unsqueeze(1), transpose_y=True)  # [b, s, n_I, n]
        logits = paddle.nn.functional.relu(logits) * self.head_dim**-0.5
        head_weights = self.linear_weights_proj(x).astype("float32") * self.n_heads**-0.5  # [b, s, n_I]
        return (logits * head_weights.unsqueeze(-1)).sum(axis=2)

    def forward(self, x: paddle.Tensor, q_latent: paddle.Tensor) -> paddle.Tensor:
        """Compressed-entry ids [b, s, min(topk, s // ratio)] (int32), -1 where not visible."""
        x, q_latent = x.detach(), q_latent.detach()
        seq = x.shape[1]
        n_comp = seq // self.ratio
        if n_comp == 0:
            return paddle.zeros([x.shape[0], seq, 0], dtype="int32")
        with paddle.no_grad():
            scores = self.scores(x, q_latent)
            visible_count = paddle.to_tensor(compressed_visible_count(seq, self.ratio).astype("int64"))
            entry = paddle.arange(n_comp, dtype="int64")
            hidden = entry.reshape([1, 1, n_comp]) >= visible_count.reshape([1, seq, 1])
            scores = paddle.where(hidden, paddle.full_like(scores, float("-inf")), scores)
            top = paddle.topk(scores, k=min(self.topk, n_comp), axis=-1).indices
            invalid = top >= visible_count.reshape([1, seq, 1])
            return paddle.where(invalid, paddle.full_like(top, -1), top).astype("int32")
