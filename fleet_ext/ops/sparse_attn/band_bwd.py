"""Launchers of the band-slot dkv kernels (``kernel_bwd_band``) for ``kernel.sparse_attn_bwd``; the contract is
``band.py``'s. Imports neither Paddle nor torch."""

from __future__ import annotations

from typing import Any

import triton

from fleet_ext import capability
from fleet_ext.ops.launch import empty_like, launch
from fleet_ext.ops.sparse_attn.band import SlotBands
from fleet_ext.ops.sparse_attn.kernel_bwd_band import (
    _bwd_band_combine_kernel,
    _bwd_dkv_band_kernel,
    _copy_kernel,
    _fill_zero_kernel,
)

# Launch settings per machine: keys x columns per program, the kernel's mode (``POISON``: operands straight from
# shared memory, a broken band shows as NaN; else a per-row select), query splits of a step-0 band (about
# ``_SPLIT_QUERIES`` queries each). The interpreter takes small tiles. H200 (--band-ab, DSv4 HCA s 16384, whole
# backward): poison, 64 keys x 128 columns, 4 warps, 3 stages 5.69 ms; the select mode's best (128 x 128, 8 warps,
# 3 stages) 5.95; poison at 128 x 128 6.42 (benchmarks/RESULTS.md, "Band slots").
# ``QPS``: queries per step of the poison mode (2: k = 2 x 64 products, 198 KB of shared memory at 64 x 128 and 3
# stages in the sm90 compile; not yet timed, so 1).
BAND_CONFIG_GPU = {"BLOCK_K": 64, "BLOCK_D": 128, "POISON": True, "QPS": 1, "num_warps": 4, "num_stages": 3}
_BAND_CONFIG_INTERP = {"BLOCK_K": 16, "BLOCK_D": 16, "POISON": True, "QPS": 1}
_SPLIT_QUERIES = 512
# Below this many queries per call a GPU keeps the CSR path for every slot: the band kernel's grid (key blocks x
# column blocks) no longer fills the machine (H200, DSv4 HCA: s 4096 1.68 -> 2.17 ms with bands, s 16384 7.69 ->
# 5.97 at the select mode). The interpreter always takes the bands (the tests' small cases).
BAND_MIN_QUERIES_GPU = 8192


def band_config() -> dict:
    """The band kernel's launch settings on this machine (``BAND_CONFIG_GPU`` or the interpreter's)."""
    return _BAND_CONFIG_INTERP if capability.detect().interpreter else BAND_CONFIG_GPU


def bands_pay(num_t: int) -> bool:
    """Whether a backward over ``num_t`` queries sums its band slots key-major (``BAND_MIN_QUERIES_GPU``)."""
    return capability.detect().interpreter or num_t >= BAND_MIN_QUERIES_GPU


def zero_fill(out: Any, numel: int) -> None:
    """Zeros into a contiguous fp32 buffer (the dkv accumulator the bands add into)."""
    launch(_fill_zero_kernel, (triton.cdiv(max(numel, 1), 1024),), out, numel, BLOCK=1024)


def copy_rows(acc: Any, out: Any, numel: int) -> None:
    """dkv = the fp32 accumulator in dkv's dtype (when the bands cover every slot: no CSR reduce to do it)."""
    launch(_copy_kernel, (triton.cdiv(max(numel, 1), 1024),), acc, out, numel, BLOCK=1024)


def band_dkv(call: Any, bufs: Any, slot_bands: SlotBands, t0: int, tc: int) -> None:
    """Adds the band slots' dkv of queries ``[t0, t0 + tc)`` to ``bufs.acc`` (fp32 [n_kv, d_qk])."""
    cfg = dict(band_config())
    block_k, block_d = cfg.pop("BLOCK_K"), cfg.pop("BLOCK_D")
    block_d = min(block_d, call.d_v, call.d_qk - call.d_v or call.d_v)  # no column block straddles value and tail
    sequences = call.num_t // slot_bands.seq
    for band in slot_bands.bands:
        lo, hi = slot_bands.key_range(band)
        if hi <= lo:
            continue
        n_keys = hi - lo
        n_split = 1 if band.step else max(1, min(64, triton.cdiv(tc, _SPLIT_QUERIES)))
        q_per_split = triton.cdiv(max(tc, 1), n_split)
        direct = n_split == 1  # each program adds its own tile to acc: no partial buffer, no combine
        part = bufs.acc if direct else empty_like(call.kv, [n_split, sequences * n_keys, call.d_qk],
                                                  dtype=bufs.acc.dtype)
        key_blocks = sequences * triton.cdiv(n_keys, block_k)
        for col0, cols, value in ((0, call.d_v, True), (call.d_v, call.d_qk - call.d_v, False)):
            if cols == 0:
                continue
            launch(_bwd_dkv_band_kernel, (cols // block_d, key_blocks, n_split), call.idx, call.topk, call.q,
                   call.d_out, bufs.p_buf, bufs.ds_buf, part, slot_bands.seq, slot_bands.kv_rows, call.width, t0,
                   t0 + tc, call.heads, bufs.h_pad, lo, n_keys, band.slot0, band.n_slots, band.base, q_per_split,
                   call.width, call.heads * call.d_qk, call.d_qk, call.heads * call.d_v, call.d_v,
                   sequences * n_keys * call.d_qk, call.d_qk, col0, STEP=band.step, VALUE=value, DIRECT=direct,
                   BLOCK_K=block_k, BLOCK_D=block_d, BLOCK_HP=bufs.h_pad, HAS_TOPK_LEN=call.has_topk_len,
                   PREC=call.meta()["PREC"], **cfg)
        if not direct:
            launch(_bwd_band_combine_kernel, (sequences * n_keys, triton.cdiv(call.d_qk, 128)), part, bufs.acc,
                   slot_bands.kv_rows, n_keys, lo, n_split, sequences * n_keys * call.d_qk, call.d_qk, BLOCK_D=128)
