"""The ``model`` section: architecture of the DSv4-hybrid causal LM (attention kinds, RoPE, mHC).

The per-layer attention kind comes from ``csa_compress_ratios`` and is interpreted by the one
layer-kind table in :mod:`fleet_ext.layer_kinds`. Types and numeric domains are declared on the
fields and enforced by :func:`~fleet_ext.config.fields.check_fields`; the rule groups below relate
keys of this section to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet_ext.config.fields import (
    ABOVE_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Section,
    at_least,
    fail,
    key_field,
)
from fleet_ext.layer_kinds import LayerKind, kind_of_entry, kinds_of

__all__ = ["ModelConfig"]

_key = key_field
_BASE_FIX = "RoPE frequencies are base^(-2i/d) and YaRN divides by ln(base): use a base > 1, e.g. 10000.0"
_HYBRID_MLA_SHAPES = (
    "hybrid_mla_q_lora_rank",
    "hybrid_mla_kv_lora_rank",
    "hybrid_mla_qk_nope_head_dim",
    "hybrid_mla_qk_rope_head_dim",
    "hybrid_mla_v_head_dim",
    "hybrid_mla_num_attention_heads",
)


@dataclass
class ModelConfig(Section):
    """Architecture of the DSv4-hybrid causal LM (attention, RoPE, mHC)."""

    vocab_size: int = _key(129280, "Vocabulary size of the embedding and LM head.", domain=POSITIVE)
    hidden_size: int = _key(4096, "Model width D.", domain=POSITIVE)
    num_hidden_layers: int = _key(43, "Number of transformer layers (MTP layers not included).", domain=POSITIVE)
    num_nextn_predict_layers: int = _key(
        0, "MTP depth (DeepSeek-V4: 1); `csa_compress_ratios` must cover these layers too (trailing entries).",
        domain=NON_NEGATIVE,
    )
    mtp_loss_scaling_factor: float = _key(
        0.1, "Weight of the MTP loss (mean over the depths) added to the LM loss's gradient (PaddleFormers key).",
        domain=NON_NEGATIVE,
    )
    num_attention_heads: int = _key(64, "Query heads n_h (all share one K=V head).", domain=POSITIVE)
    q_lora_rank: int = _key(1024, "Rank of the low-rank query path (wq_a -> q_norm -> wq_b).", domain=POSITIVE)
    v_head_dim: int = _key(512, "Width of q, k and v per head (K = V, MQA).", domain=POSITIVE)
    qk_pos_emb_head_dim: int = _key(64, "Trailing channels of each head that get interleaved RoPE.", domain=POSITIVE)
    csa_compress_ratios: list = _key(
        [0, 0, 4] + [128, 4] * 20,  # DeepSeek-V4-Flash backbone
        "Per-layer attention kind: 0 window, 2..127 CSA (overlap compressor + indexer top-k), 128 HCA, "
        "-1 full-causal MQA, -2 hybrid-MLA sparse MQA. Length = num_hidden_layers + num_nextn_predict_layers.",
    )
    hca_compress_ratio: int = _key(
        128,
        "Tokens pooled into one compressed entry by HCA layers (the csa_compress_ratios entry 128 marks an HCA "
        "layer, PaddleFleet's encoding; this key is its rate).",
        domain=at_least(2),
        fix="use 128 as DeepSeek-V4",
    )
    csa_window_size: int = _key(128, "Sliding-window length (keys t-W+1..t) of every DSv4 layer.", domain=POSITIVE)
    csa_dense_mode: bool = _key(False, "CSA layers attend to all visible compressed entries (no indexer).")
    rotary_base: float = _key(
        10000.0, "RoPE base of window-only and full-causal layers.", domain=ABOVE_ONE, fix=_BASE_FIX
    )
    csa_compress_rotary_base: float = _key(
        160000.0, "RoPE base of compressed (CSA/HCA) layers.", domain=ABOVE_ONE, fix=_BASE_FIX
    )
    csa_rope_type: str = _key("yarn", "RoPE variant of CSA layers.", ("rope", "yarn"))
    hca_rope_type: str = _key("yarn", "RoPE variant of HCA layers.", ("rope", "yarn"))
    rotary_scaling_factor: float = _key(16.0, "YaRN scaling factor of compressed layers.", domain=POSITIVE)
    original_max_position_embeddings: int = _key(65536, "YaRN original context length.", domain=POSITIVE)
    beta_fast: float = _key(32.0, "YaRN beta_fast (>= beta_slow).", domain=POSITIVE)
    beta_slow: float = _key(1.0, "YaRN beta_slow.", domain=POSITIVE)
    mscale: float = _key(
        1.0, "YaRN mscale; DSv4 RoPE is a pure rotation, so only 1.0 is accepted.", domain=POSITIVE
    )
    mscale_all_dim: float = _key(
        0.0, "YaRN mscale_all_dim; ignored because mscale is forced to 1.", domain=NON_NEGATIVE
    )
    max_position_embeddings: int = _key(1048576, "Longest position the RoPE tables are valid for.", domain=POSITIVE)
    o_groups: int = _key(8, "Groups of the grouped low-rank output projection.", domain=POSITIVE)
    o_lora_rank: int = _key(1024, "Rank per group of the grouped output projection.", domain=POSITIVE)
    dsa_index_n_heads: int = _key(
        64, "Indexer heads (CSA lightning indexer and the DSA indexer of -2 layers).", domain=POSITIVE
    )
    dsa_index_head_dim: int = _key(
        128, "Indexer head width (a power of two for the DSA indexer's Hadamard).", domain=POSITIVE
    )
    dsa_index_topk: int = _key(
        512,
        "Entries each query keeps: compressed entries in CSA layers, tokens in -2 layers (sparse phase).",
        domain=POSITIVE,
    )
    dsa_indexer_loss_coeff: float = _key(
        0.0,
        "Weight of the indexer KL loss: the CSA layers' lightning indexer (over its top-k picks) and the DSA "
        "indexer of mqa_dsa -2 layers; 0 = off.",
        domain=NON_NEGATIVE,
        fix="use 0.0 (off) or e.g. 1.0e-2",
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
        "Indexer warm-up: every parameter but the indexers (CSA lightning indexers, -2 layers' DSA indexers) is "
        "frozen (needs an indexer, dsa_indexer_loss_coeff > 0 and, with mqa_dsa, the dense phase).",
    )
    hybrid_mla_attention: str = _key(
        "mha",
        "Core of the -2 layers: dense MLA, latent MQA over all causal keys, or latent MQA with the DSA indexer.",
        ("mha", "mqa_full_causal", "mqa_dsa"),
    )
    hybrid_mla_q_lora_rank: int | None = _key(
        None, "-2 layers: query low-rank (V3.2: 1536); required with a -2 layer.", domain=POSITIVE
    )
    hybrid_mla_kv_lora_rank: int | None = _key(
        None, "-2 layers: latent KV rank = width of the MQA value (V3.2: 512); required with a -2 layer.",
        domain=POSITIVE,
    )
    hybrid_mla_qk_nope_head_dim: int | None = _key(
        None, "-2 layers: per-head q/k channels without RoPE (V3.2: 128).", domain=POSITIVE
    )
    hybrid_mla_qk_rope_head_dim: int | None = _key(
        None,
        "-2 layers: per-head q/k channels with interleaved RoPE (V3.2: 64); also the DSA indexer's RoPE width.",
        domain=POSITIVE,
    )
    hybrid_mla_v_head_dim: int | None = _key(None, "-2 layers: per-head value width (V3.2: 128).", domain=POSITIVE)
    hybrid_mla_num_attention_heads: int | None = _key(None, "-2 layers: query heads (V3.2: 128).", domain=POSITIVE)
    hybrid_mla_rope_type: str = _key("yarn", "RoPE variant of -2 layers (MLA and DSA indexer).", ("rope", "yarn"))
    hybrid_mla_rotary_base: float = _key(10000.0, "RoPE base of -2 layers.", domain=ABOVE_ONE, fix=_BASE_FIX)
    hybrid_mla_rotary_scaling_factor: float = _key(
        40.0, "YaRN factor f of -2 layers (beta_fast/beta_slow shared).", domain=POSITIVE
    )
    hybrid_mla_original_max_position_embeddings: int = _key(
        4096, "YaRN original context length of -2 layers.", domain=POSITIVE
    )
    hybrid_mla_mscale: float = _key(
        1.0,
        "YaRN mscale of -2 layers: cos/sin are scaled by m(f, mscale) / m(f, mscale_all_dim) (1 when equal).",
        domain=NON_NEGATIVE,
        fix="use 1.0 as DeepSeek-V3.2",
    )
    hybrid_mla_mscale_all_dim: float = _key(
        1.0,
        "YaRN mscale_all_dim of -2 layers: softmax scale x (0.1 mscale_all_dim ln f + 1)^2 (V3.2); 0: none.",
        domain=NON_NEGATIVE,
        fix="use 1.0 as DeepSeek-V3.2",
    )
    add_full_attention_sink_bias: bool = _key(False, "Learnable per-head attention sink in -2 layers (V3.2: none).")
    use_vha_attention: bool = _key(False, "Virtual Head Attention postmix M = I + V U^T on the attention output.")
    vha_postmix_rank: int | None = _key(
        None,
        "Rank r of the postmix; None means num_attention_heads // 4 (>= 1).",
        domain=POSITIVE,
        fix="omit it for the default num_attention_heads // 4",
    )
    vha_postmix_grouped: bool = _key(False, "Block-diagonal postmix, one block per output group.")
    enable_hyper_connections: bool = _key(True, "mHC residual streams instead of a plain residual.")
    num_residual_streams: int = _key(4, "mHC streams (hc_mult).", domain=POSITIVE)
    mhc_sinkhorn_iterations: int = _key(20, "Sinkhorn-Knopp iterations of the mHC mixing matrix.", domain=POSITIVE)
    mhc_eps: float = _key(1e-6, "mHC epsilon (pre-gate floor and Sinkhorn denominators).", domain=POSITIVE)
    rms_norm_eps: float = _key(1e-6, "Epsilon of every RMSNorm.", domain=POSITIVE)
    init_method_std: float = _key(0.02, "Std of the normal initialisation of weights.", domain=POSITIVE)
    tie_word_embeddings: bool = _key(False, "Share the embedding and LM-head weight.")
    pad_token_id: int = _key(
        0,
        "Padding token id (the LM loss ignores labels = -100; the indexer KL of CSA and -2 layers skips rows of "
        "this id).",
        domain=NON_NEGATIVE,
        fix="use a real token id",
    )
    params_dtype: str = _key(
        "float32",
        "Parameter dtype. Only float32: the model keeps fp32 master weights (and optimizer state); bf16 compute "
        "is `bf16: true` (GPU).",
        ("float32",),
        fix="set `params_dtype: float32` (and `bf16: true` on GPU for bf16 compute)",
    )

    def validate(self) -> None:
        """The rule groups, in the order a reader checks a new YAML: layers, shapes, RoPE, indexers."""
        self._check_layer_list()
        kinds = kinds_of(self)
        has_mla = LayerKind.HYBRID_MLA in kinds
        if has_mla:
            self._check_hybrid_mla()
        elif self.hybrid_mla_attention != "mha":
            fail(
                "hybrid_mla_attention",
                self.hybrid_mla_attention,
                "'mha' unless csa_compress_ratios has a -2 (hybrid-MLA) layer",
                "add a -2 entry to csa_compress_ratios or remove the key",
            )
        self._check_rope()
        self._check_head_shapes()
        has_csa_indexer = LayerKind.CSA in kinds and not self.csa_dense_mode
        self._check_csa_indexer(has_csa_indexer)
        self._check_indexer_phases(has_mla, has_csa_indexer)
        self._check_vha()
        if self.pad_token_id >= self.vocab_size:
            fail("pad_token_id", self.pad_token_id, f"0..vocab_size-1 ({self.vocab_size - 1})", "use a real token id")

    @property
    def postmix_rank(self) -> int:
        """Resolved VHA postmix rank (PaddleFleet default: n_h // 4, clamped to [1, n_h])."""
        if self.vha_postmix_rank is not None:
            return self.vha_postmix_rank
        return min(max(self.num_attention_heads // 4, 1), self.num_attention_heads)

    def _check_layer_list(self) -> None:
        """One known ``csa_compress_ratios`` entry per layer, MTP layers included (trailing)."""
        ratios = self.csa_compress_ratios
        want = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(ratios) != want:
            fail(
                "csa_compress_ratios",
                ratios,
                f"a list of {want} integers (num_hidden_layers + num_nextn_predict_layers), got length {len(ratios)}",
                "give one entry per layer",
            )
        for r in ratios:
            if not isinstance(r, int) or isinstance(r, bool):
                fail("csa_compress_ratios", ratios, "integers only", f"replace {r!r} by an integer")
            kind_of_entry(r)

    def _check_head_shapes(self) -> None:
        """Head widths that RoPE and the grouped output projection split."""
        if self.qk_pos_emb_head_dim % 2 or self.qk_pos_emb_head_dim > self.v_head_dim:
            fail(
                "qk_pos_emb_head_dim",
                self.qk_pos_emb_head_dim,
                f"an even integer <= v_head_dim ({self.v_head_dim})",
                "interleaved RoPE rotates channel pairs inside the head",
            )
        width = self.num_attention_heads * self.v_head_dim
        if width % self.o_groups:
            fail(
                "o_groups",
                self.o_groups,
                f"a divisor of num_attention_heads * v_head_dim = {width}",
                "pick o_groups that splits the heads evenly",
            )

    def _check_rope(self) -> None:
        """YaRN settings that DSv4 pins, and the order of the two YaRN ramp ends."""
        if self.mscale != 1.0:
            fail("mscale", self.mscale, "1.0", "DSv4 forces YaRN mscale to 1 (RoPE stays norm-preserving)")
        if self.beta_slow > self.beta_fast:
            fail(
                "beta_slow",
                self.beta_slow,
                f"<= beta_fast ({self.beta_fast}): YaRN keeps pairs faster than beta_fast rotations and "
                "interpolates those slower than beta_slow",
                "use beta_fast: 32.0 and beta_slow: 1.0 as DeepSeek-V4",
            )

    def _check_hybrid_mla(self) -> None:
        """Shapes of -2 (hybrid-MLA) layers (PaddleFleet: positive ints whenever a -2 entry exists)."""
        for key in _HYBRID_MLA_SHAPES:
            if getattr(self, key) is None:
                fail(
                    key,
                    None,
                    "a positive integer when csa_compress_ratios has a -2 (hybrid-MLA) layer",
                    f"set `{key}` (DeepSeek-V3.2 values are in the README's config table)",
                )
        if self.hybrid_mla_qk_rope_head_dim % 2:
            fail(
                "hybrid_mla_qk_rope_head_dim",
                self.hybrid_mla_qk_rope_head_dim,
                "an even integer",
                "RoPE rotates channel pairs",
            )

    def _check_csa_indexer(self, has_csa_indexer: bool) -> None:
        """The CSA lightning indexer ropes its trailing channels."""
        if not has_csa_indexer:
            return
        if self.dsa_index_head_dim < self.qk_pos_emb_head_dim:
            fail(
                "dsa_index_head_dim",
                self.dsa_index_head_dim,
                f">= qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim})",
                "the indexer ropes its trailing qk_pos_emb_head_dim channels",
            )

    def _check_dsa_index_width(self) -> None:
        """The DSA indexer of mqa_dsa -2 layers: Hadamard over 2^n channels, RoPE on the leading ones."""
        width = self.dsa_index_head_dim
        if width & (width - 1):
            fail(
                "dsa_index_head_dim",
                width,
                "a power of two with hybrid_mla_attention: mqa_dsa",
                "the DSA indexer's Hadamard transform needs 2^n channels (DeepSeek-V3.2 uses 128)",
            )
        if width < self.hybrid_mla_qk_rope_head_dim:
            fail(
                "dsa_index_head_dim",
                width,
                f">= hybrid_mla_qk_rope_head_dim ({self.hybrid_mla_qk_rope_head_dim})",
                "the DSA indexer ropes its leading hybrid_mla_qk_rope_head_dim channels",
            )

    def _check_indexer_phases(self, has_mla: bool, has_csa_indexer: bool) -> None:
        """PaddleFleet's phase rules for the indexers: the KL needs one (a CSA lightning indexer or the DSA
        indexer of mqa_dsa -2 layers); the phase switch is the -2 layers' (CSA layers always train over their
        top-k picks); ``train_indexer_only`` is the warm-up (dense phase for -2 layers, a positive coefficient)."""
        mqa_dsa = has_mla and self.hybrid_mla_attention == "mqa_dsa"
        coeff, sparse = self.dsa_indexer_loss_coeff, self.dsa_indexer_use_sparse_loss
        if mqa_dsa:
            self._check_dsa_index_width()
        elif not has_csa_indexer and coeff > 0:
            fail(
                "dsa_indexer_loss_coeff",
                coeff,
                "0.0 unless an indexer exists (a CSA layer without csa_dense_mode, or a -2 layer with "
                "hybrid_mla_attention: mqa_dsa)",
                "add a CSA entry (2..127) to csa_compress_ratios, set `hybrid_mla_attention: mqa_dsa` with a -2 "
                "layer, or remove the key",
            )
        if sparse and not mqa_dsa:
            fail(
                "dsa_indexer_use_sparse_loss",
                sparse,
                "false unless an indexer exists that has phases (a -2 layer with hybrid_mla_attention: mqa_dsa; "
                "CSA layers always train their indexer over its top-k picks)",
                "remove the key, or set `hybrid_mla_attention: mqa_dsa` with a -2 layer",
            )
        if not self.train_indexer_only:
            return
        if not (mqa_dsa or has_csa_indexer):
            fail(
                "train_indexer_only",
                True,
                "true only with a -2 layer under hybrid_mla_attention: mqa_dsa or a CSA layer without "
                "csa_dense_mode (the indexers it trains)",
                "add a CSA layer or set `hybrid_mla_attention: mqa_dsa` on a model with -2 layers, or "
                "`train_indexer_only: false`",
            )
        if sparse:
            fail(
                "train_indexer_only",
                True,
                "false in the sparse phase (dsa_indexer_use_sparse_loss: true): the warm-up trains the indexer "
                "alone on dense attention, the sparse phase trains everything",
                "set `dsa_indexer_use_sparse_loss: false` for the warm-up or `train_indexer_only: false`",
            )
        if not coeff > 0:
            fail(
                "dsa_indexer_loss_coeff",
                coeff,
                "> 0 with train_indexer_only (the KL loss is the indexer's only training signal)",
                "use e.g. `dsa_indexer_loss_coeff: 1.0e-2`",
            )

    def _check_vha(self) -> None:
        """The VHA postmix rank fits the heads; the grouped postmix needs heads that split by o_groups."""
        if self.vha_postmix_rank is not None and self.vha_postmix_rank > self.num_attention_heads:
            fail(
                "vha_postmix_rank",
                self.vha_postmix_rank,
                f"None or 1..num_attention_heads ({self.num_attention_heads})",
                "omit it for the default num_attention_heads // 4",
            )
        if self.use_vha_attention and self.vha_postmix_grouped and self.num_attention_heads % self.o_groups:
            fail(
                "vha_postmix_grouped",
                True,
                f"only when num_attention_heads ({self.num_attention_heads}) divides by o_groups ({self.o_groups})",
                "use the ungrouped postmix or change o_groups",
            )
