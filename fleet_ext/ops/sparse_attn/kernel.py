"""Triton sparse MQA attention with a per-head sink: forward and a deterministic backward.

One kernel family for the DSv4 CSA/HCA core (``d_qk = d_v = 512``, K = V) and the latent MQA core of the
-2 layers (``d_qk = 576``, ``d_v = 512``: the value is the first ``d_v`` channels of the key).

Contract (flat layout): ``q [T, H, d_qk]``, ``kv [N, d_qk]``, ``idx [T, K]`` int32/int64 (an entry is
valid when ``0 <= idx < N``; anything else, e.g. -1, is skipped), optional ``topk_length [T]`` (only the
first ``topk_length[t]`` slots of row t are read), ``sink [H]`` fp32 logits, ``scale``. For query t, head
h and the valid set S_t (dsv4_math.md §2.5, §7)::

    l_j = scale * q_{t,h} . kv_j          LSE = log(sum_{j in S_t} exp(l_j) + exp(sink_h))
    out_{t,h} = sum_j exp(l_j - LSE) kv_j[:d_v]          (the sink is a value-less softmax column)

Forward (``sparse_attn_fwd``): one program per (query, block of <= 64 heads) holds the whole Q tile
(all heads of the query share each gathered KV row, MQA), walks the index row in blocks of ``BLOCK_N``
gathered KV rows, online softmax in base 2 (``scale * log2 e`` folded into one multiply), the running max
starts at the sink logit (so no row ever computes ``-inf - -inf``) and the sink enters the denominator
in the epilogue. The QK contraction is split into the value part ``[0, d_v)`` and the tail
``[d_v, d_qk)`` (576 = 512 + 64: two power-of-two dots over the same gathered rows); PV reuses the value
part of the gathered tile. Returns ``out [T, H, d_v]`` (input dtype) and the sink-inclusive natural-log
``lse [T, H]`` fp32. Heads that do not fill a 64-row tile are masked (zero q, +inf lse in the backward:
exact); widths must be powers of two (``d_v`` and ``d_qk - d_v``, the latter may be 0) — the Paddle
function zero-pads other widths, which is exact.

On a Hopper GPU (bf16/fp16, ``d_v`` 512, tail 0 or 64) the forward runs the warp-specialised Gluon kernel of
``kernel_fwd_ws.py`` instead (same contract and maths; ``kernel_config.FWD_KERNEL`` and ``ws_forward_fits`` say
when), for the sparse and the dense causal forward alike (``launch_ws_forward``).

Backward (``sparse_attn_bwd``), deterministic — no floating-point atomics anywhere, every sum has one
fixed order, so the same inputs give byte-identical ``dq``, ``dkv`` and ``d_sink`` run after run:

1. ``_bwd_preprocess``: ``delta = rowsum(dO * O) - dLSE`` per (t, h) and per-query-block partial sums of
   ``d_sink_h = -sum_t exp(sink_h - LSE) * delta``; ``_dsink_reduce`` sums the partials in a fixed loop.
2. ``_bwd_dq`` (query-major, one program per (query, head block)): recompute ``P = exp2(s - LSE2)``,
   ``dP = dO V^T``, ``dS = scale * P * (dP - delta)``, accumulate ``dq`` over the index row in registers,
   and write ``P`` and ``dS`` (input dtype) to a pair-major buffer ``[pairs, H_pad]``. On Hopper it can run the
   warp-specialised Gluon kernel ``kernel_bwd_dq_ws.py`` instead (``kernel_config.DQ_KERNEL``).
3. ``_bwd_dkv_partial``: for each (query, block of slots) the per-pair dkv contribution
   ``dS^T Q_t + P^T dO_t`` — a GEMM that reduces over *all* heads at once — written to
   ``part [pairs, d_qk]`` (fp32 by default).
4. A transposed index (CSR) built once per query chunk: keys = kv row (``N`` for invalid pairs), a
   *stable* sort of the keys, ``rowptr`` by binary search (``_csr_keys``, ``_csr_rowptr``). The stable
   sort orders each row's pairs by (query, slot).
5. ``_bwd_dkv_reduce``: one program per reduce item sums a run of at most ``reduce_chunk`` of a kv row's
   pairs in CSR order (fixed-size lanes, then one tree reduction over the lanes); a row of one item (most
   rows) is written there, with the previous chunks' sum added; a longer row's items are added in order by
   ``_bwd_dkv_combine``. Without the split a row read by every query (a DSv4 HCA compressed entry) is one
   program's long serial loop that trails the whole launch. The items are mapped on the device
   (``_csr_items``: a scan of the row lengths, ``_csr_item_rows``); the grid is the bound
   ``n_kv + cdiv(pairs, reduce_chunk)`` (no host read), programs past the total exit.

Trailing bound (``row_bound``, on by default: ``derive_bound=True``): before any kernel, one small launch
reads the index table once and writes, per row, the position of its last valid slot + 1 (``min``-ed with
``topk_length`` when one is given); the forward and every backward kernel then stop there instead of at
``K``. Slots past it are invalid, and an invalid slot contributes exactly nothing (``p = 0``, rescale
factor exactly 1, ``dS = 0``, no CSR pair), so results are byte-identical with and without the bound;
interior invalid slots (holes before the last valid one) are still masked as before. Causal top-k tables
put their -1 slots last (early queries see fewer keys than ``K``): at s = 4096 with 2048 slots a quarter
of the V3.2 slots are skipped. The dkv-contribution programs whose slot block lies wholly past the bound
exit at once.

Band slots (``slot_bands``, ``band.py``): slots whose key follows from the query's position (the DSv4 window,
HCA's entries) skip steps 3-5; ``band_bwd`` sums their dkv key-major from the pair buffers into an fp32
accumulator that the CSR reduce of the other slots then adds to (or that is copied to dkv when no slot is left).

Queries are processed in chunks so the pair buffers stay under ``max_partial_bytes``; chunks are summed
in order (deterministic). This moves more bytes than an atomic scatter-add (the contributions are written
once and read once) in exchange for reproducibility.

Host launchers take torch tensors (CUDA, or CPU in interpreter mode) or Paddle tensors (through
:mod:`fleet_ext.ops.launch`); the only framework op used is the stable sort of the CSR build. The module
is split by role: this one (validation and launchers), ``kernel_fwd.py`` (forward and trailing-bound
kernels), ``kernel_bwd.py`` (backward kernels), ``kernel_config.py`` (launch-configuration choice). None
of them imports Paddle or torch, and none decides anything about the machine at import. The dense causal
mode (no index table: keys ``0 .. position``) is ``causal.py`` (launchers) and ``kernel_causal.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton

from fleet_ext import capability
from fleet_ext.ops.launch import dtype_name, empty_like, is_paddle, launch, shape_of, torch_view
from fleet_ext.ops.sparse_attn import kernel_config
from fleet_ext.ops.sparse_attn.band import SlotBands
from fleet_ext.ops.sparse_attn.band_bwd import band_dkv, bands_pay, copy_rows, zero_fill
from fleet_ext.ops.sparse_attn.kernel_bwd import (
    _bwd_dkv_combine_kernel,
    _bwd_dkv_partial_kernel,
    _bwd_dkv_reduce_kernel,
    _bwd_dq_kernel,
    _bwd_preprocess_kernel,
    _csr_item_rows_kernel,
    _csr_items_kernel,
    _csr_keys_kernel,
    _csr_rowptr_kernel,
    _dsink_reduce_kernel,
)
from fleet_ext.ops.sparse_attn.kernel_bwd_dq_ws import _bwd_dq_ws_kernel
from fleet_ext.ops.sparse_attn.kernel_config import OVERRIDES, configs_for, launch_first_fitting, reduce_config
from fleet_ext.ops.sparse_attn.kernel_fwd import _row_bound_kernel, _sparse_attn_fwd_kernel
from fleet_ext.ops.sparse_attn.kernel_fwd_ws import _sparse_attn_fwd_ws_kernel

_LOG2E = 1.4426950408889634

MAX_D_V = 512  # the fp32 [64, d_v] accumulators of the forward and dq kernels must stay in registers


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _framework_dtype(tensor: Any, name: str) -> Any:
    if is_paddle(tensor):
        import paddle

        return getattr(paddle, name)
    import torch

    return getattr(torch, name)


def _is_contiguous(tensor: Any) -> bool:
    fn = getattr(tensor, "is_contiguous", None)
    return True if fn is None else bool(fn())


def _stable_sort(keys: Any) -> tuple[Any, Any]:
    """(sorted keys, permutation) with equal keys kept in input order — the one framework op used here."""
    if is_paddle(keys):
        import paddle

        order = paddle.argsort(keys, stable=True)
        return paddle.gather(keys, order), order
    import torch

    return torch.sort(keys, stable=True)


_FLOAT = ("float32", "bfloat16", "float16")


def check_inputs(q: Any, kv: Any, idx: Any, sink: Any, d_v: int | None, topk_length: Any = None,
                 fn: str = "sparse_attn") -> tuple[int, int, int, int, int, int]:
    """Validate the flat-layout inputs; returns (T, H, d_qk, N, K, d_v). Errors name the tensor."""
    if len(q.shape) != 3:
        raise ValueError(f"{fn}: `q` must be [T, H, d_qk], got shape {list(q.shape)}")
    num_t, heads, d_qk = shape_of(q)
    if len(kv.shape) != 2 or int(kv.shape[1]) != d_qk:
        raise ValueError(f"{fn}: `kv` must be [N, {d_qk}] (d_qk of `q`), got shape {list(kv.shape)}")
    if len(idx.shape) != 2 or int(idx.shape[0]) != num_t:
        raise ValueError(f"{fn}: `idx` must be [T, K] with T = {num_t}, got shape {list(idx.shape)}")
    if dtype_name(idx) not in ("int32", "int64"):
        raise ValueError(f"{fn}: `idx` must be int32 or int64, got {idx.dtype}")
    if shape_of(sink) != [heads] or dtype_name(sink) != "float32":
        raise ValueError(f"{fn}: `sink` must be fp32 [{heads}], got {sink.dtype} {list(sink.shape)}")
    if dtype_name(q) not in _FLOAT:
        raise ValueError(f"{fn}: `q` must be float32, bfloat16 or float16, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise ValueError(f"{fn}: `kv` must have the dtype of `q` ({q.dtype}), got {kv.dtype}")
    if topk_length is not None and (shape_of(topk_length) != [num_t]
                                    or dtype_name(topk_length) not in ("int32", "int64")):
        raise ValueError(f"{fn}: `topk_length` must be int32/int64 [{num_t}], got {topk_length.dtype} "
                         f"{list(topk_length.shape)}")
    d_v = d_qk if d_v is None else int(d_v)
    d_tail = d_qk - d_v
    if not 0 < d_v <= d_qk:
        raise ValueError(f"{fn}: `d_v` must be in [1, d_qk = {d_qk}], got {d_v}")
    min_w = 16  # tl.dot needs every operand dimension >= 16 (the interpreter checks it too)
    if d_v != _pow2(d_v) or d_v < min_w or d_v > MAX_D_V:
        raise ValueError(f"{fn}: the value width d_v = {d_v} of `q`/`kv` must be a power of two in "
                         f"[{min_w}, {MAX_D_V}] for the Triton kernel (zero-pad it: exact)")
    if d_tail and (d_tail != _pow2(d_tail) or d_tail < min_w or d_tail > MAX_D_V):
        raise ValueError(f"{fn}: the key-only width d_qk - d_v = {d_tail} of `q`/`kv` must be 0 or a power of "
                         f"two in [{min_w}, {MAX_D_V}] for the Triton kernel (zero-pad it: exact)")
    for name, tensor in (("q", q), ("kv", kv), ("idx", idx), ("sink", sink), ("topk_length", topk_length)):
        if tensor is not None and not _is_contiguous(tensor):
            raise ValueError(f"{fn}: `{name}` must be contiguous")
    return num_t, heads, d_qk, int(kv.shape[0]), int(idx.shape[1]), d_v


def _prec(q: Any) -> str:
    # fp32 inputs: full-precision dots (Triton's default for fp32 would be tf32 on a GPU)
    return "ieee" if dtype_name(q) == "float32" else "tf32"


def row_bound(idx: Any, n_kv: int, topk_length: Any = None) -> Any:
    """Per-row trailing bound of an index table: int32 [T], 1 + the last slot k of row t with
    ``0 <= idx[t, k] < n_kv`` (only slots ``k < topk_length[t]`` count when given), 0 for a row with none.

    Passing it as ``topk_length`` gives byte-identical results to passing nothing (the slots past it are
    invalid, and an invalid slot contributes exactly nothing) while the kernels stop at it. One launch,
    one read of the table (T·K·4 bytes: 134 MB at T = 16384, K = 2048; its time: ``benchmarks/RESULTS.md``).
    """
    if len(idx.shape) != 2 or dtype_name(idx) not in ("int32", "int64") or not _is_contiguous(idx):
        raise ValueError(f"row_bound: `idx` must be a contiguous int32/int64 [T, K], got {idx.dtype} "
                         f"{list(idx.shape)}")
    num_t, width = shape_of(idx)
    if topk_length is not None and (shape_of(topk_length) != [num_t]
                                    or dtype_name(topk_length) not in ("int32", "int64")):
        raise ValueError(f"row_bound: `topk_length` must be int32/int64 [{num_t}], got {topk_length.dtype} "
                         f"{list(topk_length.shape)}")
    bound = empty_like(idx, [num_t], dtype=_framework_dtype(idx, "int32"))
    if num_t == 0:
        return bound
    interp = capability.detect().interpreter
    block_t, block_k = (4, 16) if interp else (8, min(256, max(16, _pow2(width))))
    launch(_row_bound_kernel, (triton.cdiv(num_t, block_t),), idx, idx if topk_length is None else topk_length,
           bound, num_t, int(n_kv), width, width, BLOCK_T=block_t, BLOCK_K=block_k,
           HAS_TOPK_LEN=topk_length is not None, num_warps=4)
    return bound


def sparse_attn_fwd(q: Any, kv: Any, idx: Any, sink: Any, scale: float, d_v: int | None = None,
                    topk_length: Any = None, derive_bound: bool = True) -> tuple[Any, Any]:
    """Forward: q [T, H, d_qk], kv [N, d_qk], idx [T, K], sink [H] fp32 -> (out [T, H, d_v], lse [T, H] fp32).

    ``derive_bound`` (default): stop each row at its last valid slot (``row_bound``, byte-identical
    results); pass ``False`` when ``topk_length`` already is such a bound (the Paddle function does).
    """
    num_t, heads, d_qk, n_kv, width, d_v = check_inputs(q, kv, idx, sink, d_v, topk_length, "sparse_attn_fwd")
    out = empty_like(q, [num_t, heads, d_v])
    lse = empty_like(q, [num_t, heads], dtype=_framework_dtype(q, "float32"))
    if num_t == 0 or heads == 0:
        return out, lse
    if derive_bound and width > 0:
        topk_length = row_bound(idx, n_kv, topk_length)
    if use_ws_forward(q, kv, d_qk, d_v, "sparse_attn_fwd"):
        launch_ws_forward(q, kv, sink, out, lse, scale, d_v, idx=idx, topk_length=topk_length)
        return out, lse
    block_h = min(64, max(16, _pow2(heads)))
    grid = (num_t, triton.cdiv(heads, block_h))
    launch_first_fitting(
        "fwd", _sparse_attn_fwd_kernel, grid, (d_qk, d_v, block_h, dtype_name(q)), configs_for("fwd"),
        q, kv, idx, q if topk_length is None else topk_length, sink, out, lse,
        heads, n_kv, width, float(scale) * _LOG2E,
        heads * d_qk, d_qk, d_qk, width, heads * d_v, d_v,
        D_V=d_v, D_TAIL=d_qk - d_v, BLOCK_H=block_h, EVEN_H=heads % block_h == 0,
        HAS_TOPK_LEN=topk_length is not None, PREC=_prec(q),
    )
    return out, lse


def launch_ws_forward(q: Any, kv: Any, sink: Any, out: Any, lse: Any, scale: float, d_v: int, idx: Any = None,
                      topk_length: Any = None, seq: int = 0, q_offset: int = 0) -> None:
    """Launch the warp-specialised forward: over the index table ``idx`` (sparse), or dense causal when ``idx`` is
    None (``causal.py``'s contract: ``seq`` queries per sequence at ``q_offset``, ``kv`` rows per sequence)."""
    num_t, heads, d_qk = shape_of(q)
    dense = idx is None
    n_kv = int(kv.shape[0]) // (num_t // seq) if dense else int(kv.shape[0])
    width = 0 if dense else int(idx.shape[1])
    head_blocks = triton.cdiv(heads, 64)
    launch(_sparse_attn_fwd_ws_kernel, (num_t * head_blocks,), q, kv, q if dense else idx,
           q if topk_length is None else topk_length, sink, out, lse, heads, n_kv, width, int(seq), int(q_offset),
           float(scale) * _LOG2E, heads * d_qk, d_qk, d_qk, width, heads * d_v, d_v,
           D_TAIL=d_qk - d_v, BLOCK_H=64, HAS_TOPK_LEN=topk_length is not None, DENSE=dense,
           HEAD_BLOCKS=head_blocks, PROBE=kernel_config.WS_FWD_PROBE, **kernel_config.WS_FWD_TILES[d_qk - d_v],
           **kernel_config.WS_FWD_META)


def _use_ws(switch: str, fits: Any, tensors: tuple, fn: str) -> bool:
    """Whether a warp-specialised Gluon kernel runs under ``kernel_config.<switch>`` ("triton" / "auto" / "gluon"):
    ``fits()`` says why it cannot (None: it can), and ``tensors`` must start 16-byte aligned; "gluon" raises
    naming why not."""
    choice = getattr(kernel_config, switch)
    if choice == "triton":
        return False
    why_not = fits()
    if why_not is None and any(int(torch_view(x).data_ptr()) % 16 for x in tensors):
        why_not = "rows not 16-byte aligned (cp.async copies 16 bytes)"
    if choice == "gluon" and why_not is not None:
        raise ValueError(f"{fn}: kernel_config.{switch} = 'gluon' cannot run here: {why_not}")
    return why_not is None


def use_ws_forward(q: Any, kv: Any, d_qk: int, d_v: int, fn: str) -> bool:
    """Whether this forward runs the warp-specialised Gluon kernel (``kernel_config.FWD_KERNEL``)."""
    return _use_ws("FWD_KERNEL", lambda: kernel_config.ws_forward_fits(dtype_name(q), d_qk, d_v), (q, kv), fn)


def _check_bwd_inputs(q: Any, kv: Any, idx: Any, sink: Any, out: Any, lse: Any, d_out: Any, d_lse: Any,
                      d_v: int | None, topk_length: Any, partial_dtype: str) -> tuple[int, int, int, int, int, int]:
    """``check_inputs`` plus the backward's own tensors; returns (T, H, d_qk, N, K, d_v)."""
    fn = "sparse_attn_bwd"
    num_t, heads, d_qk, n_kv, width, d_v = check_inputs(q, kv, idx, sink, d_v, topk_length, fn)
    if shape_of(d_out) != [num_t, heads, d_v] or d_out.dtype != q.dtype:
        raise ValueError(f"{fn}: `d_out` must be {q.dtype} [{num_t}, {heads}, {d_v}], got {d_out.dtype} "
                         f"{list(d_out.shape)}")
    if shape_of(out) != [num_t, heads, d_v]:
        raise ValueError(f"{fn}: `out` must be [{num_t}, {heads}, {d_v}], got {list(out.shape)}")
    if shape_of(lse) != [num_t, heads] or dtype_name(lse) != "float32":
        raise ValueError(f"{fn}: `lse` must be fp32 [{num_t}, {heads}], got {lse.dtype} {list(lse.shape)}")
    if d_lse is not None and (shape_of(d_lse) != [num_t, heads] or dtype_name(d_lse) != "float32"):
        raise ValueError(f"{fn}: `d_lse` must be fp32 [{num_t}, {heads}], got {d_lse.dtype} {list(d_lse.shape)}")
    if partial_dtype not in PARTIAL_DTYPES:
        raise ValueError(f"{fn}: `partial_dtype` must be one of {list(PARTIAL_DTYPES)}, got {partial_dtype!r}")
    for name, tensor in (("out", out), ("lse", lse), ("d_out", d_out), ("d_lse", d_lse)):
        if tensor is not None and not _is_contiguous(tensor):
            raise ValueError(f"{fn}: `{name}` must be contiguous")
    return num_t, heads, d_qk, n_kv, width, d_v


def _bwd_delta_and_dsink(q: Any, out: Any, d_out: Any, lse: Any, d_lse: Any, sink: Any, d_sink: Any,
                         num_t: int, heads: int, d_v: int) -> Any:
    """Step 1: returns ``delta`` fp32 [max(T, 1), H]; writes ``d_sink`` (fixed-order sum of block partials)."""
    f32 = _framework_dtype(q, "float32")
    block_t = 16
    block_hd = min(16, max(2, _pow2(heads)))
    n_tb = max(1, triton.cdiv(num_t, block_t))
    delta = empty_like(q, [max(num_t, 1), heads], dtype=f32)
    dsink_part = empty_like(q, [n_tb, heads], dtype=f32)
    launch(_bwd_preprocess_kernel, (n_tb, triton.cdiv(heads, block_hd)), out, d_out, lse,
           lse if d_lse is None else d_lse, sink, delta, dsink_part, num_t, heads,
           D_V=d_v, BLOCK_T=block_t, BLOCK_H=block_hd, HAS_DLSE=d_lse is not None,
           num_warps=4)
    launch(_dsink_reduce_kernel, (triton.cdiv(heads, 32),), dsink_part, d_sink, n_tb, heads,
           BLOCK_B=32, BLOCK_H=32, num_warps=4)
    return delta


@dataclass(frozen=True)
class _PairBuffers:
    """Query chunking and the per-pair buffers of steps 2-5, shared by every chunk."""

    chunk: int  # queries per chunk (0: one pass of the reduce writes zeros)
    n_chunks: int
    h_pad: int  # heads padded to a power of two >= 16 (the pair buffers' row width)
    block_h: int
    p_buf: Any
    ds_buf: Any
    part: Any  # the contributions ([pairs, d_qk]; packed to 24 bits: their high 16 bits as int16)
    part_lo: Any  # packed to 24 bits: their low 8 bits (uint8), else ``part`` (never read)
    keys: Any
    rowptr: Any
    acc: Any  # the fp32 running dkv when there is more than one chunk, else dkv itself
    reduce_chunk: int  # pairs per reduce item (``reduce_chunk``)
    items_bound: int  # reduce items at most: n_kv + cdiv(pairs, reduce_chunk)
    item_start: Any  # [n_kv + 1] int64: each row's first item, then the total
    item_row: Any  # [items_bound] int32: each item's row
    split: Any  # [items_bound, d_qk] fp32: the items' sums of rows with more than one item

    @property
    def packed24(self) -> bool:
        return self.part_lo is not self.part


def _pair_buffers(q: Any, kv: Any, idx: Any, dkv: Any, num_t: int, heads: int, d_qk: int, n_kv: int, width: int,
                  partial_dtype: str, max_partial_bytes: int, n_contrib: int, banded: bool) -> _PairBuffers:
    """Chunk the queries so the pair buffers stay under ``max_partial_bytes``; allocate the buffers. ``n_contrib``
    of a row's ``width`` slots take the CSR path (the others are band slots); ``banded``: an fp32 dkv accumulator
    even for one chunk (the bands add into it)."""
    f32 = _framework_dtype(q, "float32")
    h_pad = max(16, _pow2(heads))
    block_h = min(64, h_pad)
    elem = 4 if dtype_name(q) == "float32" else 2
    stored = partial_storage(partial_dtype, dtype_name(q))
    part_elem = {"float32": 4, "float24": 3, "bfloat16": 2}[stored]
    per_query = max(1, width * 2 * h_pad * elem + n_contrib * (d_qk * part_elem + 4 + 4 + 8))
    chunk = max(1, min(max(num_t, 1), int(max_partial_bytes) // per_query))
    n_chunks = triton.cdiv(num_t, chunk) if num_t else 0
    p_buf = empty_like(q, [max(chunk * width, 1), h_pad])
    ds_buf = empty_like(q, [max(chunk * width, 1), h_pad])
    pairs = chunk * n_contrib
    part = empty_like(q, [max(pairs, 1), d_qk], dtype=_framework_dtype(q, "int16" if stored == "float24" else stored))
    part_lo = empty_like(q, [max(pairs, 1), d_qk], dtype=_framework_dtype(q, "uint8")) if stored == "float24" else part
    keys = empty_like(idx, [max(pairs, 1)], dtype=_framework_dtype(idx, "int32"))
    rowptr = empty_like(idx, [n_kv + 1], dtype=_framework_dtype(idx, "int64"))
    acc = empty_like(kv, [n_kv, d_qk], dtype=f32) if n_chunks > 1 or banded else dkv
    if banded:
        zero_fill(acc, n_kv * d_qk)
    items_chunk = reduce_chunk(pairs, n_kv)
    items_bound = n_kv + triton.cdiv(pairs, items_chunk)
    item_start = empty_like(idx, [n_kv + 1], dtype=_framework_dtype(idx, "int64"))
    item_row = empty_like(idx, [max(items_bound, 1)], dtype=_framework_dtype(idx, "int32"))
    reduces = not (banded and n_contrib == 0)  # bands over every slot: no CSR reduce (``_bwd_chunk``)
    split = empty_like(kv, [max(items_bound, 1) if reduces else 1, d_qk], dtype=f32)
    if n_chunks == 0:
        n_chunks, chunk = 1, 0  # one pass of the reduce writes zeros
    return _PairBuffers(chunk, n_chunks, h_pad, block_h, p_buf, ds_buf, part, part_lo, keys, rowptr, acc,
                        items_chunk, items_bound, item_start, item_row, split)


# How the backward stores its per-pair dkv contributions (``partial_dtype``), summed in fp32 in a fixed order in
# every case: "float32"; "float24", fp32 rounded to nearest at 16 significant bits in 3 bytes (a relative error of
# at most 2^-16 per contribution, whatever the input dtype: 128x below a bf16 rounding, and dkv is bf16 when the
# inputs are); "bfloat16", for bf16/fp16 inputs only (fp32 inputs keep fp32); "auto", float24 for bf16/fp16
# inputs and float32 for fp32 ones (benchmarks/RESULTS.md: the backward 1.06-1.17x on the H200, dkv's error
# against an fp32 reference unchanged to three digits).
PARTIAL_DTYPES = ("auto", "float32", "float24", "bfloat16")


def partial_storage(partial_dtype: str, input_dtype: str) -> str:
    """How the contributions are stored for inputs of ``input_dtype`` (``PARTIAL_DTYPES``)."""
    if partial_dtype == "auto":
        return "float32" if input_dtype == "float32" else "float24"
    return "float32" if partial_dtype == "bfloat16" and input_dtype == "float32" else partial_dtype


# Pairs per item of the dkv reduce: None picks ``max(1024, next_pow2(4 * pairs / rows))`` per query chunk (rows of
# up to a few times the mean length stay one item: the same bytes as one program per row); tests set it small.
REDUCE_CHUNK: int | None = None


def reduce_chunk(pairs: int, n_kv: int) -> int:
    """Pairs per reduce item: a row with more pairs is summed by several programs (then its parts in order)."""
    if REDUCE_CHUNK is not None:
        return REDUCE_CHUNK
    return max(1024, _pow2(4 * triton.cdiv(pairs, max(n_kv, 1))))


@dataclass(frozen=True)
class _BwdCall:
    """The tensors and sizes every chunk of one backward call launches with."""

    q: Any
    kv: Any
    idx: Any
    d_out: Any
    lse: Any
    delta: Any
    dq: Any
    dkv: Any
    topk: Any  # the trailing bound / topk_length, or q as a never-read placeholder
    has_topk_len: bool
    num_t: int
    heads: int
    d_qk: int
    d_v: int
    n_kv: int
    width: int
    scale: float
    partial_dtype: str
    slot_bands: SlotBands | None  # band slots summed key-major (``band.py``), or None
    c0: int  # the CSR path's slots: [c0, c0 + n_contrib)
    n_contrib: int

    def meta(self) -> dict:
        return {"D_V": self.d_v, "D_TAIL": self.d_qk - self.d_v, "HAS_TOPK_LEN": self.has_topk_len,
                "PREC": _prec(self.q)}


def use_ws_dq(q: Any, kv: Any, d_out: Any, d_qk: int, d_v: int, block_h: int, fn: str) -> bool:
    """Whether the backward's dq step runs the warp-specialised Gluon kernel (``kernel_config.DQ_KERNEL``)."""
    return _use_ws("DQ_KERNEL", lambda: kernel_config.ws_dq_fits(dtype_name(q), d_qk, d_v, block_h), (q, kv, d_out),
                   fn)


def launch_ws_dq_dense(q: Any, kv: Any, d_out: Any, lse: Any, delta: Any, dq: Any, scale: float, d_v: int, seq: int,
                       q_offset: int) -> None:
    """The warp-specialised dq kernel in its dense causal mode (``causal.py``'s contract: ``seq`` queries per
    sequence at ``q_offset``, ``kv`` rows per sequence); no pair buffers."""
    num_t, heads, d_qk = shape_of(q)
    n_kv = int(kv.shape[0]) // (num_t // seq)
    head_blocks = triton.cdiv(heads, 64)
    launch(_bwd_dq_ws_kernel, (num_t * head_blocks,), q, kv, d_out, lse, lse, lse, delta, dq, dq, dq, heads, n_kv,
           0, 0, float(scale) * _LOG2E, float(scale), 0, heads * d_qk, d_qk, d_qk, 0, heads * d_v, d_v, S=int(seq),
           q_offset=int(q_offset), D_TAIL=d_qk - d_v, BLOCK_H=64, HAS_TOPK_LEN=False, HEAD_BLOCKS=head_blocks,
           DENSE=True, **kernel_config.WS_DQ_DENSE_META)


def _bwd_dq(call: _BwdCall, bufs: _PairBuffers, t0: int, tc: int) -> None:
    """Step 2 for queries [t0, t0 + tc): dq, and P and dS into the pair buffers."""
    q, heads, d_qk, d_v, width = call.q, call.heads, call.d_qk, call.d_v, call.width
    if use_ws_dq(q, call.kv, call.d_out, d_qk, d_v, bufs.block_h, "sparse_attn_bwd"):
        head_blocks = bufs.h_pad // 64
        launch(_bwd_dq_ws_kernel, (tc * head_blocks,), q, call.kv, call.d_out, call.idx, call.topk, call.lse,
               call.delta, call.dq, bufs.p_buf, bufs.ds_buf, heads, call.n_kv, width, t0,
               float(call.scale) * _LOG2E, float(call.scale), bufs.h_pad, heads * d_qk, d_qk, d_qk, width,
               heads * d_v, d_v, D_TAIL=d_qk - d_v, BLOCK_H=64, HAS_TOPK_LEN=call.has_topk_len,
               HEAD_BLOCKS=head_blocks, **kernel_config.WS_DQ_META)
        return
    launch_first_fitting(
        "dq", _bwd_dq_kernel, (tc * (bufs.h_pad // bufs.block_h),), (d_qk, d_v, bufs.block_h, dtype_name(q)),
        configs_for("dq"),
        q, call.kv, call.d_out, call.idx, call.topk, call.lse, call.delta, call.dq, bufs.p_buf, bufs.ds_buf,
        heads, call.n_kv, width, t0, float(call.scale) * _LOG2E, float(call.scale), bufs.h_pad,
        heads * d_qk, d_qk, d_qk, width, heads * d_v, d_v,
        BLOCK_H=bufs.block_h, EVEN_H=heads % bufs.block_h == 0, **call.meta(),
    )


def _bwd_pairs(call: _BwdCall, bufs: _PairBuffers, t0: int, tc: int) -> tuple[int, Any, Any]:
    """Steps 3-4 for queries [t0, t0 + tc): per-pair dkv contributions and the CSR keys, stably sorted.

    Returns (number of pairs, sorted keys, permutation).
    """
    q, heads, d_qk, d_v, width = call.q, call.heads, call.d_qk, call.d_v, call.width
    interp = capability.detect().interpreter
    h_pad = bufs.h_pad
    c0, n_contrib = call.c0, call.n_contrib
    launch_first_fitting(
        "partial", _bwd_dkv_partial_kernel, lambda m, tc=tc: (tc * triton.cdiv(n_contrib, m["BLOCK_M"]),),
        (d_qk, d_v, h_pad, dtype_name(q), call.partial_dtype), configs_for("partial"),
        q, call.d_out, call.topk, bufs.p_buf, bufs.ds_buf, bufs.part, bufs.part_lo,
        heads, width, t0, h_pad, c0, n_contrib, heads * d_qk, d_qk, heads * d_v, d_v, d_qk, d_qk // 2,
        BLOCK_HP=h_pad, BLOCK_D=min(d_v, 16 if interp else 64), PACK24=bufs.packed24, **call.meta(),
        **({"enable_fp_fusion": False} if bufs.packed24 else {}),  # the packing's exact rounding (_pack24_pairs)
    )
    launch(_csr_keys_kernel, (tc, triton.cdiv(n_contrib, 128 if not interp else 16)), call.idx, call.topk,
           bufs.keys, call.n_kv, c0, n_contrib, t0, width, BLOCK=128 if not interp else 16,
           HAS_TOPK_LEN=call.has_topk_len)
    n_pairs = tc * n_contrib
    keys = bufs.keys
    sorted_keys, order = _stable_sort(keys[:n_pairs] if n_pairs < int(keys.shape[0]) else keys)
    return n_pairs, sorted_keys, order


def _bwd_chunk(call: _BwdCall, bufs: _PairBuffers, c: int) -> None:
    """Steps 2-5 for chunk ``c`` of the queries; the last chunk writes dkv."""
    t0 = c * bufs.chunk
    tc = min(bufs.chunk, call.num_t - t0)
    if tc > 0:  # dq (zeros when the index table is empty)
        _bwd_dq(call, bufs, t0, tc)
    if tc > 0 and call.slot_bands is not None:
        band_dkv(call, bufs, call.slot_bands, t0, tc)
    if call.slot_bands is not None and call.n_contrib == 0:  # the bands summed every slot: acc is dkv in fp32
        if c == bufs.n_chunks - 1:
            copy_rows(bufs.acc, call.dkv, call.n_kv * call.d_qk)
        return
    if tc > 0 and call.n_contrib > 0:
        n_pairs, sorted_keys, order = _bwd_pairs(call, bufs, t0, tc)
    else:
        n_pairs = 0
        sorted_keys, order = bufs.keys, bufs.keys
    n_kv, d_qk, d_v = call.n_kv, call.d_qk, call.d_v
    steps = max(1, int(n_pairs).bit_length() + 1)
    launch(_csr_rowptr_kernel, (triton.cdiv(n_kv + 1, 128),), sorted_keys, bufs.rowptr, n_pairs, n_kv + 1,
           STEPS=steps, BLOCK=128)
    out = call.dkv if c == bufs.n_chunks - 1 else bufs.acc
    accumulate = c > 0 or call.slot_bands is not None  # the previous chunks' and the bands' sums are in acc
    launch(_csr_items_kernel, (1,), bufs.rowptr, bufs.item_start, n_kv, bufs.reduce_chunk,
           BLOCK=1024 if not capability.detect().interpreter else 16)
    launch(_csr_item_rows_kernel, (triton.cdiv(n_kv, 128),), bufs.item_start, bufs.item_row, n_kv, BLOCK=128)
    launch(_bwd_dkv_reduce_kernel, (bufs.items_bound,), bufs.part, bufs.part_lo, order, bufs.rowptr,
           bufs.item_start, bufs.item_row, bufs.split, bufs.acc, out, d_qk, bufs.reduce_chunk, n_kv, D_V=d_v,
           D_TAIL=d_qk - d_v, ACCUMULATE=accumulate, PACK24=bufs.packed24, **reduce_config())
    launch(_bwd_dkv_combine_kernel, (n_kv,), bufs.split, bufs.item_start, bufs.acc, out, d_qk, D_V=d_v,
           D_TAIL=d_qk - d_v, ACCUMULATE=accumulate)


def sparse_attn_bwd(q: Any, kv: Any, idx: Any, sink: Any, scale: float, out: Any, lse: Any, d_out: Any,
                    d_lse: Any = None, d_v: int | None = None, topk_length: Any = None,
                    partial_dtype: str = "auto", max_partial_bytes: int = 4 << 30,
                    derive_bound: bool = True, slot_bands: SlotBands | None = None) -> tuple[Any, Any, Any]:
    """Deterministic backward -> (dq [T, H, d_qk] like q, dkv [N, d_qk] like kv, d_sink [H] fp32).

    ``out``/``lse`` are the forward's outputs, ``d_out`` [T, H, d_v], ``d_lse`` [T, H] (optional, the
    gradient reaching the returned LSE). ``partial_dtype`` is how the per-pair dkv contributions are stored
    (``PARTIAL_DTYPES``: "float24", the default for bf16/fp16 inputs, cuts their round trip through memory by a
    quarter, "bfloat16" by half, each at the cost of rounding every contribution);
    ``max_partial_bytes`` bounds the pair buffers (queries are processed in chunks under it);
    ``derive_bound`` as in ``sparse_attn_fwd`` (byte-identical gradients either way). ``slot_bands``
    (``band.SlotBands``): slots whose key follows from the query's position; their dkv is summed key-major
    without per-pair contributions (dq and d_sink byte-equal, dkv in another fixed order) where that pays
    (``band_bwd.bands_pay``: enough queries to fill a GPU).
    """
    num_t, heads, d_qk, n_kv, width, d_v = _check_bwd_inputs(q, kv, idx, sink, out, lse, d_out, d_lse, d_v,
                                                             topk_length, partial_dtype)
    dq = empty_like(q)
    dkv = empty_like(kv)
    d_sink = empty_like(sink, [heads], dtype=_framework_dtype(q, "float32"))
    if heads == 0:
        return dq, dkv, d_sink
    if num_t == 0:  # nothing attends: zero gradients (rare; no kernel needed beyond the reduce)
        width = 0
    delta = _bwd_delta_and_dsink(q, out, d_out, lse, d_lse, sink, d_sink, num_t, heads, d_v)  # 1.
    # 2-5. dq and dkv, by chunks of queries
    bands = slot_bands if num_t > 0 and width > 0 and bands_pay(num_t) else None
    c0, c1 = (0, width) if bands is None else bands.contribution_slots(width)
    if bands is not None:
        bands.check(num_t, n_kv)
    bufs = _pair_buffers(q, kv, idx, dkv, num_t, heads, d_qk, n_kv, width, partial_dtype, max_partial_bytes,
                         c1 - c0, bands is not None)
    if derive_bound and num_t > 0 and width > 0:
        topk_length = row_bound(idx, n_kv, topk_length)
    call = _BwdCall(q, kv, idx, d_out, lse, delta, dq, dkv, q if topk_length is None else topk_length,
                    topk_length is not None, num_t, heads, d_qk, d_v, n_kv, width, scale, partial_dtype,
                    bands, c0, c1 - c0)
    for c in range(bufs.n_chunks):
        _bwd_chunk(call, bufs, c)
    return dq, dkv, d_sink


def flops(num_valid_pairs: int, heads: int, d_qk: int, d_v: int) -> dict[str, float]:
    """FLOP accounting of dsv4_math.md §8 over *valid* (query, index) pairs: fwd 2·H·(d_qk + d_v) per pair,
    bwd 2·H·(2·d_v + 3·d_qk) per pair (TileLang's accounting)."""
    return {"fwd": 2.0 * num_valid_pairs * heads * (d_qk + d_v),
            "bwd": 2.0 * num_valid_pairs * heads * (2 * d_v + 3 * d_qk)}


__all__ = ["sparse_attn_fwd", "sparse_attn_bwd", "row_bound", "check_inputs", "flops", "OVERRIDES"]
