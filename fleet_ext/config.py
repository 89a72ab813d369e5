"""One config tree for fleet_ext, read from and written to a flat training YAML.

Key names follow PaddleFleet's ``TransformerConfig`` (and Megatron-core where PaddleFleet borrows
them) so a PaddleFleet user can move a YAML across. The tree groups keys into sections; the YAML
itself is flat (PaddleFormers style), each key belonging to exactly one section. Every key carries a
help text; the README's switch table is generated from these.

Validation happens in ``__post_init__``: each error names the key, the value, what is allowed and
how to fix it. Features that are declared here but not built yet raise "not supported yet" so that
a YAML never silently asks for something that does not run.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

__all__ = [
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "RecomputeConfig",
    "CheckpointConfig",
    "FusionConfig",
    "TrainingConfig",
    "FleetExtConfig",
    "load_config",
    "RENAMED_KEYS",
    "layer_kind",
]


def _key(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field with its help text (and allowed values, where the set is closed)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _fail(key: str, value: Any, allowed: str, fix: str) -> None:
    raise ValueError(f"config key `{key}` = {value!r} is invalid: allowed {allowed}. Fix: {fix}")


def _not_yet(key: str, value: Any, what: str, fix: str) -> None:
    raise ValueError(f"config key `{key}` = {value!r}: {what} is not supported yet in fleet_ext. Fix: {fix}")


def _positive(section: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(section, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(key, value, "a positive integer", f"set `{key}` to an integer > 0")


# --------------------------------------------------------------------------------------------------
# csa_compress_ratios semantics (PaddleFleet): the per-layer attention kind.
# --------------------------------------------------------------------------------------------------
HYBRID_MLA = -2
FULL_CAUSAL_MQA = -1
WINDOW_ONLY = 0
HCA_RATIO = 128


def layer_kind(ratio: int) -> str:
    """Name of the attention kind a `csa_compress_ratios` entry selects."""
    if ratio == HYBRID_MLA:
        return "hybrid_mla"
    if ratio == FULL_CAUSAL_MQA:
        return "full_causal_mqa"
    if ratio == WINDOW_ONLY:
        return "window"
    if ratio == HCA_RATIO:
        return "hca"
    if 2 <= ratio < HCA_RATIO:
        return "csa"
    raise ValueError(
        f"config key `csa_compress_ratios` entry {ratio!r} is invalid: allowed -2 (hybrid-MLA sparse MQA), "
        "-1 (full-causal MQA), 0 (window only), 2..127 (CSA), 128 (HCA). "
        + ("Ratio 1 would compress nothing; use 0 for a window-only layer." if ratio == 1 else "Fix the entry.")
    )


@dataclass
class ModelConfig:
    """Architecture of the DSv4-hybrid causal LM (attention, RoPE, mHC)."""

    vocab_size: int = _key(129280, "Vocabulary size of the embedding and LM head.")
    hidden_size: int = _key(4096, "Model width D.")
    num_hidden_layers: int = _key(43, "Number of transformer layers (MTP layers not included).")
    num_nextn_predict_layers: int = _key(0, "MTP depth; `csa_compress_ratios` must cover these layers too.")
    num_attention_heads: int = _key(64, "Query heads n_h (all share one K=V head).")
    q_lora_rank: int = _key(1024, "Rank of the low-rank query path (wq_a -> q_norm -> wq_b).")
    v_head_dim: int = _key(512, "Width of q, k and v per head (K = V, MQA).")
    qk_pos_emb_head_dim: int = _key(64, "Trailing channels of each head that get interleaved RoPE.")
    csa_compress_ratios: list = _key(
        [0, 0, 4] + [128, 4] * 20,  # DeepSeek-V4-Flash backbone
        "Per-layer attention kind: 0 window, 2..127 CSA (overlap compressor + indexer top-k), 128 HCA, "
        "-1 full-causal MQA, -2 hybrid-MLA sparse MQA. Length = num_hidden_layers + num_nextn_predict_layers.",
    )
    csa_window_size: int = _key(128, "Sliding-window length (keys t-W+1..t) of every DSv4 layer.")
    csa_dense_mode: bool = _key(False, "CSA layers attend to all visible compressed entries (no indexer).")
    rotary_base: float = _key(10000.0, "RoPE base of window-only and full-causal layers.")
    csa_compress_rotary_base: float = _key(160000.0, "RoPE base of compressed (CSA/HCA) layers.")
    csa_rope_type: str = _key("yarn", "RoPE variant of CSA layers.", ("rope", "yarn"))
    hca_rope_type: str = _key("yarn", "RoPE variant of HCA layers.", ("rope", "yarn"))
    rotary_scaling_factor: float = _key(16.0, "YaRN scaling factor of compressed layers.")
    original_max_position_embeddings: int = _key(65536, "YaRN original context length.")
    beta_fast: float = _key(32.0, "YaRN beta_fast.")
    beta_slow: float = _key(1.0, "YaRN beta_slow.")
    mscale: float = _key(1.0, "YaRN mscale; DSv4 RoPE is a pure rotation, so only 1.0 is accepted.")
    mscale_all_dim: float = _key(0.0, "YaRN mscale_all_dim; ignored because mscale is forced to 1.")
    max_position_embeddings: int = _key(1048576, "Longest position the RoPE tables are valid for.")
    o_groups: int = _key(8, "Groups of the grouped low-rank output projection.")
    o_lora_rank: int = _key(1024, "Rank per group of the grouped output projection.")
    dsa_index_n_heads: int = _key(64, "Indexer heads (CSA lightning indexer and the DSA indexer of -2 layers).")
    dsa_index_head_dim: int = _key(128, "Indexer head width (a power of two for the DSA indexer's Hadamard).")
    dsa_index_topk: int = _key(
        512, "Entries each query keeps: compressed entries in CSA layers, tokens in -2 layers (sparse phase)."
    )
    dsa_indexer_loss_coeff: float = _key(
        0.0, "Weight of the DSA indexer KL loss of -2 layers (mqa_dsa); the CSA indexer loss is not built yet."
    )
    dsa_indexer_use_sparse_loss: bool = _key(
        False,
        "Phase of mqa_dsa -2 layers: true = sparse (forced window + indexer top-k, KL over the top-k set); "
        "false = dense warm-up (full-causal attention, KL over the whole causal set).",
    )
    dsa_indexer_force_window: bool = _key(
        True,
        "Sparse phase of -2 layers: each query also keeps its last csa_window_size keys, top-k picks among the "
        "older ones (PaddleFleet); false = top-k over all causal keys, no window (DeepSeek-V3.2).",
    )
    dsa_indexer_rotary_interleaved: bool = _key(
        False, "DSA indexer RoPE on interleaved pairs, not rotate-half (both on the leading [pe | nope] channels)."
    )
    train_indexer_only: bool = _key(
        False,
        "Indexer warm-up: every parameter but the -2 layers' DSA indexers is frozen (needs mqa_dsa, the dense "
        "phase and dsa_indexer_loss_coeff > 0).",
    )
    hybrid_mla_attention: str = _key(
        "mha",
        "Core of the -2 layers: dense MLA, latent MQA over all causal keys, or latent MQA with the DSA indexer.",
        ("mha", "mqa_full_causal", "mqa_dsa"),
    )
    hybrid_mla_q_lora_rank: int | None = _key(None, "-2 layers: query low-rank (V3.2: 1536); required with a -2 layer.")
    hybrid_mla_kv_lora_rank: int | None = _key(
        None, "-2 layers: latent KV rank = width of the MQA value (V3.2: 512); required with a -2 layer."
    )
    hybrid_mla_qk_nope_head_dim: int | None = _key(None, "-2 layers: per-head q/k channels without RoPE (V3.2: 128).")
    hybrid_mla_qk_rope_head_dim: int | None = _key(
        None, "-2 layers: per-head q/k channels with interleaved RoPE (V3.2: 64); also the DSA indexer's RoPE width."
    )
    hybrid_mla_v_head_dim: int | None = _key(None, "-2 layers: per-head value width (V3.2: 128).")
    hybrid_mla_num_attention_heads: int | None = _key(None, "-2 layers: query heads (V3.2: 128).")
    hybrid_mla_rope_type: str = _key("yarn", "RoPE variant of -2 layers (MLA and DSA indexer).", ("rope", "yarn"))
    hybrid_mla_rotary_base: float = _key(10000.0, "RoPE base of -2 layers.")
    hybrid_mla_rotary_scaling_factor: float = _key(40.0, "YaRN factor f of -2 layers (beta_fast/beta_slow shared).")
    hybrid_mla_original_max_position_embeddings: int = _key(4096, "YaRN original context length of -2 layers.")
    hybrid_mla_mscale: float = _key(
        1.0, "YaRN mscale of -2 layers: cos/sin are scaled by m(f, mscale) / m(f, mscale_all_dim) (1 when equal)."
    )
    hybrid_mla_mscale_all_dim: float = _key(
        1.0, "YaRN mscale_all_dim of -2 layers: softmax scale x (0.1 mscale_all_dim ln f + 1)^2 (V3.2); 0: none."
    )
    add_full_attention_sink_bias: bool = _key(False, "Learnable per-head attention sink in -2 layers (V3.2: none).")
    use_vha_attention: bool = _key(False, "Virtual Head Attention postmix M = I + V U^T on the attention output.")
    vha_postmix_rank: int | None = _key(None, "Rank r of the postmix; None means num_attention_heads // 4 (>= 1).")
    vha_postmix_grouped: bool = _key(False, "Block-diagonal postmix, one block per output group.")
    enable_hyper_connections: bool = _key(True, "mHC residual streams instead of a plain residual.")
    num_residual_streams: int = _key(4, "mHC streams (hc_mult).")
    mhc_sinkhorn_iterations: int = _key(20, "Sinkhorn-Knopp iterations of the mHC mixing matrix.")
    mhc_eps: float = _key(1e-6, "mHC epsilon (pre-gate floor and Sinkhorn denominators).")
    rms_norm_eps: float = _key(1e-6, "Epsilon of every RMSNorm.")
    init_method_std: float = _key(0.02, "Std of the normal initialisation of weights.")
    tie_word_embeddings: bool = _key(False, "Share the embedding and LM-head weight.")
    pad_token_id: int = _key(
        0, "Padding token id (the LM loss ignores labels = -100; -2 layers' indexer KL skips rows of this id)."
    )
    params_dtype: str = _key("float32", "Parameter dtype.", ("float32", "bfloat16", "float16"))

    def __post_init__(self) -> None:
        _positive(
            self,
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "q_lora_rank",
            "v_head_dim",
            "qk_pos_emb_head_dim",
            "csa_window_size",
            "o_groups",
            "o_lora_rank",
            "dsa_index_n_heads",
            "dsa_index_head_dim",
            "dsa_index_topk",
            "num_residual_streams",
            "mhc_sinkhorn_iterations",
            "max_position_embeddings",
            "original_max_position_embeddings",
        )
        if self.num_nextn_predict_layers != 0:
            _not_yet(
                "num_nextn_predict_layers",
                self.num_nextn_predict_layers,
                "building MTP layers",
                "set `num_nextn_predict_layers: 0` (HF imports drop the MTP weights)",
            )
        if self.qk_pos_emb_head_dim % 2 or self.qk_pos_emb_head_dim > self.v_head_dim:
            _fail(
                "qk_pos_emb_head_dim",
                self.qk_pos_emb_head_dim,
                f"an even integer <= v_head_dim ({self.v_head_dim})",
                "interleaved RoPE rotates channel pairs inside the head",
            )
        ratios = self.csa_compress_ratios
        want = self.num_hidden_layers + self.num_nextn_predict_layers
        if not isinstance(ratios, list) or len(ratios) != want:
            got = len(ratios) if isinstance(ratios, list) else type(ratios).__name__
            _fail(
                "csa_compress_ratios",
                ratios,
                f"a list of {want} integers (num_hidden_layers + num_nextn_predict_layers), got length {got}",
                "give one entry per layer",
            )
        for r in ratios:
            if not isinstance(r, int) or isinstance(r, bool):
                _fail("csa_compress_ratios", ratios, "integers only", f"replace {r!r} by an integer")
            layer_kind(r)
        has_mla = HYBRID_MLA in ratios
        if has_mla:
            self._check_hybrid_mla()
        elif self.hybrid_mla_attention != "mha":
            _fail(
                "hybrid_mla_attention",
                self.hybrid_mla_attention,
                "'mha' unless csa_compress_ratios has a -2 (hybrid-MLA) layer",
                "add a -2 entry to csa_compress_ratios or remove the key",
            )
        if self.mscale != 1.0:
            _fail("mscale", self.mscale, "1.0", "DSv4 forces YaRN mscale to 1 (RoPE stays norm-preserving)")
        for key in (
            "rotary_base",
            "csa_compress_rotary_base",
            "rotary_scaling_factor",
            "rms_norm_eps",
            "mhc_eps",
            "init_method_std",
        ):
            value = getattr(self, key)
            if not value > 0:
                _fail(key, value, "a positive number", f"set `{key}` > 0")
        if (self.num_attention_heads * self.v_head_dim) % self.o_groups:
            _fail(
                "o_groups",
                self.o_groups,
                f"a divisor of num_attention_heads * v_head_dim = {self.num_attention_heads * self.v_head_dim}",
                "pick o_groups that splits the heads evenly",
            )
        has_indexer = any(2 <= r < HCA_RATIO for r in ratios) and not self.csa_dense_mode
        if has_indexer and self.dsa_index_head_dim < self.qk_pos_emb_head_dim:
            _fail(
                "dsa_index_head_dim",
                self.dsa_index_head_dim,
                f">= qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim})",
                "the indexer ropes its trailing qk_pos_emb_head_dim channels",
            )
        if has_indexer and (self.dsa_indexer_loss_coeff or self.dsa_indexer_use_sparse_loss):
            _not_yet(
                "dsa_indexer_loss_coeff",
                self.dsa_indexer_loss_coeff,
                "training the CSA indexer with its KL loss",
                "set `dsa_indexer_loss_coeff: 0.0` and `dsa_indexer_use_sparse_loss: false` for now",
            )
        self._check_indexer_phases(has_mla, has_indexer)
        if self.vha_postmix_rank is not None and not 1 <= self.vha_postmix_rank <= self.num_attention_heads:
            _fail(
                "vha_postmix_rank",
                self.vha_postmix_rank,
                f"None or 1..num_attention_heads ({self.num_attention_heads})",
                "omit it for the default num_attention_heads // 4",
            )
        if self.use_vha_attention and self.vha_postmix_grouped and self.num_attention_heads % self.o_groups:
            _fail(
                "vha_postmix_grouped",
                True,
                f"only when num_attention_heads ({self.num_attention_heads}) divides by o_groups ({self.o_groups})",
                "use the ungrouped postmix or change o_groups",
            )
        if self.pad_token_id < 0 or self.pad_token_id >= self.vocab_size:
            _fail("pad_token_id", self.pad_token_id, f"0..vocab_size-1 ({self.vocab_size - 1})", "use a real token id")

    @property
    def postmix_rank(self) -> int:
        """Resolved VHA postmix rank (PaddleFleet default: n_h // 4, clamped to [1, n_h])."""
        if self.vha_postmix_rank is not None:
            return self.vha_postmix_rank
        return min(max(self.num_attention_heads // 4, 1), self.num_attention_heads)

    def _check_hybrid_mla(self) -> None:
        """Shapes and RoPE of -2 (hybrid-MLA) layers (PaddleFleet: positive ints whenever a -2 entry exists)."""
        for key in (
            "hybrid_mla_q_lora_rank",
            "hybrid_mla_kv_lora_rank",
            "hybrid_mla_qk_nope_head_dim",
            "hybrid_mla_qk_rope_head_dim",
            "hybrid_mla_v_head_dim",
            "hybrid_mla_num_attention_heads",
            "hybrid_mla_original_max_position_embeddings",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(
                    key,
                    value,
                    "a positive integer when csa_compress_ratios has a -2 (hybrid-MLA) layer",
                    f"set `{key}` (DeepSeek-V3.2 values are in the README's config table)",
                )
        if self.hybrid_mla_qk_rope_head_dim % 2:
            _fail(
                "hybrid_mla_qk_rope_head_dim",
                self.hybrid_mla_qk_rope_head_dim,
                "an even integer",
                "RoPE rotates channel pairs",
            )
        for key in ("hybrid_mla_rotary_base", "hybrid_mla_rotary_scaling_factor"):
            if not getattr(self, key) > 0:
                _fail(key, getattr(self, key), "a positive number", f"set `{key}` > 0")
        for key in ("hybrid_mla_mscale", "hybrid_mla_mscale_all_dim"):
            if not getattr(self, key) >= 0:
                _fail(key, getattr(self, key), "a number >= 0", "use 1.0 as DeepSeek-V3.2")

    def _check_indexer_phases(self, has_mla: bool, has_csa_indexer: bool) -> None:
        """PaddleFleet's phase rules for the DSA indexer of -2 layers (warm-up vs sparse, train_indexer_only)."""
        mqa_dsa = has_mla and self.hybrid_mla_attention == "mqa_dsa"
        coeff, sparse = self.dsa_indexer_loss_coeff, self.dsa_indexer_use_sparse_loss
        if not coeff >= 0:
            _fail("dsa_indexer_loss_coeff", coeff, "a number >= 0", "use 0.0 (off) or e.g. 1.0e-2")
        if mqa_dsa:
            width = self.dsa_index_head_dim
            if width & (width - 1):
                _fail(
                    "dsa_index_head_dim",
                    width,
                    "a power of two with hybrid_mla_attention: mqa_dsa",
                    "the DSA indexer's Hadamard transform needs 2^n channels (DeepSeek-V3.2 uses 128)",
                )
            if width < self.hybrid_mla_qk_rope_head_dim:
                _fail(
                    "dsa_index_head_dim",
                    width,
                    f">= hybrid_mla_qk_rope_head_dim ({self.hybrid_mla_qk_rope_head_dim})",
                    "the DSA indexer ropes its leading hybrid_mla_qk_rope_head_dim channels",
                )
        elif not has_csa_indexer and (coeff > 0 or sparse):
            key, value = ("dsa_indexer_loss_coeff", coeff) if coeff > 0 else ("dsa_indexer_use_sparse_loss", sparse)
            _fail(
                key,
                value,
                "0.0 / false unless an indexer exists (a -2 layer with hybrid_mla_attention: mqa_dsa)",
                "set `hybrid_mla_attention: mqa_dsa` with a -2 layer, or remove the key",
            )
        if self.train_indexer_only:
            if not mqa_dsa:
                _fail(
                    "train_indexer_only",
                    True,
                    "true only with a -2 layer under hybrid_mla_attention: mqa_dsa (the indexer it trains)",
                    "set `hybrid_mla_attention: mqa_dsa` on a model with -2 layers, or `train_indexer_only: false`",
                )
            if sparse:
                _fail(
                    "train_indexer_only",
                    True,
                    "false in the sparse phase (dsa_indexer_use_sparse_loss: true): the warm-up trains the indexer "
                    "alone on dense attention, the sparse phase trains everything",
                    "set `dsa_indexer_use_sparse_loss: false` for the warm-up or `train_indexer_only: false`",
                )
            if not coeff > 0:
                _fail(
                    "dsa_indexer_loss_coeff",
                    coeff,
                    "> 0 with train_indexer_only (the KL loss is the indexer's only training signal)",
                    "use e.g. `dsa_indexer_loss_coeff: 1.0e-2`",
                )


@dataclass
class MoEConfig:
    """DeepSeekMoE layers as in DSv4."""

    n_routed_experts: int = _key(256, "Routed experts per MoE layer.")
    n_shared_experts: int = _key(1, "Shared experts (run on every token), each moe_intermediate_size wide.")
    num_experts_per_tok: int = _key(6, "Experts each token is routed to.")
    moe_intermediate_size: int = _key(2048, "Hidden width of each routed and shared expert.")
    scoring_func: str = _key(
        "sqrtsoftplus", "Router score from the gate logits.", ("sqrtsoftplus", "sigmoid", "softmax")
    )
    norm_topk_prob: bool = _key(True, "Renormalise the selected scores to sum to 1.")
    routed_scaling_factor: float = _key(1.5, "Multiplier on the routing weights.")
    moe_n_hash_layers: int = _key(3, "The first N MoE layers route by a frozen token-id -> experts table.")
    swiglu_limit: float = _key(10.0, "Clamp of the SwiGLU gate (max) and up (both sides); 0 disables.")
    moe_router_enable_expert_bias: bool = _key(True, "Aux-loss-free balancing bias, used only for selection.")
    moe_router_bias_update_rate: float = _key(1e-3, "Step gamma of the bias update b -= gamma * sign(load - mean).")
    moe_router_load_balancing_type: str = _key("none", "Auxiliary balancing loss.", ("none", "seq_aux_loss"))
    moe_aux_loss_coeff: float = _key(1e-4, "Coefficient of the sequence-wise aux loss.")
    first_k_dense_replace: int = _key(0, "The first K layers use a dense SwiGLU MLP instead of MoE.")
    intermediate_size: int = _key(11264, "Hidden width of the dense MLP layers.")

    def __post_init__(self) -> None:
        _positive(self, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size")
        if self.num_experts_per_tok > self.n_routed_experts:
            _fail(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                f"<= n_routed_experts ({self.n_routed_experts})",
                "route to fewer experts or add experts",
            )
        for key in ("n_shared_experts", "moe_n_hash_layers", "first_k_dense_replace"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _fail(key, value, "an integer >= 0", f"set `{key}` to 0 or more")
        if self.swiglu_limit < 0:
            _fail("swiglu_limit", self.swiglu_limit, "a number >= 0 (0 = no clamp)", "use 10.0 as in DSv4")


@dataclass
class ParallelConfig:
    """Parallel layout. DSv4 attention has no tensor parallelism (as in PaddleFleet)."""

    tensor_model_parallel_size: int = _key(1, "Tensor parallelism; must be 1 for DSv4 attention.")
    pipeline_model_parallel_size: int = _key(1, "Pipeline parallelism.")
    context_parallel_size: int = _key(1, "Context parallelism over the sequence.")
    expert_model_parallel_size: int = _key(1, "Expert parallelism of the routed experts.")
    sequence_parallel: bool = _key(False, "Megatron sequence parallelism (needs tensor parallelism).")
    cp_balance_mode: str = _key(
        "contiguous_allgather",
        "CP token layout; DSv4 layers need contiguous_allgather.",
        ("contiguous_allgather", "dualchunk_allgather"),
    )

    def __post_init__(self) -> None:
        _positive(
            self,
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        )
        if self.tensor_model_parallel_size != 1:
            _fail(
                "tensor_model_parallel_size",
                self.tensor_model_parallel_size,
                "1",
                "DSv4 hybrid attention does not support tensor parallelism (as in PaddleFleet); "
                "scale with data, expert or context parallelism instead",
            )
        if self.sequence_parallel:
            _fail("sequence_parallel", True, "false", "sequence parallelism needs tensor parallelism, which DSv4 lacks")
        if self.pipeline_model_parallel_size != 1:
            _not_yet(
                "pipeline_model_parallel_size", self.pipeline_model_parallel_size, "pipeline parallelism", "set it to 1"
            )
        if self.context_parallel_size != 1:
            _not_yet(
                "context_parallel_size",
                self.context_parallel_size,
                "context parallelism",
                "set it to 1 until the CP issue lands",
            )
        if self.expert_model_parallel_size != 1:
            _not_yet(
                "expert_model_parallel_size",
                self.expert_model_parallel_size,
                "expert parallelism",
                "set it to 1 until the EP issue lands",
            )
        if self.cp_balance_mode != "contiguous_allgather":
            _fail(
                "cp_balance_mode",
                self.cp_balance_mode,
                "'contiguous_allgather' for DSv4 layers",
                "DSv4 compressors need contiguous sequence shards, as in PaddleFleet",
            )


@dataclass
class RecomputeConfig:
    """Activation recompute (Megatron names)."""

    recompute_granularity: str | None = _key(None, "None, 'full' or 'selective'.", (None, "full", "selective"))
    recompute_method: str | None = _key(None, "For full recompute: 'uniform' or 'block'.", (None, "uniform", "block"))
    recompute_num_layers: int | None = _key(None, "Layers per recompute chunk (full recompute).")
    recompute_modules: list | None = _key(None, "Modules for selective recompute, e.g. ['full_attn'].")

    def __post_init__(self) -> None:
        if self.recompute_granularity is not None:
            _not_yet(
                "recompute_granularity",
                self.recompute_granularity,
                "activation recompute",
                "leave `recompute_granularity` unset (null) until the recompute issue lands",
            )
        for key in ("recompute_method", "recompute_num_layers", "recompute_modules"):
            if getattr(self, key) is not None:
                _fail(
                    key,
                    getattr(self, key),
                    "null while recompute_granularity is null",
                    "remove the key or set recompute_granularity",
                )


@dataclass
class CheckpointConfig:
    """Checkpoint format (the saved names are always the unfused, unsharded ones)."""

    save_checkpoint_format: str = _key("flex_checkpoint", "Format of saved checkpoints.", ("flex_checkpoint",))
    load_checkpoint_format: str = _key("flex_checkpoint", "Format of loaded checkpoints.", ("flex_checkpoint",))


@dataclass
class FusionConfig:
    """Fusion switches (PaddleFleet names). All default off; a switch is either honoured or raises."""

    apply_rope_fusion: bool = _key(False, "Triton partial interleaved RoPE (forward and inverse).")
    fuse_inv_rope_into_vha_postmix: bool = _key(False, "Inverse RoPE fused into the ungrouped VHA postmix.")
    sparse_attn_global_kv_idx_remap_fusion: bool = _key(False, "Triton local -> flat-global KV index remap.")
    dsa_sink_grad_fusion: bool = _key(False, "Triton deterministic attention-sink gradient.")
    dsv4_q_rms_norm_fusion: bool = _key(False, "Triton weightless per-head q RMS norm.")
    use_fused_mhc: bool = _key(False, "Fused mHC pre/post/Sinkhorn kernels.")
    csa_sparse_attn_backend: str = _key("unfused", "Sparse attention of DSv4 layers.", ("unfused", "triton"))
    mqa_sparse_attn_backend: str = _key("unfused", "Sparse attention of -2 layers.", ("unfused", "triton"))
    mqa_sparse_attn_backward_backend: str = _key(
        "triton",
        "Backward of the triton sparse-attention backends: the deterministic (atomic-free, byte-identical run to "
        "run) Triton kernel; PaddleFleet's atomic cuDNN backward is not built.",
        ("triton",),
    )


RESUME_AUTO = "auto"
LR_SCHEDULER_TYPES = ("cosine", "linear", "constant")


@dataclass
class TrainingConfig:
    """Pretraining job (PaddleFormers/PaddleNLP trainer names): data, optimizer, schedule, logging, checkpoints."""

    output_dir: str = _key("out", "Directory of metrics.jsonl, loss.png and the checkpoint-<step>/ directories.")
    train_dataset_path: str = _key(
        "builtin",
        "Training tokens: 'builtin' (the shipped public-domain corpus, byte tokens) or a token file made by "
        "`python -m fleet_ext.training.data` (memory-mapped).",
    )
    eval_dataset_path: str | None = _key(
        None, "Held-out token file; null holds out the last eval_split_ratio of the training tokens."
    )
    eval_split_ratio: float = _key(0.05, "Share of the training tokens held out for evaluation (when no eval file).")
    max_seq_len: int = _key(256, "Tokens per packed training sequence.")
    per_device_train_batch_size: int = _key(1, "Sequences per micro-batch on each data-parallel rank.")
    per_device_eval_batch_size: int = _key(1, "Sequences per evaluation batch on each rank.")
    gradient_accumulation_steps: int = _key(1, "Micro-batches per optimizer step on each rank.")
    max_steps: int = _key(1000, "Optimizer steps to train for.")
    learning_rate: float = _key(3e-4, "Peak learning rate (after warmup).")
    min_lr: float = _key(0.0, "Learning rate at the end of the decay.")
    warmup_steps: int = _key(0, "Linear warmup steps from 0 to learning_rate.")
    lr_scheduler_type: str = _key("cosine", "Decay after warmup, down to min_lr at max_steps.", LR_SCHEDULER_TYPES)
    weight_decay: float = _key(0.0, "AdamW decoupled weight decay (not on norms, biases, sinks, position biases).")
    adam_beta1: float = _key(0.9, "AdamW beta1.")
    adam_beta2: float = _key(0.999, "AdamW beta2.")
    adam_epsilon: float = _key(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _key(1.0, "Clip gradients to this global L2 norm; 0 disables clipping.")
    seed: int = _key(42, "Seed of parameter init (same on every rank) and data order; ranks add their rank to it.")
    logging_steps: int = _key(1, "Write a metrics.jsonl record every this many steps.")
    eval_steps: int = _key(0, "Evaluate held-out perplexity every this many steps (0: only at the end).")
    eval_iters: int = _key(4, "Held-out batches per evaluation on each rank; 0 disables evaluation.")
    save_steps: int = _key(0, "Save a checkpoint every this many steps (0: only at the end).")
    save_total_limit: int | None = _key(None, "Keep at most this many checkpoints (oldest deleted first); null: all.")
    resume_from_checkpoint: str | None = _key(
        None,
        "null: start fresh (refuses an output_dir that holds checkpoints); 'auto': the newest complete "
        "checkpoint-<step> in output_dir, or fresh if there is none; or a checkpoint directory.",
    )
    bf16: bool = _key(False, "bf16 autocast, fp32 master weights (GPU only: Paddle's CPU build has no bf16 matmul).")
    disable_tqdm: bool = _key(False, "No progress bar on rank 0.")

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_seq_len",
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "max_steps",
            "logging_steps",
        )
        for key in ("warmup_steps", "eval_steps", "eval_iters", "save_steps", "seed"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _fail(key, value, "an integer >= 0", f"set `{key}` to 0 or more")
        for key in ("output_dir", "train_dataset_path"):
            if not getattr(self, key).strip():
                _fail(key, getattr(self, key), "a non-empty path", f"set `{key}`")
        if self.eval_dataset_path is not None and not self.eval_dataset_path.strip():
            _fail("eval_dataset_path", self.eval_dataset_path, "null or a token file", "use null to hold out a split")
        if not 0.0 <= self.eval_split_ratio < 0.5:
            _fail("eval_split_ratio", self.eval_split_ratio, "a number in [0, 0.5)", "use e.g. 0.05")
        if self.eval_iters and self.eval_dataset_path is None and self.eval_split_ratio == 0.0:
            _fail(
                "eval_split_ratio",
                0.0,
                "> 0 while eval_iters > 0 and eval_dataset_path is null (nothing would be held out)",
                "set eval_split_ratio (e.g. 0.05), give eval_dataset_path, or set eval_iters: 0",
            )
        if not self.learning_rate > 0:
            _fail("learning_rate", self.learning_rate, "a number > 0", "use e.g. 3.0e-4")
        if not 0.0 <= self.min_lr <= self.learning_rate:
            _fail("min_lr", self.min_lr, f"a number in [0, learning_rate = {self.learning_rate}]", "lower min_lr")
        if self.warmup_steps > self.max_steps:
            _fail("warmup_steps", self.warmup_steps, f"<= max_steps ({self.max_steps})", "shorten the warmup")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                _fail(key, getattr(self, key), "a number in [0, 1)", "use 0.9 / 0.95 / 0.999")
        if not self.adam_epsilon > 0:
            _fail("adam_epsilon", self.adam_epsilon, "a number > 0", "use 1.0e-8")
        for key in ("weight_decay", "max_grad_norm"):
            if not getattr(self, key) >= 0:
                _fail(key, getattr(self, key), "a number >= 0", f"set `{key}` to 0 to disable")
        if self.save_total_limit is not None and (
            not isinstance(self.save_total_limit, int)
            or isinstance(self.save_total_limit, bool)
            or self.save_total_limit < 1
        ):
            _fail("save_total_limit", self.save_total_limit, "null or an integer >= 1", "use null to keep all")
        if self.resume_from_checkpoint is not None and not self.resume_from_checkpoint.strip():
            _fail(
                "resume_from_checkpoint",
                self.resume_from_checkpoint,
                f"null, '{RESUME_AUTO}' or a checkpoint directory",
                "use null to start fresh",
            )


# --------------------------------------------------------------------------------------------------
# The tree, flat YAML in and out.
# --------------------------------------------------------------------------------------------------
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "moe": MoEConfig,
    "parallel": ParallelConfig,
    "recompute": RecomputeConfig,
    "checkpoint": CheckpointConfig,
    "fusion": FusionConfig,
    "training": TrainingConfig,
}

# Keys that PaddleFleet, Hugging Face or the official DSv4 code spell differently: rejected with the new name.
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
    "mtp_num_layers": "num_nextn_predict_layers",
    "csa_train_indexer_only": "train_indexer_only",
    "csa_indexer_init_from_scratch": "indexer_init_from_scratch",
    "kv_lora_rank": "hybrid_mla_kv_lora_rank",  # HF DeepSeek-V3.2 / PaddleFleet plain MLA names: -2 layers here
    "qk_nope_head_dim": "hybrid_mla_qk_nope_head_dim",
    "indexer_rope_interleave": "dsa_indexer_rotary_interleaved",
    "dw_p2p_overlap": "p2p_overlap_dw_calc",
    "tp_degree": "tensor_model_parallel_size",
    "cp_degree": "context_parallel_size",
    "ep_degree": "expert_model_parallel_size",
}

_KEY_TO_SECTION: dict[str, str] = {}
for _section, _cls in SECTIONS.items():
    for _f in fields(_cls):
        if _f.name in _KEY_TO_SECTION:  # pragma: no cover - guarded by a test as well
            raise RuntimeError(f"config key {_f.name} is declared in two sections")
        _KEY_TO_SECTION[_f.name] = _section


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Coerce YAML scalars to the declared type; raise naming the key otherwise."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if value is None:
        if optional:
            return None
        _fail(key, value, f"a value of type {getattr(base, '__name__', base)}", f"give `{key}` a value")
    if base is bool:
        if isinstance(value, bool):
            return value
        _fail(key, value, "true or false", f"write `{key}: true` or `{key}: false`")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _fail(key, value, "an integer", f"write `{key}` as an integer")
    if base is float:
        if isinstance(value, bool):
            _fail(key, value, "a number", f"write `{key}` as a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-6` as a string; shipped JSONs quote bases.
            try:
                return float(value)
            except ValueError:
                pass
        _fail(key, value, "a number", f"write `{key}` as a number, e.g. 1.0e-6")
    if base is str:
        if isinstance(value, str):
            return value
        _fail(key, value, "a string", f"quote the value of `{key}`")
    if base is list or typing.get_origin(base) is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        _fail(key, value, "a list", f"write `{key}` as a YAML list")
    return value


def _build_section(name: str, values: dict[str, Any]) -> Any:
    cls = SECTIONS[name]
    hints = _field_types(cls)
    kwargs = {}
    for key, value in values.items():
        value = _coerce(key, value, hints[key])
        choices = cls.__dataclass_fields__[key].metadata.get("choices")
        if choices is not None and value not in choices:
            _fail(key, value, f"one of {list(choices)}", f"pick one of {list(choices)}")
        kwargs[key] = value
    return cls(**kwargs)


def _check_key(key: str) -> str:
    if key in RENAMED_KEYS:
        raise ValueError(
            f"config key `{key}` was renamed: use `{RENAMED_KEYS[key]}` (fleet_ext follows PaddleFleet's names)"
        )
    if key not in _KEY_TO_SECTION:
        close = difflib.get_close_matches(key, list(_KEY_TO_SECTION), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join('`' + c + '`' for c in close)}?" if close else ""
        raise ValueError(f"unknown config key `{key}`.{hint} The keys are listed in the README's config table.")
    return _KEY_TO_SECTION[key]


@dataclass
class FleetExtConfig:
    """The whole config: one section per concern, flat keys in the YAML."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def __post_init__(self) -> None:
        m, moe = self.model, self.moe
        if moe.moe_n_hash_layers > m.num_hidden_layers:
            _fail(
                "moe_n_hash_layers",
                moe.moe_n_hash_layers,
                f"<= num_hidden_layers ({m.num_hidden_layers})",
                "lower the number of hash-routed layers",
            )
        if moe.first_k_dense_replace > m.num_hidden_layers:
            _fail(
                "first_k_dense_replace",
                moe.first_k_dense_replace,
                f"<= num_hidden_layers ({m.num_hidden_layers})",
                "lower the number of dense layers",
            )
        if moe.moe_n_hash_layers and moe.first_k_dense_replace:
            _fail(
                "first_k_dense_replace",
                moe.first_k_dense_replace,
                "0 when moe_n_hash_layers > 0 (hash-routed layers are the first MoE layers, as in DSv4)",
                "use either dense first layers or hash-routed first layers",
            )

        from fleet_ext.registry import config_errors  # no Paddle import; registry reads this config duck-typed

        for switch, value, reason, fix in config_errors(self):
            raise ValueError(f"config key `{switch}` = {value!r} can never run: {reason}. Fix: {fix}")

    # -- YAML / dict -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Flat ``{key: value}`` of every key, defaults included; ``load_config`` inverts it exactly."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    def save_yaml(self, path: str | os.PathLike) -> None:
        """Write a flat YAML with one ``### section`` comment block per section."""
        lines = []
        for name, cls in SECTIONS.items():
            lines.append(f"### {name}: {cls.__doc__.strip().splitlines()[0]}")
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                dumped = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
                lines.append(dumped[1:-1])  # drop the braces of the one-entry flow mapping
            lines.append("")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines))

    def replace(self, **overrides: Any) -> FleetExtConfig:
        """A copy with some flat keys changed (validated like a YAML)."""
        flat = self.to_dict()
        for key in overrides:
            _check_key(key)
        flat.update(overrides)
        return load_config(flat)


def load_config(source: str | os.PathLike | dict | None = None, **overrides: Any) -> FleetExtConfig:
    """Build the config from a YAML path or a dict (flat keys, or nested by section name).

    Unknown keys raise with a did-you-mean, renamed keys raise with their new name, and values are
    type-checked and validated by each section's ``__post_init__``.
    """
    raw: dict[str, Any]
    if source is None:
        raw = {}
    elif isinstance(source, dict):
        raw = dict(source)
    else:
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path!r} does not exist")
        with open(path, encoding="utf-8") as fh:
            try:
                loaded = yaml.safe_load(fh)
            except yaml.YAMLError as exc:
                raise ValueError(f"config file {path!r} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path!r} must hold a mapping of keys to values, got {type(loaded).__name__}")
        raw = loaded
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                if _check_key(sub_key) != key:
                    raise ValueError(
                        f"config key `{sub_key}` belongs to section `{_KEY_TO_SECTION[sub_key]}`, not `{key}`"
                    )
                flat[sub_key] = sub_value
        else:
            flat[key] = value
    flat.update(overrides)
    per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        per_section[_check_key(key)][key] = value
    return FleetExtConfig(**{name: _build_section(name, values) for name, values in per_section.items()})


def config_key_table() -> list[tuple[str, str, Any, str]]:
    """(section, key, default, help) for every key, in declaration order; feeds the README table."""
    rows = []
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            help_text = f.metadata["help"]
            if "choices" in f.metadata:
                help_text += " One of: " + ", ".join(str(c) for c in f.metadata["choices"]) + "."
            rows.append((name, f.name, default, help_text))
    return rows
