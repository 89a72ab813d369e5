"""Multi-token prediction (MTP), as DeepSeek-V3 / V4 train it.

Depth k (1 .. ``num_nextn_predict_layers``) predicts the token k + 1 positions ahead. At position i it combines
the previous depth's hidden state (the main model's residual streams for k = 1) with the embedding of token
i + k, each RMS-normalised: ``x = e_proj(enorm(E[t_(i+k)])) + h_proj(hnorm(h_i))`` (DeepSeek-V4's split form of
V3's ``eh_proj`` over the concatenation; broadcast over the mHC streams), runs one transformer layer whose kind is
the trailing ``csa_compress_ratios`` entry ``num_hidden_layers + k - 1``, then its own mHC head and final norm
and the main model's (shared) LM head. The embedding and the LM head are the main model's; everything else is
the depth's own, named ``mtp_layers.<k-1>.*`` (FlexCheckpoint) and ``mtp.<k-1>.*`` in the official release.

Loss: cross-entropy of depth k at position i against ``labels[i + k]`` (the last k positions have no target),
averaged over the depths and weighted by ``mtp_loss_scaling_factor`` (PaddleFormers / Megatron key), attached to
the main loss's gradient (``AuxLossAutoScaler``); the returned loss stays the LM loss.
"""

from __future__ import annotations

from collections.abc import Callable

import paddle

from fleet_ext.config import FleetExtConfig
from fleet_ext.framework.layer import FleetLayer, normal_init
from fleet_ext.framework.spec import build_layer
from fleet_ext.layers.mhc import HyperHead
from fleet_ext.layers.norm import RMSNorm
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.specs.backend import BackendProvider
from fleet_ext.specs.layer_specs import decoder_layer_spec

__all__ = ["MultiTokenPredictionLayer", "shifted"]


def shifted(ids: paddle.Tensor, depth: int, fill: int | None = None) -> paddle.Tensor:
    """``ids[:, i + depth]`` at position i; the last ``depth`` positions get ``fill`` (default: the last id)."""
    batch, seq = ids.shape
    if not 0 < depth < seq:
        raise ValueError(f"shifted: need 0 < depth < sequence length {seq}, got {depth}")
    tail = ids[:, -1:].expand([batch, depth]) if fill is None else paddle.full([batch, depth], fill, ids.dtype)
    return paddle.concat([ids[:, depth:], tail], axis=1)


class MultiTokenPredictionLayer(FleetLayer):
    """One MTP depth: [b, s, (n,) D] hidden + token ids ahead -> (its hidden, its normalised head input)."""

    def __init__(self, config: FleetExtConfig, depth: int, backend: BackendProvider) -> None:
        super().__init__()
        m = config.model
        self.depth = depth
        std = m.init_method_std
        self.enorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.hnorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.e_proj = paddle.nn.Linear(m.hidden_size, m.hidden_size, weight_attr=normal_init(std), bias_attr=False)
        self.h_proj = paddle.nn.Linear(m.hidden_size, m.hidden_size, weight_attr=normal_init(std), bias_attr=False)
        # Its kind, RoPE and MoE routing are those of the trailing csa_compress_ratios entry.
        self.decoder = build_layer(decoder_layer_spec(config, m.num_hidden_layers + depth - 1, backend), config)
        self.mhc_head = HyperHead(m, backend.mhc_ops) if m.enable_hyper_connections else None
        self.final_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)

    def forward(
        self, hidden: paddle.Tensor, ids_ahead: paddle.Tensor, embed: Callable, layout: SequenceLayout
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """``hidden``: the previous depth's hidden state (streams under mHC); ``ids_ahead`` [b, s]: token i + k at
        position i. Returns this depth's hidden state and the normalised input of the shared LM head."""
        token = self.e_proj(self.enorm(embed(ids_ahead)))
        x = self.h_proj(self.hnorm(hidden))
        x = x + (token.unsqueeze(2) if self.mhc_head is not None else token)
        x = self.decoder(x, input_ids=ids_ahead, layout=layout)
        head_input = self.mhc_head(x) if self.mhc_head is not None else x
        return x, self.final_layernorm(head_input)
