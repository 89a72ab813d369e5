"""Hugging Face DeepSeek-V4 checkpoints <-> fleet_ext ``DSv4ForCausalLM``.

A transformers DeepSeek-V4 directory holds ``config.json`` and ``*.safetensors`` with the official
DeepSeek names (``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``, ...), which
``transformers`` renames on load and back on save. This module maps those names, transposes the
torch ``[out, in]`` linear weights into Paddle's ``[in, out]`` and packs the per-expert weights into
our grouped ``weight1``/``weight2``. MTP weights (``mtp.*``) are not built and are skipped, as
transformers does.

The directory entry points (:func:`load_hf_checkpoint`, :func:`load_hf_weights`, :func:`save_hf_checkpoint`,
:func:`flat_config_from_dir`) also read and write transformers DeepSeek-V3.2 directories, whose maps are in
:mod:`fleet_ext.models.hf_dsv32`: by ``model_type`` on import, by the layer kinds (all ``-2``) on export.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from typing import Any

import numpy as np

from fleet_ext.config import TrainingConfig
from fleet_ext.layer_kinds import HCA_ENTRY, LayerKind, kinds_of

logger = logging.getLogger(__name__)

_CSA, _HCA, _SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

# Per-layer tensors: official suffix -> (our suffix, transpose?)
_LAYER_MAP: dict[str, tuple[str, bool]] = {
    "attn.wq_a.weight": ("self_attention.linear_q_down_proj.weight", True),
    "attn.q_norm.weight": ("self_attention.q_layernorm.weight", False),
    "attn.wq_b.weight": ("self_attention.linear_q_up_proj.weight", True),
    "attn.wkv.weight": ("self_attention.linear_kv_proj.weight", True),
    "attn.norm.weight": ("self_attention.kv_layernorm.weight", False),
    "attn.wo_a.weight": ("self_attention.linear_o_group_proj", False),
    "attn.wo_b.weight": ("self_attention.o_proj.weight", True),
    "attn.attn_sink": ("self_attention.core_attention.attn_sink", False),
    "attn.compressor.wkv.weight": ("self_attention.core_attention.compressor.linear_wkv.weight", True),
    "attn.compressor.wgate.weight": ("self_attention.core_attention.compressor.linear_wgate.weight", True),
    "attn.compressor.ape": ("self_attention.core_attention.compressor.ape", False),
    "attn.compressor.norm.weight": ("self_attention.core_attention.compressor.norm.weight", False),
    "attn.indexer.wq_b.weight": ("self_attention.core_attention.indexer.linear_wq_b.weight", True),
    "attn.indexer.weights_proj.weight": ("self_attention.core_attention.indexer.linear_weights_proj.weight", True),
    "attn.indexer.compressor.wkv.weight": ("self_attention.core_attention.indexer.compressor.linear_wkv.weight", True),
    "attn.indexer.compressor.wgate.weight": (
        "self_attention.core_attention.indexer.compressor.linear_wgate.weight",
        True,
    ),
    "attn.indexer.compressor.ape": ("self_attention.core_attention.indexer.compressor.ape", False),
    "attn.indexer.compressor.norm.weight": ("self_attention.core_attention.indexer.compressor.norm.weight", False),
    "attn_norm.weight": ("input_layernorm.weight", False),
    "ffn_norm.weight": ("pre_mlp_layernorm.weight", False),
    "hc_attn_fn": ("mhc_attn.fn", False),
    "hc_attn_base": ("mhc_attn.base", False),
    "hc_attn_scale": ("mhc_attn.scale", False),
    "hc_ffn_fn": ("mhc_mlp.fn", False),
    "hc_ffn_base": ("mhc_mlp.base", False),
    "hc_ffn_scale": ("mhc_mlp.scale", False),
    "ffn.gate.weight": ("mlp.router.weight", False),
    "ffn.gate.bias": ("mlp.router.expert_bias", False),
    "ffn.gate.tid2eid": ("mlp.router.tid2eid", False),
}
_GLOBAL_MAP: dict[str, tuple[str, bool]] = {
    "embed.weight": ("word_embeddings.weight", False),
    "head.weight": ("output_layer.weight", True),
    "norm.weight": ("final_layernorm.weight", False),
    "hc_head_fn": ("mhc_head.fn", False),
    "hc_head_base": ("mhc_head.base", False),
    "hc_head_scale": ("mhc_head.scale", False),
}
# Spellings transformers' save_pretrained uses for the global tensors.
_GLOBAL_ALIASES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
# MTP depth k's own tensors, ``mtp.<k>.<official>`` -> ``mtp_layers.<k>.<ours>``; its transformer layer's tensors
# follow the per-layer map (``mtp.<k>.attn.wq_a.weight`` like ``layers.<i>.attn.wq_a.weight``) under ``.decoder``.
_MTP_MAP: dict[str, tuple[str, bool]] = {
    "e_proj.weight": ("e_proj.weight", True),
    "h_proj.weight": ("h_proj.weight", True),
    "enorm.weight": ("enorm.weight", False),
    "hnorm.weight": ("hnorm.weight", False),
    "norm.weight": ("final_layernorm.weight", False),
    "hc_head_fn": ("mhc_head.fn", False),
    "hc_head_base": ("mhc_head.base", False),
    "hc_head_scale": ("mhc_head.scale", False),
}
_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.(experts\.(\d+)|shared_experts)\.(w[123])\.weight$")


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------
def _mtp_ratios(hf: dict[str, Any], n_layers: int, depth: int, rates: dict[str, int]) -> list[int]:
    """``csa_compress_ratios`` entries of the MTP layers: from ``layer_types`` or the official ``compress_ratios``
    when they cover them, else window (DeepSeek-V4's MTP layer is a window layer)."""
    types = hf.get("layer_types") or []
    if len(types) >= n_layers + depth:
        return [{_SWA: 0, _CSA: rates[_CSA], _HCA: HCA_ENTRY}[t] for t in types[n_layers : n_layers + depth]]
    legacy = hf.get("compress_ratios") or []
    if len(legacy) >= n_layers + depth:
        return [HCA_ENTRY if r == rates[_HCA] else r for r in legacy[n_layers : n_layers + depth]]
    return [0] * depth


def config_from_hf(hf: dict[str, Any], mtp_depth: int = 0) -> dict[str, Any]:
    """Flat fleet_ext config keys from a transformers ``DeepseekV4Config`` dict (config.json). ``mtp_depth``: the
    MTP depths whose weights the checkpoint holds (transformers drops them; the official release keeps them)."""
    if hf.get("model_type") != "deepseek_v4":
        raise ValueError(f"config.json: model_type must be 'deepseek_v4', got {hf.get('model_type')!r}")
    n_layers = hf["num_hidden_layers"]
    rates = {_CSA: 4, _HCA: 128, **(hf.get("compress_rates") or {})}
    layer_types = hf["layer_types"][:n_layers]
    ratios = [{_SWA: 0, _CSA: rates[_CSA], _HCA: HCA_ENTRY}[t] for t in layer_types]
    ratios += _mtp_ratios(hf, n_layers, mtp_depth, rates) if mtp_depth else []
    mlp_types = hf["mlp_layer_types"][:n_layers]
    n_hash = sum(t == "hash_moe" for t in mlp_types)
    if mlp_types[:n_hash] != ["hash_moe"] * n_hash:
        raise ValueError(f"config.json: hash_moe layers must come first in mlp_layer_types, got {mlp_types}")
    head_dim = hf["head_dim"]
    rope = hf.get("rope_parameters") or {}
    main, compress = rope.get("main", {}), rope.get("compress", {})
    rope_dim = int(head_dim * (hf.get("partial_rotary_factor") or main.get("partial_rotary_factor") or 0.125))
    compress_type = compress.get("rope_type", "default")
    if compress_type not in ("default", "yarn"):
        raise ValueError(f"config.json: compress rope_type {compress_type!r} is not supported (default or yarn)")
    if compress.get("truncate", True) is not True:
        raise ValueError("config.json: YaRN `truncate: false` is not supported")
    if (hf.get("num_nextn_predict_layers") or 0) > mtp_depth:
        logger.info("the checkpoint holds weights of %d of its %d MTP layer(s): building those", mtp_depth,
                    hf["num_nextn_predict_layers"])
    flat = {
        "num_nextn_predict_layers": mtp_depth,
        "hca_compress_ratio": rates[_HCA],  # the csa_compress_ratios entry 128 marks HCA; this is its rate
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_hidden_layers": n_layers,
        "num_attention_heads": hf["num_attention_heads"],
        "q_lora_rank": hf["q_lora_rank"],
        "v_head_dim": head_dim,
        "qk_pos_emb_head_dim": rope_dim,
        "csa_compress_ratios": ratios,
        "csa_window_size": hf["sliding_window"],
        "rotary_base": float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "csa_compress_rotary_base": float(compress.get("rope_theta", hf.get("compress_rope_theta", 160000.0))),
        "csa_rope_type": "yarn" if compress_type == "yarn" else "rope",
        "hca_rope_type": "yarn" if compress_type == "yarn" else "rope",
        "o_groups": hf["o_groups"],
        "o_lora_rank": hf["o_lora_rank"],
        "dsa_index_n_heads": hf["index_n_heads"],
        "dsa_index_head_dim": hf["index_head_dim"],
        "dsa_index_topk": hf["index_topk"],
        "enable_hyper_connections": True,
        "num_residual_streams": hf["hc_mult"],
        "mhc_sinkhorn_iterations": hf["hc_sinkhorn_iters"],
        "mhc_eps": hf["hc_eps"],
        "rms_norm_eps": hf["rms_norm_eps"],
        "init_method_std": hf.get("initializer_range", 0.02),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "pad_token_id": hf.get("pad_token_id") or 0,
        "max_position_embeddings": hf["max_position_embeddings"],
        # A training sequence cannot be longer than the model's positions (a load_config rule).
        "max_seq_len": min(TrainingConfig().max_seq_len, hf["max_position_embeddings"]),
        "n_routed_experts": hf["n_routed_experts"],
        "n_shared_experts": 1,  # transformers' shared expert is one MLP of moe_intermediate_size
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "scoring_func": hf["scoring_func"],
        "norm_topk_prob": True,  # transformers always renormalises the selected scores
        "routed_scaling_factor": hf["routed_scaling_factor"],
        "moe_n_hash_layers": n_hash,
        "swiglu_limit": hf["swiglu_limit"],
        "moe_router_enable_expert_bias": True,
    }
    if compress_type == "yarn":
        flat.update(
            rotary_scaling_factor=float(compress["factor"]),
            original_max_position_embeddings=int(compress["original_max_position_embeddings"]),
            beta_fast=float(compress.get("beta_fast") or 32),
            beta_slow=float(compress.get("beta_slow") or 1),
        )
    return flat


def _export_problems(config: Any, kinds: list[LayerKind], csa: list[int]) -> list[str]:
    """Why this config has no Hugging Face DeepSeek-V4 equivalent (empty when it has one)."""
    m, moe = config.model, config.moe
    problems = []
    if not m.enable_hyper_connections:
        problems.append("enable_hyper_connections must be true (DeepSeek-V4 always uses mHC)")
    if LayerKind.HYBRID_MLA in kinds or LayerKind.FULL_CAUSAL in kinds:
        problems.append("csa_compress_ratios -1/-2 layers have no DeepSeek-V4 equivalent")
    if len(csa) > 1:
        problems.append(f"all CSA layers must share one ratio, got {csa}")
    if m.csa_dense_mode or m.use_vha_attention:
        problems.append("csa_dense_mode and use_vha_attention have no DeepSeek-V4 equivalent")
    if moe.n_shared_experts != 1 or moe.first_k_dense_replace or not moe.norm_topk_prob or moe.n_group != 1:
        problems.append(
            "DeepSeek-V4 needs n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=true, n_group=1"
        )
    if m.csa_rope_type != m.hca_rope_type:
        problems.append("csa_rope_type and hca_rope_type must agree (one 'compress' rope in DeepSeek-V4)")
    return problems


def _compress_rope_to_hf(m: Any) -> dict[str, Any]:
    """HF ``rope_parameters['compress']`` of the compressed (CSA/HCA) layers."""
    compress: dict[str, Any] = {
        "rope_theta": m.csa_compress_rotary_base,
        "partial_rotary_factor": m.qk_pos_emb_head_dim / m.v_head_dim,
    }
    if m.csa_rope_type == "yarn":
        compress.update(
            rope_type="yarn",
            factor=m.rotary_scaling_factor,
            attention_factor=1.0,
            original_max_position_embeddings=m.original_max_position_embeddings,
            beta_fast=m.beta_fast,
            beta_slow=m.beta_slow,
        )
    else:
        compress["rope_type"] = "default"
    return compress


def config_to_hf(config: Any) -> dict[str, Any]:
    """A transformers DeepSeek-V4 ``config.json`` dict for a fleet_ext config (raises where HF has no equivalent)."""
    m, moe = config.model, config.moe
    kinds = kinds_of(m)
    csa = sorted({r for r, kind in zip(m.csa_compress_ratios, kinds) if kind is LayerKind.CSA})
    problems = _export_problems(config, kinds, csa)
    if problems:
        raise ValueError("cannot export to Hugging Face DeepSeek-V4: " + "; ".join(problems))
    hf_type = {LayerKind.WINDOW: _SWA, LayerKind.CSA: _CSA, LayerKind.HCA: _HCA}
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": m.v_head_dim,
        "q_lora_rank": m.q_lora_rank,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "n_routed_experts": moe.n_routed_experts,
        "n_shared_experts": 1,
        "scoring_func": moe.scoring_func,
        "norm_topk_prob": True,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": m.rotary_base,
        "compress_rope_theta": m.csa_compress_rotary_base,
        "layer_types": [hf_type[kind] for kind in kinds],
        "compress_rates": {_CSA: csa[0] if csa else 4, _HCA: m.hca_compress_ratio},
        "hc_mult": m.num_residual_streams,
        "hc_sinkhorn_iters": m.mhc_sinkhorn_iterations,
        "hc_eps": m.mhc_eps,
        "mlp_layer_types": ["hash_moe" if i < moe.moe_n_hash_layers else "moe" for i in range(len(kinds))],
        "swiglu_limit": moe.swiglu_limit,
        "sliding_window": m.csa_window_size,
        "o_groups": m.o_groups,
        "o_lora_rank": m.o_lora_rank,
        "index_n_heads": m.dsa_index_n_heads,
        "index_head_dim": m.dsa_index_head_dim,
        "index_topk": m.dsa_index_topk,
        "num_nextn_predict_layers": m.num_nextn_predict_layers,  # transformers skips their mtp.* weights
        "rms_norm_eps": m.rms_norm_eps,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": m.tie_word_embeddings,
        "pad_token_id": m.pad_token_id,
        "partial_rotary_factor": m.qk_pos_emb_head_dim / m.v_head_dim,
        "rope_parameters": {
            "main": {
                "rope_type": "default",
                "rope_theta": m.rotary_base,
                "partial_rotary_factor": m.qk_pos_emb_head_dim / m.v_head_dim,
            },
            "compress": _compress_rope_to_hf(m),
        },
        "dtype": "float32",
    }


