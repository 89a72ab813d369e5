"""Fixtures of the GPU tests: ``heavy_gpu_memory`` runs a test under ``helpers.gpu.one_heavy_test_at_a_time``."""

import pytest
from helpers.gpu import one_heavy_test_at_a_time


@pytest.fixture
def heavy_gpu_memory():
    with one_heavy_test_at_a_time():
        yield
