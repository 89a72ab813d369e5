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
the input's dtype and framework. One program handles ``BLOCK_R`` rows (the batch index is computed per
row, not per element) by ``BLOCK_K`` columns: 32 KiB of table per program, 16-byte vector accesses when
the column stride is 1, which Triton specialises on.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import empty_like, launch

INT32_LIMIT = 2**31  # largest valid flat id is B * seqlen_kv - 1, which must be <= 2**31 - 1
INT64_LIMIT = 2**63
_TILE_BYTES = 32 * 1024


@triton.jit
def _kv_idx_remap_kernel(
    idx_ptr, out_ptr, seqlen_kv,
    n_rows, S, K,
    s_b, s_s, s_k,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
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


def _dtype_name(t: Any) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


def _shape(t: Any) -> list[int]:
    return [int(n) for n in t.shape]


def _strides(t: Any) -> list[int]:
    strides = getattr(t, "strides", None)  # Paddle: a list attribute; torch: the stride() method
    return [int(s) for s in (strides if strides is not None and not callable(strides) else t.stride())]


def check_args(local_idx: Any, seqlen_kv: Any, fn: str = "local_to_global_flat") -> tuple[int, int, int, int]:
    """The reference's validation (same messages) plus the overflow guard; returns (B, S, K, seqlen_kv)."""
    if local_idx.ndim != 3:
        raise ValueError(f"{fn}: `local_idx` must be [B, S, K], got shape {_shape(local_idx)}")
    dtype = _dtype_name(local_idx)
    if dtype not in ("int32", "int64"):
        raise ValueError(f"{fn}: `local_idx` must be int32 or int64, got {dtype}")
    if isinstance(seqlen_kv, bool) or not hasattr(seqlen_kv, "__index__"):
        raise ValueError(f"{fn}: `seqlen_kv` must be an int, got {type(seqlen_kv).__name__} {seqlen_kv!r}")
    seqlen_kv = int(seqlen_kv)
    if seqlen_kv < 0:
        raise ValueError(f"{fn}: `seqlen_kv` must be >= 0, got {seqlen_kv}")
    batch, seq, width = _shape(local_idx)
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


def _detached(t: Any) -> Any:
    """The same storage without autograd (Paddle refuses to DLPack-export a tensor that requires grad)."""
    return t.detach() if getattr(t, "stop_gradient", True) is False or getattr(t, "requires_grad", False) else t


def tile(width: int, itemsize: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K): 128 columns (or the next power of two below), rows filling 32 KiB."""
    block_k = min(128, triton.next_power_of_2(max(width, 1)))
    block_r = max(1, _TILE_BYTES // (itemsize * block_k))
    return block_r, block_k


def local_to_global_flat(local_idx: Any, seqlen_kv: int) -> Any:
    """``[B, S, K]`` local ids -> new contiguous ``[B*S, K]`` flat ids (``idx + b*seqlen_kv`` where idx >= 0)."""
    batch, seq, width, seqlen_kv = check_args(local_idx, seqlen_kv)
    out = empty_like(local_idx, shape=[batch * seq, width])
    n_rows = batch * seq
    if n_rows == 0 or width == 0:
        return out
    itemsize = 4 if _dtype_name(local_idx) == "int32" else 8
    block_r, block_k = tile(width, itemsize)
    s_b, s_s, s_k = _strides(local_idx)
    launch(
        _kv_idx_remap_kernel, (triton.cdiv(n_rows, block_r), triton.cdiv(width, block_k)),
        _detached(local_idx), out, seqlen_kv,
        n_rows, seq, width,
        s_b, s_s, s_k,
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=8,
    )
    return out
