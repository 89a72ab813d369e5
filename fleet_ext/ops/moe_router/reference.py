"""MoE routing in pure Paddle: the op sequence the fused router replaces (DSv4's ungrouped top-k and hash routing).

From per-expert scores ``s`` [T, E] (the score function is applied before: ``fleet_ext.layers.moe.router_scores``):

- selection: the top-k experts of ``s + bias`` (the aux-loss-free bias steers the choice only), or the given
  ``indices`` (a routing replay), or the hash table's row of each token (``table[ids]``);
- weights: the *unbiased* scores of the selected experts, divided by their sum (+ 1e-20) when
  ``norm_topk_prob``, times ``scaling``;
- counts: selections per expert (``bincount``), for the bias update and the dispatcher;
- ``router_logits``: the fp32 GEMM before the score function, ``x W^T`` (``moe_router_logits_fusion``'s reference).

The layers (``TopKRouter``, ``HashRouter``) compute the same maths with these ops; this module is the
standalone reference the fused kernel is tested against.
"""

from __future__ import annotations

import paddle

NORM_EPS = 1e-20  # as HF/official DSv4: only guards an all-zero row of selected scores


def check_route_args(scores, bias, topk, indices, table, ids, fn: str = "moe_route") -> None:
    """Shapes and dtypes of ``route``'s inputs; errors name the tensor."""
    if not isinstance(scores, paddle.Tensor) or scores.ndim != 2 or scores.dtype != paddle.float32:
        got = f"{list(scores.shape)} {scores.dtype}" if isinstance(scores, paddle.Tensor) else type(scores).__name__
        raise ValueError(f"{fn}: `scores` must be float32 [T, E], got {got}")
    tokens, experts = scores.shape
    if not 1 <= int(topk) <= experts:
        raise ValueError(f"{fn}: `topk` must lie in [1, {experts}], got {topk}")
    if bias is not None and (list(bias.shape) != [experts] or bias.dtype != paddle.float32):
        raise ValueError(f"{fn}: `bias` must be float32 [{experts}], got {bias.dtype} {list(bias.shape)}")
    int_types = (paddle.int32, paddle.int64)
    if indices is not None and (list(indices.shape) != [tokens, topk] or indices.dtype not in int_types):
        raise ValueError(f"{fn}: `indices` must be int32/int64 [{tokens}, {topk}], got {indices.dtype} "
                         f"{list(indices.shape)}")
    if (table is None) != (ids is None):
        raise ValueError(f"{fn}: hash routing needs both `table` and `ids`, got only one of them")
    if table is not None:
        if table.ndim != 2 or table.shape[1] != topk or table.dtype not in int_types:
            raise ValueError(f"{fn}: `table` must be int32/int64 [vocab, {topk}], got {table.dtype} "
                             f"{list(table.shape)}")
        if list(ids.shape) != [tokens] or ids.dtype not in int_types:
            raise ValueError(f"{fn}: `ids` must be int32/int64 [{tokens}], got {ids.dtype} {list(ids.shape)}")
        if indices is not None:
            raise ValueError(f"{fn}: give `indices` or a hash `table`, not both")


def route(
    scores: paddle.Tensor,
    bias: paddle.Tensor | None,
    topk: int,
    norm_topk_prob: bool,
    scaling: float,
    indices: paddle.Tensor | None = None,
    table: paddle.Tensor | None = None,
    ids: paddle.Tensor | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """``scores`` [T, E] fp32 -> (weights [T, k] fp32, indices [T, k] int64, counts [E] int64).

    ``indices`` given: no selection (routing replay); ``table`` [vocab, k] and ``ids`` [T]: hash routing.
    """
    check_route_args(scores, bias, topk, indices, table, ids)
    with paddle.no_grad():
        if table is not None:
            indices = paddle.gather(table, ids.astype("int64"), axis=0)
        elif indices is None:
            biased = scores if bias is None else scores + bias
            indices = paddle.topk(biased, topk, axis=-1)[1]
        indices = indices.astype("int64")
        counts = paddle.bincount(indices.reshape([-1]), minlength=scores.shape[1])
    weights = paddle.take_along_axis(scores, indices, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdim=True) + NORM_EPS)
    return weights * scaling, indices, counts


def router_logits(hidden: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
    """``hidden`` [T, D] (any float dtype), ``weight`` [E, D] fp32 -> logits [T, E] fp32: the router's GEMM in fp32
    (the selections are precision-sensitive), also under bf16 autocast (which would run a matmul in bf16)."""
    with paddle.amp.auto_cast(enable=False):
        return paddle.matmul(hidden.astype("float32"), weight, transpose_y=True)
