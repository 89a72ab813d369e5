"""Layer specs of the DSv4 decoder, in the style of PaddleFleet's ``get_gpt_layer_local_spec``."""

from __future__ import annotations

from fleet_ext.config import FleetExtConfig, recompute_plan
from fleet_ext.framework.contracts import MoEOps
from fleet_ext.framework.spec import LayerSpec
from fleet_ext.layer_kinds import LayerKind, layer_attention
from fleet_ext.specs.backend import BackendProvider


def mlp_spec(
    config: FleetExtConfig, layer_number: int, recompute: frozenset[str] = frozenset(), moe_ops: MoEOps | None = None
) -> LayerSpec:
    """Dense SwiGLU for the first ``first_k_dense_replace`` layers, DeepSeekMoE (with ``moe_ops``) otherwise."""
    from fleet_ext.layers.mlp import SwiGLUMLP
    from fleet_ext.layers.moe import MoELayer

    if layer_number < config.moe.first_k_dense_replace:
        width = {"hidden_size": config.model.hidden_size, "ffn_hidden_size": config.moe.intermediate_size}
        return LayerSpec(SwiGLUMLP, params=width)
    return LayerSpec(MoELayer, params={"layer_number": layer_number, "recompute_modules": recompute, "ops": moe_ops})


def decoder_layer_spec(config: FleetExtConfig, layer_number: int, backend: BackendProvider) -> LayerSpec:
    """The TransformerLayer spec for one layer; the attention kind comes from csa_compress_ratios, the
    selective-recompute modules of this layer from the recompute plan (decided here, once)."""
    from fleet_ext.layers.dsv4_attention import DSv4HybridSelfAttention
    from fleet_ext.specs.transformer_layer import TransformerLayer

    attention_cls = DSv4HybridSelfAttention
    if layer_attention(config.model, layer_number).kind is LayerKind.HYBRID_MLA:
        # -2: MLA (dense, or absorbed latent MQA with the DSA indexer).
        from fleet_ext.layers.mla import MLASelfAttention

        attention_cls = MLASelfAttention
    recompute = recompute_plan(config).modules.get(layer_number, frozenset())
    attention = LayerSpec(
        attention_cls,
        params={"layer_number": layer_number, "ops": backend.attention_ops, "recompute_modules": recompute},
    )
    return LayerSpec(
        TransformerLayer,
        params={"layer_number": layer_number, "recompute_modules": recompute, "mhc_ops": backend.mhc_ops},
        sublayers={"self_attention": attention, "mlp": mlp_spec(config, layer_number, recompute, backend.moe_ops)},
    )
