"""Dense causal mode of the Triton sparse-attention family: every key ``0 .. position``, no index table.

Flat layout, ``B`` sequences: ``q [B*S, H, d_qk]`` (row ``b*S + i`` is query ``i`` of sequence ``b``, at
global position ``q_offset + i``: a context-parallel rank's chunk starts at ``q_offset``), ``kv [B*N, d_qk]``
(the ``N`` keys of every sequence, all-gathered under context parallelism), ``sink [H]`` fp32. Query row
``b*S + i`` attends keys ``0 .. min(q_offset + i, N - 1)`` of its sequence, with the same sink, the same
maths and the same outputs as ``kernel.sparse_attn_fwd`` given the full-causal index table (``out [T, H,
d_v]``, sink-inclusive ``lse [T, H]`` fp32) — only the keys are read contiguously and the loop stops at the
row's causal bound, so no ``[S, N]`` table exists and key blocks past the bound are never read.

Backward (``causal_attn_bwd``), deterministic — no floating-point atomics, one fixed order for every sum, so
the same inputs give byte-identical ``dq``, ``dkv``, ``d_sink`` run after run: ``delta`` and ``d_sink`` by
the sparse family's preprocess; ``dq`` query-major (on Hopper the warp-specialised Gluon dq kernel's dense mode,
``kernel_config.DQ_KERNEL``); ``dkv`` key-major (each key block's fp32 gradient in registers, its (query, head)
rows in order, no pair buffers, no sort). For parallelism the rows may be cut into ``dkv_splits`` slices handled
by separate programs, each writing an fp32 partial that one more launch sums in slice order. ``causal_probs``
gives the head-summed probabilities ``sum_h P[t, h, j]`` [T, n_cols] fp32 (the
DSA indexer warm-up KL's target) without the [T, H, N] logits.

Launch configurations: the first that fits the device (``kernel_config.launch_first_fitting``, overridable by
name through ``kernel.OVERRIDES``: ``causal_fwd``, ``causal_dq``, ``causal_dkv``, ``causal_probs``). Imports
neither Paddle nor torch; takes torch or Paddle tensors through :mod:`fleet_ext.ops.launch`.
"""

from __future__ import annotations

from typing import Any

import triton

from fleet_ext import capability
from fleet_ext.ops.launch import dtype_name, empty_like, launch, shape_of
from fleet_ext.ops.sparse_attn.kernel import (
    _LOG2E,
    MAX_D_V,
    _bwd_delta_and_dsink,
    _framework_dtype,
    _is_contiguous,
    _pow2,
    _prec,
    flops,
    launch_ws_dq_dense,
    launch_ws_forward,
    use_ws_dq,
    use_ws_forward,
)
from fleet_ext.ops.sparse_attn.kernel_causal import (
    _causal_bwd_dkv_kernel,
    _causal_bwd_dq_kernel,
    _causal_dkv_reduce_kernel,
    _causal_fwd_kernel,
    _causal_probs_kernel,
)
from fleet_ext.ops.sparse_attn.kernel_config import launch_first_fitting

