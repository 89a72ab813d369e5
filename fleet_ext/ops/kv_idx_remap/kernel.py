"""Triton per-batch-local -> flat-global KV index remap: ``idx + b * seqlen_kv`` where ``idx >= 0``.

Framework-agnostic host launcher (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this
module imports neither Paddle nor torch. One kernel replaces the reference's arange / scale / add /
compare / where / reshape sequence and is bitwise equal to it:

- the offset ``b * seqlen_kv`` and the sum are computed in int64 and narrowed to the table's dtype, which
  is exactly two's-complement int32 arithmetic for int32 tables (so even out-of-range data gives the
  reference's bits) and exact for int64;
- **no silent int32 wrap-around**: for an int32 table the launcher raises when a valid flat id could
  leave int32, i.e. when ``B * seqlen_kv > 2**31`` (the largest valid id is ``B * seqlen_kv - 1``);
  the fix is an int64 table. This is a shape check: it assumes valid entries satisfy
  ``0 <= idx < seqlen_kv`` (the attention kernels' contract) and needs no device sync;
- negative entries are written back unchanged (they are not normalised to -1).

Layout: ``local_idx`` is [B, S, K] with any strides; the result is a new contiguous [B*S, K] table in
the input's dtype and framework.

- **Contiguous tables** (the production case) take a flat 1-D path: ``FLAT_BLOCK_BYTES`` of table per
  program, 16-byte vector loads and stores, one division per program (``b0 = start // (S*K)``; a program
  no longer than ``S*K`` meets at most one batch boundary, so each entry picks ``b0`` or ``b0 + 1`` by a
  compare); for B = 1 the offset is 0 and the op is a copy.
- **Any other strides**: ``BLOCK_R`` rows (the batch index computed per row, not per element) by
  ``BLOCK_K`` columns, 32 KiB of table per program, 16-byte accesses when the column stride is 1.

Why these choices: at the production sizes a plain ``clone`` of the table is the practical ceiling, and
the flat path with 2-4 KiB programs came closest to it in a sweep on the H200 (4 KiB is the default;
larger programs, the 2-D kernel and cache hints were slower); outside a CUDA graph the op is bound by the
host launch path at K = 640. The timings: ``benchmarks/RESULTS.md``, "kv_idx_remap tuning (moved from the
kernel source)".
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import (
    Plan,
    dtype_name,
    empty_like,
    fire,
    layout_key,
    plan_cache,
    shape_of,
    strides_of,
)

INT32_LIMIT = 2**31  # largest valid flat id is B * seqlen_kv - 1, which must be <= 2**31 - 1
INT64_LIMIT = 2**63
_TILE_BYTES = 32 * 1024


@triton.jit
def _kv_idx_remap_kernel(
    idx_ptr, out_ptr, seqlen_kv,
    n_rows, S, K, n_flat, SK,
    s_b, s_s, s_k,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    FLAT: tl.constexpr, BLOCK: tl.constexpr, ONE_BATCH: tl.constexpr, WIDE: tl.constexpr,
    STREAM: tl.constexpr,
):
    if FLAT:
        # contiguous table: a flat 1-D stream of n_flat = B*S*K entries, BLOCK <= S*K per program, so a
        # program meets at most one batch boundary: b = b0 or b0 + 1, one compare per entry.
        if WIDE:
            start = tl.program_id(0).to(tl.int64) * BLOCK
        else:
            start = tl.program_id(0) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_flat
        if STREAM:  # read once, written once: keep neither in L2
            local = tl.load(idx_ptr + offs, mask=mask, other=0, eviction_policy="evict_first")
        else:
            local = tl.load(idx_ptr + offs, mask=mask, other=0)
        if ONE_BATCH:  # b = 0 everywhere: where(idx >= 0, idx + 0, idx) is idx, bit for bit
            remapped = local
        else:
            b0 = start // SK  # one division per program
            off0 = (b0.to(tl.int64) * seqlen_kv).to(local.dtype)  # < 2**31 for int32 (check_args)
            off1 = ((b0 + 1).to(tl.int64) * seqlen_kv).to(local.dtype)  # only used below n_flat, so in range
            offset = tl.where(offs >= (b0 + 1) * SK, off1, off0)
            remapped = tl.where(local >= 0, local + offset, local)  # wraps like the table dtype
        if STREAM:
            tl.store(out_ptr + offs, remapped, mask=mask, cache_modifier=".cs")
        else:
            tl.store(out_ptr + offs, remapped, mask=mask)
    else:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # int32 (n_rows < 2**31): a cheap division
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & (cols < K)[None, :]
        b = rows // S
        s = rows - b * S
        b = b.to(tl.int64)  # offsets and ids in int64
        src = idx_ptr + (b * s_b + s.to(tl.int64) * s_s)[:, None] + cols[None, :].to(tl.int64) * s_k
        local = tl.load(src, mask=mask, other=0)
        wide = local.to(tl.int64)
        offset = b * seqlen_kv
        remapped = tl.where(wide >= 0, wide + offset[:, None], wide)
        dst = out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
        tl.store(dst, remapped.to(out_ptr.dtype.element_ty), mask=mask)


def check_args(local_idx: Any, seqlen_kv: Any, fn: str = "local_to_global_flat") -> tuple[int, int, int, int]:
    """The reference's validation (same messages) plus the overflow guard; returns (B, S, K, seqlen_kv)."""
    if local_idx.ndim != 3:
        raise ValueError(f"{fn}: `local_idx` must be [B, S, K], got shape {shape_of(local_idx)}")
    dtype = dtype_name(local_idx)
    if dtype not in ("int32", "int64"):
        raise ValueError(f"{fn}: `local_idx` must be int32 or int64, got {dtype}")
    if isinstance(seqlen_kv, bool) or not hasattr(seqlen_kv, "__index__"):
        raise ValueError(f"{fn}: `seqlen_kv` must be an int, got {type(seqlen_kv).__name__} {seqlen_kv!r}")
    seqlen_kv = int(seqlen_kv)
    if seqlen_kv < 0:
        raise ValueError(f"{fn}: `seqlen_kv` must be >= 0, got {seqlen_kv}")
    batch, seq, width = shape_of(local_idx)
    if batch * seq >= 2**31:
        raise ValueError(f"{fn}: `local_idx` has B*S = {batch * seq} rows; at most 2**31 - 1 are supported")
    limit = INT32_LIMIT if dtype == "int32" else INT64_LIMIT
    if batch * seqlen_kv > limit:
        fix = "pass int64 indices" if dtype == "int32" else "split the batch"
        raise ValueError(
            f"{fn}: `local_idx` is {dtype} but flat ids reach B * seqlen_kv - 1 = {batch * seqlen_kv - 1} "
            f"(B={batch}, seqlen_kv={seqlen_kv}), beyond the {dtype} range: they would wrap around; {fix}"
        )
    return batch, seq, width, seqlen_kv


