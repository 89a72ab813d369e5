"""Rotary frequency tables (plain RoPE and YaRN with mscale forced to 1).

Which base and variant a layer uses is its kind's ``RopeSpec`` (``fleet_ext.layer_kinds``): window-only
and full-causal layers plain RoPE at ``rotary_base``; compressed layers (CSA/HCA)
``csa_compress_rotary_base`` with YaRN (or plain RoPE when their ``*_rope_type`` says so). DSv4
RoPE is a pure rotation, so the YaRN attention factor is always 1. The rotation itself lives in
``fleet_ext.ops.rope`` so a fused kernel can replace it.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import paddle

from fleet_ext.layer_kinds import RopeSpec


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


# Shared by every layer of a forward (layers of one kind hold equal frequencies), keyed on (frequencies, range,
# device); bounded: variable-length inference must not grow it forever.
_CACHED_TABLES = 256
_TABLES: OrderedDict[tuple[bytes, range, str], tuple[paddle.Tensor, paddle.Tensor]] = OrderedDict()
_BUILDS = [0]


def rope_cache_builds() -> int:
    """cos/sin tables built so far (host computation + host-to-device copy): a forward that builds none leaves
    it unchanged."""
    return _BUILDS[0]


def clear_rope_cache() -> None:
    """Drop every cached cos/sin table (tests that count builds start from here)."""
    _TABLES.clear()


class RotaryTable:
    """cos/sin of ``position * inv_freq`` for one layer kind; shape ``[n_pos, dim // 2]`` fp32.

    The values are the fp32 roundings of angles computed in float64 on the host (a device fp32 or
    platform-libm float64 computation would not be bit-identical to them). The tables of one range of
    positions are built once per (frequencies, range, device), moved to the device once and cached at module
    level, so every layer with the same frequencies shares them and a training step with a fixed layout
    copies nothing to the device.
    """

    def __init__(self, inv_freq: np.ndarray) -> None:
        self.inv_freq = inv_freq

    @classmethod
    def for_spec(cls, spec: RopeSpec) -> RotaryTable:
        """The table of a layer kind's RoPE (``fleet_ext.layer_kinds.layer_attention(...).rope``)."""
        if spec.rope_type == "rope":
            return cls(plain_inv_freq(spec.dim, spec.base))
        return cls(
            yarn_inv_freq(
                spec.dim, spec.base, spec.scaling_factor, spec.original_max_position, spec.beta_fast, spec.beta_slow
            )
        )

    def cos_sin(self, positions: range) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and sin for the global positions ``positions`` (a ``range``: the layout's positions, or a
        compressor's block starts), cached per (frequencies, range, device)."""
        if not isinstance(positions, range):
            raise ValueError(f"RotaryTable.cos_sin: `positions` must be a range, got {type(positions).__name__}")
        freq = np.ascontiguousarray(self.inv_freq, dtype=np.float64)
        key = (freq.tobytes(), positions, paddle.get_device())
        tables = _TABLES.get(key)
        if tables is None:
            if len(_TABLES) >= _CACHED_TABLES:
                _TABLES.popitem(last=False)
            tables = _TABLES[key] = self._build(np.arange(positions.start, positions.stop, positions.step))
            _BUILDS[0] += 1
        else:
            _TABLES.move_to_end(key)
        return tables

    def cos_sin_at(self, positions: np.ndarray | list[int]) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos and sin for arbitrary integer positions (not cached)."""
        return self._build(np.asarray(positions))

    def _build(self, positions: np.ndarray) -> tuple[paddle.Tensor, paddle.Tensor]:
        angles = positions.astype(np.float64)[:, None] * self.inv_freq[None, :]
        return (
            paddle.to_tensor(np.cos(angles).astype(np.float32)),
            paddle.to_tensor(np.sin(angles).astype(np.float32)),
        )
