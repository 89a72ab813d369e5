"""What every ``tests/gpu`` module shares: its skip on a machine without CUDA (``from helpers.gpu import CUDA_ONLY``,
then ``pytestmark = CUDA_ONLY``). Imports torch: for the GPU test modules only."""

from __future__ import annotations

import pytest
import torch

CUDA_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA-only kernel tests: they run on the H200 via the device tool (torch + Triton, no Paddle)",
)
