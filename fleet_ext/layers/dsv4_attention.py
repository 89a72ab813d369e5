"""DSv4-hybrid self-attention: low-rank query, single K=V head, partial RoPE, sparse core with sink,
inverse RoPE on the output, optional VHA postmix, grouped low-rank output projection.

The ops (RoPE, q RMS, sparse attention) arrive through ``AttentionOps`` chosen once by the backend
provider, so ``forward`` never re-decides between reference and fused paths.
"""

from __future__ import annotations

import paddle

from fleet_ext.config import FleetExtConfig
from fleet_ext.framework.contracts import AttentionOps
from fleet_ext.framework.layer import FleetLayer, normal_init
from fleet_ext.layer_kinds import layer_attention
from fleet_ext.layers.dsv4_core_attention import CompressedSparseAttention
from fleet_ext.layers.norm import RMSNorm
from fleet_ext.layers.rope import RotaryTable
from fleet_ext.layers.vha import VHAPostmix
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import maybe_checkpointed


class DSv4HybridSelfAttention(FleetLayer):
    """[b, s, D] -> [b, s, D] for one layer whose kind is ``layer_attention(config.model, layer_number)``."""

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
        self.recompute_postmix = "vha_postmix" in recompute_modules
        attention = layer_attention(m, layer_number)
        self.kind = attention.kind
        self.heads, self.head_dim = m.num_attention_heads, m.v_head_dim
        self.groups, self.o_lora_rank = m.o_groups, m.o_lora_rank
        self.eps = m.rms_norm_eps
        self.pad_token_id = m.pad_token_id
        if ops.q_norm_rope is None or ops.kv_norm_rope is None:
            raise ValueError("DSv4HybridSelfAttention: `ops.q_norm_rope` and `ops.kv_norm_rope` must be callables "
                             "(the attention prologue), got None; build the ops with the backend provider "
                             "(fleet_ext.specs.backend.BackendProvider)")
        self.ops = ops
        std = m.init_method_std
        self.linear_q_down_proj = paddle.nn.Linear(
            m.hidden_size, m.q_lora_rank, weight_attr=normal_init(std), bias_attr=False
        )
        self.q_layernorm = RMSNorm(m.q_lora_rank, m.rms_norm_eps)
        self.linear_q_up_proj = paddle.nn.Linear(
            m.q_lora_rank, self.heads * self.head_dim, weight_attr=normal_init(std), bias_attr=False
        )
        self.linear_kv_proj = paddle.nn.Linear(
            m.hidden_size, self.head_dim, weight_attr=normal_init(std), bias_attr=False
        )
        self.kv_layernorm = RMSNorm(self.head_dim, m.rms_norm_eps)
        self.core_attention = CompressedSparseAttention(m, attention, ops.sparse_attn, ops.rope)
        self.postmix = VHAPostmix(m) if m.use_vha_attention else None
        # The ungrouped postmix takes inverse RoPE + M @ O as one op (fused when the switch is on).
        self._fuse_postmix = self.postmix is not None and not self.postmix.grouped
        group_in = self.heads * self.head_dim // self.groups
        self.linear_o_group_proj = self.create_parameter(
            [self.groups * self.o_lora_rank, group_in], dtype=m.params_dtype, default_initializer=normal_init(std)
        )
        self.o_proj = paddle.nn.Linear(
            self.groups * self.o_lora_rank, m.hidden_size, weight_attr=normal_init(std), bias_attr=False
        )
        self.rope_table = RotaryTable.for_spec(attention.rope)

    @property
    def indexer_loss(self) -> paddle.Tensor | None:
        """Detached CSA indexer KL (before ``dsa_indexer_loss_coeff``) of the last training forward, else None."""
        return self.core_attention.indexer_loss

    def forward(
        self,
        hidden_states: paddle.Tensor,
        input_ids: paddle.Tensor | None = None,
        layout: SequenceLayout | None = None,
    ) -> paddle.Tensor:
        """``layout``: which global positions ``hidden_states`` holds (default: the whole sequence).
        ``input_ids`` [b, s] (optional): rows holding ``pad_token_id`` are skipped by the CSA indexer KL."""
        if hidden_states.ndim != 3 or hidden_states.shape[-1] != self.linear_q_down_proj.weight.shape[0]:
            raise ValueError(
                f"DSv4HybridSelfAttention: `hidden_states` must be [b, s, {self.linear_q_down_proj.weight.shape[0]}], "
                f"got shape {hidden_states.shape}"
            )
        batch, seq, _ = hidden_states.shape
        layout = SequenceLayout.resolve(layout, "DSv4HybridSelfAttention", "hidden_states", seq)
        q_latent = self.q_layernorm(self.linear_q_down_proj(hidden_states))
        q = self.linear_q_up_proj(q_latent).reshape([batch, seq, self.heads, self.head_dim])
        cos, sin = self.rope_table.cos_sin(layout.positions())
        # norm + RoPE: one fused pass each when the provider resolved the prologue fusion, else the two ops
        q = self.ops.q_norm_rope(q, self.eps, cos, sin)
        kv_norm = self.kv_layernorm
        kv = self.ops.kv_norm_rope(self.linear_kv_proj(hidden_states), kv_norm.weight, kv_norm.eps, cos, sin)
        core = self.core_attention
        loss_mask = input_ids != self.pad_token_id if input_ids is not None and core.loss_coeff > 0 else None
        out = maybe_checkpointed(self.recompute_core, core, q, kv, hidden_states, q_latent, layout, loss_mask)
        if self._fuse_postmix:
            out = maybe_checkpointed(self.recompute_postmix, self._inv_rope_postmix, out, cos, sin)
        else:
            out = self.ops.rope(out, cos, sin, inverse=True)
            if self.postmix is not None:
                out = maybe_checkpointed(self.recompute_postmix, self.postmix, out)  # grouped postmix
        return self.o_proj(self._grouped_out_proj(out))

    def _inv_rope_postmix(self, out: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        """Inverse RoPE + ungrouped postmix ``M @ O`` as one op slot (fused when the switch is on)."""
        return self.ops.inv_rope_postmix(out, cos, sin, self.postmix.mixing_matrix())

    def _grouped_out_proj(self, out: paddle.Tensor) -> paddle.Tensor:
        """[b, s, h, d] -> [b, s, G * r]: each group of heads through its own [r, h*d/G] block."""
        batch, seq = out.shape[0], out.shape[1]
        grouped = out.reshape([batch * seq, self.groups, -1]).transpose([1, 0, 2])  # [G, bs, h*d/G]
        weight = self.linear_o_group_proj.reshape([self.groups, self.o_lora_rank, -1])  # [G, r, h*d/G]
        projected = paddle.matmul(grouped, weight.astype(grouped.dtype), transpose_y=True)  # [G, bs, r]
        return projected.transpose([1, 0, 2]).reshape([batch, seq, self.groups * self.o_lora_rank])