def tile(width: int, itemsize: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K) of the strided path: 128 columns (or the next power of two below), rows filling 32 KiB."""
    block_k = min(128, triton.next_power_of_2(max(width, 1)))
    block_r = max(1, _TILE_BYTES // (itemsize * block_k))
    return block_r, block_k


# Flat path (contiguous tables): entries per program and warps, chosen on the H200 (module docstring;
# timings in benchmarks/RESULTS.md). ``TUNE`` lets the benchmark sweep them without editing the module.
FLAT_BLOCK_BYTES = 4 * 1024
FLAT_NUM_WARPS = 4
FLAT_STREAM = False
TUNE: dict = {}


def flat_block(itemsize: int) -> int:
    return int(TUNE.get("flat_block_bytes", FLAT_BLOCK_BYTES)) // itemsize


_PLANS = plan_cache("kv_idx_remap")


def _tuning() -> tuple:
    """The launch defaults a plan depends on (the benchmark's sweep changes them between calls)."""
    return FLAT_BLOCK_BYTES, FLAT_NUM_WARPS, FLAT_STREAM, tuple(TUNE.items()) if TUNE else ()


def _prepare(key: tuple, local_idx: Any, seqlen_kv: Any) -> Plan:
    """Validate (same checks and messages) and plan one launch; ``info`` is the output shape [B*S, K]."""
    batch, seq, width, seqlen_kv = check_args(local_idx, seqlen_kv)
    n_rows = batch * seq
    info = [n_rows, width]
    if n_rows == 0 or width == 0:
        return _PLANS.add(key, Plan(None, info=info))
    itemsize = 4 if dtype_name(local_idx) == "int32" else 8
    s_b, s_s, s_k = strides_of(local_idx)
    n_flat, sk = n_rows * width, seq * width
    block = flat_block(itemsize)
    contiguous = (width == 1 or s_k == 1) and (seq == 1 or s_s == width) and (batch == 1 or s_b == sk)
    flat = contiguous and (batch == 1 or sk >= block) and not TUNE.get("force_2d", False)
    if flat:
        grid = (triton.cdiv(n_flat, block),)
        block_r, block_k, warps = 1, 1, int(TUNE.get("flat_num_warps", FLAT_NUM_WARPS))
    else:
        block_r, block_k = tile(width, itemsize)
        grid = (triton.cdiv(n_rows, block_r), triton.cdiv(width, block_k))
        warps = 8
    meta = dict(BLOCK_R=block_r, BLOCK_K=block_k, FLAT=flat, BLOCK=block, ONE_BATCH=batch == 1,
                WIDE=n_flat + block >= 2**31, STREAM=bool(TUNE.get("stream", FLAT_STREAM)), num_warps=warps)
    return _PLANS.add(key, Plan(grid, (seqlen_kv, n_rows, seq, width, n_flat, sk, s_b, s_s, s_k), meta, info))


def local_to_global_flat(local_idx: Any, seqlen_kv: int) -> Any:
    """``[B, S, K]`` local ids -> new contiguous ``[B*S, K]`` flat ids (``idx + b*seqlen_kv`` where idx >= 0)."""
    if type(seqlen_kv) is not int:  # anything else takes the checks (and is read as an int) first
        seqlen_kv = check_args(local_idx, seqlen_kv)[3]
    key = (layout_key(local_idx), seqlen_kv, _tuning())
    plan = _PLANS.get(key) or _prepare(key, local_idx, seqlen_kv)
    out = empty_like(local_idx, shape=plan.info)
    fire(_kv_idx_remap_kernel, plan, local_idx, out)
    return out
