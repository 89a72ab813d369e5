"""Context-parallel collectives with autograd, in a fixed order, on gloo (CPU) and NCCL (GPU).

Three exchanges move sequence data between the ranks of a context-parallel group (``layout.cp_group``):

- :func:`gather_sequence`: every rank's shard concatenated in rank order (= global order, as shards are
  contiguous). Backward ``"sum"``: each rank's gradient of the whole is summed over the group and each rank
  keeps its own rows (a reduce-scatter; used for keys that every rank's queries read). Backward ``"slice"``:
  the consumer is replicated (every rank computes the same value from the whole, e.g. the loss), so each
  rank's gradient of its rows is already complete and is just sliced out.
- :func:`halo_from_previous`: the last ``rows`` rows of the previous rank (point to point); the first rank
  gets ``fill``. Backward: the halo's gradient goes back to its owner and is added to its last rows.
- :func:`sum_over_sequence`: a no-gradient sum over the group (token counts, statistics).
- :func:`exchange_with_mirror`: a no-gradient point-to-point swap with the mirror rank ``cp - 1 - r`` (the
  DSA indexer's dual-chunk rebalance trades half a chunk of query inputs, then the picks, this way).

Every rank calls every exchange with the same shapes, so the autograd graphs (and the order of the backward's
collectives) agree on all ranks.

Transports. NCCL: a context-parallel sub-group, its all-gather and reduce-scatter, and send/recv for the halo
(even ranks send first, so the chain never deadlocks). gloo (the CPU tests): Paddle 3.3's gloo cannot carry
this: creating several sub-groups races in its rendezvous (intermittent "connection refused" with 4 ranks), and
its send/recv pair messages by a per-rank operation counter, so a chain in which the end ranks make fewer calls
than the middle ones hangs once cp > 2. So on gloo every exchange is one all-gather over the world group, from
which each rank keeps its group's pieces (the halo: the previous rank's tail; the reduce-scatter: its own rows of
every group member's gradient, added in rank order: identical bits on every rank, run to run). That moves more
than the algorithm needs; ``COMM_BYTES`` counts what the algorithm needs (the NCCL route's payload).

``COMM_BYTES`` counts, per exchange kind, the payload bytes this rank sends (what the algorithm must move:
an all-gather sends this rank's shard to each of the ``cp - 1`` others); the measuring scripts read it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from fleet_ext.parallel.layout import SequenceLayout

__all__ = [
    "COMM_BYTES",
    "ContextParallelGroup",
    "exchange_with_mirror",
    "gather_sequence",
    "halo_from_previous",
    "mirror_rank",
    "sum_over_sequence",
]

COMM_BYTES: collections.Counter = collections.Counter()


@dataclass(frozen=True)
class ContextParallelGroup:
    """A context-parallel process group: Paddle's group, its global ranks in order, the backend, and this
    process's index in the group."""

    group: Any
    ranks: tuple[int, ...]
    backend: str
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


def _cp(layout: SequenceLayout) -> ContextParallelGroup:
    group = layout.cp_group
    if not isinstance(group, ContextParallelGroup) or group.size != layout.cp_size:
        raise ValueError(
            f"context parallelism: the layout of rank {layout.cp_rank} of {layout.cp_size} needs a "
            f"ContextParallelGroup of {layout.cp_size} ranks as `cp_group`, got {group!r}"
        )
    return group


def _nbytes(x: paddle.Tensor) -> int:
    return int(x.size) * paddle.core.size_of_dtype(x.dtype)


def _all_gather(x: paddle.Tensor, cp: ContextParallelGroup) -> list[paddle.Tensor]:
    """Every group member's ``x``, in group order (gloo: gathered over the world, the group's pieces kept)."""
    pieces: list[paddle.Tensor] = []
    dist.all_gather(pieces, x.contiguous(), group=cp.group if cp.backend == "nccl" else None)
    return pieces if cp.backend == "nccl" else [pieces[rank] for rank in cp.ranks]


