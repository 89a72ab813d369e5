"""Data-parallel plumbing over ``paddle.distributed`` that works on gloo (CPU) and NCCL (GPU).

Only collectives that gloo implements are used (all_reduce, broadcast, all_gather_object, barrier; gloo
has no reduce_scatter / all_to_all). Gradients travel in buckets (``BUCKET_ELEMENTS`` numbers), reduced in
place, so a step is a handful of all_reduces whatever the number of parameters and never holds an fp32 copy of
every gradient. With one process every call is a no-op (the gradient scaling excepted).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import paddle
import paddle.distributed as dist

from fleet_ext.parallel.cp_collectives import ContextParallelGroup
from fleet_ext.parallel.expert_parallel import ExpertParallelGroup, build_expert_groups

__all__ = ["BUCKET_ELEMENTS", "DistEnv", "ParallelTopology", "env_world", "init_distributed"]

BUCKET_ELEMENTS = 1 << 23  # 8 Mi numbers (32 MiB of fp32) per gradient all-reduce bucket


def env_world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment, readable before any process group exists."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0")), int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


@dataclass
class DistEnv:
    rank: int
    world_size: int
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    # -- collectives -----------------------------------------------------------------------------------
    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_sum_(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """In-place sum over ranks (a no-op with one process)."""
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast_(self, tensor: paddle.Tensor, src: int = 0) -> paddle.Tensor:
        if self.enabled:
            dist.broadcast(tensor, src=src)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = []
        dist.all_gather_object(out, obj)
        return out

    def agree(self, value: Any, what: str) -> Any:
        """Check that every rank holds the same ``value`` (e.g. the resume step); raise naming ``what`` if not."""
        values = self.all_gather_object(value)
        if any(v != values[0] for v in values):
            raise RuntimeError(f"ranks disagree on {what}: {values}")
        return values[0]

    # -- data parallel ---------------------------------------------------------------------------------
    def broadcast_parameters(self, model: paddle.nn.Layer) -> None:
        """Rank 0's parameters and persistable buffers on every rank (one broadcast each)."""
        if not self.enabled:
            return
        with paddle.no_grad():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)

    def reduce_gradients_(self, params: list, scale: float, bucket_elements: int = BUCKET_ELEMENTS) -> None:
        """Sum gradients over ranks, then multiply by ``scale`` (1 / (accumulation * world)), in place.

        A parameter that got a gradient on some ranks only (an expert no local token chose) ends up with the same
        summed gradient everywhere; a parameter no rank touched keeps ``grad is None`` on every rank (as AdamW then
        skips it, exactly as one process would). One presence flag per parameter is all-reduced first (one small
        collective and the reduction's one device-to-host read); then the gradients travel in buckets of at most
        ``bucket_elements`` numbers (a larger gradient alone): a bucket of one fp32 gradient is all-reduced and
        scaled where it lies, the others are packed into one fp32 buffer and written back, so the reduction never
        holds an fp32 copy of more than one bucket. Summing two addends is commutative in IEEE arithmetic and every
        path scales with the same op (Paddle's ``scale``), so DP=2 reproduces DP=1 with 2 accumulation steps bit
        for bit. With one process the gradients are only scaled, in place.
        """
        if not self.enabled:
            if scale != 1.0:
                with paddle.no_grad():
                    for p in params:
                        if p.grad is not None:
                            _scale_(p.grad, scale)
            return
        present = paddle.to_tensor([0.0 if p.grad is None else 1.0 for p in params], dtype="float32")
        seen = [v > 0.0 for v in self.all_reduce_sum_(present).tolist()]  # one host read for all presence flags
        with paddle.no_grad():
            for bucket in _buckets([p for p, s in zip(params, seen) if s], bucket_elements):
                self._reduce_bucket_(bucket, scale)

    def _reduce_bucket_(self, bucket: list, scale: float) -> None:
        """All-reduce and scale one bucket of parameters that have a gradient on some rank."""
        first = bucket[0]
        if len(bucket) == 1 and first.grad is not None and first.grad.dtype == paddle.float32:
            _scale_(self.all_reduce_sum_(first.grad), scale)  # in place, no copy
            return
        flat = paddle.concat([
            p.grad.astype("float32").reshape([-1]) if p.grad is not None else paddle.zeros([int(p.size)], "float32")
            for p in bucket
        ])
        self.all_reduce_sum_(flat)
        _scale_(flat, scale)
        offset = 0
        for p in bucket:
            n = int(p.size)
            value = flat[offset : offset + n].reshape(p.shape).astype(p.dtype)
            offset += n
            if p.grad is None:
                p._copy_gradient_from(value)
            else:
                paddle.assign(value, output=p.grad)


