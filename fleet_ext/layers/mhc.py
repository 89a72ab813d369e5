"""mHC: manifold-constrained hyper-connections (``num_residual_streams`` residual streams).

Before each sub-block the streams X [b, s, n, D] give, through one projection of their RMS-normalised
concatenation, a pre gate (collapse to the block input), a post gate (expand the block output) and a
mixing matrix made doubly stochastic by Sinkhorn-Knopp. After the block:
``X'_k = post_k * f + sum_j comb[j, k] X_j``. The final head collapses the streams with a pre gate only.
All mHC arithmetic runs in fp32.
"""

from __future__ import annotations

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.layers.norm import rms_normalize


def sinkhorn(logits: paddle.Tensor, iterations: int, eps: float) -> paddle.Tensor:
    """Doubly-stochastic projection of [..., n, n] logits: row softmax, then alternate col/row normalising."""
    comb = paddle.nn.functional.softmax(logits, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(axis=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdim=True) + eps)
    return comb


class HyperConnection(FleetLayer):
    """Pre/post gates and the mixing matrix for one sub-block (attention or MLP)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n, width = config.num_residual_streams, config.hidden_size
        self.n, self.iterations = n, config.mhc_sinkhorn_iterations
        self.eps, self.norm_eps = config.mhc_eps, config.rms_norm_eps
        self.fn = self.create_parameter(
            [(2 + n) * n, n * width],
            dtype="float32",
            default_initializer=paddle.nn.initializer.Normal(0.0, config.init_method_std),
        )
        self.base = self.create_parameter(
            [(2 + n) * n], dtype="float32", default_initializer=paddle.nn.initializer.Constant(0.0)
        )
        self.scale = self.create_parameter(
            [3], dtype="float32", default_initializer=paddle.nn.initializer.Constant(1.0)
        )

    def forward(self, streams: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """streams [b, s, n, D] -> (post [b, s, n], comb [b, s, n, n], collapsed block input [b, s, D])."""
        batch, seq, n, _ = streams.shape
        flat = rms_normalize(streams.reshape([batch, seq, -1]).astype("float32"), self.norm_eps)
        mix = paddle.matmul(flat, self.fn, transpose_y=True)
        pre_w, post_w, comb_w = paddle.split(mix, [n, n, n * n], axis=-1)
        pre_b, post_b, comb_b = paddle.split(self.base, [n, n, n * n])
        pre = paddle.nn.functional.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2.0 * paddle.nn.functional.sigmoid(post_w * self.scale[1] + post_b)
        comb_logits = (comb_w * self.scale[2] + comb_b).reshape([batch, seq, n, n])
        comb = sinkhorn(comb_logits, self.iterations, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams.astype("float32")).sum(axis=2).astype(streams.dtype)
        return post, comb, collapsed


def hyper_combine(
    streams: paddle.Tensor, block_out: paddle.Tensor, post: paddle.Tensor, comb: paddle.Tensor
) -> paddle.Tensor:
    """``X'_k = post_k * f + sum_j comb[j, k] X_j`` for streams [b, s, n, D] and f [b, s, D]."""
    dtype = streams.dtype
    mixed = paddle.matmul(comb.astype(dtype), streams, transpose_x=True)
    return post.astype(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


class HyperHead(FleetLayer):
    """Final collapse of the streams into one hidden state (pre gate, no Sinkhorn)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n, width = config.num_residual_streams, config.hidden_size
        self.eps, self.norm_eps = config.mhc_eps, config.rms_norm_eps
        self.fn = self.create_parameter(
            [n, n * width],
            dtype="float32",
            default_initializer=paddle.nn.initializer.Normal(0.0, config.init_method_std),
        )
        self.base = self.create_parameter([n], dtype="float32", default_initializer=paddle.nn.initializer.Constant(0.0))
        self.scale = self.create_parameter(
            [1], dtype="float32", default_initializer=paddle.nn.initializer.Constant(1.0)
        )

    def forward(self, streams: paddle.Tensor) -> paddle.Tensor:
        batch, seq = streams.shape[0], streams.shape[1]
        flat = rms_normalize(streams.reshape([batch, seq, -1]).astype("float32"), self.norm_eps)
        pre = paddle.nn.functional.sigmoid(paddle.matmul(flat, self.fn, transpose_y=True) * self.scale + self.base)
        pre = pre + self.eps
        return (pre.unsqueeze(-1) * streams.astype("float32")).sum(axis=2).astype(streams.dtype)