def _reduce_scatter(full: paddle.Tensor, axis: int, layout: SequenceLayout) -> paddle.Tensor:
    """Sum ``full`` over the group and keep this rank's shard of ``axis``, in a fixed order."""
    cp = _cp(layout)
    COMM_BYTES["reduce_scatter"] += _nbytes(full) * (cp.size - 1) // cp.size
    if cp.backend == "nccl":
        shards = [piece.contiguous() for piece in paddle.split(full, cp.size, axis=axis)]
        out = paddle.empty_like(shards[layout.cp_rank])
        dist.reduce_scatter(out, shards, group=cp.group)
        return out
    pieces = _all_gather(full, cp)  # gloo: no reduce-scatter; add the ranks' copies of my shard in rank order
    total = None
    for piece in pieces:
        mine = paddle.split(piece, cp.size, axis=axis)[layout.cp_rank]
        total = mine if total is None else total + mine
    return total


class _GatherSequence(PyLayer):
    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, axis: int, layout: SequenceLayout, backward: str) -> paddle.Tensor:
        cp = _cp(layout)
        ctx.axis, ctx.layout, ctx.mode, ctx.rows = axis, layout, backward, x.shape[axis]
        COMM_BYTES["all_gather"] += _nbytes(x) * (cp.size - 1)
        return paddle.concat(_all_gather(x, cp), axis=axis)

    @staticmethod
    def backward(ctx: Any, grad: paddle.Tensor) -> paddle.Tensor:
        if ctx.mode == "slice":
            start = ctx.layout.cp_rank * ctx.rows
            return paddle.slice(grad, [ctx.axis], [start], [start + ctx.rows])
        return _reduce_scatter(grad, ctx.axis, ctx.layout)


def gather_sequence(x: paddle.Tensor, layout: SequenceLayout, axis: int = 1, backward: str = "sum") -> paddle.Tensor:
    """This rank's shard ``x`` (sequence on ``axis``) -> the whole sequence, shards in rank order.

    ``backward``: ``"sum"`` (each rank consumes the whole differently: reduce-scatter the gradient) or
    ``"slice"`` (every rank computes the same thing from the whole: keep this rank's rows of the gradient).
    One process (``cp_size`` 1): ``x`` itself.
    """
    if backward not in ("sum", "slice"):
        raise ValueError(f"gather_sequence: `backward` must be 'sum' or 'slice', got {backward!r}")
    if layout.cp_size == 1:
        return x
    return _GatherSequence.apply(x, axis, layout, backward)


def _shift(x: paddle.Tensor, cp: ContextParallelGroup, forward: bool, fill: float) -> paddle.Tensor:
    """Group rank r's ``x`` delivered to rank r + 1 (``forward``) or r - 1; the rank with no sender gets ``fill``."""
    r, n = cp.rank, cp.size
    source = r - 1 if forward else r + 1
    if cp.backend != "nccl":
        pieces = _all_gather(x, cp)
        return pieces[source] if 0 <= source < n else paddle.full(x.shape, fill, dtype=x.dtype)
    target = r + 1 if forward else r - 1
    out = paddle.full(x.shape, fill, dtype=x.dtype)
    transfers = [lambda: dist.send(x.contiguous(), dst=cp.ranks[target], group=cp.group) if 0 <= target < n else None,
                 lambda: dist.recv(out, src=cp.ranks[source], group=cp.group) if 0 <= source < n else None]
    for transfer in transfers if r % 2 == 0 else transfers[::-1]:  # even ranks send first: no deadlock
        transfer()
    return out


class _HaloFromPrevious(PyLayer):
    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, rows: int, axis: int, layout: SequenceLayout, fill: float) -> paddle.Tensor:
        cp, r = _cp(layout), layout.cp_rank
        ctx.rows, ctx.axis, ctx.layout, ctx.length = rows, axis, layout, x.shape[axis]
        length = x.shape[axis]
        tail = paddle.slice(x, [axis], [length - rows], [length])
        if r < cp.size - 1:
            COMM_BYTES["halo"] += _nbytes(tail)
        return _shift(tail, cp, forward=True, fill=fill)

    @staticmethod
    def backward(ctx: Any, grad: paddle.Tensor) -> paddle.Tensor:
        cp, r, axis = _cp(ctx.layout), ctx.layout.cp_rank, ctx.axis
        if r > 0:
            COMM_BYTES["halo"] += _nbytes(grad)
        tail_grad = _shift(grad, cp, forward=False, fill=0.0)
        shape = list(grad.shape)
        shape[axis] = ctx.length - ctx.rows
        return paddle.concat([paddle.zeros(shape, dtype=grad.dtype), tail_grad], axis=axis)


