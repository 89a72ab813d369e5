"""Data-parallel plumbing over ``paddle.distributed`` that works on gloo (CPU) and NCCL (GPU).

Only collectives that gloo implements are used (all_reduce, broadcast, all_gather_object, barrier; gloo
has no reduce_scatter / all_to_all). Gradients travel as one coalesced fp32 buffer per step, so a step is
one all_reduce whatever the number of parameters. With one process every call is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import paddle
import paddle.distributed as dist

__all__ = ["DistEnv", "env_world", "init_distributed"]


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

    def reduce_gradients_(self, params: list, scale: float) -> None:
        """Sum gradients over ranks, then multiply by ``scale`` (1 / (accumulation * world)).

        One flat fp32 buffer holds every gradient plus one presence flag per parameter, so a parameter that
        got a gradient on some ranks only (an expert no local token chose) ends up with the same summed
        gradient everywhere; a parameter no rank touched keeps ``grad is None`` on every rank (as AdamW
        then skips it, exactly as one process would). Summing two addends is commutative in IEEE
        arithmetic, so DP=2 reproduces DP=1 with 2 accumulation steps bit for bit.
        """
        if not self.enabled and scale == 1.0:
            return
        sizes = [int(p.size) for p in params]
        bodies, flags = [], []
        for p, n in zip(params, sizes):
            g = p.grad
            bodies.append(g.astype("float32").reshape([-1]) if g is not None else paddle.zeros([n], "float32"))
            flags.append(0.0 if g is None else 1.0)
        total = sum(sizes)
        flat = paddle.concat([*bodies, paddle.to_tensor(flags, dtype="float32")])
        self.all_reduce_sum_(flat)
        present = flat[total:].tolist()  # one host sync for all presence flags
        flat = flat[:total]
        if scale != 1.0:
            flat = flat * scale
        offset = 0
        with paddle.no_grad():
            for p, n, seen in zip(params, sizes, present):
                body = flat[offset : offset + n]
                offset += n
                if seen == 0.0:
                    continue
                value = body.reshape(p.shape).astype(p.dtype)
                if p.grad is None:
                    p._copy_gradient_from(value)
                else:
                    paddle.assign(value, output=p.grad)


def init_distributed() -> DistEnv:
    """Join the launcher's process group when there is more than one process (gloo on CPU, NCCL on GPU)."""
    _, world = env_world()
    if world > 1:
        dist.init_parallel_env()
        backend = str(dist.get_backend()).lower()
        return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=backend)
    return DistEnv(rank=0, world_size=1, backend="none (one process)")
