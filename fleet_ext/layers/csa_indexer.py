"""CSA lightning indexer: picks, per query, the top-k visible compressed entries.

Score ``I[t, i] = sum_h w[t, h] * ReLU(q[t, h] . k[i]) / sqrt(d_I)`` with ``w = x W_w / sqrt(n_I)``,
``q = c_Q W_q`` (roped at t) and ``k`` from the indexer's own overlapping compressor. Entry i is visible
to query t iff ``i < floor((t + 1) / ratio)``, t the query's global position from the sequence layout;
picks beyond the visible set come back as -1. Under context parallelism each rank's compressor produces the
keys of its chunk's blocks; they are all-gathered in rank order, so every query scores every compressed entry
of the sequence by global position.

The indexer's inputs are detached: it never sends gradient into the backbone. Its KL loss trains it
(``CompressedSparseAttention``): the student is ``gathered_scores`` at the picks, from the same ``parts``
(q, k, w) that ``select`` ranks, so the picks and the student agree bit for bit.
The official code also applies a Hadamard rotation to q and k before FP4 fake-quant; without the
quantisation that rotation leaves every score unchanged (it is orthogonal), so it is omitted here.
"""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.layer import FleetLayer, normal_init
from fleet_ext.layer_kinds import LayerAttention
from fleet_ext.layers.compressor import Compressor
from fleet_ext.layers.dsa_indexer import gather_rows
from fleet_ext.layers.index_tables import compressed_visible_count
from fleet_ext.layers.rope import RotaryTable
from fleet_ext.parallel.cp_collectives import gather_sequence
from fleet_ext.parallel.layout import SequenceLayout


class CSAIndexer(FleetLayer):
    """Top-k compressed-entry selection for one CSA layer."""

    def __init__(self, config: ModelConfig, attention: LayerAttention, rope_apply: Callable) -> None:
        super().__init__()
        if not attention.has_csa_indexer(csa_dense_mode=False):
            raise ValueError(f"CSAIndexer: layer kind {attention.kind.value!r} has no lightning indexer (CSA only)")
        self.ratio = attention.compress_ratio
        self.n_heads = config.dsa_index_n_heads
        self.head_dim = config.dsa_index_head_dim
        self.topk = config.dsa_index_topk
        std = config.init_method_std
        self.linear_wq_b = paddle.nn.Linear(
            config.q_lora_rank, self.n_heads * self.head_dim, weight_attr=normal_init(std), bias_attr=False
        )
        self.linear_weights_proj = paddle.nn.Linear(
            config.hidden_size, self.n_heads, weight_attr=normal_init(std), bias_attr=False
        )
        self.compressor = Compressor(config, attention, self.head_dim, rope_apply)
        self.rope_table = RotaryTable.for_spec(attention.rope)
        self._rope = rope_apply

    def parts(
        self, x: paddle.Tensor, q_latent: paddle.Tensor, layout: SequenceLayout
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """The scoring inputs (fp32): q [b, s, n_I, d_I] roped at t, keys [b, n_comp, d_I] of every compressed
        entry of the sequence, head weights w [b, s, n_I] (with the ``n_I^-1/2``). Differentiable in x, q_latent
        and the indexer's parameters (callers detach the inputs)."""
        batch, seq, _ = x.shape
        keys = gather_sequence(self.compressor(x, layout), layout).astype("float32")  # [b, n, d_I]
        q = self.linear_wq_b(q_latent).reshape([batch, seq, self.n_heads, self.head_dim])
        cos, sin = self.rope_table.cos_sin(layout.positions())
        q = self._rope(q, cos, sin).astype("float32")
        head_weights = self.linear_weights_proj(x).astype("float32") * self.n_heads**-0.5  # [b, s, n_I]
        return q, keys, head_weights

    def scores(self, x: paddle.Tensor, q_latent: paddle.Tensor, layout: SequenceLayout) -> paddle.Tensor:
        """Index scores [b, s, n_comp] (every compressed entry of the sequence) before masking (fp32)."""
        return self.score_all(*self.parts(x, q_latent, layout))

    def score_all(self, q: paddle.Tensor, keys: paddle.Tensor, head_weights: paddle.Tensor) -> paddle.Tensor:
        """Scores [b, s, n_comp] of every key from ``parts``."""
        logits = paddle.matmul(q, keys.unsqueeze(1), transpose_y=True)  # [b, s, n_I, n]
        logits = paddle.nn.functional.relu(logits) * self.head_dim**-0.5
        return (logits * head_weights.unsqueeze(-1)).sum(axis=2)

    def gathered_scores(
        self, q: paddle.Tensor, keys: paddle.Tensor, head_weights: paddle.Tensor, picked: paddle.Tensor
    ) -> paddle.Tensor:
        """Scores [b, s, K] of the entries ``picked`` [b, s, K] (-1 slots hold entry 0's score: mask them); the
        KL loss's student, differentiable in the indexer's parameters."""
        chosen = gather_rows(keys, picked)  # [b, s, K, d_I]
        logits = paddle.matmul(q, chosen, transpose_y=True)  # [b, s, n_I, K]
        logits = paddle.nn.functional.relu(logits) * self.head_dim**-0.5
        return (logits * head_weights.unsqueeze(-1)).sum(axis=2)

    def select(
        self, q: paddle.Tensor, keys: paddle.Tensor, head_weights: paddle.Tensor, layout: SequenceLayout
    ) -> paddle.Tensor:
        """The top-k visible entries [b, s, min(topk, n_comp)] (int32, -1 where not visible) from ``parts``,
        without gradient (``n_comp > 0``)."""
        seq, n_comp = q.shape[1], keys.shape[1]
        with paddle.no_grad():
            scores = self.score_all(q.detach(), keys.detach(), head_weights.detach())
            visible_count = compressed_visible_count(layout, self.ratio)
            entry = paddle.arange(n_comp, dtype="int64")
            hidden = entry.reshape([1, 1, n_comp]) >= visible_count.reshape([1, seq, 1])
            scores = paddle.where(hidden, paddle.full_like(scores, float("-inf")), scores)
            top = paddle.topk(scores, k=min(self.topk, n_comp), axis=-1).indices
            invalid = top >= visible_count.reshape([1, seq, 1])
            return paddle.where(invalid, paddle.full_like(top, -1), top).astype("int32")

    def forward(self, x: paddle.Tensor, q_latent: paddle.Tensor, layout: SequenceLayout) -> paddle.Tensor:
        """Compressed-entry ids [b, s, min(topk, n_comp)] (int32), -1 where not visible."""
        x, q_latent = x.detach(), q_latent.detach()
        if layout.global_len // self.ratio == 0:
            return paddle.zeros([x.shape[0], x.shape[1], 0], dtype="int32")
        with paddle.no_grad():
            return self.select(*self.parts(x, q_latent, layout), layout)
