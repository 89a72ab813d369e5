"""DSv4 KV compressor: gated per-channel softmax pooling of every ``ratio`` tokens into one entry.

HCA layers pool each block of ``ratio`` tokens. CSA layers overlap: each entry pools
its own block through the second half of the projected channels and the previous block through the
first half, one softmax over the ``2 * ratio`` slots per channel (the first block's "previous" slots
are empty). Entries are RMS-normalised and roped at their block's first global position (from the
sequence layout). Tokens past the last full block get no entry: the sliding window covers them. The
layer kind (``fleet_ext.layer_kinds``) says the rate, whether blocks overlap, and the RoPE.

Context parallelism: each rank compresses the blocks of its own chunk (the layout's first position is a
multiple of the rate). An overlapping compressor's first block also needs the previous block's projected
first half: it comes from the previous rank as a halo of ``ratio`` rows of kv and score (2 x ratio x head_dim
values), not the raw hidden states.
"""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.layer import FleetLayer, normal_init
from fleet_ext.layer_kinds import LayerAttention
from fleet_ext.layers.norm import RMSNorm
from fleet_ext.layers.rope import RotaryTable
from fleet_ext.parallel.cp_collectives import halo_from_previous
from fleet_ext.parallel.layout import SequenceLayout


class Compressor(FleetLayer):
    """Compress [b, s, D] hidden states into [b, s // ratio, head_dim] roped KV entries."""

    def __init__(self, config: ModelConfig, attention: LayerAttention, head_dim: int, rope_apply: Callable) -> None:
        super().__init__()
        if not attention.has_compressor:
            raise ValueError(f"Compressor: layer kind {attention.kind.value!r} has no compressor (CSA or HCA only)")
        ratio = attention.compress_ratio
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = attention.overlapping_compressor
        coff = 2 if self.overlap else 1
        self.linear_wkv = paddle.nn.Linear(
            config.hidden_size, coff * head_dim, weight_attr=normal_init(config.init_method_std), bias_attr=False
        )
        self.linear_wgate = paddle.nn.Linear(
            config.hidden_size, coff * head_dim, weight_attr=normal_init(config.init_method_std), bias_attr=False
        )
        self.ape = self.create_parameter(
            [ratio, coff * head_dim], dtype="float32", default_initializer=paddle.nn.initializer.Constant(0.0)
        )
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rope_table = RotaryTable.for_spec(attention.rope)
        self._rope = rope_apply

    def forward(self, x: paddle.Tensor, layout: SequenceLayout) -> paddle.Tensor:
        """x [b, s_local, D] at the layout's positions -> this rank's entries [b, s_local // ratio, head_dim]
        (entry i pools the layout's block ``offset / ratio + i``)."""
        batch, seq, _ = x.shape
        layout.check_input("Compressor", "x", seq)
        if layout.offset % self.ratio:
            raise ValueError(
                f"Compressor: the layout's first position {layout.offset} must be a multiple of the compression "
                f"rate {self.ratio}, so that blocks do not straddle ranks"
            )
        n_comp = seq // self.ratio
        if n_comp == 0:
            return paddle.zeros([batch, 0, self.head_dim], dtype=x.dtype)
        usable = x[:, : n_comp * self.ratio]
        kv = self.linear_wkv(usable).reshape([batch, n_comp, self.ratio, -1])
        score = self.linear_wgate(usable).reshape([batch, n_comp, self.ratio, -1]).astype("float32") + self.ape
        if self.overlap:
            kv, score = self._overlap(kv, score, layout)
        weights = paddle.nn.functional.softmax(score, axis=2).astype(kv.dtype)
        pooled = self.norm((kv * weights).sum(axis=2))
        cos, sin = self.rope_table.cos_sin(range(layout.offset, layout.offset + n_comp * self.ratio, self.ratio))
        return self._rope(pooled, cos, sin)

    def _overlap(
        self, kv: paddle.Tensor, score: paddle.Tensor, layout: SequenceLayout
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """[b, n, r, 2d] -> [b, n, 2r, d]: previous block's first half, then this block's second half.

        The block before the sequence's first is empty (kv 0, score -inf); on a shard it is the previous rank's
        last block (the first rank of the group receives the empty block)."""
        batch, n_comp, ratio, _ = kv.shape
        d = self.head_dim
        if layout.cp_size > 1:
            empty_kv = halo_from_previous(kv[:, -1:, :, :d], 1, layout)
            empty_score = halo_from_previous(score[:, -1:, :, :d], 1, layout, fill=float("-inf"))
        else:
            empty_kv = paddle.zeros([batch, 1, ratio, d], dtype=kv.dtype)
            empty_score = paddle.full([batch, 1, ratio, d], float("-inf"), dtype=score.dtype)
        prev_kv = paddle.concat([empty_kv, kv[:, : n_comp - 1, :, :d]], axis=1)
        prev_score = paddle.concat([empty_score, score[:, : n_comp - 1, :, :d]], axis=1)
        return (
            paddle.concat([prev_kv, kv[:, :, :, d:]], axis=2),
            paddle.concat([prev_score, score[:, :, :, d:]], axis=2),
        )
