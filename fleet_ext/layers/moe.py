"""DeepSeekMoE as in DSv4: routers (learned top-k and hash), grouped experts, the MoE layer.

Semantics follow Hugging Face ``modeling_deepseek_v4`` (``DeepseekV4TopKRouter``, ``DeepseekV4HashRouter``,
``DeepseekV4Experts``, ``DeepseekV4SparseMoeBlock``) so imported HF weights give the same logits; the
training extras (aux-loss-free bias update, sequence-wise aux loss) follow Megatron-core's router.

Parameter names (stable, Megatron style, Paddle [in, out] layout):
``router.weight`` [E, D] fp32, ``router.expert_bias`` [E] fp32 (top-k layers with the bias on) or
``router.tid2eid`` [vocab, k] int64 (hash layers), ``experts.weight1`` [E, D, 2I] (``gate | up``),
``experts.weight2`` [E, I, D], ``shared_experts.linear_fc1.weight`` [D, 2F], ``shared_experts.linear_fc2.weight``
[F, D] with F = n_shared_experts * moe_intermediate_size.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from fleet_ext.framework.aux_loss import AuxLossAutoScaler
from fleet_ext.framework.contracts import MoEOps
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.framework.precision import autocast_matmul_dtype
from fleet_ext.layers.mlp import SwiGLUMLP, check_hidden
from fleet_ext.ops.moe_experts.reference import grouped_mlp
from fleet_ext.ops.moe_permute import reference as permute_reference
from fleet_ext.ops.moe_router.reference import router_logits as reference_router_logits
from fleet_ext.parallel.cp_collectives import sum_over_sequence
from fleet_ext.parallel.expert_parallel import (
    ExpertParallelGroup,
    combine_rows,
    dispatch_rows,
    gather_counts,
    layout_of,
)
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import maybe_checkpointed, recording, replayed

__all__ = [
    "SCORING_FUNCS",
    "router_scores",
    "gather_routing_weights",
    "sequence_aux_loss",
    "MoEAuxLossAutoScaler",
    "TopKRouter",
    "HashRouter",
    "GroupedExperts",
    "MoELayer",
]

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
_INT_DTYPES = (paddle.int32, paddle.int64)
_NORM_EPS = 1e-20  # as HF/official DSv4: only guards an all-zero row of selected scores


# --------------------------------------------------------------------------------------------------
# Routing maths (pure functions, fp32).
# --------------------------------------------------------------------------------------------------
def router_scores(logits: paddle.Tensor, scoring_func: str) -> paddle.Tensor:
    """Per-expert scores from gate logits [T, E]; DSv4 uses sqrt(softplus) (non-negative, unnormalised)."""
    if scoring_func == "sqrtsoftplus":
        return paddle.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return F.sigmoid(logits)
    if scoring_func == "softmax":
        return F.softmax(logits, axis=-1)
    raise ValueError(f"config key `scoring_func` = {scoring_func!r} is invalid: allowed {list(SCORING_FUNCS)}")


def gather_routing_weights(
    scores: paddle.Tensor, indices: paddle.Tensor, norm_topk_prob: bool, scaling: float
) -> paddle.Tensor:
    """Unbiased scores at the selected experts, renormalised (the scoring is not a softmax) and scaled."""
    weights = paddle.take_along_axis(scores, indices, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdim=True) + _NORM_EPS)
    return weights * scaling


def sequence_aux_loss(
    scores: paddle.Tensor,
    indices: paddle.Tensor,
    batch: int,
    seq: int,
    coeff: float,
    layout: SequenceLayout | None = None,
) -> paddle.Tensor:
    """DeepSeek-V3 sequence-wise balance loss ``coeff * mean_b sum_i f_i P_i``.

    f_i = E / (k S) * (tokens of the sequence routed to i) is a constant; P_i = mean over the
    sequence of s_i / sum_j s_j carries the gradient into the router. Under context parallelism (``layout``)
    this rank holds ``seq`` of the sequence's S tokens: the routed counts are summed over the group, and P_i
    sums this rank's tokens over S, so the ranks' losses (and gradients) add up to the whole sequence's.
    """
    layout = layout or SequenceLayout.whole(seq)
    num_experts, topk, total = scores.shape[-1], indices.shape[-1], layout.global_len
    probs = scores / (scores.sum(axis=-1, keepdim=True) + _NORM_EPS)
    probs = probs.reshape([batch, seq, num_experts])
    p_mean = probs.mean(axis=1) if layout.cp_size == 1 else probs.sum(axis=1) / total
    with paddle.no_grad():
        counts = F.one_hot(indices, num_experts).astype(scores.dtype).sum(axis=1)
        counts = sum_over_sequence(counts.reshape([batch, seq, num_experts]).sum(axis=1), layout)
        f = counts * (num_experts / (topk * total))
    return (f * p_mean).sum(axis=-1).mean() * coeff


# The router attaches the sequence aux loss to its routing weights with the shared auto-scaler (Megatron's name).
MoEAuxLossAutoScaler = AuxLossAutoScaler


# --------------------------------------------------------------------------------------------------
# Routers.
# --------------------------------------------------------------------------------------------------
class _RouterBase(FleetLayer):
    """Learned gate ``weight`` [E, D] (fp32) and its scores; counts selections for load balancing."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        moe = config.moe
        if moe.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"config key `scoring_func` = {moe.scoring_func!r} is invalid: allowed {list(SCORING_FUNCS)}"
            )
        self.hidden_size = config.model.hidden_size
        self.num_experts = moe.n_routed_experts
        self.topk = moe.num_experts_per_tok
        self.scoring_func = moe.scoring_func
        self.norm_topk_prob = moe.norm_topk_prob
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.aux_loss: paddle.Tensor | None = None
        self.aux_loss_backward_scale = 1.0  # the main loss's backward scale (set through the model)
        self.weight = self.create_parameter(
            [self.num_experts, self.hidden_size],
            dtype="float32",
            default_initializer=paddle.nn.initializer.Normal(mean=0.0, std=config.model.init_method_std),
        )
        self.fused_route: Callable | None = None  # `moe_router_fusion`'s kernel, set by MoELayer from its ops
        self.router_logits: Callable = reference_router_logits  # `moe_router_logits_fusion`'s op: set likewise
        # Selections per expert since the last bias update (not saved: a step-local statistic).
        self.register_buffer(
            "local_tokens_per_expert", paddle.zeros([self.num_experts], dtype="float32"), persistable=False
        )

    def _scores(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        """fp32 logits ``x W^T`` (routing decisions are precision-sensitive) through the score function."""
        flat = hidden_states.reshape([-1, self.hidden_size])
        return router_scores(self.router_logits(flat, self.weight), self.scoring_func)

    def _count(self, indices: paddle.Tensor, counts: paddle.Tensor | None = None) -> None:
        """Add the selections per expert (``counts``, when the fused router counted them already). Counted by sorting
        (static shapes, exact: ``bincount`` would size its output from the values, a host read on a GPU)."""
        if not self.training:
            return
        with paddle.no_grad():
            if counts is None:
                counts = permute_reference.expert_counts(paddle.sort(indices.reshape([-1])), self.num_experts)
            self.local_tokens_per_expert.add_(counts[: self.num_experts].astype("float32"))

    def _check_hidden(self, hidden_states: Any) -> None:
        check_hidden(type(self).__name__, "hidden_states", hidden_states, self.hidden_size, rank=3)

    def _fused(self, scores: paddle.Tensor, **selection: Any) -> tuple:
        """(weights, indices, counts) from the fused router (``moe_router_fusion``)."""
        bias = getattr(self, "expert_bias", None) if not selection else None
        return self.fused_route(scores, bias, self.topk, self.norm_topk_prob, self.routed_scaling_factor, **selection)

    def reset_tokens_per_expert(self) -> None:
        """Zero the selection counts (called after each bias update)."""
        self.local_tokens_per_expert.zero_()

    def update_expert_bias(self, tokens_per_expert: paddle.Tensor | None = None) -> None:
        """No bias on this router: only reset the counts."""
        self.reset_tokens_per_expert()


class TopKRouter(_RouterBase):
    """Learned top-k routing; the aux-loss-free ``expert_bias`` shifts the selection, never the weights."""

    def __init__(self, config: Any, layer_number: int | None = None) -> None:
        super().__init__(config)
        moe = config.moe
        self.layer_number = layer_number
        self.bias_update_rate = moe.moe_router_bias_update_rate
        self.load_balancing_type = moe.moe_router_load_balancing_type
        self.aux_loss_coeff = moe.moe_aux_loss_coeff
        self.n_group, self.topk_group = moe.n_group, moe.topk_group  # group-limited top-k (DeepSeek-V3)
        if moe.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", paddle.zeros([self.num_experts], dtype="float32"), persistable=True)
        else:
            self.expert_bias = None

    def forward(
        self, hidden_states: paddle.Tensor, input_ids: paddle.Tensor | None = None, layout: SequenceLayout | None = None
    ) -> tuple:
        """[b, s, D] -> (weights [b*s, k] fp32, indices [b*s, k] int64); ``input_ids`` is ignored; ``layout``
        (this rank's share of the sequence) scopes the sequence aux loss."""
        self._check_hidden(hidden_states)
        scores = self._scores(hidden_states)
        # Under recompute the re-run replays the forward's experts (routing replay); weights stay
        # differentiable functions of the recomputed scores; counts and the logged aux loss happen once.
        if self.fused_route is None:
            indices, first = replayed("TopKRouter", lambda: self._select(scores))
            weights = gather_routing_weights(scores, indices, self.norm_topk_prob, self.routed_scaling_factor)
            counts = None
        else:
            weights, indices, counts, first = self._fused_select(scores)
        if first:
            self._count(indices, counts)
            self.aux_loss = None
        if self.load_balancing_type == "seq_aux_loss" and self.training and paddle.is_grad_enabled():
            batch, seq = hidden_states.shape[0], hidden_states.shape[1]
            aux_loss = sequence_aux_loss(scores, indices, batch, seq, self.aux_loss_coeff, layout)
            weights = MoEAuxLossAutoScaler.apply(weights, aux_loss, self.aux_loss_backward_scale)
            if first:
                self.aux_loss = aux_loss.detach()
        return weights, indices

    def _select(self, scores: paddle.Tensor) -> paddle.Tensor:
        """Top-k experts per token by biased score (the bias steers selection only); with ``n_group`` > 1 only
        among the experts of the token's ``topk_group`` best groups (DeepSeek-V3's group-limited routing)."""
        with paddle.no_grad():
            biased = scores if self.expert_bias is None else scores + self.expert_bias
            if self.n_group > 1 and self.topk_group < self.n_group:
                biased = self._keep_best_groups(biased)
            return paddle.topk(biased, self.topk, axis=-1)[1]

    def _keep_best_groups(self, biased: paddle.Tensor) -> paddle.Tensor:
        """``biased`` [T, E] with the experts outside each token's ``topk_group`` best groups set to -inf. A
        group's score is the sum of its two largest biased scores (DeepSeek-V3 and transformers' V3/V3.2 router;
        Megatron-core sums the top ``k / topk_group`` instead, the same for DeepSeek-V3's 8 / 4)."""
        grouped = biased.reshape([-1, self.n_group, self.num_experts // self.n_group])
        group_scores = paddle.topk(grouped, 2, axis=-1)[0].sum(axis=-1)  # [T, n_group]
        best = paddle.topk(group_scores, self.topk_group, axis=-1)[1]  # [T, topk_group]
        keep = F.one_hot(best, self.n_group).sum(axis=1) > 0  # [T, n_group]
        keep = keep.unsqueeze(-1).expand(grouped.shape).reshape(biased.shape)
        return paddle.where(keep, biased, paddle.full_like(biased, float("-inf")))

    def _fused_select(self, scores: paddle.Tensor) -> tuple:
        """One fused kernel selects, weighs and counts; a recompute re-run replays the selection into it."""
        first_run: list[tuple] = []

        def select() -> paddle.Tensor:
            first_run.append(self._fused(scores))
            return first_run[0][1]

        indices, first = replayed("TopKRouter", select)
        weights, _, counts = first_run[0] if first_run else self._fused(scores, indices=indices)
        return weights, indices, counts, first

    def update_expert_bias(self, tokens_per_expert: paddle.Tensor | None = None) -> None:
        """``b_e -= rate * sign(load_e - mean load)``, from the given counts or the accumulated ones.

        Called by the trainer after the optimizer step (after all-reducing the counts across data
        parallel ranks when there are several); always resets the accumulated counts.
        """
        if tokens_per_expert is None:
            tokens_per_expert = self.local_tokens_per_expert
        if not isinstance(tokens_per_expert, paddle.Tensor) or list(tokens_per_expert.shape) != [self.num_experts]:
            got = list(tokens_per_expert.shape) if isinstance(tokens_per_expert, paddle.Tensor) else tokens_per_expert
            raise ValueError(f"TopKRouter: `tokens_per_expert` must be [{self.num_experts}], got {got}")
        if self.expert_bias is not None:
            with paddle.no_grad():
                load = tokens_per_expert.astype("float32")
                step = paddle.sign(load - load.mean()) * self.bias_update_rate
                paddle.assign(self.expert_bias - step, output=self.expert_bias)
        self.reset_tokens_per_expert()


class HashRouter(_RouterBase):
    """Hash routing (DSv4's first layers): experts from the frozen ``tid2eid[input_ids]``, weights from the gate."""

    def __init__(self, config: Any, layer_number: int | None = None) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.vocab_size = config.model.vocab_size
        # Megatron's synthetic init (token_id + j) % E; the real table comes from the checkpoint.
        table = paddle.arange(self.vocab_size, dtype="int64").unsqueeze(-1) + paddle.arange(self.topk, dtype="int64")
        self.register_buffer("tid2eid", table % self.num_experts, persistable=True)

    def forward(
        self, hidden_states: paddle.Tensor, input_ids: paddle.Tensor | None = None, layout: SequenceLayout | None = None
    ) -> tuple:
        """[b, s, D] and ``input_ids`` [b, s] -> (weights [b*s, k] fp32, indices [b*s, k] int64) (token-local:
        ``layout`` is not needed)."""
        self._check_hidden(hidden_states)
        _check_input_ids("HashRouter", input_ids, hidden_states.shape[:2], required=True)
        scores = self._scores(hidden_states)
        if self.fused_route is None:
            indices = paddle.gather(self.tid2eid, input_ids.reshape([-1]).astype("int64"), axis=0)
            weights = gather_routing_weights(scores, indices, self.norm_topk_prob, self.routed_scaling_factor)
            counts = None
        else:  # the same table lookup, inside the fused kernel
            weights, indices, counts = self._fused(scores, table=self.tid2eid, ids=input_ids.reshape([-1]))
        if recording():  # once per step, not again when a recomputed segment re-runs
            self._count(indices, counts)
        return weights, indices


def _check_input_ids(owner: str, input_ids: Any, batch_seq: list, required: bool) -> None:
    """Raise a ValueError naming ``input_ids`` unless it is an integer [batch, seq] tensor."""
    want = f"{owner}: `input_ids` must be an int32/int64 tensor of shape {list(batch_seq)}"
    if input_ids is None:
        if required:
            raise ValueError(f"{want} (hash-routed layers pick experts from token ids), got None")
        return
    if not isinstance(input_ids, paddle.Tensor):
        raise ValueError(f"{want}, got {type(input_ids).__name__}")
    if input_ids.dtype not in _INT_DTYPES or list(input_ids.shape) != list(batch_seq):
        raise ValueError(f"{want}, got {list(input_ids.shape)} {input_ids.dtype}")


# --------------------------------------------------------------------------------------------------
# Experts.
# --------------------------------------------------------------------------------------------------
class GroupedExperts(FleetLayer):
    """All routed experts as two stacked weights, computed on tokens grouped by expert on the device.

    (token, slot) pairs are stably sorted by expert (``ops.permute``), the experts slot runs one clamped-SwiGLU
    expert per contiguous segment of the sorted rows (``ops.experts``: the fused grouped GEMMs, or the reference
    ``fleet_ext.ops.moe_experts.reference.grouped_mlp``), the outputs are scaled by the routing weights after the
    down projection (as HF does) and added back to their tokens (``ops.unpermute``).

    Host reads: exactly one per forward (:meth:`_read_host`: the expert-id range check and the rows per expert,
    which the reference's padding and the expert-parallel exchange need on the host); a recomputed forward replays
    it instead of reading again.
    """

    def __init__(self, config: Any, recompute_activation: bool = False, ops: MoEOps | None = None) -> None:
        super().__init__()
        moe, model = config.moe, config.model
        self.recompute_activation = recompute_activation  # selective recompute `moe_act`: the SwiGLU only
        # permute / unpermute: the pure-Paddle reference unless the backend provider hands the fused ops.
        self.ops = ops or MoEOps(permute=permute_reference.permute, unpermute=permute_reference.unpermute)
        self.num_experts = moe.n_routed_experts
        self.hidden_size = model.hidden_size
        self.ffn_hidden_size = moe.moe_intermediate_size
        self.limit = float(moe.swiglu_limit)
        init = paddle.nn.initializer.Normal(mean=0.0, std=model.init_method_std)
        e, d, i = self.num_experts, self.hidden_size, self.ffn_hidden_size
        self.weight1 = self.create_parameter([e, d, 2 * i], dtype=model.params_dtype, default_initializer=init)
        self.weight2 = self.create_parameter([e, i, d], dtype=model.params_dtype, default_initializer=init)
        self.ep: ExpertParallelGroup | None = None  # expert parallelism (:meth:`shard`); None: every expert here
        self.first_expert = 0  # global id of this rank's first expert

    def shard(self, ep: ExpertParallelGroup) -> None:
        """Keep only this rank's experts ``ep.local_experts``: ``weight1`` / ``weight2`` become the slices
        [L, ...] of the stacked weights (same names; the checkpoint records global shape and offset)."""
        if self.ep is not None or ep.size == 1:
            return
        local = ep.local_experts(self.num_experts)
        for name in ("weight1", "weight2"):
            full = getattr(self, name)
            part = self.create_parameter(
                [len(local), *full.shape[1:]], dtype=full.dtype,
                default_initializer=paddle.nn.initializer.Assign(full[local.start : local.stop].numpy()),
            )
            setattr(self, name, part)
        self.ep, self.first_expert = ep, local.start

    def forward(self, hidden_states: paddle.Tensor, indices: paddle.Tensor, weights: paddle.Tensor) -> paddle.Tensor:
        """``hidden_states`` [T, D], ``indices`` [T, k] int, ``weights`` [T, k] float -> [T, D]."""
        self._check(hidden_states, indices, weights)
        x_sorted, plan = self.ops.permute(hidden_states, indices, self.num_experts, check_range=False)
        counts, table = self._read_host(indices, plan.counts)
        compute = self._compute_weights(x_sorted)
        if self.ep is not None:
            y = self._expert_parallel(x_sorted, hidden_states, indices, table, compute)
        else:
            y = self._grouped(x_sorted, plan.counts, max(counts), compute)
        return self.ops.unpermute(y, weights, plan)

    def _read_host(self, indices: paddle.Tensor, counts: paddle.Tensor) -> tuple[list[int], np.ndarray | None]:
        """The layer's one device-to-host read: ``indices``' min and max (checked against [0, E) here, before any
        result of the permute is used) and the rows per expert; under expert parallelism every member's counts
        (gathered on the device first). Returns (this rank's counts, the members' [ep or world, E] table or None).
        Replayed, not read again, when recompute re-runs the forward."""

        def read() -> list[int]:
            flat = indices.reshape([-1])
            parts = [paddle.stack([flat.min(), flat.max()]).astype("int64"), counts.astype("int64")]
            if self.ep is not None:
                parts.append(gather_counts(counts.astype("int64"), self.ep).reshape([-1]))
            return paddle.concat(parts).tolist()

        values, _ = replayed("GroupedExperts", read)
        e = self.num_experts
        permute_reference.check_expert_range(values[0], values[1], e, "GroupedExperts")
        mine = values[2 : 2 + e]
        table = np.asarray(values[2 + e :], dtype=np.int64).reshape([-1, e]) if self.ep is not None else None
        return mine, table

    def _compute_weights(self, rows: paddle.Tensor) -> tuple[paddle.dtype | None, paddle.Tensor, paddle.Tensor]:
        """(dtype, weight1, weight2): this rank's weights in the dtype the experts compute in. The experts are
        matmuls: under Paddle's autocast their operands are cast to its dtype (None: no cast), as Paddle's own matmul
        would cast them (``framework.precision``), for the reference and the fused slot alike; once per forward."""
        dtype = autocast_matmul_dtype(rows)
        if dtype is None:
            return None, self.weight1, self.weight2
        return dtype, self.weight1.astype(dtype), self.weight2.astype(dtype)

    def _grouped(self, rows: paddle.Tensor, counts: paddle.Tensor, max_count: int,
                 compute: tuple[paddle.dtype | None, paddle.Tensor, paddle.Tensor]) -> paddle.Tensor:
        """The experts slot on expert-sorted ``rows`` with ``counts`` [E] (device) and the weights of ``compute``
        (:meth:`_compute_weights`: ``rows`` are cast to its dtype); the reference is told ``max(counts)``, which the
        layer has on the host already."""
        # ``maybe_checkpointed(True, ...)``: resolves recompute's ``checkpointed`` at call time (as the layers do).
        checkpoint = partial(maybe_checkpointed, True)
        experts = self.ops.experts or partial(grouped_mlp, max_count=max_count, checkpoint=checkpoint)
        dtype, weight1, weight2 = compute
        rows = rows if dtype is None else rows.astype(dtype)
        return experts(rows, counts, weight1, weight2, self.limit, self.recompute_activation)

    def _expert_parallel(
        self, x_sorted: paddle.Tensor, hidden_states: paddle.Tensor, indices: paddle.Tensor, table: np.ndarray,
        compute: tuple[paddle.dtype | None, paddle.Tensor, paddle.Tensor],
    ) -> paddle.Tensor:
        """Rows to their experts' owners, the local experts run once per source rank on that source's rows, outputs
        back in this rank's expert-sorted order (``fleet_ext.parallel.expert_parallel``).

        A loop over the sources, not the experts: a source's rows are grouped as the source itself would group them
        under data parallelism (its own ``max(counts)`` sizes the reference's buffer), so each expert's weight
        gradient is a sum of per-source partials with the bits data parallelism all-reduces. The counts are on the
        host already (the one read of :meth:`_read_host`); the local ones go back to the device once.
        """
        layout = layout_of(table, indices.shape[-1], self.ep)
        received = dispatch_rows(x_sorted, hidden_states, indices, layout, self.ep)
        first = self.ep.rank * layout.per_rank
        local = paddle.to_tensor(layout.counts[:, first : first + layout.per_rank])  # [ep, L]
        outs, start = [], 0
        for source in range(layout.size):
            n = sum(layout.local_counts(source))
            if n:
                outs.append(self._grouped(received[start : start + n], local[source], int(layout.counts[source].max()),
                                          compute))
                start += n
        y = paddle.concat(outs, axis=0) if outs else received[:0]
        return combine_rows(y, layout, self.ep)

    def _check(self, hidden_states: Any, indices: Any, weights: Any) -> None:
        """Validate shapes and dtypes (no host read: the expert-id range is checked by :meth:`_read_host`)."""
        check_hidden("GroupedExperts", "hidden_states", hidden_states, self.hidden_size, rank=2)
        tokens = hidden_states.shape[0]
        if (
            not isinstance(indices, paddle.Tensor)
            or indices.dtype not in _INT_DTYPES
            or indices.ndim != 2
            or indices.shape[0] != tokens
        ):
            got = f"{list(indices.shape)} {indices.dtype}" if isinstance(indices, paddle.Tensor) else type(indices)
            raise ValueError(f"GroupedExperts: `indices` must be [{tokens}, k] int32/int64, got {got}")
        if (
            not isinstance(weights, paddle.Tensor)
            or not paddle.is_floating_point(weights)
            or list(weights.shape) != list(indices.shape)
        ):
            got = f"{list(weights.shape)} {weights.dtype}" if isinstance(weights, paddle.Tensor) else type(weights)
            raise ValueError(f"GroupedExperts: `weights` must be {list(indices.shape)} float, got {got}")
        if indices.shape[0] == 0 or indices.shape[1] == 0:
            raise ValueError("GroupedExperts: `indices` must hold at least one token, got an empty tensor")


# --------------------------------------------------------------------------------------------------
# The MoE layer.
# --------------------------------------------------------------------------------------------------
class _GradsInOrder(PyLayer):
    """Views of the flattened ``x`` for the router [b, s, D], the experts [T, D] and the shared experts [b, s, D];
    backward: ``(shared + experts) + router``.

    Paddle's engine adds a tensor's gradients in the order their branches finish, which a fused op that
    shortens one branch would change (fp32 sums are not associative). The order fixed here is the one the
    unfused layer's branches finish in, so the unfused result keeps its bits. Each view is a new tensor of a
    shape other than the input's (Paddle would merge the gradients of outputs that are the input itself).
    """

    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, shape: list[int], shared: bool) -> tuple:
        views = (x.reshape(shape), x.reshape([-1, shape[-1]]))
        return (*views, x.reshape(shape)) if shared else views

    @staticmethod
    def backward(ctx: Any, router: paddle.Tensor, experts: paddle.Tensor, *shared: paddle.Tensor) -> paddle.Tensor:
        experts = experts.reshape(router.shape)
        return ((shared[0] + experts if shared else experts) + router).reshape([-1])


class MoELayer(FleetLayer):
    """Routed experts + shared experts: ``y = experts(x; router(x)) + shared_experts(x)``.

    ``layer_number`` is the 0-based decoder layer index: layers below ``moe_n_hash_layers`` are hash
    routed and need ``input_ids``.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        recompute_modules: frozenset[str] = frozenset(),
        ops: MoEOps | None = None,
    ) -> None:
        super().__init__()
        moe, model = config.moe, config.model
        n_layers = model.num_hidden_layers + model.num_nextn_predict_layers  # MTP layers are numbered after the main
        if not isinstance(layer_number, int) or not 0 <= layer_number < n_layers:
            raise ValueError(
                f"MoELayer: `layer_number` must be a 0-based layer index in [0, {n_layers}), "
                f"got {layer_number!r}"
            )
        if layer_number < moe.first_k_dense_replace:
            raise ValueError(
                f"MoELayer: layer {layer_number} is dense (config key `first_k_dense_replace` = "
                f"{moe.first_k_dense_replace}); build a SwiGLUMLP there instead"
            )
        self.layer_number = layer_number
        self.hidden_size = model.hidden_size
        self.is_hash = layer_number < moe.moe_n_hash_layers
        router_cls = HashRouter if self.is_hash else TopKRouter
        self.router = router_cls(config, layer_number)
        self.router.fused_route = ops.router if ops is not None else None  # moe_router_fusion (None: reference)
        if ops is not None and ops.router_logits is not None:
            self.router.router_logits = ops.router_logits  # moe_router_logits_fusion (or the reference's GEMM)
        self.recompute_experts = "moe" in recompute_modules
        self.experts = GroupedExperts(config, recompute_activation="moe_act" in recompute_modules, ops=ops)
        self.shared_experts = None
        if moe.n_shared_experts > 0:
            ffn = moe.n_shared_experts * moe.moe_intermediate_size
            self.shared_experts = SwiGLUMLP(config, model.hidden_size, ffn)

    def forward(
        self, hidden_states: paddle.Tensor, input_ids: paddle.Tensor | None = None, layout: SequenceLayout | None = None
    ) -> paddle.Tensor:
        """``hidden_states`` [b, s, D], ``input_ids`` [b, s] (required on hash layers) -> [b, s, D]; ``layout``: the
        positions this rank holds (the sequence aux loss counts over the whole sequence)."""
        check_hidden("MoELayer", "hidden_states", hidden_states, self.hidden_size, rank=3)
        _check_input_ids("MoELayer", input_ids, hidden_states.shape[:2], required=self.is_hash)
        batch, seq = hidden_states.shape[0], hidden_states.shape[1]
        to_router, flat, to_shared = self._fan_out(hidden_states)
        weights, indices = self.router(to_router, input_ids, layout)
        out = maybe_checkpointed(self.recompute_experts, self.experts, flat, indices, weights)
        out = out.reshape([batch, seq, self.hidden_size])
        if self.shared_experts is not None:
            out = out + self.shared_experts(to_shared)
        return out

    def _fan_out(self, hidden_states: paddle.Tensor) -> tuple:
        """(router input [b, s, D], experts input [T, D], shared experts input [b, s, D]) whose gradients are summed
        in one fixed order (``_GradsInOrder``), so fused ops that shorten a branch's backward cannot reorder them."""
        if not paddle.is_grad_enabled() or hidden_states.stop_gradient:
            return hidden_states, hidden_states.reshape([-1, self.hidden_size]), hidden_states
        shared = self.shared_experts is not None
        views = _GradsInOrder.apply(hidden_states.reshape([-1]), list(hidden_states.shape), shared)
        return views[0], views[1], views[2] if shared else None

    @property
    def aux_loss(self) -> paddle.Tensor | None:
        """Detached sequence-wise aux loss of the last training forward (None when off or on hash layers)."""
        return self.router.aux_loss

    def set_aux_loss_backward_scale(self, scale: float) -> None:
        """Backward scale of the aux-loss gradient: the main loss's (loss scale / micro-batches)."""
        self.router.aux_loss_backward_scale = float(scale)

    @property
    def tokens_per_expert(self) -> paddle.Tensor:
        """Selections per expert accumulated since the last bias update."""
        return self.router.local_tokens_per_expert

    def update_expert_bias(self, tokens_per_expert: paddle.Tensor | None = None) -> None:
        """Aux-loss-free bias step (no-op on hash layers or without the bias); resets the counts."""
        self.router.update_expert_bias(tokens_per_expert)
