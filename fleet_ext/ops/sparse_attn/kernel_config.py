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
# 16-slot tiles lose; the dkv-contribution GEMM prefers 128-slot tiles, 8 warps and 3 stages (H200, --partial-ab:
# 1.05-1.16x over 2 stages on the backward at seven V3.2 / DSv4 shapes, the same bytes). The smaller entries
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
    {"BLOCK_M": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 1},
]
REDUCE_CONFIG_GPU = {"BLOCK_P": 16, "num_warps": 4, "num_stages": 1}
_GPU = {"fwd": FWD_CONFIGS_GPU, "dq": DQ_CONFIGS_GPU, "partial": PARTIAL_CONFIGS_GPU}
_INTERP = {"fwd": [{"BLOCK_N": 16}], "dq": [{"BLOCK_N": 16}], "partial": [{"BLOCK_M": 16}],
           "reduce": {"BLOCK_P": 4}}

# The forward kernel: "auto" runs the warp-specialised Gluon forward (``kernel_fwd_ws.py``) wherever
# ``ws_forward_fits`` says it can, else the Triton kernel; "triton" / "gluon" force one (benchmarks, tests; "gluon"
# raises where it cannot run).
FWD_KERNEL = "auto"
# Registers per thread, 3 x 168 shared by the three warpgroups: right half 168, gather 96, the softmax warpgroup the
# 240 left (the sweep of 2026-12-01: best at all four shapes, within 2 % of a 80-register gather).
WS_FWD_META = {"num_warps": 4, "maxnreg": 168, "RIGHT_REGS": 168, "GATHER_REGS": 96}
# Per key-only tail width (64: V3.2 latent, 0: DSv4): slots per block, stage buffers, whether the softmax
# warpgroup's PV reads P from registers (kernel_fwd_ws.py; sweep: scripts/bench/tune_sparse_fwd_ws.py).
WS_FWD_TILES = {64: {"BLOCK_N": 64, "NUM_STAGES": 2, "P_IN_REGS": True},
                0: {"BLOCK_N": 64, "NUM_STAGES": 2, "P_IN_REGS": True}}
# A measuring instrument, never a setting: 1 drops the forward's KV copies, 2 its MMAs, 3 all but its barriers
# (wrong results; ``scripts/bench/tune_sparse_fwd_ws.py --probe`` times what limits the kernel).
WS_FWD_PROBE = 0

# The backward's dq step: "auto" (the warp-specialised Gluon dq kernel, ``kernel_bwd_dq_ws.py``, wherever
# ``ws_dq_fits`` says it can run, else the Triton one), "triton" (``kernel_bwd._bwd_dq_kernel`` always), "gluon"
# (forced: raises where it cannot run). H200, 2026-12-01 (--dq-ab): the dq kernel 1.37-1.84x, the backward
# 1.11-1.27x; V3.2's dq within 1e-4 of the Triton kernel's (other MMA shapes), DSv4's byte-equal.
DQ_KERNEL = "auto"
# Registers: B warpgroup 208, gather 48, warpgroup A the rest (the sm90 compile's split without spills of note;
# on the H200 the best of 208/48, 200/56, 192/64, 184/72 at V3.2, within 0.3 % at DSv4);
# 32 keys per block, two stages (Q, dO and two 32-row stages take 225,744 of the 232,448 bytes of shared memory).
WS_DQ_META = {"num_warps": 4, "maxnreg": 168, "B_REGS": 208, "GATHER_REGS": 48, "BLOCK_N": 32, "NUM_STAGES": 2}
# The dense causal mode (``kernel.launch_ws_dq_dense``): a 64-register gather (its contiguous rows and per-sequence
# base need them: the sm90 compile spills 44-92 bytes with 48, none or 12 with 64), warpgroup A 232.
WS_DQ_DENSE_META = {**WS_DQ_META, "GATHER_REGS": 64}

_CHOSEN: dict[tuple, dict] = {}
OVERRIDES: dict[str, list[dict]] = {}  # kernel name -> configurations to try instead (benchmarks)


def configs_for(kind: str) -> list[dict]:
    """The configurations to try for kernel ``kind`` ("fwd", "dq", "partial") on this machine."""
    return _INTERP[kind] if capability.detect().interpreter else _GPU[kind]


def ws_forward_fits(dtype: str, d_qk: int, d_v: int) -> str | None:
    """None when the warp-specialised forward can run this call, else why not (the fallback's reason).

    It needs a Hopper GPU (wgmma, mbarriers, ``setmaxnreg``), 16-bit inputs, the value width 512 split into two
    256-wide halves and a key-only tail of 0 or 64 channels (the caller checks the 16-byte row alignment).
    """
    cap = capability.detect()
    if cap.interpreter or not cap.gpu or cap.sm is None or cap.sm[0] != 9:
        return "not a Hopper GPU (sm90)"
    if dtype not in ("bfloat16", "float16"):
        return f"dtype {dtype} (needs bf16/fp16)"
    if d_v != 512 or d_qk - d_v not in (0, 64):
        return f"widths d_qk {d_qk} / d_v {d_v} (needs 512 / 512 or 576)"
    return None


def ws_dq_fits(dtype: str, d_qk: int, d_v: int, block_h: int) -> str | None:
    """None when the warp-specialised dq kernel can run this call, else why not: the forward's conditions and
    64-head tiles (at least 64 heads, padded to a power of two)."""
    why_not = ws_forward_fits(dtype, d_qk, d_v)
    if why_not is None and block_h != 64:
        why_not = f"{block_h}-head tiles (needs 64)"
    return why_not


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
