"""Expert parallelism: expert groups, token dispatch with autograd, expert-gradient reduction, on gloo and NCCL.

Layout (Megatron's, with expert tensor parallelism 1): the ``world = dp x cp`` ranks are cut into expert groups of
``ep`` consecutive ranks; rank ``r`` is expert rank ``r % ep`` of expert group ``r // ep`` and owns the routed experts
``[(r % ep) * L, (r % ep + 1) * L)`` of every MoE layer (``L = n_routed_experts / ep``). The ranks with the same
expert rank form an expert-data-parallel group (``dp x cp / ep`` ranks) over which the expert gradients are summed.

One MoE layer's forward on each rank (:func:`dispatch_rows` / :func:`combine_rows`):

1. the rank routes its own tokens and sorts its (token, slot) rows by expert (``permute``); the rows of one owner
   are a contiguous block;
2. per-expert counts are exchanged (every rank learns how many rows every member sends to every expert);
3. dispatch: ``alltoall`` sends each block to its owner; ``allgather`` gives every member all the group's tokens
   and routing, and each owner builds its rows itself (same rows, same order);
4. each owner runs each local expert once per source rank, on that source's rows (so an expert's weight gradient
   is a sum of per-source partials, as under data parallelism: with two sources the sum is exact whichever comes
   first, which makes EP=2 bitwise equal to DP=2);
5. combine: the outputs travel back to their sources in the order they came (an all-to-all), where ``unpermute``
   weighs and adds them exactly as one process does.

Backward: the transposed exchanges (:class:`_Exchange` sends gradients back along the forward's routes; the
``allgather`` dispatch returns the row gradients to their sources, which add them onto their tokens in row order,
as ``permute``'s own backward does).

Transports. NCCL: real sub-groups, ``all_gather`` and ``alltoall_single`` with split sizes (not exercised by this
repository's CPU tests). gloo (the CPU tests): Paddle 3.3's gloo cannot carry sub-group collectives reliably
(``cp_collectives``' docstring), so every exchange is one all-gather over the WORLD group that every rank calls in
the same order: the per-destination blocks padded to the largest block in the world, each rank keeping what is
addressed to it, in source order. That moves more than the algorithm; ``COMM_BYTES`` counts what the algorithm
sends (the NCCL route's payload): rows to other ranks only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

from fleet_ext.parallel.cp_collectives import COMM_BYTES

__all__ = [
    "DISPATCHERS",
    "ExpertParallelGroup",
    "DispatchLayout",
    "build_expert_groups",
    "gather_counts",
    "layout_of",
    "dispatch_rows",
    "combine_rows",
    "reduce_expert_gradients_",
    "expert_grad_square_sums",
]

DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class ExpertParallelGroup:
    """This rank's expert group (``ranks``, in order; ``rank``: its index) and expert-data-parallel group
    (``edp_ranks``), the backend, the dispatcher, and the world size (gloo exchanges span the world)."""

    group: Any
    ranks: tuple[int, ...]
    edp_group: Any
    edp_ranks: tuple[int, ...]
    backend: str
    rank: int
    world_size: int
    dispatcher: str = "alltoall"

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def nccl(self) -> bool:
        return self.backend == "nccl"

    def local_experts(self, num_experts: int) -> range:
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


def build_expert_groups(rank: int, world_size: int, backend: str, ep: int, dispatcher: str = "alltoall"
                        ) -> ExpertParallelGroup | None:
    """Carve the expert and expert-data-parallel groups out of the world (None for ``ep`` 1). Every rank creates
    every NCCL group in the same order; gloo creates none (world collectives, see the module docstring)."""
    if ep == 1:
        return None
    if ep < 1 or world_size % ep:
        raise ValueError(
            f"config key `expert_model_parallel_size` = {ep} is invalid: allowed a divisor of the number of launched "
            f"processes ({world_size}). Fix: launch a multiple of {ep} processes or change expert_model_parallel_size"
        )
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"config key `moe_token_dispatcher_type` = {dispatcher!r} is invalid: allowed {DISPATCHERS}")
    nccl = backend == "nccl"
    ep_groups = [tuple(range(g * ep, (g + 1) * ep)) for g in range(world_size // ep)]
    edp_groups = [tuple(range(i, world_size, ep)) for i in range(ep)]
    made = {ranks: (dist.new_group(list(ranks)) if nccl else None) for ranks in [*ep_groups, *edp_groups]}
    mine, edp = ep_groups[rank // ep], edp_groups[rank % ep]
    return ExpertParallelGroup(made[mine], mine, made[edp], edp, backend, rank % ep, world_size, dispatcher)


def _nbytes_row(x: paddle.Tensor) -> int:
    return int(np.prod(x.shape[1:])) * paddle.core.size_of_dtype(x.dtype)


def _world_gather(x: paddle.Tensor) -> list[paddle.Tensor]:
    pieces: list[paddle.Tensor] = []
    dist.all_gather(pieces, x.contiguous())
    return pieces


# --------------------------------------------------------------------------------------------------
# Counts and the layout of one dispatch.
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DispatchLayout:
    """Who sends how many rows to whom in one MoE layer. ``counts[s, e]``: rows expert-group member ``s`` routes to
    global expert ``e``; ``pad``: the largest block any rank of the world sends (gloo pads every block to it)."""

    counts: np.ndarray
    rank: int
    pad: int
    topk: int
    token_pad: int  # the most tokens any rank of the world (gloo) or group (NCCL) holds: allgather's common length

    @property
    def size(self) -> int:
        return self.counts.shape[0]

    @property
    def per_rank(self) -> int:
        return self.counts.shape[1] // self.size

    def blocks(self, source: int) -> list[int]:
        """Rows ``source`` sends to each member (its rows of that member's experts)."""
        return self.counts[source].reshape(self.size, self.per_rank).sum(axis=1).tolist()

    @property
    def send(self) -> list[int]:
        return self.blocks(self.rank)

    @property
    def recv(self) -> list[int]:
        return [self.blocks(s)[self.rank] for s in range(self.size)]

    def local_counts(self, source: int) -> list[int]:
        """Rows ``source`` sends to each of this rank's experts."""
        lo = self.rank * self.per_rank
        return self.counts[source, lo : lo + self.per_rank].tolist()


def gather_counts(counts: paddle.Tensor, epg: ExpertParallelGroup) -> paddle.Tensor:
    """[world (gloo) or ep (NCCL), E] int64 on the device: each rank's ``counts`` [E] (one small all-gather; read
    it with the caller's other host values, then :func:`layout_of`)."""
    pieces = _world_gather(counts) if not epg.nccl else _group_gather(counts, epg)
    return paddle.stack(pieces)


def layout_of(table: np.ndarray, topk: int, epg: ExpertParallelGroup) -> DispatchLayout:
    """The dispatch layout from :func:`gather_counts`' table, on the host."""
    ep = epg.size
    pad = max(int(table.reshape(table.shape[0], ep, -1).sum(axis=2).max()), 1)
    token_pad = max(int(table.sum(axis=1).max()) // topk, 1)
    group = table if epg.nccl else table[list(epg.ranks)]
    return DispatchLayout(group, epg.rank, pad, topk, token_pad)


def _group_gather(x: paddle.Tensor, epg: ExpertParallelGroup) -> list[paddle.Tensor]:
    pieces: list[paddle.Tensor] = []
    dist.all_gather(pieces, x.contiguous(), group=epg.group)
    return pieces


# --------------------------------------------------------------------------------------------------
# The all-to-all with variable sizes and its autograd.
# --------------------------------------------------------------------------------------------------
def _all_to_all(x: paddle.Tensor, send: list[int], recv: list[int], pad: int, epg: ExpertParallelGroup
                ) -> paddle.Tensor:
    """``x`` = this rank's blocks for members 0..ep-1 concatenated (``send`` rows each) -> the blocks the members
    sent here, concatenated in member order (``recv`` rows each)."""
    COMM_BYTES["ep_all_to_all"] += sum(n for j, n in enumerate(send) if j != epg.rank) * _nbytes_row(x)
    width = list(x.shape[1:])
    if epg.nccl:
        out = paddle.empty([sum(recv), *width], dtype=x.dtype)
        dist.alltoall_single(out, x.contiguous(), send, recv, group=epg.group)
        return out
    starts = np.concatenate([[0], np.cumsum(send)]).tolist()
    padded = []
    for j, n in enumerate(send):
        block = x[starts[j] : starts[j] + n]
        padded.append(paddle.concat([block, paddle.zeros([pad - n, *width], dtype=x.dtype)]) if n < pad else block)
    pieces = _world_gather(paddle.stack(padded))  # [ep, pad, ...] from every rank of the world
    got = [pieces[source][epg.rank, :n] for source, n in zip(epg.ranks, recv)]
    return paddle.concat(got, axis=0) if got else x[:0]


class _Exchange(PyLayer):
    """All-to-all of row blocks; the backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, send: list, recv: list, pad: int, epg: ExpertParallelGroup
                ) -> paddle.Tensor:
        ctx.send, ctx.recv, ctx.pad, ctx.epg = send, recv, pad, epg
        return _all_to_all(x, send, recv, pad, epg)

    @staticmethod
    def backward(ctx: Any, grad: paddle.Tensor) -> paddle.Tensor:
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.pad, ctx.epg)


def _sorted_tokens(indices: paddle.Tensor) -> paddle.Tensor:
    """Token of each expert-sorted row: the order of the reference ``permute`` (stable sort by expert)."""
    return paddle.argsort(indices.reshape([-1]), stable=True) // indices.shape[-1]


class _GatherTokens(PyLayer):
    """``allgather`` dispatch: every member's tokens and routing reach every member, which gathers the rows of its
    experts (the same rows, in the same order, as ``alltoall`` delivers). Backward: each owner returns its row
    gradients to their sources (all-to-all), which add them onto their tokens in row order (``permute``'s order)."""

    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, indices: paddle.Tensor, layout: DispatchLayout, epg: ExpertParallelGroup
                ) -> paddle.Tensor:
        ctx.layout, ctx.epg, ctx.tokens = layout, epg, x.shape[0]
        ctx.token_of = _sorted_tokens(indices)
        tokens = [int(layout.counts[s].sum()) // layout.topk for s in range(layout.size)]
        COMM_BYTES["ep_all_gather"] += (epg.size - 1) * x.shape[0] * (
            _nbytes_row(x) + layout.topk * paddle.core.size_of_dtype(indices.dtype))
        xs = _gather_padded(x, tokens, layout.token_pad, epg)
        ids = _gather_padded(indices, tokens, layout.token_pad, epg)
        lo = epg.rank * layout.per_rank
        rows = []
        for s in range(layout.size):
            start, n = int(layout.counts[s, :lo].sum()), layout.recv[s]
            if n:
                rows.append(paddle.gather(xs[s], _sorted_tokens(ids[s])[start : start + n], axis=0))
        return paddle.concat(rows, axis=0) if rows else x[:0]

    @staticmethod
    def backward(ctx: Any, grad: paddle.Tensor) -> tuple:
        layout = ctx.layout
        row_grads = _all_to_all(grad, layout.recv, layout.send, layout.pad, ctx.epg)
        out = paddle.zeros([ctx.tokens, grad.shape[-1]], dtype=grad.dtype)
        return paddle.index_add(out, ctx.token_of, 0, row_grads), None


def _gather_padded(x: paddle.Tensor, tokens: list[int], longest: int, epg: ExpertParallelGroup
                   ) -> list[paddle.Tensor]:
    """Every member's ``x`` (its first ``tokens[s]`` rows), in member order, through a common padded length."""
    full = x
    if longest > x.shape[0]:
        full = paddle.concat([x, paddle.zeros([longest - x.shape[0], *x.shape[1:]], dtype=x.dtype)])
    pieces = _group_gather(full, epg) if epg.nccl else _keep_group(_world_gather(full), epg)
    return [piece[:n] for piece, n in zip(pieces, tokens)]


def _keep_group(pieces: list[paddle.Tensor], epg: ExpertParallelGroup) -> list[paddle.Tensor]:
    return [pieces[r] for r in epg.ranks]


def dispatch_rows(x_sorted: paddle.Tensor, hidden_states: paddle.Tensor, indices: paddle.Tensor,
                  layout: DispatchLayout, epg: ExpertParallelGroup) -> paddle.Tensor:
    """The rows of this rank's experts from every member, concatenated by source, each source's rows sorted by
    expert. ``alltoall`` sends ``x_sorted`` (this rank's expert-sorted rows); ``allgather`` gathers tokens."""
    if epg.dispatcher == "allgather":
        return _GatherTokens.apply(hidden_states, indices, layout, epg)
    return _Exchange.apply(x_sorted, layout.send, layout.recv, layout.pad, epg)


def combine_rows(y: paddle.Tensor, layout: DispatchLayout, epg: ExpertParallelGroup) -> paddle.Tensor:
    """Expert outputs (laid out as :func:`dispatch_rows` delivered the rows) back to their sources: this rank's rows
    in its expert-sorted order, ready for ``unpermute``."""
    return _Exchange.apply(y, layout.recv, layout.send, layout.pad, epg)


# --------------------------------------------------------------------------------------------------
# Gradients of the expert shards.
# --------------------------------------------------------------------------------------------------
def _present_anywhere(params: list) -> list[bool]:
    """Whether some rank of the world holds a gradient of each parameter (a world all-reduce of flags)."""
    flags = paddle.to_tensor([0.0 if p.grad is None else 1.0 for p in params], dtype="float32")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags)
    return [v > 0.0 for v in flags.tolist()]


def reduce_expert_gradients_(params: list, scale: float, epg: ExpertParallelGroup) -> None:
    """Sum the expert shards' gradients over the expert-data-parallel group, then multiply by ``scale`` (the dense
    parameters' 1 / (accumulation x dp)), in place.

    Each shard's gradient already sums its experts' per-source partials over the expert group (the dispatch's
    backward); the expert-data-parallel sum adds the other expert groups'. A shard no rank touched keeps no gradient
    on every rank, and a shard whose experts got no rows here while some rank's shard did gets zeros (data
    parallelism would hold a gradient of the whole stacked weight then; AdamW must update it the same way).
    gloo: one world all-gather of the packed gradients per call (every rank calls it; members' pieces added in
    rank order: the same bits on every rank of the group); NCCL: an all-reduce over the group.
    """
    present = _present_anywhere(params)
    with paddle.no_grad():
        for p, seen in zip(params, present):
            if seen and p.grad is None:
                p._copy_gradient_from(paddle.zeros(p.shape, dtype=p.dtype))
        live = [p for p, seen in zip(params, present) if seen]
        if not live:
            return
        if len(epg.edp_ranks) > 1:
            flat = paddle.concat([p.grad.astype("float32").reshape([-1]) for p in live])
            if epg.nccl:
                dist.all_reduce(flat, group=epg.edp_group)
            else:
                pieces = _world_gather(flat)
                flat = pieces[epg.edp_ranks[0]]
                for r in epg.edp_ranks[1:]:
                    flat = flat + pieces[r]
            offset = 0
            for p in live:
                n = int(p.size)
                paddle.assign(flat[offset : offset + n].reshape(p.shape).astype(p.dtype), output=p.grad)
                offset += n
        if scale != 1.0:
            for p in live:
                paddle.assign(p.grad.scale(scale) if p.grad.dtype == paddle.float32
                              else (p.grad.astype("float32") * scale).astype(p.dtype), output=p.grad)


def expert_grad_square_sums(params: list, epg: ExpertParallelGroup) -> dict[int, paddle.Tensor]:
    """{id(param): sum of squares of the whole (unsharded) gradient} for the expert shards that hold a gradient.

    The shards of the expert group are gathered (in expert order, axis 0) and squared-summed as one process sums
    the whole stacked weight, so the global gradient norm (and the clipping) equals the unsharded run's bit for bit
    (CPU). The price is one temporary unsharded gradient per parameter; every rank calls the same gathers.
    """
    out: dict[int, paddle.Tensor] = {}
    with paddle.no_grad():
        for p in params:
            if p.grad is None:
                continue
            g = p.grad.astype("float32")
            pieces = _group_gather(g, epg) if epg.nccl else _keep_group(_world_gather(g), epg)
            out[id(p)] = paddle.sum(paddle.square(paddle.concat(pieces, axis=0)))
    return out