# GPU launch configurations, most preferred first (later entries: devices with less shared memory). Measured on
# the H200 (benchmarks/RESULTS.md, "Dense causal mode", 2026-12-01 run 2): dq's 3-stage tile does not fit (out of
# shared memory), so 2 stages first; dkv (64 keys, 8 warps): 16 (query, head) rows x 3 stages 37.4 ms at s 4096
# H 128 against 40.1 for 32 rows x 2 stages (229,760 B of shared memory, the most that fits) and 42.4 for 32 x 1;
# s 16384 H 64: 291 / 311 / 329 ms. Offline sm90 compile (Triton 3.6): 16 x 3 takes 186,752 B, no spills in the
# loop, loads as 16-byte cp.async.
GPU_CONFIGS = {
    "causal_fwd": [{"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}, {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
                   {"BLOCK_N": 32, "num_warps": 8, "num_stages": 1}],
    "causal_dq": [{"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}, {"BLOCK_N": 16, "num_warps": 8, "num_stages": 1}],
    "causal_dkv": [{"BLOCK_N": 64, "BLOCK_M": 16, "num_warps": 8, "num_stages": 3},
                   {"BLOCK_N": 64, "BLOCK_M": 16, "num_warps": 8, "num_stages": 1}],
    "causal_probs": [{"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
                     {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}],
}
INTERP_CONFIGS = {name: [{"BLOCK_N": 16}] for name in GPU_CONFIGS}
INTERP_CONFIGS["causal_dkv"] = [{"BLOCK_N": 16, "BLOCK_M": 16}]
MAX_DKV_SPLITS = 16
# The default slices aim at about this many dkv programs (4 waves of the H200's 132 SMs). A constant, not the
# device's SM count (``ops.multiprocessors``): the slice count sets dkv's summation order, so the same shapes give
# the same bits on every GPU.
DKV_PROGRAMS = 528


def _configs(name: str) -> list[dict]:
    return INTERP_CONFIGS[name] if capability.detect().interpreter else GPU_CONFIGS[name]


def check_causal_inputs(q: Any, kv: Any, sink: Any, d_v: int | None, seq: int, q_offset: int,
                        fn: str = "causal_attn") -> tuple[int, int, int, int, int, int]:
    """Validate the flat-layout inputs (``sink`` may be None); returns (T, H, d_qk, B, N, d_v). Errors name the
    tensor or argument."""
    if len(q.shape) != 3:
        raise ValueError(f"{fn}: `q` must be [B*S, H, d_qk], got shape {list(q.shape)}")
    num_t, heads, d_qk = shape_of(q)
    if len(kv.shape) != 2 or int(kv.shape[1]) != d_qk:
        raise ValueError(f"{fn}: `kv` must be [B*N, {d_qk}] (d_qk of `q`), got shape {list(kv.shape)}")
    if sink is not None and (shape_of(sink) != [heads] or dtype_name(sink) != "float32"):
        raise ValueError(f"{fn}: `sink` must be fp32 [{heads}], got {sink.dtype} {list(sink.shape)}")
    if dtype_name(q) not in ("float32", "bfloat16", "float16") or kv.dtype != q.dtype:
        raise ValueError(f"{fn}: `q` and `kv` must share one of float32, bfloat16, float16, got {q.dtype} and "
                         f"{kv.dtype}")
    seq, q_offset = int(seq), int(q_offset)
    if seq < 1 or num_t % seq:
        raise ValueError(f"{fn}: `seq` (queries per sequence) must be >= 1 and divide the {num_t} rows of `q`, "
                         f"got {seq}")
    batch = num_t // seq
    if batch and int(kv.shape[0]) % batch:
        raise ValueError(f"{fn}: `kv` rows ({int(kv.shape[0])}) must be B * N for the B = {batch} sequences of `q`")
    n_keys = int(kv.shape[0]) // batch if batch else 0
    if batch and not 0 <= q_offset <= n_keys - seq:
        raise ValueError(f"{fn}: `q_offset` (global position of each sequence's first query) must be in "
                         f"[0, N - S] = [0, {n_keys - seq}] so every query is one of the N = {n_keys} keys, got "
                         f"{q_offset}")
    if batch * max(n_keys, 1) >= 2**31:
        raise ValueError(f"{fn}: `kv` holds {batch * n_keys} rows; the kernels index < 2**31")
    d_v = d_qk if d_v is None else int(d_v)
    d_tail = d_qk - d_v
    if d_v != _pow2(d_v) or not 16 <= d_v <= MAX_D_V:
        raise ValueError(f"{fn}: the value width d_v = {d_v} of `q`/`kv` must be a power of two in [16, {MAX_D_V}] "
                         "for the Triton kernel (zero-pad it: exact)")
    if d_tail and (d_tail != _pow2(d_tail) or not 16 <= d_tail <= MAX_D_V):
        raise ValueError(f"{fn}: the key-only width d_qk - d_v = {d_tail} of `q`/`kv` must be 0 or a power of two "
                         f"in [16, {MAX_D_V}] for the Triton kernel (zero-pad it: exact)")
    for name, tensor in (("q", q), ("kv", kv), ("sink", sink)):
        if tensor is not None and not _is_contiguous(tensor):
            raise ValueError(f"{fn}: `{name}` must be contiguous")
    return num_t, heads, d_qk, batch, n_keys, d_v


def _block_h(heads: int) -> int:
    return min(64, max(16, _pow2(heads)))


def causal_attn_fwd(q: Any, kv: Any, sink: Any, scale: float, seq: int, q_offset: int = 0,
                    d_v: int | None = None) -> tuple[Any, Any]:
    """Forward: q [B*S, H, d_qk], kv [B*N, d_qk], sink [H] fp32 -> (out [B*S, H, d_v], lse [B*S, H] fp32)."""
    num_t, heads, d_qk, _, n_keys, d_v = check_causal_inputs(q, kv, sink, d_v, seq, q_offset, "causal_attn_fwd")
    out = empty_like(q, [num_t, heads, d_v])
    lse = empty_like(q, [num_t, heads], dtype=_framework_dtype(q, "float32"))
    if num_t == 0 or heads == 0:
        return out, lse
    if use_ws_forward(q, kv, d_qk, d_v, "causal_attn_fwd"):
        launch_ws_forward(q, kv, sink, out, lse, scale, d_v, seq=seq, q_offset=q_offset)
        return out, lse
    block_h = _block_h(heads)
    launch_first_fitting(
        "causal_fwd", _causal_fwd_kernel, (num_t, triton.cdiv(heads, block_h)),
        (d_qk, d_v, block_h, dtype_name(q)), _configs("causal_fwd"),
        q, kv, sink, out, lse, heads, int(seq), n_keys, int(q_offset), float(scale) * _LOG2E,
        heads * d_qk, d_qk, d_qk, heads * d_v, d_v,
        D_V=d_v, D_TAIL=d_qk - d_v, BLOCK_H=block_h, EVEN_H=heads % block_h == 0, PREC=_prec(q),
    )
    return out, lse


def default_dkv_splits(seq: int, batch: int, n_keys: int, d_qk: int, max_partial_bytes: int,
                       block_n: int = 64) -> int:
    """Row slices of the dkv pass: enough for about ``DKV_PROGRAMS`` programs over the ``B x N / block_n`` key
    blocks (at most ``MAX_DKV_SPLITS``, at most ``seq``), fewer when the fp32 partials (``splits x B*N x d_qk x 4``
    bytes) would pass ``max_partial_bytes``; 1 writes dkv directly."""
    by_memory = int(max_partial_bytes) // max(1, batch * n_keys * d_qk * 4)
    by_work = triton.cdiv(DKV_PROGRAMS, max(1, batch * triton.cdiv(n_keys, block_n)))
    return max(1, min(MAX_DKV_SPLITS, by_work, int(seq), by_memory))


def causal_attn_bwd(q: Any, kv: Any, sink: Any, scale: float, out: Any, lse: Any, d_out: Any, d_lse: Any = None,
                    *, seq: int, q_offset: int = 0, d_v: int | None = None, dkv_splits: int | None = None,
                    max_partial_bytes: int = 1 << 30) -> tuple[Any, Any, Any]:
    """Deterministic backward -> (dq like q, dkv like kv, d_sink [H] fp32).

    ``out``/``lse``: the forward's; ``d_out`` [B*S, H, d_v]; ``d_lse`` [B*S, H] fp32 or None (the gradient
    reaching the LSE). ``dkv_splits``: row slices of the dkv pass (default ``default_dkv_splits``); any
    value gives byte-identical results run to run (not across values: the slices' sums are added in slice order).
    """
    fn = "causal_attn_bwd"
    num_t, heads, d_qk, batch, n_keys, d_v = check_causal_inputs(q, kv, sink, d_v, seq, q_offset, fn)
    for name, tensor, shape in (("out", out, [num_t, heads, d_v]), ("d_out", d_out, [num_t, heads, d_v]),
                                ("lse", lse, [num_t, heads]), ("d_lse", d_lse, [num_t, heads])):
        if tensor is not None and (shape_of(tensor) != shape or not _is_contiguous(tensor)):
            raise ValueError(f"{fn}: `{name}` must be a contiguous {shape}, got {list(tensor.shape)}")
    if d_out.dtype != q.dtype or dtype_name(lse) != "float32" or (d_lse is not None and dtype_name(d_lse) != "float32"):
        raise ValueError(f"{fn}: `d_out` must have the dtype of `q` ({q.dtype}) and `lse`/`d_lse` must be fp32, got "
                         f"{d_out.dtype}, {lse.dtype}, {None if d_lse is None else d_lse.dtype}")
    dq, dkv = empty_like(q), empty_like(kv)
    d_sink = empty_like(sink, [heads], dtype=_framework_dtype(q, "float32"))
    if heads == 0:
        return dq, dkv, d_sink
    delta = _bwd_delta_and_dsink(q, out, d_out, lse, d_lse, sink, d_sink, num_t, heads, d_v)
    block_h, scale2 = _block_h(heads), float(scale) * _LOG2E
    meta = {"D_V": d_v, "D_TAIL": d_qk - d_v, "BLOCK_H": block_h, "PREC": _prec(q)}
    key = (d_qk, d_v, block_h, dtype_name(q))
    if num_t and use_ws_dq(q, kv, d_out, d_qk, d_v, block_h, fn):
        launch_ws_dq_dense(q, kv, d_out, lse, delta, dq, scale, d_v, seq, q_offset)
    elif num_t:
        launch_first_fitting(
            "causal_dq", _causal_bwd_dq_kernel, (num_t, triton.cdiv(heads, block_h)), key, _configs("causal_dq"),
            q, kv, d_out, lse, delta, dq, heads, int(seq), n_keys, int(q_offset), scale2, float(scale),
            heads * d_qk, d_qk, d_qk, heads * d_v, d_v, EVEN_H=heads % block_h == 0, **meta,
        )
    splits = default_dkv_splits(seq, batch, n_keys, d_qk, max_partial_bytes) if dkv_splits is None else int(dkv_splits)
    if splits < 1:
        raise ValueError(f"{fn}: `dkv_splits` must be >= 1 (or None for the default), got {dkv_splits}")
    rows = batch * n_keys
    part = dkv if splits == 1 else empty_like(kv, [splits, max(rows, 1), d_qk], dtype=_framework_dtype(q, "float32"))
    if rows:
        configs = [dict(c, SHIFT_LAST=int(seq) * heads >= c["BLOCK_M"]) for c in _configs("causal_dkv")]
        launch_first_fitting(
            "causal_dkv", _causal_bwd_dkv_kernel,
            lambda m: (triton.cdiv(n_keys, m["BLOCK_N"]) * splits, batch), key, configs,
            q, kv, d_out, lse, delta, part, heads, int(seq), n_keys, int(q_offset), scale2, float(scale), splits,
            rows * d_qk, D_V=d_v, D_TAIL=d_qk - d_v, PREC=_prec(q),
        )
    if splits > 1 and rows:
        block = 1024 if not capability.detect().interpreter else 256
        launch(_causal_dkv_reduce_kernel, (triton.cdiv(rows * d_qk, block),), part, dkv, rows * d_qk, splits,
               BLOCK=block, num_warps=4)
    return dq, dkv, d_sink


def causal_probs(q: Any, kv: Any, lse: Any, scale: float, seq: int, q_offset: int = 0, n_cols: int | None = None,
                 d_v: int | None = None) -> Any:
    """Head-summed causal probabilities [B*S, n_cols] fp32: ``sum_h exp(scale q_{t,h} . kv_j - lse_{t,h})`` for
    key ``j`` up to the row's position, 0 after it; ``n_cols`` (default N) leading keys. No gradient.

    ``lse`` [B*S, H] fp32 is the forward's (sink-inclusive), so a row's entries sum to 1 minus the sink's share.
    ``d_v`` only selects the kernel's 512 + 64 split of the contraction (the sum is over all d_qk channels).
    """
    fn = "causal_probs"
    num_t, heads, d_qk, _, n_keys, d_v = check_causal_inputs(q, kv, None, d_v, seq, q_offset, fn)
    n_cols = n_keys if n_cols is None else int(n_cols)
    if not 0 <= n_cols <= n_keys:
        raise ValueError(f"{fn}: `n_cols` must be in [0, N = {n_keys}], got {n_cols}")
    if shape_of(lse) != [num_t, heads] or dtype_name(lse) != "float32" or not _is_contiguous(lse):
        raise ValueError(f"{fn}: `lse` must be a contiguous fp32 [{num_t}, {heads}], got {lse.dtype} "
                         f"{list(lse.shape)}")
    probs = empty_like(q, [num_t, n_cols], dtype=_framework_dtype(q, "float32"))
    if num_t == 0 or n_cols == 0:
        return probs
    block_h = _block_h(heads)
    launch_first_fitting(
        "causal_probs", _causal_probs_kernel, lambda m: (num_t, triton.cdiv(n_cols, m["BLOCK_N"])),
        (d_qk, d_v, block_h, dtype_name(q)), _configs("causal_probs"),
        q, kv, lse, probs, heads, int(seq), n_keys, n_cols, int(q_offset), float(scale) * _LOG2E,
        heads * d_qk, d_qk, d_qk, n_cols,
        D_V=d_v, D_TAIL=d_qk - d_v, BLOCK_H=block_h, N_HB=triton.cdiv(heads, block_h), PREC=_prec(q),
    )
    return probs


def causal_pairs(seq: int, n_keys: int, q_offset: int = 0, batch: int = 1) -> int:
    """(query, key) pairs the dense causal mode computes: ``B * sum_i min(q_offset + i + 1, N)``."""
    full = max(0, min(seq, n_keys - q_offset))  # rows whose bound is inside the keys
    inside = full * (q_offset + 1) + full * (full - 1) // 2
    return batch * (inside + (seq - full) * n_keys)


def causal_flops(seq: int, n_keys: int, heads: int, d_qk: int, d_v: int, q_offset: int = 0,
                 batch: int = 1) -> dict[str, float]:
    """``kernel.flops`` over the causal pairs (the sparse family's accounting: fwd 2·H·(d_qk + d_v) per pair)."""
    return flops(causal_pairs(seq, n_keys, q_offset, batch), heads, d_qk, d_v)


__all__ = ["causal_attn_fwd", "causal_attn_bwd", "causal_probs", "causal_pairs", "causal_flops",
           "check_causal_inputs", "default_dkv_splits"]
