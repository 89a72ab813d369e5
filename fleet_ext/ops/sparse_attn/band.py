"""Band slots of an index table: where the backward sums dkv key-major instead of through per-pair contributions.

A caller that builds its index table from positions knows where most keys sit: the DSv4 window puts key
``i - W + 1 + j`` (shifted by a context-parallel halo) in slot ``j`` of the query at position ``i``, and HCA puts
compressed entry ``c`` in slot ``W + c``. ``SlotBands`` carries that knowledge to ``kernel.sparse_attn_bwd``:
the dkv of band slots comes from ``band_bwd`` / ``kernel_bwd_band`` (no per-pair contribution through memory, no
sort), the remaining slots (one contiguous range, e.g. CSA's top-k picks) keep the CSR path. Forward, dq and ``d_sink``
are unchanged (byte-equal); dkv sums the same products in another fixed order (deterministic, not byte-equal
to the CSR path). The kernels check ``idx == key`` for every slot they read, so a band that the table does not
follow loses those slots' gradient (tests plant exactly that and see it fail), never reads out of bounds.

Imports neither Paddle, torch nor Triton (layers name bands without the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    """Slot ``j`` in ``[slot0, slot0 + n_slots)`` of local query ``i`` holds local key ``step * i + base + j`` or
    an invalid id; ``step`` is 1 (a window) or 0 (the same keys for every query)."""

    slot0: int
    n_slots: int
    step: int
    base: int


@dataclass(frozen=True)
class SlotBands:
    """The bands of an index table of ``seq`` queries per sequence over ``kv_rows`` kv rows per sequence."""

    seq: int
    kv_rows: int
    bands: tuple[Band, ...]

    def key_range(self, band: Band) -> tuple[int, int]:
        """Local keys ``[lo, hi)`` the band can hold (clipped to the sequence's kv rows)."""
        lo = band.base + band.slot0
        hi = lo + band.n_slots + (self.seq - 1 if band.step else 0)
        return max(0, lo), min(self.kv_rows, hi)

    def contribution_slots(self, width: int) -> tuple[int, int]:
        """The slots ``[c0, c1)`` outside every band (the CSR path's); raises unless they are one range."""
        spans = sorted((band.slot0, band.slot0 + band.n_slots) for band in self.bands)
        for band in self.bands:
            if band.step not in (0, 1) or band.n_slots < 1 or band.slot0 < 0 or band.slot0 + band.n_slots > width:
                raise ValueError(f"sparse_attn_bwd: band {band} must have step 0 or 1 and slots inside [0, {width})")
        gaps, end = [], 0  # the uncovered spans between and after the bands
        for lo, hi in spans:
            if lo < end:
                raise ValueError(f"sparse_attn_bwd: bands {self.bands} overlap at slot {lo}")
            if lo > end:
                gaps.append((end, lo))
            end = hi
        if end < width:
            gaps.append((end, width))
        if len(gaps) > 1:
            raise ValueError(f"sparse_attn_bwd: the slots outside the bands {self.bands} must be one contiguous "
                             f"range, got {gaps}")
        return gaps[0] if gaps else (width, width)

    def check(self, num_t: int, n_kv: int) -> None:
        """Raises unless the flat q rows (``num_t``) and kv rows (``n_kv``) are whole sequences of this shape."""
        if self.seq < 1 or num_t % self.seq or n_kv != (num_t // self.seq) * self.kv_rows:
            raise ValueError(f"sparse_attn_bwd: slot bands for {self.seq} queries and {self.kv_rows} kv rows per "
                             f"sequence do not fit q's {num_t} rows and kv's {n_kv}")
