"""What every ``tests/gpu`` module shares: its skip on a machine without CUDA (``from helpers.gpu import CUDA_ONLY``,
then ``pytestmark = CUDA_ONLY``), and ``one_heavy_test_at_a_time`` for tests whose float oracles take tens of GiB.
Imports torch: for the GPU test modules only."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch

CUDA_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA-only kernel tests: they run on the H200 via the device tool (torch + Triton, no Paddle)",
)


@contextlib.contextmanager
def one_heavy_test_at_a_time() -> Iterator[None]:
    """Hold a machine-wide file lock for a memory-heavy GPU test, then hand its cached memory back.

    ``pytest -n 6`` runs six workers on one GPU; two production-shape oracles at once (with the other workers'
    caches) ran out of its 140 GiB (``test_qkv_prologue_gpu.py::test_production_shapes``, ``test_rounded_partials``;
    benchmarks/RESULTS.md). The lock serialises only the tests that take it.
    """
    with open(os.path.join(tempfile.gettempdir(), "fleet_ext_gpu_heavy.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