def halo_from_previous(
    x: paddle.Tensor, rows: int, layout: SequenceLayout, axis: int = 1, fill: float = 0.0
) -> paddle.Tensor:
    """The previous rank's last ``rows`` rows of ``x`` along ``axis`` (``fill`` on the first rank).

    Needs ``rows <= x.shape[axis]`` (the halo comes from one neighbour; the config checks the length). Every
    rank of the group calls it, also the first (whose result is ``fill``), so the transfers pair up.
    """
    if layout.cp_size == 1:
        raise ValueError("halo_from_previous: one rank holds the whole sequence; there is no previous rank")
    if not 0 < rows <= x.shape[axis]:
        raise ValueError(
            f"halo_from_previous: need 0 < rows <= {x.shape[axis]} (this rank's rows on axis {axis}), got {rows}: "
            "a halo must come from the previous rank alone"
        )
    return _HaloFromPrevious.apply(x, rows, axis, layout, fill)


def sum_over_sequence(x: paddle.Tensor, layout: SequenceLayout) -> paddle.Tensor:
    """Sum of ``x`` over the context-parallel group, without gradient (``x`` itself with one rank)."""
    if layout.cp_size == 1:
        return x
    cp = _cp(layout)
    out = x.detach().clone()
    COMM_BYTES["all_reduce"] += _nbytes(out) * (cp.size - 1) // cp.size
    if cp.backend == "nccl":
        dist.all_reduce(out, group=cp.group)
        return out
    pieces = _all_gather(out, cp)  # fixed rank order: the same bits on every rank
    total = pieces[0]
    for piece in pieces[1:]:
        total = total + piece
    return total


def mirror_rank(layout: SequenceLayout) -> int:
    """The context-parallel rank whose chunk mirrors this rank's about the middle of the sequence: ``cp - 1 - r``
    (the middle rank of an odd group is its own mirror)."""
    return layout.cp_size - 1 - layout.cp_rank


def exchange_with_mirror(x: paddle.Tensor, layout: SequenceLayout) -> paddle.Tensor:
    """Send ``x`` to the mirror rank (:func:`mirror_rank`) and return what the mirror sent, without gradient.

    Both sides of a pair pass the same shape and dtype. NCCL: the lower rank of a pair sends first and the higher
    receives first, so each pair is one blocking send/recv exchange whatever the parity of ``cp`` (pairs are
    disjoint, so they never wait on each other). gloo: one all-gather over the world, like every exchange here
    (its send/recv pairing would break on the middle rank of an odd group, which sends nothing). A rank that is
    its own mirror gets ``x`` back. Every rank of the group must call it (same order of calls on every rank).
    """
    partner = mirror_rank(layout)
    own = partner == layout.cp_rank
    if own and (layout.cp_group is None or layout.cp_group.backend == "nccl"):
        return x  # needs nothing; only gloo's world all-gather (below) must see every rank
    cp = _cp(layout)
    if cp.backend != "nccl":
        if partner != layout.cp_rank:
            COMM_BYTES["mirror"] += _nbytes(x)
        return _all_gather(x.detach(), cp)[partner]
    mine = x.detach().contiguous()
    theirs = paddle.empty(mine.shape, dtype=mine.dtype)
    COMM_BYTES["mirror"] += _nbytes(mine)
    if layout.cp_rank < partner:
        dist.send(mine, dst=cp.ranks[partner], group=cp.group)
        dist.recv(theirs, src=cp.ranks[partner], group=cp.group)
    else:
        dist.recv(theirs, src=cp.ranks[partner], group=cp.group)
        dist.send(mine, dst=cp.ranks[partner], group=cp.group)
    return theirs
