"""Clamped SwiGLU MLP (DSv4 shared experts and dense layers).

DSv4 clamps the SwiGLU pre-activations (gate from above, up on both sides) so that outliers in low
precision cannot blow up the product; ``swiglu_limit: 0`` switches the clamp off. The parameter
layout is Megatron's: ``linear_fc1.weight`` [D, 2F] holds ``[gate | up]`` along the output axis and
``linear_fc2.weight`` [F, D], both in Paddle's [in, out] layout, no biases.
"""

from __future__ import annotations

from typing import Any

import paddle

from fleet_ext.framework.layer import FleetLayer, normal_init
from fleet_ext.ops.moe_experts.reference import clamped_swiglu  # the routed experts' too; exported here

__all__ = ["clamped_swiglu", "check_hidden", "Linear", "SwiGLUMLP"]

_FLOAT_DTYPES = (paddle.float32, paddle.float16, paddle.bfloat16, paddle.float64)


def check_hidden(owner: str, name: str, x: Any, width: int, rank: int | None = None) -> None:
    """Raise a ValueError naming ``name`` unless ``x`` is a float tensor ending in ``width`` (of ``rank`` dims)."""
    layout = "[batch, seq, {w}]" if rank == 3 else "[tokens, {w}]" if rank == 2 else "[..., {w}]"
    want = f"{owner}: `{name}` must be {layout.format(w=width)} float"
    if not isinstance(x, paddle.Tensor):
        raise ValueError(f"{want}, got {type(x).__name__}")
    shape = list(x.shape)
    if x.dtype not in _FLOAT_DTYPES or (rank is not None and len(shape) != rank) or not shape or shape[-1] != width:
        raise ValueError(f"{want}, got {shape} {x.dtype}")


class Linear(FleetLayer):
    """Bias-free ``y = x @ weight`` with ``weight`` [in, out] (Paddle layout), Normal(0, std) init."""

    def __init__(self, in_features: int, out_features: int, std: float, dtype: str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.create_parameter(
            [in_features, out_features], dtype=dtype, default_initializer=normal_init(std)
        )

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(x, self.weight)


class SwiGLUMLP(FleetLayer):
    """``y = clamped_swiglu(x W_fc1) W_fc2``: DSv4's shared expert (F = n_shared * moe_intermediate_size)
    and dense-layer MLP (F = intermediate_size, the default)."""

    def __init__(self, config: Any, hidden_size: int | None = None, ffn_hidden_size: int | None = None) -> None:
        super().__init__()
        model = config.model
        self.hidden_size = model.hidden_size if hidden_size is None else hidden_size
        self.ffn_hidden_size = config.moe.intermediate_size if ffn_hidden_size is None else ffn_hidden_size
        for key, value in (("hidden_size", self.hidden_size), ("ffn_hidden_size", self.ffn_hidden_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SwiGLUMLP: `{key}` must be a positive integer, got {value!r}")
        self.limit = float(config.moe.swiglu_limit)
        std, dtype = model.init_method_std, model.params_dtype
        self.linear_fc1 = Linear(self.hidden_size, 2 * self.ffn_hidden_size, std, dtype)
        self.linear_fc2 = Linear(self.ffn_hidden_size, self.hidden_size, std, dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        check_hidden("SwiGLUMLP", "x", x, self.hidden_size)
        return self.linear_fc2(clamped_swiglu(self.linear_fc1(x), self.limit))
