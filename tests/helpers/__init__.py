"""The one shared test-helper package (DESIGN.md layout: ``tests/helpers``).

- ``asserts``: ``assert_bitwise`` (byte for byte) and ``assert_close`` (a named tolerance);
- ``tolerances``: one table per dtype, every loosening explained;
- ``launches``: ``expect_launches``, proof that a fused kernel ran;
- ``configs``: the tiny model configurations;
- ``model_runs``: ``model_step``, one seeded training step of the tiny model (the model-level fusion tests);
- ``oracles``: independent float64 NumPy oracles (``from helpers import oracles as orc``);
- ``torch_rope``: the RoPE reference's op sequence in eager torch;
- ``transfers``: ``HostTransfers``, counts host round trips (``from helpers.transfers import HostTransfers``);
- ``gpu``: ``CUDA_ONLY``, the skip of every ``tests/gpu`` module (imports torch; not imported here);
- ``pack24``: the sparse-attention backward's float24 packing as a round-trip test kernel and its float64 rounding
  oracle (imports torch and Triton; not imported here).

Importable from every test directory (tests/conftest.py puts ``tests/`` on ``sys.path``); imports neither
Paddle nor torch, so tests/gpu can use it on a machine without Paddle.
"""

from .asserts import assert_bitwise, assert_close
from .configs import DEFAULT_WIDTHS_2L, TINY_HYBRID_MLA, TINY_MODEL, move_constant_inits, tiny_model
from .launches import expect_launches, launch_counts
from .model_runs import model_step
from .tolerances import TOLERANCES, Tol, tolerance

__all__ = [
    "DEFAULT_WIDTHS_2L", "TINY_HYBRID_MLA", "TINY_MODEL", "TOLERANCES", "Tol", "assert_bitwise", "assert_close",
    "expect_launches", "launch_counts", "model_step", "move_constant_inits", "tiny_model", "tolerance",
]
