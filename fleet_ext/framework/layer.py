"""Base layer: a Paddle Layer that can describe its parameters as FlexCheckpoint shards."""

from __future__ import annotations

import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight


def normal_init(std: float) -> paddle.nn.initializer.Initializer:
    """``Normal(0, std)``: the initialiser of every fleet_ext weight matrix (``init_method_std``)."""
    return paddle.nn.initializer.Normal(mean=0.0, std=std)


class FleetLayer(paddle.nn.Layer):
    """Every fleet_ext layer derives from this.

    ``sharded_state_dict`` returns the stock (unfused, unsharded) names with each tensor described as
    a FlexCheckpoint ``ShardedWeight``. Without tensor/expert sharding every weight is replicated:
    local shape = global shape, offset 0. Parallel layers override ``_shard_of`` for the tensors they
    split, so the saved layout stays the unsharded one (DESIGN.md rule 7).
    """

    def sharded_state_dict(self, structured_name_prefix: str = "") -> dict[str, ShardedWeight]:
        out: dict[str, ShardedWeight] = {}
        for name, tensor in self.state_dict(structured_name_prefix=structured_name_prefix).items():
            local_shape, global_shape, offset = self._shard_of(name, tensor)
            out[name] = ShardedWeight(
                key=name,
                local_tensor=tensor,
                local_shape=local_shape,
                global_shape=global_shape,
                global_offset=offset,
            )
        return out

    def _shard_of(self, name: str, tensor: paddle.Tensor) -> tuple[tuple, tuple, tuple]:
        shape = tuple(tensor.shape)
        return shape, shape, tuple(0 for _ in shape)
