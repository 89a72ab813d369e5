"""TransformerLayer: attention then MLP/MoE, joined by a plain residual or by mHC streams."""

from __future__ import annotations

import inspect

import paddle

from fleet_ext.config import FleetExtConfig
from fleet_ext.framework.contracts import MHCOps
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.framework.spec import LayerSpec, build_layer
from fleet_ext.layers.mhc import REFERENCE_OPS, HyperConnection
from fleet_ext.layers.norm import RMSNorm
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import maybe_checkpointed


class TransformerLayer(FleetLayer):
    """One decoder layer. Sublayers: ``self_attention`` and ``mlp`` specs (chosen by the layer spec).

    With mHC the hidden state is [b, s, n, D] (n residual streams); otherwise [b, s, D].
    """

    def __init__(
        self,
        config: FleetExtConfig,
        layer_number: int,
        sublayers: dict[str, LayerSpec],
        recompute_modules: frozenset[str] = frozenset(),
        mhc_ops: MHCOps | None = None,
    ) -> None:
        super().__init__()
        m = config.model
        self.layer_number = layer_number
        self.recompute_attention = "full_attn" in recompute_modules
        self.recompute_mhc = "mhc" in recompute_modules
        self.use_mhc = m.enable_hyper_connections
        self.input_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.self_attention = build_layer(sublayers["self_attention"], config)
        self.pre_mlp_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.mlp = build_layer(sublayers["mlp"], config)
        # Hash-routed MoE layers and -2 attention (its indexer loss mask) take the token ids; the other
        # sublayers do not. Decided once, here.
        self.mlp_routes_tokens = "input_ids" in inspect.signature(self.mlp.forward).parameters  # MoE: also the layout
        self.attention_takes_ids = "input_ids" in inspect.signature(self.self_attention.forward).parameters
        if self.use_mhc:
            self.mhc_attn = HyperConnection(m, mhc_ops)
            self.mhc_mlp = HyperConnection(m, mhc_ops)
            self.hyper_combine = (mhc_ops or REFERENCE_OPS).combine  # use_fused_mhc: the kernel (backend provider)

    def _mlp(self, x: paddle.Tensor, input_ids: paddle.Tensor | None, layout: SequenceLayout | None) -> paddle.Tensor:
        return self.mlp(x, input_ids=input_ids, layout=layout) if self.mlp_routes_tokens else self.mlp(x)

    def _attention(
        self, x: paddle.Tensor, input_ids: paddle.Tensor | None, layout: SequenceLayout | None
    ) -> paddle.Tensor:
        if self.attention_takes_ids:
            return self.self_attention(x, input_ids=input_ids, layout=layout)
        return self.self_attention(x, layout=layout)

    def forward(
        self,
        hidden_states: paddle.Tensor,
        input_ids: paddle.Tensor | None = None,
        layout: SequenceLayout | None = None,
    ) -> paddle.Tensor:
        """``layout``: the global positions this rank's tokens hold (the model builds it once per forward)."""
        if not self.use_mhc:
            attn_out = maybe_checkpointed(
                self.recompute_attention, self._attention, self.input_layernorm(hidden_states), input_ids, layout
            )
            hidden_states = hidden_states + attn_out
            return hidden_states + self._mlp(self.pre_mlp_layernorm(hidden_states), input_ids, layout)
        post, comb, collapsed = maybe_checkpointed(self.recompute_mhc, self.mhc_attn, hidden_states)
        attn_out = maybe_checkpointed(
            self.recompute_attention, self._attention, self.input_layernorm(collapsed), input_ids, layout
        )
        hidden_states = maybe_checkpointed(self.recompute_mhc, self.hyper_combine, hidden_states, attn_out, post, comb)
        post, comb, collapsed = maybe_checkpointed(self.recompute_mhc, self.mhc_mlp, hidden_states)
        mlp_out = self._mlp(self.pre_mlp_layernorm(collapsed), input_ids, layout)
        return maybe_checkpointed(self.recompute_mhc, self.hyper_combine, hidden_states, mlp_out, post, comb)
