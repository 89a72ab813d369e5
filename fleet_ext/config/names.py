"""Key names from elsewhere that a YAML may carry over, each refused with a message that says what to do.

``RENAMED_KEYS``: names that PaddleFleet, Hugging Face or the official DSv4 code spell differently; the
value is the fleet_ext key (a test checks every one is a real key). ``PADDLEFLEET_ONLY_KEYS``: PaddleFleet
options (and the old names PaddleFleet itself rejects) that fleet_ext does not have at all; the value
says what the option does there.
"""

from __future__ import annotations

__all__ = ["PADDLEFLEET_ONLY_KEYS", "RENAMED_KEYS", "absent_key_message", "renamed_key_message"]

RENAMED_KEYS: dict[str, str] = {
    "compress_ratios": "csa_compress_ratios",
    "sliding_window": "csa_window_size",
    "head_dim": "v_head_dim",
    "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "rope_theta": "rotary_base",
    "compress_rope_theta": "csa_compress_rotary_base",
    "index_n_heads": "dsa_index_n_heads",
    "index_head_dim": "dsa_index_head_dim",
    "index_topk": "dsa_index_topk",
    "indexer_loss_coeff": "dsa_indexer_loss_coeff",
    "indexer_use_sparse_loss": "dsa_indexer_use_sparse_loss",
    "hc_mult": "num_residual_streams",
    "hc_sinkhorn_iters": "mhc_sinkhorn_iterations",
    "hc_eps": "mhc_eps",
    "num_hash_layers": "moe_n_hash_layers",
    "route_scale": "routed_scaling_factor",
    "score_func": "scoring_func",
    "n_activated_experts": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
    "moe_router_num_groups": "n_group",  # Megatron-core's names of DeepSeek-V3's group-limited routing
    "moe_router_group_topk": "topk_group",
    "mtp_num_layers": "num_nextn_predict_layers",
    "csa_train_indexer_only": "train_indexer_only",
    "kv_lora_rank": "hybrid_mla_kv_lora_rank",  # HF DeepSeek-V3.2 / PaddleFleet plain MLA names: -2 layers here
    "qk_nope_head_dim": "hybrid_mla_qk_nope_head_dim",
    "indexer_rope_interleave": "dsa_indexer_rotary_interleaved",
    "tp_degree": "tensor_model_parallel_size",
    "cp_degree": "context_parallel_size",
    "ep_degree": "expert_model_parallel_size",
}

_NO_PIPELINE = "fleet_ext has no pipeline parallelism"
_FRESH_INDEXER = (
    "fleet_ext's Hugging Face import loads every tensor, indexers included, and refuses a checkpoint that lacks one"
)
PADDLEFLEET_ONLY_KEYS: dict[str, str] = {
    "dw_p2p_overlap": f"PaddleFleet's old name of p2p_overlap_dw_calc, deferred weight-gradient overlap under "
    f"virtual pipeline parallelism; {_NO_PIPELINE}",
    "p2p_overlap_dw_calc": f"deferred weight-gradient overlap under virtual pipeline parallelism; {_NO_PIPELINE}",
    "csa_indexer_init_from_scratch": "PaddleFleet's old name of indexer_init_from_scratch, which keeps a fresh "
    f"indexer when loading a checkpoint that has none; {_FRESH_INDEXER}",
    "indexer_init_from_scratch": "keeps a fresh indexer when loading a checkpoint that has none; "
    f"{_FRESH_INDEXER}",
}


def renamed_key_message(key: str) -> str:
    return f"config key `{key}` was renamed: use `{RENAMED_KEYS[key]}` (fleet_ext follows PaddleFleet's names)"


def absent_key_message(key: str) -> str:
    return (
        f"config key `{key}` is a PaddleFleet option that fleet_ext does not have ({PADDLEFLEET_ONLY_KEYS[key]}): "
        "remove it"
    )
