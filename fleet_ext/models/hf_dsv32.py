"""Hugging Face DeepSeek-V3.2 checkpoints <-> fleet_ext ``DSv4ForCausalLM`` with every layer ``-2``.

A transformers ``DeepseekV32ForCausalLM`` is DeepSeek-V3's MLA with the DSA lightning indexer on every
layer, a plain residual, dense SwiGLU MLPs in the first ``first_k_dense_replace`` layers and DeepSeekMoE
after them (sigmoid scores, ``e_score_correction_bias`` for selection only, group-limited top-k over
``n_group`` groups, ``norm_topk_prob``, ``routed_scaling_factor``). In fleet_ext that is ``csa_compress_ratios``
all ``-2`` with ``hybrid_mla_attention: mqa_dsa`` in the sparse phase, top-k only (no forced window), no
sink, no mHC, ``scoring_func: sigmoid`` and ``swiglu_limit: 0`` (transformers' SwiGLU has no clamp).

This module holds the config and tensor-name maps; reading and writing directories is in
:mod:`fleet_ext.models.hf_dsv4` (one entry point for both formats). Tensor names are the ones
transformers' ``save_pretrained`` writes (``model.layers.{i}.self_attn.q_a_proj.weight``, per-expert
``mlp.experts.{e}.gate_proj.weight``); the fused ``mlp.experts.gate_up_proj`` spelling also loads.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from fleet_ext.config import TrainingConfig
from fleet_ext.layer_kinds import LayerKind, kinds_of

logger = logging.getLogger(__name__)

MODEL_TYPE = "deepseek_v32"
_ATTN = "self_attention."
_INDEXER = "self_attention.core_attention.indexer."
# Per-layer tensors: transformers' suffix (after ``model.layers.{i}.``) -> (our suffix, transpose?)
_LAYER_MAP: dict[str, tuple[str, bool]] = {
    "input_layernorm.weight": ("input_layernorm.weight", False),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", False),
    "self_attn.q_a_proj.weight": (_ATTN + "linear_q_down_proj.weight", True),
    "self_attn.q_a_layernorm.weight": (_ATTN + "q_layernorm.weight", False),
    "self_attn.q_b_proj.weight": (_ATTN + "linear_q_up_proj.weight", True),
    "self_attn.kv_a_proj_with_mqa.weight": (_ATTN + "linear_kv_down_proj.weight", True),
    "self_attn.kv_a_layernorm.weight": (_ATTN + "kv_layernorm.weight", False),
    "self_attn.kv_b_proj.weight": (_ATTN + "linear_kv_up_proj.weight", True),
    "self_attn.o_proj.weight": (_ATTN + "o_proj.weight", True),
    "self_attn.indexer.wq_b.weight": (_INDEXER + "linear_wq_b.weight", True),
    "self_attn.indexer.wk.weight": (_INDEXER + "linear_wk.weight", True),
    "self_attn.indexer.k_norm.weight": (_INDEXER + "k_norm.weight", False),
    "self_attn.indexer.k_norm.bias": (_INDEXER + "k_norm.bias", False),
    "self_attn.indexer.weights_proj.weight": (_INDEXER + "linear_weights_proj.weight", True),
    "mlp.gate.weight": ("mlp.router.weight", False),
    "mlp.gate.e_score_correction_bias": ("mlp.router.expert_bias", False),
}
_GLOBAL_MAP: dict[str, tuple[str, bool]] = {
    "model.embed_tokens.weight": ("word_embeddings.weight", False),
    "model.norm.weight": ("final_layernorm.weight", False),
    "lm_head.weight": ("output_layer.weight", True),
}
# SwiGLU blocks: transformers' prefix (after ``model.layers.{i}.``) -> ours; gate|up pack into linear_fc1.
_MLP_BLOCKS = {"mlp.": "mlp.", "mlp.shared_experts.": "mlp.shared_experts."}
_PROJ_RE = re.compile(r"^(mlp\.(?:shared_experts\.)?)(gate|up|down)_proj\.weight$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------
def _rope_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """-2 layer RoPE keys from ``rope_parameters`` (or the older ``rope_scaling`` + ``rope_theta``)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"hybrid_mla_rope_type": "rope", "hybrid_mla_rotary_base": theta}
    if kind != "yarn":
        raise ValueError(f"config.json: rope_type {kind!r} is not supported for DeepSeek-V3.2 (default or yarn)")
    if rope.get("attention_factor") is not None:
        raise ValueError("config.json: an explicit YaRN `attention_factor` is not supported (give mscale instead)")
    if rope.get("truncate", True) is not True:
        raise ValueError("config.json: YaRN `truncate: false` is not supported")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf["max_position_embeddings"] / original  # transformers' fallback
    return {
        "hybrid_mla_rope_type": "yarn",
        "hybrid_mla_rotary_base": theta,
        "hybrid_mla_rotary_scaling_factor": float(factor),
        "hybrid_mla_original_max_position_embeddings": original,
        # transformers treats a missing mscale like 0 (both scale cos/sin only when both are set): so does fleet_ext
        "hybrid_mla_mscale": float(rope.get("mscale") or 0.0),
        "hybrid_mla_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
        "beta_fast": float(rope.get("beta_fast") or 32),
        "beta_slow": float(rope.get("beta_slow") or 1),
    }


