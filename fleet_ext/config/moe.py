"""The ``moe`` section: DeepSeekMoE layers as in DSv4 (routing, shared experts, balancing, dense layers)."""

from __future__ import annotations

from dataclasses import dataclass

from fleet_ext.config.fields import NON_NEGATIVE, POSITIVE, Section, fail, key_field

__all__ = ["MoEConfig"]

_key = key_field


@dataclass
class MoEConfig(Section):
    """DeepSeekMoE layers as in DSv4."""

    n_routed_experts: int = _key(256, "Routed experts per MoE layer.", domain=POSITIVE)
    n_shared_experts: int = _key(
        1, "Shared experts (run on every token), each moe_intermediate_size wide.", domain=NON_NEGATIVE
    )
    num_experts_per_tok: int = _key(6, "Experts each token is routed to.", domain=POSITIVE)
    moe_intermediate_size: int = _key(2048, "Hidden width of each routed and shared expert.", domain=POSITIVE)
    scoring_func: str = _key(
        "sqrtsoftplus", "Router score from the gate logits.", ("sqrtsoftplus", "sigmoid", "softmax")
    )
    norm_topk_prob: bool = _key(True, "Renormalise the selected scores to sum to 1.")
    routed_scaling_factor: float = _key(
        1.5, "Multiplier on the routing weights.", domain=POSITIVE, fix="use 1.5 as DeepSeek-V4-Flash"
    )
    moe_n_hash_layers: int = _key(
        3, "The first N MoE layers route by a frozen token-id -> experts table.", domain=NON_NEGATIVE
    )
    # DeepSeek-V3/V3.2 node-limited routing, under the names PaddleFleet and transformers use (Megatron-core:
    # moe_router_num_groups / moe_router_group_topk, refused with these names). The group score is the sum of
    # the group's two largest biased scores (DeepSeek-V3 / transformers; Megatron sums the top k / topk_group).
    n_group: int = _key(
        1,
        "Expert groups of the learned routers' group-limited top-k (DeepSeek-V3); 1: no group limit.",
        domain=POSITIVE,
        fix="use 1 (DeepSeek-V4) or 8 (DeepSeek-V3/V3.2)",
    )
    topk_group: int = _key(
        1,
        "Groups each token may route to: those with the largest sum of their two best biased scores; the "
        "top-k then picks among their experts. Ignored when n_group is 1.",
        domain=POSITIVE,
        fix="use 4 as DeepSeek-V3/V3.2 (with n_group 8)",
    )
    swiglu_limit: float = _key(
        10.0,
        "Clamp of the SwiGLU gate (max) and up (both sides); 0 disables.",
        domain=NON_NEGATIVE,
        fix="use 10.0 as in DSv4 (0 = no clamp)",
    )
    moe_router_enable_expert_bias: bool = _key(True, "Aux-loss-free balancing bias, used only for selection.")
    moe_router_bias_update_rate: float = _key(
        1e-3,
        "Step gamma of the bias update b -= gamma * sign(load - mean); 0 freezes the bias.",
        domain=NON_NEGATIVE,
        fix="use 1.0e-3 as DeepSeek-V3",
    )
    moe_router_load_balancing_type: str = _key("none", "Auxiliary balancing loss.", ("none", "seq_aux_loss"))
    moe_aux_loss_coeff: float = _key(1e-4, "Coefficient of the sequence-wise aux loss.", domain=NON_NEGATIVE)
    first_k_dense_replace: int = _key(
        0, "The first K layers use a dense SwiGLU MLP instead of MoE.", domain=NON_NEGATIVE
    )
    intermediate_size: int = _key(11264, "Hidden width of the dense MLP layers.", domain=POSITIVE)

    def validate(self) -> None:
        if self.num_experts_per_tok > self.n_routed_experts:
            fail(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                f"<= n_routed_experts ({self.n_routed_experts})",
                "route to fewer experts or add experts",
            )
        self._check_groups()

    def _check_groups(self) -> None:
        """Group-limited top-k: whole groups, >= 2 experts each (the group score sums two), enough experts."""
        if self.n_group == 1:
            return
        per_group = self.n_routed_experts // self.n_group
        if self.n_routed_experts % self.n_group or per_group < 2:
            fail(
                "n_group",
                self.n_group,
                f"1 or a divisor of n_routed_experts ({self.n_routed_experts}) leaving >= 2 experts per group "
                "(the group score sums the group's two best scores)",
                "use fewer groups (DeepSeek-V3: 8 groups of 32 experts)",
            )
        if self.topk_group > self.n_group:
            fail("topk_group", self.topk_group, f"<= n_group ({self.n_group})", "keep fewer groups per token")
        if self.num_experts_per_tok > self.topk_group * per_group:
            fail(
                "topk_group",
                self.topk_group,
                f">= num_experts_per_tok / experts per group = {self.num_experts_per_tok} / {per_group} "
                "(the kept groups must hold num_experts_per_tok experts)",
                "keep more groups per token or route to fewer experts",
            )
