"""The ``parallel`` section: the parallel layout (PaddleFleet / Megatron names)."""

from __future__ import annotations

from dataclasses import dataclass

from fleet_ext.config.fields import POSITIVE, Section, fail, key_field, not_yet

__all__ = ["CP_BALANCE_MODES", "ParallelConfig"]

_key = key_field
# Only what DSv4 layers accept: each CP rank must hold one contiguous run of positions, because the
# compressors pool consecutive tokens and the window/compressed index tables are offsets into one run.
# PaddleFleet's default `dualchunk_allgather` (zigzag) is refused by its DSv4 layers as well.
CP_BALANCE_MODES = ("contiguous_allgather",)


@dataclass
class ParallelConfig(Section):
    """Parallel layout. DSv4 attention has no tensor parallelism (as in PaddleFleet)."""

    tensor_model_parallel_size: int = _key(1, "Tensor parallelism; must be 1 for DSv4 attention.", domain=POSITIVE)
    pipeline_model_parallel_size: int = _key(1, "Pipeline parallelism.", domain=POSITIVE)
    context_parallel_size: int = _key(1, "Context parallelism over the sequence.", domain=POSITIVE)
    expert_model_parallel_size: int = _key(1, "Expert parallelism of the routed experts.", domain=POSITIVE)
    sequence_parallel: bool = _key(False, "Megatron sequence parallelism (needs tensor parallelism).")
    cp_balance_mode: str = _key(
        "contiguous_allgather",
        "CP token layout. Only contiguous_allgather: DSv4 layers need contiguous sequence shards (compressors "
        "pool consecutive tokens), so PaddleFleet's default dualchunk_allgather (zigzag) is not offered.",
        CP_BALANCE_MODES,
        fix="use `cp_balance_mode: contiguous_allgather`: DSv4 compressors need contiguous sequence shards, "
        "as in PaddleFleet",
    )

    def validate(self) -> None:
        if self.tensor_model_parallel_size != 1:
            fail(
                "tensor_model_parallel_size",
                self.tensor_model_parallel_size,
                "1",
                "DSv4 hybrid attention does not support tensor parallelism (as in PaddleFleet); "
                "scale with data, expert or context parallelism instead",
            )
        if self.sequence_parallel:
            fail("sequence_parallel", True, "false", "sequence parallelism needs tensor parallelism, which DSv4 lacks")
        if self.pipeline_model_parallel_size != 1:
            not_yet(
                "pipeline_model_parallel_size", self.pipeline_model_parallel_size, "pipeline parallelism", "set it to 1"
            )
        if self.context_parallel_size != 1:
            not_yet(
                "context_parallel_size",
                self.context_parallel_size,
                "context parallelism",
                "set it to 1 until the CP issue lands",
            )
        if self.expert_model_parallel_size != 1:
            not_yet(
                "expert_model_parallel_size",
                self.expert_model_parallel_size,
                "expert parallelism",
                "set it to 1 until the EP issue lands",
            )
