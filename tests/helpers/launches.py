"""Proof that a fused path really ran: Triton launches counted by ``fleet_ext.ops.launch.LAUNCH_COUNTS``.

A fused path that silently fell back to the reference would pass a parity test; wrapping the fused call in
``expect_launches`` makes that fallback a failure. The launch adapter is imported on first use, so this
module imports neither Paddle nor torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator


def launch_counts() -> dict[str, int]:
    """A snapshot of every kernel's launch count so far."""
    from fleet_ext.ops.launch import LAUNCH_COUNTS

    return dict(LAUNCH_COUNTS)


@contextlib.contextmanager
def expect_launches(*kernels: str | Iterable[str], min: int = 1, exactly: int | None = None,
                    any_of: bool = False) -> Iterator[dict[str, int]]:
    """Assert that each named kernel was launched at least ``min`` (or ``exactly``) times inside the block.

    A name may be given as a collection of names whose launches count together (``any_of=True`` treats all
    names as one such collection: e.g. every kernel of one op module). The yielded dict is filled on exit
    with the launches per kernel seen inside the block.
    """
    from fleet_ext.ops.launch import LAUNCH_COUNTS

    if not kernels:
        raise ValueError("expect_launches: name at least one kernel")
    groups = [tuple(k for g in kernels for k in ([g] if isinstance(g, str) else g))] if any_of else [
        (g,) if isinstance(g, str) else tuple(g) for g in kernels]
    names = {k for g in groups for k in g}
    before = {k: LAUNCH_COUNTS[k] for k in names}
    seen: dict[str, int] = {}
    yield seen
    seen.update({k: LAUNCH_COUNTS[k] - before[k] for k in sorted(names)})
    for group in groups:
        count = sum(seen[k] for k in group)
        label = group[0] if len(group) == 1 else f"any of {sorted(group)}"
        if exactly is not None and count != exactly:
            raise AssertionError(f"{label}: launched {count} times, expected exactly {exactly}")
        if exactly is None and count < min:
            raise AssertionError(f"{label}: launched {count} times, expected at least {min}: the fused path did "
                                 "not run (a silent fallback?)")
