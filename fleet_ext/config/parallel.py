"""The ``parallel`` section: the parallel layout (PaddleFleet / Megatron names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet_ext.config.fields import POSITIVE, Section, fail, key_field, not_yet
from fleet_ext.layer_kinds import LayerKind, layer_attention

__all__ = [
    "CP_BALANCE_MODES",
    "DISPATCHER_TYPES",
    "MQA_INDEXER_CP_MODES",
    "ParallelConfig",
    "check_context_parallel",
    "check_expert_parallel",
]

_key = key_field
# Only what DSv4 layers accept: each CP rank must hold one contiguous run of positions, because the
# compressors pool consecutive tokens and the window/compressed index tables are offsets into one run.
# PaddleFleet's default `dualchunk_allgather` (zigzag) is refused by its DSv4 layers as well.
CP_BALANCE_MODES = ("contiguous_allgather",)
# How the -2 layers' DSA indexer shares its causal top-k scoring out over the CP ranks (PaddleFleet's
# `mqa_indexer_cp_mode`, whose only value is dualchunk_p2p; unset there means contiguous).
MQA_INDEXER_CP_MODES = ("contiguous", "dualchunk_p2p")
# Expert-parallel token dispatchers (PaddleFleet's `moe_token_dispatcher_type`; deepep / hybridep are GPU libraries).
DISPATCHER_TYPES = ("alltoall", "allgather")


@dataclass
class ParallelConfig(Section):
    """Parallel layout. DSv4 attention has no tensor parallelism (as in PaddleFleet)."""

    tensor_model_parallel_size: int = _key(1, "Tensor parallelism; must be 1 for DSv4 attention.", domain=POSITIVE)
    pipeline_model_parallel_size: int = _key(1, "Pipeline parallelism.", domain=POSITIVE)
    context_parallel_size: int = _key(1, "Context parallelism over the sequence.", domain=POSITIVE)
    expert_model_parallel_size: int = _key(1, "Expert parallelism of the routed experts.", domain=POSITIVE)
    sequence_parallel: bool = _key(False, "Megatron sequence parallelism (needs tensor parallelism).")
    moe_token_dispatcher_type: str = _key(
        "alltoall",
        "How routed tokens reach the ranks owning their experts under expert parallelism (PaddleFleet's key). "
        "alltoall: each rank sends each (token, expert) row to the expert's owner and gets the outputs back. "
        "allgather: every rank of the expert group receives all the group's tokens and routing and builds the "
        "rows its experts need itself (more traffic, no per-destination split); outputs return as with alltoall. "
        "Both give the same bits. No effect with expert_model_parallel_size 1.",
        DISPATCHER_TYPES,
        fix="use `moe_token_dispatcher_type: alltoall` (the default) or `allgather`; PaddleFleet's deepep / "
        "hybridep need their GPU libraries",
    )
    cp_balance_mode: str = _key(
        "contiguous_allgather",
        "CP token layout. Only contiguous_allgather: DSv4 layers need contiguous sequence shards (compressors "
        "pool consecutive tokens), so PaddleFleet's default dualchunk_allgather (zigzag) is not offered.",
        CP_BALANCE_MODES,
        fix="use `cp_balance_mode: contiguous_allgather`: DSv4 compressors need contiguous sequence shards, "
        "as in PaddleFleet",
    )
    mqa_indexer_cp_mode: str = _key(
        "contiguous",
        "Who scores the -2 layers' DSA indexer top-k under context parallelism (sparse phase). contiguous: each "
        "rank its own chunk's queries against the keys before its chunk's end, so the last rank scores the most. "
        "dualchunk_p2p (PaddleFleet): each rank trades the second half of its chunk's indexer queries with rank "
        "cp-1-r (point to point) and sends the picks back, so every rank scores one early and one late "
        "half-chunk (equal work for an even chunk length; the same picks as contiguous, checked bit for bit on "
        "CPU). The KL loss's scores stay local. No effect with context_parallel_size 1 or outside the sparse phase.",
        MQA_INDEXER_CP_MODES,
        fix="use `mqa_indexer_cp_mode: contiguous` (the default) or `dualchunk_p2p`",
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


def check_context_parallel(model: Any, max_seq_len: int, cp: int) -> None:
    """The sequence rules of context parallelism (contiguous chunks of ``max_seq_len / cp`` tokens per rank).

    Each rank compresses the blocks of its own chunk, so every compression rate must divide the chunk; a
    query's window reaches back ``W - 1`` positions and that halo comes from the previous rank alone, so the
    chunk must hold at least ``W - 1`` tokens.
    """
    if cp == 1:
        return
    if max_seq_len % cp:
        fail("context_parallel_size", cp, f"a divisor of max_seq_len ({max_seq_len})",
             f"choose max_seq_len as a multiple of {cp} or another context_parallel_size")
    if model.num_nextn_predict_layers:
        not_yet("num_nextn_predict_layers", model.num_nextn_predict_layers, "MTP under context parallelism (depth k "
                "reads the token k places ahead, which crosses into the next rank's chunk)",
                "set num_nextn_predict_layers: 0, or context_parallel_size: 1")
    chunk = max_seq_len // cp
    for i in range(model.num_hidden_layers):
        attention = layer_attention(model, i)
        ratio, window = attention.compress_ratio, attention.window
        if ratio and chunk % ratio:
            fail("max_seq_len", max_seq_len,
                 f"a multiple of context_parallel_size x {ratio} (layer {i} is {attention.kind.value} at rate {ratio}: "
                 "each rank compresses whole blocks of its own chunk)",
                 f"use max_seq_len = a multiple of {cp * ratio}, or a smaller context_parallel_size")
        halo_kind = attention.kind not in (LayerKind.FULL_CAUSAL, LayerKind.HYBRID_MLA)  # those gather all keys
        halo = min(window or 0, max_seq_len) - 1
        if halo_kind and halo > chunk:
            fail("context_parallel_size", cp,
                 f"at most {max_seq_len // halo} here: each rank's chunk ({chunk} tokens) must hold the {halo}-token "
                 f"window halo the next rank needs (layer {i})",
                 "raise max_seq_len or lower context_parallel_size")


def check_expert_parallel(moe: Any, ep: int, world: int | None = None, cp: int = 1) -> None:
    """Expert parallelism splits every MoE layer's routed experts evenly over ``ep`` ranks carved from the
    data x context ranks (Megatron: expert-data-parallel size = dp x cp / ep). ``world``: the launched processes
    (checked at start-up, before any process group; None: config only)."""
    if ep == 1:
        return
    if moe.n_routed_experts % ep:
        fail("expert_model_parallel_size", ep, f"a divisor of n_routed_experts ({moe.n_routed_experts})",
             "choose an expert_model_parallel_size that divides n_routed_experts (every rank owns the same number "
             "of experts)")
    if world is not None and world % ep:
        fail("expert_model_parallel_size", ep,
             f"a divisor of the number of launched processes ({world} = data parallel x context parallel "
             f"{cp}), as expert groups are carved from the data x context ranks",
             f"launch a multiple of {ep} processes (--nproc_per_node) or change expert_model_parallel_size")
