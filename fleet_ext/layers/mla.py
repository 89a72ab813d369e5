"""Self-attention of -2 (hybrid-MLA) layers: DeepSeek-V3 / V3.2 multi-head latent attention.

Parameters (the plain MLA layout, so dense-MLA checkpoints load whatever ``hybrid_mla_attention`` is):
``linear_q_down_proj`` [D, q_lora] -> ``q_layernorm`` -> ``linear_q_up_proj`` [q_lora, h (nope + rope)];
``linear_kv_down_proj`` [D, kv_lora + rope] (latent ``c_kv`` then the shared ``k_pe``) -> ``kv_layernorm`` on
``c_kv``; ``linear_kv_up_proj`` [kv_lora, h (nope + v)] (per head ``W_UK`` then ``W_UV``); ``o_proj`` [h v, D];
``attn_sink`` [h] with ``add_full_attention_sink_bias``; ``core_attention.indexer.*`` under ``mqa_dsa``.
RoPE is interleaved on the trailing ``qk_rope`` channels of q and on ``k_pe`` (``ops.rope``).

``hybrid_mla_attention``:
- ``mha``: dense causal MLA, each head with its own key ``[k_nope | k_pe]`` and value (the reference);
- ``mqa_full_causal`` / ``mqa_dsa``: activation-level absorption into MQA form. The query becomes
  ``[q_nope W_UK | q_pe]`` ([b, s, h, kv_lora + rope], 576 in production), the single key ``[c_kv | k_pe]``, the
  value ``c_kv``; ``MQALatentAttention`` attends, then the output is de-absorbed through ``W_UV``. Scores are
  unchanged by absorption, so the softmax scale is the MHA one: ``(qk_nope + qk_rope)^-1/2``, times
  ``m(f, mscale_all_dim)^2`` with YaRN (HF DeepSeek-V3.2 ``yarn_apply_mscale``).
"""

from __future__ import annotations

import math

import paddle

from fleet_ext.config import FleetExtConfig, ModelConfig
from fleet_ext.framework.contracts import AttentionOps
from fleet_ext.framework.layer import FleetLayer, normal_init
from fleet_ext.layer_kinds import LayerKind, RopeSpec, layer_attention
from fleet_ext.layers import index_tables
from fleet_ext.layers.mqa_latent_attention import MQALatentAttention
from fleet_ext.layers.norm import RMSNorm
from fleet_ext.layers.rope import RotaryTable
from fleet_ext.parallel.cp_collectives import gather_sequence
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import maybe_checkpointed

__all__ = ["MLASelfAttention", "hybrid_mla_rope"]

# Sink logit of -2 layers without ``add_full_attention_sink_bias``: exp(-1e30 - max) underflows, so the sink
# carries no mass (finite, so kernels never compute inf - inf); it is a constant, not a parameter.
NO_SINK = -1.0e30


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def hybrid_mla_rope(config: ModelConfig, spec: RopeSpec) -> tuple[RotaryTable, float, float]:
    """(frequency table, cos/sin factor, softmax-scale factor) of -2 layers, as HF DeepSeek-V3.2 computes them.

    YaRN: frequencies from ``hybrid_mla_rotary_base`` / ``_scaling_factor`` / ``_original_max_position_embeddings``
    and the shared beta_fast/beta_slow; cos/sin times ``m(f, mscale) / m(f, mscale_all_dim)`` (HF's
    ``attention_factor``; 1 for V3.2 where both are 1); softmax scale times ``m(f, mscale_all_dim)^2``.
    """
    table = RotaryTable.for_spec(spec)
    if spec.rope_type == "rope":
        return table, 1.0, 1.0
    factor = spec.scaling_factor
    mscale, mscale_all_dim = config.hybrid_mla_mscale, config.hybrid_mla_mscale_all_dim
    if mscale and mscale_all_dim:
        cos_sin_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    else:
        cos_sin_factor = _yarn_mscale(factor, 1.0)
    softmax_factor = _yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return table, cos_sin_factor, softmax_factor


