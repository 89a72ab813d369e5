"""Triton sparse MQA attention with sink for Paddle: an autograd PyLayer with the reference's contract.

``sparse_attention_triton`` takes exactly the arguments of ``reference.sparse_attention_with_sink`` and
returns the same ``(out [B, S, H, d_v], lse [B, S, H])`` (``lse`` includes the sink and is differentiable).
It flattens ``q`` to ``[B*S, H, d]`` and ``kv`` to ``[B*N, d]``, turns the per-batch-local index table into
flat-global ids with ``remap`` (default the reference remap; pass the fused one to use it) and runs the
kernels of ``kernel.py``: the forward and the deterministic backward (``dq``, ``dkv``, ``d_sink`` — the same
inputs give byte-identical gradients run after run). The backward reuses the forward's index table, ``out``
and ``lse`` (saved, not recomputed), and the per-row trailing bound the forward derives once from the flat
table (``kernel.row_bound``: last valid slot + 1), so neither pass walks the -1 slots that end a row
(byte-identical to walking them).

Widths the kernels do not tile (``d_v`` or ``d - d_v`` not a power of two >= 16) are zero-padded here,
outside the PyLayer (exact: zero channels add nothing to a logit, produce zero output channels that are
sliced away, and autograd routes no gradient into them). Head counts need no padding (the kernels mask
partial head tiles).

Not bitwise equal to the reference: the kernel accumulates in a different order (online softmax over
blocks of index slots, tiled dot products), so fp32 results agree to rounding (see the CPU test's
tolerance table).
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability
from fleet_ext.ops.kv_idx_remap.reference import local_to_global_flat

capability.prepare_triton()
from fleet_ext.ops.sparse_attn import kernel  # noqa: E402  (after prepare_triton: interpreter mode on CPU)

_FN = "sparse_attention_triton"


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


class _SparseAttnTriton(PyLayer):
    @staticmethod
    def forward(ctx, q, kv, flat_idx, sink, scale, d_v):
        # per-row trailing bound (last valid slot + 1), derived once and used by the forward and the backward
        bound = kernel.row_bound(flat_idx, kv.shape[0]) if flat_idx.shape[0] and flat_idx.shape[1] else None
        out, lse = kernel.sparse_attn_fwd(q, kv, flat_idx, sink, scale, d_v=d_v, topk_length=bound,
                                          derive_bound=False)
        ctx.bound = bound
        ctx.save_for_backward(q, kv, flat_idx, sink, out, lse)
        ctx.scale, ctx.d_v = scale, d_v
        # Paddle wants None (not a tensor) for an input that does not require a gradient
        ctx.needs_grad = (not q.stop_gradient, not kv.stop_gradient, not sink.stop_gradient)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kv, flat_idx, sink, out, lse = ctx.saved_tensor()
        if d_out is None:
            d_out = paddle.zeros_like(out)
        d_out = d_out.contiguous() if not d_out.is_contiguous() else d_out
        if d_lse is not None:
            d_lse = d_lse.astype("float32")
            d_lse = d_lse.contiguous() if not d_lse.is_contiguous() else d_lse
        dq, dkv, d_sink = kernel.sparse_attn_bwd(q, kv, flat_idx, sink, ctx.scale, out, lse, d_out, d_lse,
                                                 d_v=ctx.d_v, topk_length=ctx.bound, derive_bound=False)
        dq, dkv, d_sink = (g if need else None for g, need in zip((dq, dkv, d_sink), ctx.needs_grad))
        return dq, dkv, None, d_sink


def _validate(q, kv, idx, sink, d_v):
    if q.ndim != 4:
        raise ValueError(f"{_FN}: `q` must be [B, S, H, d], got shape {q.shape}")
    if q.dtype not in (paddle.float32, paddle.bfloat16, paddle.float16):
        raise ValueError(f"{_FN}: `q` must be float32, bfloat16 or float16, got {q.dtype}")
    if kv.ndim != 3 or kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"{_FN}: `kv` must be [B, N, {q.shape[-1]}] with B={q.shape[0]}, got shape {kv.shape}")
    if kv.dtype != q.dtype:
        raise ValueError(f"{_FN}: `kv` must have the dtype of `q` ({q.dtype}), got {kv.dtype}")
    if idx.ndim != 3 or tuple(idx.shape[:2]) != tuple(q.shape[:2]):
        raise ValueError(f"{_FN}: `idx` must be [B, S, K] with B, S = {q.shape[:2]}, got shape {idx.shape}")
    if idx.dtype not in (paddle.int32, paddle.int64):
        raise ValueError(f"{_FN}: `idx` must be int32 or int64, got {idx.dtype}")
    if sink.shape != [q.shape[2]] or sink.dtype != paddle.float32:
        raise ValueError(f"{_FN}: `sink` must be fp32 [{q.shape[2]}], got {sink.dtype} {sink.shape}")
    if d_v is not None and not 0 < int(d_v) <= q.shape[-1]:
        raise ValueError(f"{_FN}: `d_v` must be in [1, {q.shape[-1]}] (the width of `q`/`kv`), got {d_v}")
    if q.shape[0] * kv.shape[1] >= 2**31:
        raise ValueError(f"{_FN}: `kv` holds B*N = {q.shape[0] * kv.shape[1]} rows; the kernels index < 2**31")


def _pad_width(x, d_v: int, width_v: int, width_tail: int):
    """[..., d] -> [..., width_v + width_tail]: value channels, zeros, key-only channels, zeros."""
    d = x.shape[-1]
    parts = [x[..., :d_v]]
    if width_v > d_v:
        parts.append(paddle.zeros(x.shape[:-1] + [width_v - d_v], dtype=x.dtype))
    if d > d_v:
        parts.append(x[..., d_v:])
    if width_tail > d - d_v:
        parts.append(paddle.zeros(x.shape[:-1] + [width_tail - (d - d_v)], dtype=x.dtype))
    return paddle.concat(parts, axis=-1) if len(parts) > 1 else x


def sparse_attention_triton(
    q: paddle.Tensor,
    kv: paddle.Tensor,
    idx: paddle.Tensor,
    sink: paddle.Tensor,
    scale: float,
    remap=local_to_global_flat,
    d_v: int | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """q [B, S, H, d], kv [B, N, d], idx [B, S, K] int (-1 invalid), sink [H] fp32 -> (out [B,S,H,d_v], lse [B,S,H]).

    Same contract as ``reference.sparse_attention_with_sink``: ``lse`` includes the sink, ``remap`` turns
    local ids into flat ids, ``d_v`` (default d) keeps the first ``d_v`` channels as the value.
    """
    _validate(q, kv, idx, sink, d_v)
    batch, seq, heads, dim = q.shape
    n_kv = kv.shape[1]
    value = dim if d_v is None else int(d_v)
    tail = dim - value
    width_v = _pow2_at_least_16(value)
    width_tail = 0 if tail == 0 else _pow2_at_least_16(tail)
    flat_idx = remap(idx, n_kv)  # [B*S, K], invalid entries negative
    if not flat_idx.is_contiguous():
        flat_idx = flat_idx.contiguous()
    q_flat = q.reshape([batch * seq, heads, dim])
    kv_flat = kv.reshape([batch * n_kv, dim])
    if width_v != value or width_tail != tail:
        q_flat = _pad_width(q_flat, value, width_v, width_tail)
        kv_flat = _pad_width(kv_flat, value, width_v, width_tail)
    out, lse = _SparseAttnTriton.apply(q_flat, kv_flat, flat_idx, sink, float(scale), width_v)
    if width_v != value:
        out = out[..., :value]
    return out.reshape([batch, seq, heads, value]), lse.reshape([batch, seq, heads])
