"""Launch-configuration choice of the sparse-attention kernels (tile sizes, warps, pipeline stages).

Each kernel has a list of configurations, most preferred first; the first that compiles on the device (a
configuration that overflows shared memory or registers fails at compile time) is remembered per shape
key and reused. On a GPU the preferred ones are the fastest measured on an H200 (timings: "Sparse attention"
and "sparse_attn launch defaults" in ``benchmarks/RESULTS.md``); the Triton interpreter (numpy per op) gets
small tiles. ``OVERRIDES`` lets a benchmark try other configurations without editing this module.

Imports neither Paddle nor torch; the machine is asked at launch (``capability.detect()``), not at import.
"""

from __future__ import annotations

from typing import Any

from fleet_ext import capability
from fleet_ext.ops.launch import launch

# Why these orders: the forward's 64-slot tiles with 2 stages beat 32-slot tiles; dq's 3 stages beat 2 and
# 16-slot tiles lose; the dkv-contribution GEMM prefers 128-slot tiles and 8 warps. The smaller entries
# are fallbacks for devices with less shared memory.
FWD_CONFIGS_GPU = [
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
]
DQ_CONFIGS_GPU = [
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    {"BLOCK_N": 16, "num_warps": 8, "num_stages": 1},
]
PARTIAL_CONFIGS_GPU = [
    {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1},
]
REDUCE_CONFIG_GPU = {"BLOCK_P": 16, "num_warps": 4, "num_stages": 1}
_GPU = {"fwd": FWD_CONFIGS_GPU, "dq": DQ_CONFIGS_GPU, "partial": PARTIAL_CONFIGS_GPU}
_INTERP = {"fwd": [{"BLOCK_N": 16}], "dq": [{"BLOCK_N": 16}], "partial": [{"BLOCK_M": 16}],
           "reduce": {"BLOCK_P": 4}}

_CHOSEN: dict[tuple, dict] = {}
OVERRIDES: dict[str, list[dict]] = {}  # kernel name -> configurations to try instead (benchmarks)


def configs_for(kind: str) -> list[dict]:
    """The configurations to try for kernel ``kind`` ("fwd", "dq", "partial") on this machine."""
    return _INTERP[kind] if capability.detect().interpreter else _GPU[kind]


def reduce_config() -> dict:
    """The one configuration of the CSR dkv reduce (no fallback needed: small tiles)."""
    return _INTERP["reduce"] if capability.detect().interpreter else REDUCE_CONFIG_GPU


def launch_first_fitting(name: str, kernel: Any, grid: Any, key: tuple, configs: list[dict],
                         *args: Any, **meta: Any) -> None:
    """Launch with the first configuration that fits the device (cached per ``(name, *key)``)."""
    configs = OVERRIDES.get(name, configs)
    cache_key = (name, *key, repr(configs))
    if cache_key in _CHOSEN:
        launch(kernel, grid, *args, **meta, **_CHOSEN[cache_key])
        return
    error = None
    for config in configs:
        try:
            launch(kernel, grid, *args, **meta, **config)
        except Exception as exc:  # noqa: BLE001 - only resource failures fall through, others re-raise
            if type(exc).__name__ not in ("OutOfResources", "OutOfResourcesError"):
                raise
            error = exc
            continue
        _CHOSEN[cache_key] = config
        return
    raise RuntimeError(f"{name}: no launch configuration fits this device: {error}")