# --------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------
def _official_name(key: str) -> str:
    """Normalise transformers' saved spelling to the official one (no ``model.`` prefix)."""
    if key.startswith("model."):
        key = key[len("model.") :]
    return _GLOBAL_ALIASES.get(key, key)


def hf_to_fleet_state(
    tensors: dict[str, np.ndarray], n_experts: int, n_layers: int = 0, mtp_depth: int = 0
) -> dict[str, np.ndarray]:
    """Official-name numpy tensors -> fleet_ext state-dict names and layouts. MTP depths below ``mtp_depth`` are
    kept (their transformer layer numbered ``n_layers + k`` on the way, then renamed), the others dropped."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, dict[str, np.ndarray]]] = {}
    for raw_key, value in tensors.items():
        key = _official_name(raw_key)
        mtp = _MTP_RE.match(key)
        if mtp is not None:
            depth, suffix = int(mtp.group(1)), mtp.group(2)
            if depth >= mtp_depth:
                continue
            if suffix in _MTP_MAP:
                name, transpose = _MTP_MAP[suffix]
                out[f"mtp_layers.{depth}.{name}"] = value.T if transpose else value
                continue
            key = f"layers.{n_layers + depth}.{suffix}"
        if key in _GLOBAL_MAP:
            name, transpose = _GLOBAL_MAP[key]
            out[name] = value.T if transpose else value
            continue
        match = re.match(r"^layers\.(\d+)\.(.+)$", key)
        if match is None:
            raise ValueError(f"Hugging Face checkpoint: unexpected tensor {raw_key!r}")
        layer, suffix = int(match.group(1)), match.group(2)
        expert = _EXPERT_RE.match(suffix)
        if expert is not None:
            slot = int(expert.group(2)) if expert.group(2) is not None else -1
            experts.setdefault((layer, "routed" if slot >= 0 else "shared"), {}).setdefault(slot, {})[
                expert.group(3)
            ] = value
            continue
        if suffix not in _LAYER_MAP:
            raise ValueError(f"Hugging Face checkpoint: unexpected tensor {raw_key!r}")
        name, transpose = _LAYER_MAP[suffix]
        out[f"layers.{layer}.{name}"] = value.T if transpose else value
    for (layer, kind), slots in experts.items():

        def fc1(w: dict[str, np.ndarray]) -> np.ndarray:
            return np.concatenate([w["w1"].T, w["w3"].T], axis=-1)

        if kind == "shared":
            out[f"layers.{layer}.mlp.shared_experts.linear_fc1.weight"] = fc1(slots[-1])
            out[f"layers.{layer}.mlp.shared_experts.linear_fc2.weight"] = slots[-1]["w2"].T
            continue
        if sorted(slots) != list(range(n_experts)):
            raise ValueError(
                f"Hugging Face checkpoint: layer {layer} has experts {sorted(slots)}, expected 0..{n_experts - 1}"
            )
        out[f"layers.{layer}.mlp.experts.weight1"] = np.stack([fc1(slots[e]) for e in range(n_experts)])
        out[f"layers.{layer}.mlp.experts.weight2"] = np.stack([slots[e]["w2"].T for e in range(n_experts)])
    return _rename_layers(out, {f"layers.{n_layers + k}.": f"mtp_layers.{k}.decoder." for k in range(mtp_depth)})


def _rename_layers(state: dict[str, np.ndarray], prefixes: dict[str, str]) -> dict[str, np.ndarray]:
    """``state`` with each key starting with a ``prefixes`` key re-prefixed (the MTP layers' two numberings)."""
    def rename(key: str) -> str:
        for old, new in prefixes.items():
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    return {rename(key): value for key, value in state.items()}


def fleet_to_hf_state(state: dict[str, np.ndarray], n_layers: int = 0) -> dict[str, np.ndarray]:
    """fleet_ext state-dict numpy tensors -> the names transformers' save_pretrained writes; MTP depth k's as the
    official release spells them (``mtp.<k>.*``: transformers skips them, fleet_ext reads them back)."""
    state = dict(state)
    depths = sorted({int(name.split(".")[1]) for name in state if name.startswith("mtp_layers.")})
    inverse_mtp = {ours: (theirs, t) for theirs, (ours, t) in _MTP_MAP.items()}
    out: dict[str, np.ndarray] = {}
    for k in depths:
        own = f"mtp_layers.{k}."
        for name in [n for n in state if n.startswith(own) and n[len(own) :] in inverse_mtp]:
            theirs, transpose = inverse_mtp[name[len(own) :]]
            value = state.pop(name)
            out[f"mtp.{k}.{theirs}"] = np.ascontiguousarray(value.T if transpose else value)
    state = _rename_layers(state, {f"mtp_layers.{k}.decoder.": f"layers.{n_layers + k}." for k in depths})
    layers = _fleet_layers_to_hf(state)
    return {**out, **_rename_layers(layers, {f"model.layers.{n_layers + k}.": f"mtp.{k}." for k in depths})}


def _fleet_layers_to_hf(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The main model's tensors (MTP layers renumbered as layers after the last) -> transformers' names."""
    inverse_layer = {ours: (theirs, t) for theirs, (ours, t) in _LAYER_MAP.items()}
    inverse_global = {ours: (theirs, t) for theirs, (ours, t) in _GLOBAL_MAP.items()}
    saved_global = {v: k for k, v in _GLOBAL_ALIASES.items()}
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name in inverse_global:
            theirs, transpose = inverse_global[name]
            theirs = saved_global.get(theirs, theirs)
            key = theirs if theirs == "head.weight" else f"model.{theirs}"
            out[key] = np.ascontiguousarray(value.T if transpose else value)
            continue
        match = re.match(r"^layers\.(\d+)\.(.+)$", name)
        if match is None:
            raise ValueError(f"fleet_ext state: unexpected tensor {name!r}")
        layer, suffix = match.group(1), match.group(2)
        prefix = f"model.layers.{layer}."
        if suffix in inverse_layer:
            theirs, transpose = inverse_layer[suffix]
            out[prefix + theirs] = np.ascontiguousarray(value.T if transpose else value)
        elif suffix in ("mlp.shared_experts.linear_fc1.weight", "mlp.experts.weight1"):
            half = value.shape[-1] // 2
            gate, up = value[..., :half], value[..., half:]
            if suffix.startswith("mlp.shared"):
                out[prefix + "ffn.shared_experts.w1.weight"] = np.ascontiguousarray(gate.T)
                out[prefix + "ffn.shared_experts.w3.weight"] = np.ascontiguousarray(up.T)
            else:
                for e in range(value.shape[0]):
                    out[prefix + f"ffn.experts.{e}.w1.weight"] = np.ascontiguousarray(gate[e].T)
                    out[prefix + f"ffn.experts.{e}.w3.weight"] = np.ascontiguousarray(up[e].T)
        elif suffix == "mlp.shared_experts.linear_fc2.weight":
            out[prefix + "ffn.shared_experts.w2.weight"] = np.ascontiguousarray(value.T)
        elif suffix == "mlp.experts.weight2":
            for e in range(value.shape[0]):
                out[prefix + f"ffn.experts.{e}.w2.weight"] = np.ascontiguousarray(value[e].T)
        else:
            raise ValueError(f"fleet_ext state: tensor {name!r} has no Hugging Face DeepSeek-V4 equivalent")
    return out


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint directory, as a dict."""
    path = os.fspath(path)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face checkpoint directory")
    with open(config_path, encoding="utf-8") as fh:
        return json.load(fh)


def flat_config_from_dir(path: str | os.PathLike) -> dict[str, Any]:
    """Flat fleet_ext config keys from a transformers DeepSeek-V4 or DeepSeek-V3.2 directory's config.json."""
    from fleet_ext.models import hf_dsv32

    hf = read_hf_config(path)
    if hf.get("model_type") == hf_dsv32.MODEL_TYPE:
        return hf_dsv32.config_from_hf(hf)
    if hf.get("model_type") != "deepseek_v4":
        raise ValueError(
            f"{os.fspath(path)}/config.json: model_type must be 'deepseek_v4' or '{hf_dsv32.MODEL_TYPE}', "
            f"got {hf.get('model_type')!r}"
        )
    return config_from_hf(hf, _mtp_depth_in(path, hf))


def _mtp_depth_in(path: str | os.PathLike, hf: dict[str, Any]) -> int:
    """How many MTP depths (0, 1, ..) of the config's ``num_nextn_predict_layers`` the weight files hold."""
    from safetensors import safe_open

    held = set()
    for file in glob.glob(os.path.join(os.fspath(path), "*.safetensors")):
        with safe_open(file, "np") as fh:
            held |= {int(m.group(1)) for m in map(_MTP_RE.match, fh.keys()) if m is not None}
    depth = 0
    while depth in held and depth < (hf.get("num_nextn_predict_layers") or 0):
        depth += 1
    return depth


def load_hf_weights(model, path: str | os.PathLike) -> None:
    """Copy the weights of a transformers DeepSeek-V4 / V3.2 directory into ``model`` (built for its config)."""
    from safetensors.numpy import load_file

    from fleet_ext.models import hf_dsv32

    path = os.fspath(path)
    hf = read_hf_config(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path!r} has no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(load_file(file))
    config = model.config
    if hf.get("model_type") == hf_dsv32.MODEL_TYPE:
        state = hf_dsv32.hf_to_fleet_state(tensors, config.model.num_hidden_layers, config.moe.n_routed_experts)
    else:
        m = config.model
        state = hf_to_fleet_state(tensors, config.moe.n_routed_experts, m.num_hidden_layers, m.num_nextn_predict_layers)
    if config.model.tie_word_embeddings:
        state.pop("output_layer.weight", None)
    _assign(model, state)


def load_hf_checkpoint(model_cls, path: str | os.PathLike, **overrides: Any):
    """Build ``model_cls`` from a transformers DeepSeek-V4 or V3.2 directory and load its weights."""
    from fleet_ext.config import load_config

    flat = flat_config_from_dir(path)
    flat.update(overrides)
    model = model_cls(load_config(flat))
    load_hf_weights(model, path)
    return model


def _assign(model, state: dict[str, np.ndarray]) -> None:
    """Copy numpy tensors into the model; every model tensor must be covered, shapes must match."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, tensor in own.items():
        value = state[name]
        if list(value.shape) != list(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {list(value.shape)}, the model expects {tensor.shape}"
            )
        tensor.set_value(value.astype(tensor.numpy().dtype, copy=False))


def save_hf_checkpoint(model, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors in transformers' layout: DeepSeek-V3.2 when every layer is ``-2``,
    DeepSeek-V4 otherwise."""
    from safetensors.numpy import save_file

    from fleet_ext.models import hf_dsv32

    v32 = all(kind is LayerKind.HYBRID_MLA for kind in kinds_of(model.config.model))
    hf_config = (hf_dsv32.config_to_hf if v32 else config_to_hf)(model.config)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    if model.config.model.tie_word_embeddings:
        state["output_layer.weight"] = state["word_embeddings.weight"].T
    n_layers = model.config.model.num_hidden_layers
    tensors = hf_dsv32.fleet_to_hf_state(state) if v32 else fleet_to_hf_state(state, n_layers)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf_config, fh, indent=2)