def _dense_layers(hf: dict[str, Any], n_layers: int) -> int:
    """``first_k_dense_replace`` from ``mlp_layer_types`` (dense layers must come first) or the key itself."""
    types = hf.get("mlp_layer_types")
    if types is None:
        return min(int(hf.get("first_k_dense_replace") or 0), n_layers)
    types = list(types)[:n_layers]
    n_dense = sum(t == "dense" for t in types)
    if types != ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense):
        raise ValueError(f"config.json: dense layers must come first in mlp_layer_types, got {types}")
    return n_dense


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Flat fleet_ext config keys from a transformers ``DeepseekV32Config`` dict (config.json)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json: model_type must be {MODEL_TYPE!r}, got {hf.get('model_type')!r}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"config.json: `{key}: true` is not supported (fleet_ext's projections have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act must be 'silu', got {hf.get('hidden_act')!r}")
    if hf.get("num_nextn_predict_layers"):
        logger.info("dropping %d MTP layer(s): fleet_ext does not build MTP yet", hf["num_nextn_predict_layers"])
    n_layers = hf["num_hidden_layers"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_hidden_layers": n_layers,
        "csa_compress_ratios": [-2] * n_layers,
        # transformers' V3.2 attention: latent MQA over the indexer's top-k only, no sink, no forced window.
        "hybrid_mla_attention": "mqa_dsa",
        "dsa_indexer_use_sparse_loss": True,
        "dsa_indexer_force_window": False,
        "dsa_indexer_rotary_interleaved": False,
        "add_full_attention_sink_bias": False,
        "hybrid_mla_q_lora_rank": hf["q_lora_rank"],
        "hybrid_mla_kv_lora_rank": hf["kv_lora_rank"],
        "hybrid_mla_qk_nope_head_dim": hf["qk_nope_head_dim"],
        "hybrid_mla_qk_rope_head_dim": hf["qk_rope_head_dim"],
        "hybrid_mla_v_head_dim": hf["v_head_dim"],
        "hybrid_mla_num_attention_heads": hf["num_attention_heads"],
        **_rope_keys(hf),
        "dsa_index_n_heads": hf["index_n_heads"],
        "dsa_index_head_dim": hf["index_head_dim"],
        "dsa_index_topk": hf["index_topk"],
        "enable_hyper_connections": False,
        "rms_norm_eps": hf["rms_norm_eps"],
        "init_method_std": hf.get("initializer_range", 0.02),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "pad_token_id": hf.get("pad_token_id") or 0,
        "max_position_embeddings": hf["max_position_embeddings"],
        # A training sequence cannot be longer than the model's positions (a load_config rule).
        "max_seq_len": min(TrainingConfig().max_seq_len, hf["max_position_embeddings"]),
        "n_routed_experts": hf["n_routed_experts"],
        "n_shared_experts": hf.get("n_shared_experts", 1),
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "intermediate_size": hf["intermediate_size"],
        "first_k_dense_replace": _dense_layers(hf, n_layers),
        "scoring_func": "sigmoid",  # transformers' V3.2 router always uses sigmoid scores
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "routed_scaling_factor": hf["routed_scaling_factor"],
        "n_group": hf.get("n_group", 1),
        "topk_group": hf.get("topk_group", 1),
        "moe_n_hash_layers": 0,
        "swiglu_limit": 0.0,
        "moe_router_enable_expert_bias": True,
    }