def _scale_(tensor: paddle.Tensor, scale: float) -> paddle.Tensor:
    """``tensor *= scale`` in place, through fp32 for other dtypes; Paddle's ``scale`` op, which ``x * float`` is too
    (so the bits equal the out-of-place product's)."""
    if scale == 1.0:
        return tensor
    if tensor.dtype == paddle.float32:
        return tensor.scale_(scale)
    paddle.assign((tensor.astype("float32") * scale).astype(tensor.dtype), output=tensor)
    return tensor


def _buckets(params: list, bucket_elements: int) -> list[list]:
    """``params`` in order, cut into runs of at most ``bucket_elements`` numbers (a larger one alone)."""
    out: list[list] = []
    size = 0
    for p in params:
        n = int(p.size)
        if not out or size + n > bucket_elements:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def init_distributed() -> DistEnv:
    """Join the launcher's process group when there is more than one process (gloo on CPU, NCCL on GPU)."""
    _, world = env_world()
    if world > 1:
        dist.init_parallel_env()
        backend = str(dist.get_backend()).lower()
        return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=backend)
    return DistEnv(rank=0, world_size=1, backend="none (one process)")


@dataclass(frozen=True)
class ParallelTopology:
    """How the ``world = dp x cp`` ranks split: context parallelism is the inner group (Megatron's order), so
    rank ``r`` is context-parallel rank ``r % cp`` of data-parallel rank ``r // cp``; the ``cp`` ranks of one
    data-parallel rank read the same samples and each keeps its contiguous chunk of the sequence."""

    dp_size: int
    cp_size: int
    dp_rank: int
    cp_rank: int
    cp_group: ContextParallelGroup | None = None
    ep_group: ExpertParallelGroup | None = None  # expert parallelism (carved from data x context; None: ep 1)

    @property
    def ep_size(self) -> int:
        return self.ep_group.size if self.ep_group is not None else 1

    @classmethod
    def build(cls, env: DistEnv, cp_size: int, ep_size: int = 1, dispatcher: str = "alltoall") -> ParallelTopology:
        """Carve the context-parallel groups, then the expert groups, out of the world (every rank creates every
        group, in order)."""
        topology = cls._build_cp(env, cp_size)
        if ep_size == 1:
            return topology
        ep = build_expert_groups(env.rank, env.world_size, env.backend, ep_size, dispatcher)
        return dataclasses.replace(topology, ep_group=ep)

    @classmethod
    def _build_cp(cls, env: DistEnv, cp_size: int) -> ParallelTopology:
        """Carve the context-parallel groups out of the world (every rank creates every group, in order)."""
        if cp_size < 1 or env.world_size % cp_size:
            raise ValueError(
                f"config key `context_parallel_size` = {cp_size} is invalid: allowed a divisor of the number of "
                f"launched processes ({env.world_size}), as world = data parallel x context parallel. Fix: launch "
                f"a multiple of {cp_size} processes (--nproc_per_node) or change context_parallel_size"
            )
        dp_size, dp_rank, cp_rank = env.world_size // cp_size, env.rank // cp_size, env.rank % cp_size
        if cp_size == 1:
            return cls(dp_size, 1, dp_rank, 0)
        mine = None
        for d in range(dp_size):
            ranks = tuple(range(d * cp_size, (d + 1) * cp_size))
            # gloo: point-to-point over the world group (see cp_collectives); NCCL: a real sub-group.
            group = dist.new_group(list(ranks)) if env.backend == "nccl" else None
            if d == dp_rank:
                mine = ContextParallelGroup(group, ranks, env.backend, cp_rank)
        return cls(dp_size, cp_size, dp_rank, cp_rank, mine)

    def describe(self) -> str:
        """One line for the start-up table."""
        if self.ep_group is not None:
            ep = self.ep_group
            return (
                f"data {self.dp_size} x context {self.cp_size}, experts over {ep.size} ranks ({ep.dispatcher}; "
                f"expert-data-parallel {len(ep.edp_ranks)}; this rank: expert rank {ep.rank})"
            )
        if self.cp_size == 1:
            return f"data {self.dp_size} x context 1"
        return (
            f"data {self.dp_size} x context {self.cp_size} (contiguous chunks; this rank: data rank {self.dp_rank}, "
            f"context rank {self.cp_rank})"
        )