class MLASelfAttention(FleetLayer):
    """[b, s, D] -> [b, s, D] for one -2 layer."""

    def __init__(
        self,
        config: FleetExtConfig,
        layer_number: int,
        ops: AttentionOps,
        recompute_modules: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        m = config.model
        self.layer_number = layer_number
        self.recompute_core = "core_attn" in recompute_modules
        self.recompute_up_proj = "mla_up_proj" in recompute_modules
        self.mode = m.hybrid_mla_attention
        self.heads = m.hybrid_mla_num_attention_heads
        self.kv_lora_rank = m.hybrid_mla_kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = (
            m.hybrid_mla_qk_nope_head_dim,
            m.hybrid_mla_qk_rope_head_dim,
            m.hybrid_mla_v_head_dim,
        )
        self.pad_token_id = m.pad_token_id
        self.ops = ops
        std = m.init_method_std
        self.linear_q_down_proj = paddle.nn.Linear(
            m.hidden_size, m.hybrid_mla_q_lora_rank, weight_attr=normal_init(std), bias_attr=False
        )
        self.q_layernorm = RMSNorm(m.hybrid_mla_q_lora_rank, m.rms_norm_eps)
        q_width = self.heads * (self.nope + self.rope_dim)
        self.linear_q_up_proj = paddle.nn.Linear(
            m.hybrid_mla_q_lora_rank, q_width, weight_attr=normal_init(std), bias_attr=False
        )
        self.linear_kv_down_proj = paddle.nn.Linear(
            m.hidden_size, self.kv_lora_rank + self.rope_dim, weight_attr=normal_init(std), bias_attr=False
        )
        self.kv_layernorm = RMSNorm(self.kv_lora_rank, m.rms_norm_eps)
        self.linear_kv_up_proj = paddle.nn.Linear(
            self.kv_lora_rank, self.heads * (self.nope + self.v_dim), weight_attr=normal_init(std), bias_attr=False
        )
        self.o_proj = paddle.nn.Linear(
            self.heads * self.v_dim, m.hidden_size, weight_attr=normal_init(std), bias_attr=False
        )
        self.attn_sink = (
            self.create_parameter(
                [self.heads], dtype="float32", default_initializer=paddle.nn.initializer.Constant(0.0)
            )
            if m.add_full_attention_sink_bias
            else None
        )
        attention = layer_attention(m, layer_number)
        if attention.kind is not LayerKind.HYBRID_MLA:
            raise ValueError(f"MLASelfAttention: layer {layer_number} is a {attention.kind.value!r} layer, not -2")
        self.rope_table, self._cos_sin_factor, softmax_factor = hybrid_mla_rope(m, attention.rope)
        self.softmax_scale = (self.nope + self.rope_dim) ** -0.5 * softmax_factor
        self.core_attention = (
            None if self.mode == "mha" else MQALatentAttention(
                m, ops.mqa_sparse_attn, self.softmax_scale, config.parallel.mqa_indexer_cp_mode, ops.mqa_causal_probs
            )
        )

    # -- pieces shared by every mode --------------------------------------------------------------------
    def cos_sin(self, layout: SequenceLayout) -> tuple[paddle.Tensor, paddle.Tensor]:
        """cos/sin [s, rope/2] of the layout's positions (times the YaRN attention factor when it is not 1)."""
        cos, sin = self.rope_table.cos_sin(layout.positions())
        if self._cos_sin_factor != 1.0:
            cos, sin = cos * self._cos_sin_factor, sin * self._cos_sin_factor
        return cos, sin

    def _project(self, hidden_states: paddle.Tensor, layout: SequenceLayout) -> tuple:
        """q_latent, q_nope [b,s,h,n], roped q_pe [b,s,h,r], c_kv [b,s,L], roped k_pe [b,s,r], cos, sin.

        ``hidden_states`` was checked against ``layout`` (``_layout``)."""
        batch, seq, _ = hidden_states.shape
        q_latent = self.q_layernorm(self.linear_q_down_proj(hidden_states))
        q = self.linear_q_up_proj(q_latent).reshape([batch, seq, self.heads, self.nope + self.rope_dim])
        kv = self.linear_kv_down_proj(hidden_states)
        c_kv = self.kv_layernorm(kv[..., : self.kv_lora_rank])
        cos, sin = self.cos_sin(layout)
        q_pe = self.ops.rope(q[..., self.nope :], cos, sin)
        k_pe = self.ops.rope(kv[..., self.kv_lora_rank :], cos, sin)
        return q_latent, q[..., : self.nope], q_pe, c_kv, k_pe, cos, sin

    def _up_proj_weights(self) -> tuple[paddle.Tensor, paddle.Tensor]:
        """W_UK [h, kv_lora, nope] and W_UV [h, kv_lora, v] views of ``linear_kv_up_proj.weight``."""
        weight = self.linear_kv_up_proj.weight.reshape([self.kv_lora_rank, self.heads, self.nope + self.v_dim])
        weight = weight.transpose([1, 0, 2])
        return weight[:, :, : self.nope], weight[:, :, self.nope :]

    def _layout(self, hidden_states: paddle.Tensor, layout: SequenceLayout | None) -> SequenceLayout:
        """The given layout (checked against the input) or the whole sequence."""
        width = self.linear_q_down_proj.weight.shape[0]
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != width:
            raise ValueError(
                f"MLASelfAttention: `hidden_states` must be [b, s, {width}], got shape {hidden_states.shape}"
            )
        seq = hidden_states.shape[1]
        return SequenceLayout.resolve(layout, "MLASelfAttention", "hidden_states", seq)

    def _sink(self) -> paddle.Tensor:
        if self.attn_sink is not None:
            return self.attn_sink
        return paddle.full([self.heads], NO_SINK, dtype="float32")

    # -- forward ----------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: paddle.Tensor,
        input_ids: paddle.Tensor | None = None,
        loss_mask: paddle.Tensor | None = None,
        layout: SequenceLayout | None = None,
    ) -> paddle.Tensor:
        """``loss_mask`` [b, s] bool (False: padding rows, skipped by the indexer KL); by default
        ``input_ids != pad_token_id`` when the token ids are given, else every row. ``layout``: which global
        positions ``hidden_states`` holds (default: the whole sequence)."""
        if loss_mask is None and input_ids is not None:
            loss_mask = input_ids != self.pad_token_id
        layout = self._layout(hidden_states, layout)
        batch, seq = hidden_states.shape[0], hidden_states.shape[1]
        q_latent, q_nope, q_pe, c_kv, k_pe, cos, sin = self._project(hidden_states, layout)
        if self.core_attention is None:
            out = maybe_checkpointed(self.recompute_core, self._dense_mla, q_nope, q_pe, c_kv, k_pe, layout)
        else:
            query = maybe_checkpointed(self.recompute_up_proj, self._absorb, q_nope, q_pe)
            # Context parallelism: queries stay local, the latent keys of the whole sequence are all-gathered.
            key = gather_sequence(paddle.concat([c_kv, k_pe.astype(c_kv.dtype)], axis=-1), layout)
            latent = maybe_checkpointed(
                self.recompute_core, self.core_attention,
                query, key, self._sink(), hidden_states, q_latent, cos, sin, loss_mask, layout,
            )
            out = maybe_checkpointed(self.recompute_up_proj, self._deabsorb, latent)
        return self.o_proj(out.reshape([batch, seq, self.heads * self.v_dim]))

    def _absorb(self, q_nope: paddle.Tensor, q_pe: paddle.Tensor) -> paddle.Tensor:
        """Latent-MQA query ``[q_nope W_UK | q_pe]`` [b, s, h, L + r]: q_nope [h, bs, n] @ W_UK^T [h, n, L]."""
        batch, seq = q_nope.shape[0], q_nope.shape[1]
        w_uk, _ = self._up_proj_weights()
        q_heads = q_nope.transpose([2, 0, 1, 3]).reshape([self.heads, batch * seq, self.nope])
        q_abs = paddle.matmul(q_heads, w_uk.astype(q_heads.dtype), transpose_y=True)
        q_abs = q_abs.reshape([self.heads, batch, seq, self.kv_lora_rank]).transpose([1, 2, 0, 3])
        return paddle.concat([q_abs, q_pe.astype(q_abs.dtype)], axis=-1)

    def _deabsorb(self, latent: paddle.Tensor) -> paddle.Tensor:
        """Per-head values [b, s, h, v] from the latent output: latent [h, bs, L] @ W_UV [h, L, v]."""
        batch, seq = latent.shape[0], latent.shape[1]
        _, w_uv = self._up_proj_weights()
        latent = latent.transpose([2, 0, 1, 3]).reshape([self.heads, batch * seq, self.kv_lora_rank])
        out = paddle.matmul(latent, w_uv.astype(latent.dtype))
        return out.reshape([self.heads, batch, seq, self.v_dim]).transpose([1, 2, 0, 3])

    def _dense_mla(self, q_nope, q_pe, c_kv, k_pe, layout: SequenceLayout) -> paddle.Tensor:
        """Reference causal MLA with per-head keys and values: [b, s, h, v] (keys of the whole sequence: the
        latent ``c_kv`` and ``k_pe`` are all-gathered under context parallelism, then up-projected)."""
        batch, seq = q_nope.shape[0], q_nope.shape[1]
        c_kv, k_pe = gather_sequence(c_kv, layout), gather_sequence(k_pe, layout)
        keys = c_kv.shape[1]
        kv = self.linear_kv_up_proj(c_kv).reshape([batch, keys, self.heads, self.nope + self.v_dim])
        k_pe = k_pe.unsqueeze(2).expand([batch, keys, self.heads, self.rope_dim])
        key = paddle.concat([kv[..., : self.nope], k_pe.astype(kv.dtype)], axis=-1).transpose([0, 2, 1, 3])
        query = paddle.concat([q_nope, q_pe.astype(q_nope.dtype)], axis=-1).transpose([0, 2, 1, 3])
        value = kv[..., self.nope :].transpose([0, 2, 1, 3])  # [b, h, s, v]
        logits = paddle.matmul(query.astype("float32"), key.astype("float32"), transpose_y=True) * self.softmax_scale
        causal = index_tables.full_causal_index_table(layout) >= 0  # [s, s]: key j <= query t
        logits = paddle.where(causal, logits, paddle.full_like(logits, float("-inf")))
        if self.attn_sink is not None:
            sink = self.attn_sink.reshape([1, self.heads, 1, 1]).expand([batch, self.heads, seq, 1])
            probs = paddle.nn.functional.softmax(paddle.concat([logits, sink], axis=-1), axis=-1)[..., :keys]
        else:
            probs = paddle.nn.functional.softmax(logits, axis=-1)
        out = paddle.matmul(probs, value.astype("float32")).astype(q_nope.dtype)
        return out.transpose([0, 2, 1, 3])

    # -- inspection ---------------------------------------------------------------------------------------
    def topk_indices(self, hidden_states: paddle.Tensor, layout: SequenceLayout | None = None) -> paddle.Tensor:
        """The indexer's top-k key ids [b, s, k_top] (int32, -1 empty) for these hidden states (sparse phase)."""
        if self.core_attention is None or self.core_attention.indexer is None:
            raise ValueError("MLASelfAttention.topk_indices: needs hybrid_mla_attention: mqa_dsa")
        layout = self._layout(hidden_states, layout)
        with paddle.no_grad():
            q_latent, _, _, _, _, cos, sin = self._project(hidden_states, layout)
            idx, k_top = self.core_attention.select(hidden_states, q_latent, cos, sin, layout)
        return idx[:, :, :k_top]

    @property
    def indexer_loss(self) -> paddle.Tensor | None:
        """Detached indexer KL (before ``dsa_indexer_loss_coeff``) of the last training forward, else None."""
        return None if self.core_attention is None else self.core_attention.indexer_loss