def export_problems(config: Any) -> list[str]:
    """Why this config has no transformers DeepSeek-V3.2 equivalent (empty when it has one)."""
    m, moe = config.model, config.moe
    problems = []
    if any(kind is not LayerKind.HYBRID_MLA for kind in kinds_of(m)):
        problems.append("every csa_compress_ratios entry must be -2")
    if m.hybrid_mla_attention != "mqa_dsa":
        problems.append("hybrid_mla_attention must be mqa_dsa (DeepSeek-V3.2 attends through the DSA indexer)")
    if m.dsa_indexer_force_window or m.add_full_attention_sink_bias or m.dsa_indexer_rotary_interleaved:
        problems.append(
            "dsa_indexer_force_window, add_full_attention_sink_bias and dsa_indexer_rotary_interleaved must be false"
        )
    if m.enable_hyper_connections or m.use_vha_attention:
        problems.append("enable_hyper_connections and use_vha_attention must be false")
    if moe.scoring_func != "sigmoid" or moe.swiglu_limit or moe.moe_n_hash_layers:
        problems.append("DeepSeek-V3.2 needs scoring_func=sigmoid, swiglu_limit=0, moe_n_hash_layers=0")
    if m.hybrid_mla_mscale and not m.hybrid_mla_mscale_all_dim and m.hybrid_mla_mscale != 1.0:
        problems.append("hybrid_mla_mscale must be 1 (or 0) when hybrid_mla_mscale_all_dim is 0")
    return problems


def _rope_to_hf(m: Any) -> dict[str, Any]:
    if m.hybrid_mla_rope_type == "rope":
        return {"rope_type": "default", "rope_theta": m.hybrid_mla_rotary_base}
    return {
        "rope_type": "yarn",
        "rope_theta": m.hybrid_mla_rotary_base,
        "factor": m.hybrid_mla_rotary_scaling_factor,
        "original_max_position_embeddings": m.hybrid_mla_original_max_position_embeddings,
        "mscale": m.hybrid_mla_mscale,
        "mscale_all_dim": m.hybrid_mla_mscale_all_dim,
        "beta_fast": m.beta_fast,
        "beta_slow": m.beta_slow,
    }


def config_to_hf(config: Any) -> dict[str, Any]:
    """A transformers DeepSeek-V3.2 ``config.json`` dict (raises where transformers has no equivalent)."""
    problems = export_problems(config)
    if problems:
        raise ValueError("cannot export to Hugging Face DeepSeek-V3.2: " + "; ".join(problems))
    m, moe = config.model, config.moe
    if not m.dsa_indexer_use_sparse_loss:
        logger.warning(
            "exporting a model in the DSA dense warm-up phase (dsa_indexer_use_sparse_loss: false): transformers "
            "runs the sparse phase (indexer top-k), so its logits differ from this model's"
        )
    n_layers, n_dense = m.num_hidden_layers, moe.first_k_dense_replace
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": moe.intermediate_size,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": m.hybrid_mla_num_attention_heads,
        "num_key_value_heads": m.hybrid_mla_num_attention_heads,
        "q_lora_rank": m.hybrid_mla_q_lora_rank,
        "kv_lora_rank": m.hybrid_mla_kv_lora_rank,
        "qk_nope_head_dim": m.hybrid_mla_qk_nope_head_dim,
        "qk_rope_head_dim": m.hybrid_mla_qk_rope_head_dim,
        "v_head_dim": m.hybrid_mla_v_head_dim,
        "index_n_heads": m.dsa_index_n_heads,
        "index_head_dim": m.dsa_index_head_dim,
        "index_topk": m.dsa_index_topk,
        "n_routed_experts": moe.n_routed_experts,
        "n_shared_experts": moe.n_shared_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "first_k_dense_replace": n_dense,
        "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense),
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "rope_parameters": _rope_to_hf(m),
        "rms_norm_eps": m.rms_norm_eps,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": m.tie_word_embeddings,
        "pad_token_id": m.pad_token_id,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }


