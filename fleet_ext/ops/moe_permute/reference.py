"""MoE token permutation in pure Paddle: the op sequence the fused kernels replace (and must match bitwise).

``permute`` sorts the flattened (token, slot) pairs stably by expert, so the rows of one expert are
contiguous and, inside an expert, in token order; row ``r`` holds token ``order[r] // k``. ``unpermute``
scales each expert output row by its routing weight (in fp32, rounded to the output dtype) and adds the
rows back to their tokens with ``index_add``: a token's k contributions are summed in row order (ascending
expert, then slot), starting from zero, in the output dtype. Autograd gives the backward: the gather's
gradient adds a token's row gradients in the same row order; the weights' gradient is the sum over the
hidden dimension of ``d_out * y`` in fp32.

Every plan carries ``counts`` [E] int64 (rows per expert, on the device) for the grouped expert compute, counted
with static-shape device ops (``expert_counts``: a ``searchsorted`` of the sorted ids, no ``bincount``, whose
output size a GPU would read back from the values).
"""

from __future__ import annotations

from typing import NamedTuple

import paddle


class PermutePlan(NamedTuple):
    """Where every permuted row came from (the reference's form; the fused path has its own)."""

    order: paddle.Tensor  # [T*k] int64: flat (token, slot) index of each row
    token_of: paddle.Tensor  # [T*k] int64: token of each row
    counts: paddle.Tensor  # [E] int64: rows per expert (ids outside [0, E) are in no expert)
    num_tokens: int
    dtype: paddle.dtype  # of the hidden states: the combined output's dtype


def check_permute_args(hidden_states: paddle.Tensor, indices: paddle.Tensor, fn: str) -> None:
    """Shapes and dtypes of ``permute``'s inputs; errors name the tensor."""
    if not isinstance(hidden_states, paddle.Tensor) or hidden_states.ndim != 2:
        got = list(hidden_states.shape) if isinstance(hidden_states, paddle.Tensor) else type(hidden_states).__name__
        raise ValueError(f"{fn}: `hidden_states` must be a [T, D] tensor, got {got}")
    if (
        not isinstance(indices, paddle.Tensor)
        or indices.dtype not in (paddle.int32, paddle.int64)
        or indices.ndim != 2
        or indices.shape[0] != hidden_states.shape[0]
    ):
        got = f"{list(indices.shape)} {indices.dtype}" if isinstance(indices, paddle.Tensor) else type(indices)
        raise ValueError(f"{fn}: `indices` must be [{hidden_states.shape[0]}, k] int32/int64, got {got}")
    if hidden_states.shape[0] == 0 or indices.shape[1] == 0:
        raise ValueError(f"{fn}: `indices` must hold at least one token and one slot, got {list(indices.shape)}")


def check_unpermute_args(y: paddle.Tensor, weights: paddle.Tensor, num_tokens: int, topk: int, fn: str) -> None:
    """``y`` [T*k, D] float and ``weights`` [T, k] float (T, k from the plan); errors name the tensor."""
    rows = num_tokens * topk
    if not isinstance(y, paddle.Tensor) or y.ndim != 2 or y.shape[0] != rows or not paddle.is_floating_point(y):
        got = f"{list(y.shape)} {y.dtype}" if isinstance(y, paddle.Tensor) else type(y).__name__
        raise ValueError(f"{fn}: `y` must be [{rows}, D] float (one row per permuted row), got {got}")
    if (
        not isinstance(weights, paddle.Tensor)
        or not paddle.is_floating_point(weights)
        or list(weights.shape) != [num_tokens, topk]
    ):
        got = f"{list(weights.shape)} {weights.dtype}" if isinstance(weights, paddle.Tensor) else type(weights)
        raise ValueError(f"{fn}: `weights` must be [{num_tokens}, {topk}] float, got {got}")


def expert_counts(sorted_ids: paddle.Tensor, num_experts: int) -> paddle.Tensor:
    """[E] int64 rows per expert of ascending expert ids ``sorted_ids`` [N] (ids outside [0, E) count nowhere).

    ``searchsorted`` against 0..E gives each expert's first row: a static output shape, no host read, exact.
    """
    edges = paddle.searchsorted(sorted_ids, paddle.arange(int(num_experts) + 1, dtype=sorted_ids.dtype))
    return edges[1:] - edges[:-1]


def check_expert_range(low: int, high: int, num_experts: int, fn: str) -> None:
    """Raise a ValueError naming ``indices`` unless the host values ``low``..``high`` lie in [0, num_experts)."""
    if low < 0 or high >= num_experts:
        raise ValueError(f"{fn}: `indices` must lie in [0, {num_experts}), got values in [{low}, {high}]")


def read_expert_range(indices: paddle.Tensor, num_experts: int, fn: str) -> None:
    """``check_expert_range`` of ``indices``' min and max (one device-to-host read)."""
    low, high = (int(v) for v in paddle.stack([indices.min(), indices.max()]).astype("int64").tolist())
    check_expert_range(low, high, num_experts, fn)


def permute(hidden_states: paddle.Tensor, indices: paddle.Tensor, num_experts: int, check_range: bool = True
            ) -> tuple:
    """``hidden_states`` [T, D], ``indices`` [T, k] -> (rows [T*k, D] grouped by expert, ``PermutePlan``).

    ``check_range``: raise a ValueError unless ``indices`` lie in [0, num_experts) (one host read); False when the
    caller checks them itself (the MoE layer folds the check into its one read per layer).
    """
    check_permute_args(hidden_states, indices, "moe_permute")
    if check_range:
        read_expert_range(indices, int(num_experts), "moe_permute")
    topk = indices.shape[-1]
    flat = indices.reshape([-1])
    order = paddle.argsort(flat, stable=True)
    token_of = order // topk
    rows = paddle.gather(hidden_states, token_of, axis=0)
    counts = expert_counts(paddle.gather(flat, order).astype("int64"), num_experts)
    return rows, PermutePlan(order, token_of, counts, hidden_states.shape[0], hidden_states.dtype)


def unpermute(y: paddle.Tensor, weights: paddle.Tensor, plan: PermutePlan) -> paddle.Tensor:
    """``y`` [T*k, D] expert outputs in permuted order, ``weights`` [T, k] -> [T, D]: each token's weighted sum."""
    check_unpermute_args(y, weights, plan.num_tokens, plan.order.shape[0] // plan.num_tokens, "moe_unpermute")
    w_sorted = paddle.gather(weights.reshape([-1]), plan.order, axis=0).astype("float32")
    scaled = (y.astype("float32") * w_sorted.unsqueeze(-1)).astype(plan.dtype)
    out = paddle.zeros([plan.num_tokens, y.shape[-1]], dtype=plan.dtype)
    return paddle.index_add(out, plan.token_of, 0, scaled)
