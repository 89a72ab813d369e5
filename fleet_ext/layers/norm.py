"""RMS normalisations used across DSv4: weighted (learned gain) and weightless (per-head q)."""

from __future__ import annotations

import paddle

from fleet_ext.framework.layer import FleetLayer
from fleet_ext.ops.q_rms_norm.reference import rms_normalize  # the weightless norm lives in ops (layers -> ops)
from fleet_ext.ops.qkv_prologue.reference import rms_norm  # so does the weighted one (the kv prologue fuses it)

__all__ = ["RMSNorm", "rms_normalize"]


class RMSNorm(FleetLayer):
    """RMSNorm with an fp32 gain (DSv4 keeps norm weights in fp32)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter(
            [hidden_size], dtype="float32", default_initializer=paddle.nn.initializer.Constant(1.0)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return rms_norm(x, self.weight, self.eps)
