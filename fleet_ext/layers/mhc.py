"""mHC: manifold-constrained hyper-connections (``num_residual_streams`` residual streams).

Before each sub-block the streams X [b, s, n, D] give, through one projection of their RMS-normalised
concatenation, a pre gate (collapse to the block input), a post gate (expand the block output) and a
mixing matrix made doubly stochastic by Sinkhorn-Knopp. After the block:
``X'_k = post_k * f + sum_j comb[j, k] X_j``. The final head collapses the streams with a pre gate only.
All mHC arithmetic runs in fp32.

The layers hold the parameters; the arithmetic is the ``MHCOps`` they are given (the backend provider's:
the pure-Paddle reference, ``fleet_ext.ops.mhc.reference``, or the fused kernels with ``use_fused_mhc``).
"""

from __future__ import annotations

import paddle

from fleet_ext.config import ModelConfig
from fleet_ext.framework.contracts import MHCOps
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.ops.mhc import reference
from fleet_ext.ops.mhc.reference import mhc_combine as hyper_combine
from fleet_ext.ops.mhc.reference import sinkhorn

__all__ = ["REFERENCE_OPS", "HyperConnection", "HyperHead", "hyper_combine", "sinkhorn"]

# The unfused maths: what a layer built without ops (tests, tools) uses.
REFERENCE_OPS = MHCOps(pre=reference.mhc_pre, head=reference.mhc_head, combine=reference.mhc_combine)


class HyperConnection(FleetLayer):
    """Pre/post gates and the mixing matrix for one sub-block (attention or MLP)."""

    def __init__(self, config: ModelConfig, ops: MHCOps | None = None) -> None:
        super().__init__()
        n, width = config.num_residual_streams, config.hidden_size
        self.ops = ops or REFERENCE_OPS
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
        return self.ops.pre(streams, self.fn, self.base, self.scale, self.iterations, self.eps, self.norm_eps)


class HyperHead(FleetLayer):
    """Final collapse of the streams into one hidden state (pre gate, no Sinkhorn)."""

    def __init__(self, config: ModelConfig, ops: MHCOps | None = None) -> None:
        super().__init__()
        n, width = config.num_residual_streams, config.hidden_size
        self.ops = ops or REFERENCE_OPS
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
        """streams [b, s, n, D] -> the final hidden state [b, s, D]."""
        return self.ops.head(streams, self.fn, self.base, self.scale, self.eps, self.norm_eps)
