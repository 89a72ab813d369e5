"""Rotary frequency tables for DSv4 layers (plain RoPE and YaRN with mscale forced to 1).

Window-only and full-causal layers use plain RoPE at ``rotary_base``; compressed layers (CSA/HCA)
use ``csa_compress_rotary_base`` with YaRN (or plain RoPE when their ``*_rope_type`` says so). DSv4
RoPE is a pure rotation, so the YaRN attention factor is always 1. The rotation itself lives in
``fleet_ext.ops.rope`` so a fused kernel can replace it.
"""

from __future__ import annotations

import math

import numpy as np
import paddle

from fleet_ext.config import ModelConfig


def plain_inv_freq(dim: int, base: float) -> np.ndarray:
    """``1 / base^(2i/dim)`` for the ``dim // 2`` channel pairs (float64)."""
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def yarn_inv_freq(
    dim: int, base: float, factor: float, original_max_position: int, beta_fast: float, beta_slow: float
) -> np.ndarray:
    """YaRN frequencies: interpolate the slow pairs by ``factor``, keep the fast ones (float64)."""

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    base_freq = plain_inv_freq(dim, base)
    return base_freq / factor * (1.0 - extrapolation_weight) + base_freq * extrapolation_weight


class RotaryTable:
    """cos/sin of ``position * inv_freq`` for one layer kind; shape ``[n_pos, dim // 2]`` fp32."""

    def __init__(self, inv_freq: np.ndarray) -> None:
        self.inv_freq = inv_freq

    @classmethod
    def for_layer(cls, config: ModelConfig, ratio: int) -> RotaryTable:
        """The table a layer with compress ratio ``ratio`` uses (window/full-causal vs compressed)."""
        dim = config.qk_pos_emb_head_dim
        if ratio <= 0:
            return cls(plain_inv_freq(dim, config.rotary_base))
        rope_type = config.hca_rope_type if ratio == 128 else config.csa_rope_type
        if rope_type == "rope":
            return cls(plain_inv_freq(dim, config.csa_compress_rotary_base))
        return cls(
            yarn_inv_freq(
                dim,
                config.csa_compress_rotary_base,
                config.rotary_scaling_factor,
                config.original_max_position_embeddings,
                config.beta_fast,
                config.beta_slow,
            )
        )

    def cos_sin(self, positions: np.ndarray | list[int] | range) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and sin for the given integer positions (angles formed in float64, stored fp32)."""
        angles = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        return (
            paddle.to_tensor(np.cos(angles).astype(np.float32)),
            paddle.to_tensor(np.sin(angles).astype(np.float32)),
        )