# --------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------
def _fc1(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """torch ``[F, D]`` gate and up -> our packed ``[D, 2F]`` = ``[gate | up]``."""
    return np.concatenate([gate.T, up.T], axis=-1)


def _unexpected(key: str) -> ValueError:
    hint = " (FP8 block scales: dequantize the checkpoint to bf16/fp32 first)" if key.endswith("_scale_inv") else ""
    return ValueError(f"Hugging Face DeepSeek-V3.2 checkpoint: unexpected tensor {key!r}{hint}")


def _layer_tensor(out: dict, swiglu: dict, experts: dict, layer: int, suffix: str, value: np.ndarray) -> None:
    """File one ``model.layers.{layer}.{suffix}`` tensor into ``out`` or the SwiGLU / expert collections."""
    if suffix in _LAYER_MAP:
        name, transpose = _LAYER_MAP[suffix]
        out[f"layers.{layer}.{name}"] = value.T if transpose else value
    elif (match := _EXPERT_RE.match(suffix)) is not None:
        experts.setdefault(layer, {}).setdefault(int(match.group(1)), {})[match.group(2)] = value
    elif suffix == "mlp.experts.gate_up_proj":  # fused spelling: [E, 2I, D], gate rows first
        out[f"layers.{layer}.mlp.experts.weight1"] = np.ascontiguousarray(value.transpose(0, 2, 1))
    elif suffix == "mlp.experts.down_proj":  # fused spelling: [E, D, I]
        out[f"layers.{layer}.mlp.experts.weight2"] = np.ascontiguousarray(value.transpose(0, 2, 1))
    elif (match := _PROJ_RE.match(suffix)) is not None:
        swiglu.setdefault((layer, match.group(1)), {})[match.group(2)] = value
    else:
        raise _unexpected(f"model.layers.{layer}.{suffix}")


def hf_to_fleet_state(tensors: dict[str, np.ndarray], n_layers: int, n_experts: int) -> dict[str, np.ndarray]:
    """transformers-named numpy tensors -> fleet_ext state-dict names and layouts (MTP layers skipped)."""
    out: dict[str, np.ndarray] = {}
    swiglu: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    experts: dict[int, dict[int, dict[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        if key in _GLOBAL_MAP:
            name, transpose = _GLOBAL_MAP[key]
            out[name] = value.T if transpose else value
            continue
        match = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
        if match is None:
            raise _unexpected(key)
        if int(match.group(1)) >= n_layers:  # DeepSeek's MTP layer(s) follow the main layers
            continue
        _layer_tensor(out, swiglu, experts, int(match.group(1)), match.group(2), value)
    for (layer, prefix), proj in swiglu.items():
        if sorted(proj) != ["down", "gate", "up"]:
            raise ValueError(f"Hugging Face checkpoint: layer {layer} {prefix} has projections {sorted(proj)}")
        ours = f"layers.{layer}.{_MLP_BLOCKS[prefix]}"
        out[ours + "linear_fc1.weight"] = _fc1(proj["gate"], proj["up"])
        out[ours + "linear_fc2.weight"] = proj["down"].T
    for layer, slots in experts.items():
        if sorted(slots) != list(range(n_experts)):
            raise ValueError(
                f"Hugging Face checkpoint: layer {layer} has experts {sorted(slots)}, expected 0..{n_experts - 1}"
            )
        out[f"layers.{layer}.mlp.experts.weight1"] = np.stack(
            [_fc1(slots[e]["gate"], slots[e]["up"]) for e in range(n_experts)]
        )
        out[f"layers.{layer}.mlp.experts.weight2"] = np.stack([slots[e]["down"].T for e in range(n_experts)])
    return out


def _swiglu_to_hf(out: dict, prefix: str, fc1: np.ndarray, fc2: np.ndarray) -> None:
    half = fc1.shape[-1] // 2
    out[prefix + "gate_proj.weight"] = np.ascontiguousarray(fc1[:, :half].T)
    out[prefix + "up_proj.weight"] = np.ascontiguousarray(fc1[:, half:].T)
    out[prefix + "down_proj.weight"] = np.ascontiguousarray(fc2.T)


def fleet_to_hf_state(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """fleet_ext state-dict numpy tensors -> the names transformers' save_pretrained writes for DeepSeek-V3.2."""
    inverse_layer = {ours: (theirs, t) for theirs, (ours, t) in _LAYER_MAP.items()}
    inverse_global = {ours: (theirs, t) for theirs, (ours, t) in _GLOBAL_MAP.items()}
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name in inverse_global:
            theirs, transpose = inverse_global[name]
            out[theirs] = np.ascontiguousarray(value.T if transpose else value)
            continue
        match = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if match is None:
            raise ValueError(f"fleet_ext state: unexpected tensor {name!r}")
        prefix, suffix = f"model.layers.{match.group(1)}.", match.group(2)
        if suffix in inverse_layer:
            theirs, transpose = inverse_layer[suffix]
            out[prefix + theirs] = np.ascontiguousarray(value.T if transpose else value)
            if suffix == "mlp.router.weight" and name.replace("weight", "expert_bias") not in state:
                # moe_router_enable_expert_bias: false; transformers' router always has the bias: zero = none
                out[prefix + "mlp.gate.e_score_correction_bias"] = np.zeros(value.shape[0], np.float32)
        elif suffix in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
            block = suffix[: -len("linear_fc1.weight")]
            _swiglu_to_hf(out, prefix + block, value, state[name.replace("linear_fc1", "linear_fc2")])
        elif suffix == "mlp.experts.weight1":
            for e in range(value.shape[0]):
                _swiglu_to_hf(out, f"{prefix}mlp.experts.{e}.", value[e], state[name[: -1] + "2"][e])
        elif suffix not in ("mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight", "mlp.experts.weight2"):
            raise ValueError(f"fleet_ext state: tensor {name!r} has no Hugging Face DeepSeek-V3.2 equivalent")
    return out
