"""Tiny model configurations shared by the tests (plain dicts of config keys, for ``load_config`` / models).

``TINY_MODEL`` has one layer of every DSv4 kind (window 0, CSA 4, HCA 128, full causal -1) at CPU-test
widths; tests change what they exercise with ``tiny_model(**overrides)``. ``TINY_HYBRID_MLA`` holds the
widths of the -2 (hybrid-MLA) layers (not the mode, ``hybrid_mla_attention``), to be merged on top.
``DEFAULT_WIDTHS_2L`` keeps the DSv4-Flash default widths with two layers and no hash layers: for tests that
resolve switches or export configs and never run a forward.
"""

from __future__ import annotations

from typing import Any

TINY_MODEL: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "q_lora_rank": 16,
    "v_head_dim": 16, "qk_pos_emb_head_dim": 8, "csa_compress_ratios": [0, 4, 128, -1], "csa_window_size": 8,
    "o_groups": 2, "o_lora_rank": 8, "dsa_index_n_heads": 2, "dsa_index_head_dim": 8, "dsa_index_topk": 3,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_n_hash_layers": 1,
    "original_max_position_embeddings": 64, "rotary_scaling_factor": 4.0, "init_method_std": 0.1,
}

TINY_HYBRID_MLA: dict[str, Any] = {
    "hybrid_mla_q_lora_rank": 12, "hybrid_mla_kv_lora_rank": 16, "hybrid_mla_qk_nope_head_dim": 8,
    "hybrid_mla_qk_rope_head_dim": 8, "hybrid_mla_v_head_dim": 8, "hybrid_mla_num_attention_heads": 4,
    "dsa_index_head_dim": 16, "dsa_index_topk": 5,
}

DEFAULT_WIDTHS_2L: dict[str, Any] = {"num_hidden_layers": 2, "csa_compress_ratios": [0, 128], "moe_n_hash_layers": 0}


def tiny_model(**overrides: Any) -> dict[str, Any]:
    """A fresh copy of ``TINY_MODEL`` with ``overrides`` applied (nested lists copied, so edits stay local)."""
    config = {k: list(v) if isinstance(v, list) else v for k, v in TINY_MODEL.items()}
    config.update(overrides)
    return config


def move_constant_inits(model: Any, rng: Any, scale: float) -> None:
    """Move every fp32 parameter a constant initialiser set (norm gains 1, sinks / biases / ape / VHA V 0) off
    that constant by ``scale`` x N(0, 1), so no gradient is trivially 0 or 1 and a comparison means something."""
    for name, tensor in model.state_dict().items():
        if str(tensor.dtype).endswith("float32") and (tensor.ndim == 1 or name.endswith((".ape", "vha_postmix_V"))):
            tensor.set_value(tensor.numpy() + scale * rng.standard_normal(tensor.shape).astype("float32"))
