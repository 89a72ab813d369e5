"""The sequence layout: which global token positions this rank holds.

Built once per forward by the model and handed to every attention layer. RoPE angles, the
window / compressed / causal index tables and the indexers' visibility rules are computed from it, never
from ``0 .. s-1``: that is the seam context parallelism plugs into. Without context parallelism the layout is
the whole sequence (offset 0, local = global); with ``context_parallel_size: cp`` rank r of the group holds the
r-th of cp equal contiguous chunks, and the layers exchange keys through ``fleet_ext.parallel.cp_collectives``.

Convention for index tables (``fleet_ext.layers.index_tables``): rows are this rank's queries (global
positions ``offset .. offset + local_len - 1``), key ids are *global* (raw keys ``0 .. global_len - 1``,
then compressed entries), so a context-parallel attention gathers the keys it needs and keeps the
tables unchanged (PaddleFleet builds its tables at the global length and slices the rows, likewise).

The object is small, immutable and hashable: cached tables are keyed on it. It imports no Paddle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CHUNKING_MODES", "SequenceLayout"]

# How the global sequence is cut into per-rank shards. Only contiguous shards exist (DSv4 compressors
# need contiguous blocks, as in PaddleFleet's ``cp_balance_mode: contiguous_allgather``).
CHUNKING_MODES = ("contiguous",)


@dataclass(frozen=True)
class SequenceLayout:
    """This rank's shard of the sequence: global positions ``[offset, offset + local_len)`` of ``global_len``.

    ``cp_size`` / ``cp_rank`` describe the context-parallel group the shard belongs to (1 / 0 without
    context parallelism); ``cp_group`` is the process group (None with one rank; not part of equality).
    """

    offset: int
    local_len: int
    global_len: int
    cp_size: int = 1
    cp_rank: int = 0
    chunking: str = "contiguous"
    cp_group: Any = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("offset", "local_len", "global_len", "cp_size", "cp_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"SequenceLayout: `{name}` must be an int, got {value!r}")
        if self.local_len < 1 or self.offset < 0 or self.offset + self.local_len > self.global_len:
            raise ValueError(
                "SequenceLayout: need 0 <= offset and 1 <= local_len with offset + local_len <= global_len, got "
                f"offset={self.offset}, local_len={self.local_len}, global_len={self.global_len}"
            )
        if self.cp_size < 1 or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"SequenceLayout: need 0 <= cp_rank < cp_size, got {self.cp_rank} / {self.cp_size}")
        if self.chunking not in CHUNKING_MODES:
            raise ValueError(f"SequenceLayout: `chunking` must be one of {CHUNKING_MODES}, got {self.chunking!r}")
        if self.offset != self.cp_rank * self.local_len or self.global_len != self.cp_size * self.local_len:
            raise ValueError(
                f"SequenceLayout: contiguous chunks need offset = cp_rank x local_len and global_len = cp_size x "
                f"local_len, got offset={self.offset}, local_len={self.local_len}, global_len={self.global_len}, "
                f"cp_rank={self.cp_rank}, cp_size={self.cp_size}"
            )

    @classmethod
    def whole(cls, seq_len: int) -> SequenceLayout:
        """One rank holds the whole sequence (no context parallelism)."""
        return cls(offset=0, local_len=seq_len, global_len=seq_len)

    @classmethod
    def contiguous_shard(cls, global_len: int, cp_size: int, cp_rank: int, cp_group: Any = None) -> SequenceLayout:
        """Rank ``cp_rank`` of ``cp_size`` holds the ``cp_rank``-th of ``cp_size`` equal contiguous chunks."""
        if cp_size < 1 or global_len % cp_size:
            raise ValueError(
                f"SequenceLayout.contiguous_shard: `global_len` ({global_len}) must divide by cp_size ({cp_size})"
            )
        local = global_len // cp_size
        return cls(offset=cp_rank * local, local_len=local, global_len=global_len, cp_size=cp_size,
                   cp_rank=cp_rank, cp_group=cp_group)

    @property
    def end(self) -> int:
        """One past this rank's last global position."""
        return self.offset + self.local_len

    @property
    def is_whole(self) -> bool:
        """This rank holds every position (queries and keys coincide)."""
        return self.offset == 0 and self.local_len == self.global_len

    def positions(self) -> range:
        """Global positions of this rank's tokens, in order."""
        return range(self.offset, self.end)

    @classmethod
    def resolve(cls, layout: SequenceLayout | None, owner: str, name: str, seq_len: int) -> SequenceLayout:
        """``layout`` checked against a tensor's sequence axis, or the whole sequence when None (a layer used
        on its own, outside the model)."""
        layout = layout or cls.whole(seq_len)
        layout.check_input(owner, name, seq_len)
        return layout

    def check_input(self, owner: str, name: str, seq_len: int) -> None:
        """Raise unless a tensor's sequence axis (``seq_len``) is this rank's shard."""
        if seq_len != self.local_len:
            raise ValueError(
                f"{owner}: `{name}` has {seq_len} tokens on its sequence axis, but the sequence layout gives this "
                f"rank {self.local_len} (positions {self.offset}..{self.end - 1} of {self.global_len})"
            )
