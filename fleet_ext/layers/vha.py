"""VHA (Virtual Head Attention) linear postmix: ``O' = M O`` over the head axis, ``M = I + V U^T``.

A PaddleFleet research extension (not in the released DSv4): V starts at 0 so the map is the identity
at initialisation. The grouped variant is block-diagonal, one block per output-projection group.
"""

from __future__ import annotations

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.layer import FleetLayer


class VHAPostmix(FleetLayer):
    """Mix the heads of o [b, s, h, d] with a dense (or block-diagonal) identity-plus-low-rank matrix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads, rank = config.num_attention_heads, config.postmix_rank
        self.grouped = config.vha_postmix_grouped
        self.groups = config.o_groups if self.grouped else 1
        shape = [self.groups, heads // self.groups, rank] if self.grouped else [heads, rank]
        self.vha_postmix_U = self.create_parameter(
            shape, dtype="float32", default_initializer=paddle.nn.initializer.Normal(0.0, 0.01)
        )
        self.vha_postmix_V = self.create_parameter(
            shape, dtype="float32", default_initializer=paddle.nn.initializer.Constant(0.0)
        )

    def mixing_matrix(self) -> paddle.Tensor:
        """M = I + V U^T: [h, h], or [G, h/G, h/G] when grouped."""
        size = self.vha_postmix_U.shape[-2]
        return paddle.eye(size, dtype="float32") + paddle.matmul(
            self.vha_postmix_V, self.vha_postmix_U, transpose_y=True
        )

    def forward(self, o: paddle.Tensor) -> paddle.Tensor:
        mix = self.mixing_matrix().astype(o.dtype)
        if not self.grouped:
            return paddle.matmul(mix, o)
        batch, seq, heads, dim = o.shape
        per_group = heads // self.groups
        # [G, h/G, b*s*d] so the batched GEMM has matching batch dims (Paddle's CPU matmul backward
        # does not broadcast a 3-D matrix against 5-D activations).
        grouped = o.reshape([batch * seq, self.groups, per_group, dim]).transpose([1, 2, 0, 3])
        mixed = paddle.matmul(mix, grouped.reshape([self.groups, per_group, -1]))
        mixed = mixed.reshape([self.groups, per_group, batch * seq, dim]).transpose([2, 0, 1, 3])
        return mixed.reshape([batch, seq, heads, dim])
