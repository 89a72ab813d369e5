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

``idx=None`` is the dense causal mode (``causal.py``): query ``i`` of ``q`` sits at global position
``q_offset + i`` (a context-parallel rank's chunk start) and attends keys ``0 .. q_offset + i`` of ``kv``,
with no index table at all; ``causal_probs_triton`` gives the head-summed probabilities of that attention
(the DSA indexer warm-up KL's target) without the [B, S, H, N] logits.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability
from fleet_ext.ops.kv_idx_remap.reference import local_to_global_flat
from fleet_ext.ops.sparse_attn.band import Band, SlotBands

capability.prepare_triton()
from fleet_ext.ops.sparse_attn import causal, kernel  # noqa: E402  (after prepare_triton: interpreter mode on CPU)

_FN = "sparse_attention_triton"


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


class _SparseAttnTriton(PyLayer):
    @staticmethod
    def forward(ctx, q, kv, flat_idx, sink, scale, d_v, partial_dtype, slot_bands):
        # per-row trailing bound (last valid slot + 1), derived once and used by the forward and the backward
        bound = kernel.row_bound(flat_idx, kv.shape[0]) if flat_idx.shape[0] and flat_idx.shape[1] else None
        out, lse = kernel.sparse_attn_fwd(q, kv, flat_idx, sink, scale, d_v=d_v, topk_length=bound,
                                          derive_bound=False)
        ctx.bound = bound
        ctx.save_for_backward(q, kv, flat_idx, sink, out, lse)
        ctx.scale, ctx.d_v, ctx.partial_dtype, ctx.slot_bands = scale, d_v, partial_dtype, slot_bands
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
                                                 d_v=ctx.d_v, topk_length=ctx.bound, derive_bound=False,
                                                 partial_dtype=ctx.partial_dtype, slot_bands=ctx.slot_bands)
        dq, dkv, d_sink = (g if need else None for g, need in zip((dq, dkv, d_sink), ctx.needs_grad))
        return dq, dkv, None, d_sink


class _CausalAttnTriton(PyLayer):
    """The dense causal mode (no index table): ``causal.causal_attn_fwd`` / ``causal_attn_bwd``."""

    @staticmethod
    def forward(ctx, q, kv, sink, scale, d_v, seq, q_offset):
        out, lse = causal.causal_attn_fwd(q, kv, sink, scale, seq, q_offset, d_v=d_v)
        ctx.save_for_backward(q, kv, sink, out, lse)
        ctx.args = (scale, d_v, seq, q_offset)
        ctx.needs_grad = (not q.stop_gradient, not kv.stop_gradient, not sink.stop_gradient)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kv, sink, out, lse = ctx.saved_tensor()
        scale, d_v, seq, q_offset = ctx.args
        d_out = paddle.zeros_like(out) if d_out is None else d_out.contiguous()
        if d_lse is not None:
            d_lse = d_lse.astype("float32").contiguous()
        grads = causal.causal_attn_bwd(q, kv, sink, scale, out, lse, d_out, d_lse, seq=seq, q_offset=q_offset,
                                       d_v=d_v)
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_grad))


def _validate(q, kv, idx, sink, d_v):
    if q.ndim != 4:
        raise ValueError(f"{_FN}: `q` must be [B, S, H, d], got shape {q.shape}")
    if q.dtype not in (paddle.float32, paddle.bfloat16, paddle.float16):
        raise ValueError(f"{_FN}: `q` must be float32, bfloat16 or float16, got {q.dtype}")
    if kv.ndim != 3 or kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1]:
        raise ValueError(f"{_FN}: `kv` must be [B, N, {q.shape[-1]}] with B={q.shape[0]}, got shape {kv.shape}")
    if kv.dtype != q.dtype:
        raise ValueError(f"{_FN}: `kv` must have the dtype of `q` ({q.dtype}), got {kv.dtype}")
    if idx is not None and (idx.ndim != 3 or tuple(idx.shape[:2]) != tuple(q.shape[:2])):
        raise ValueError(f"{_FN}: `idx` must be [B, S, K] with B, S = {q.shape[:2]}, got shape {idx.shape}")
    if idx is not None and idx.dtype not in (paddle.int32, paddle.int64):
        raise ValueError(f"{_FN}: `idx` must be int32 or int64, got {idx.dtype}")
    if sink is not None and (sink.shape != [q.shape[2]] or sink.dtype != paddle.float32):
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


def _padded(q, kv, d_v):
    """Flat q [B*S, H, w], kv [B*N, w] with the value and key-only widths zero-padded for the kernels, and
    (value width, padded value width)."""
    batch, seq, heads, dim = q.shape
    value = dim if d_v is None else int(d_v)
    tail = dim - value
    width_v = _pow2_at_least_16(value)
    width_tail = 0 if tail == 0 else _pow2_at_least_16(tail)
    q_flat = q.reshape([batch * seq, heads, dim])
    kv_flat = kv.reshape([batch * kv.shape[1], dim])
    if width_v != value or width_tail != tail:
        q_flat = _pad_width(q_flat, value, width_v, width_tail)
        kv_flat = _pad_width(kv_flat, value, width_v, width_tail)
    return q_flat, kv_flat, value, width_v


def sparse_attention_triton(
    q: paddle.Tensor,
    kv: paddle.Tensor,
    idx: paddle.Tensor | None,
    sink: paddle.Tensor,
    scale: float,
    remap=local_to_global_flat,
    d_v: int | None = None,
    q_offset: int = 0,
    partial_dtype: str = "auto",
    slot_bands: tuple[Band, ...] = (),
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """q [B, S, H, d], kv [B, N, d], idx [B, S, K] int (-1 invalid), sink [H] fp32 -> (out [B,S,H,d_v], lse [B,S,H]).

    Same contract as ``reference.sparse_attention_with_sink``: ``lse`` includes the sink, ``remap`` turns
    local ids into flat ids, ``d_v`` (default d) keeps the first ``d_v`` channels as the value.
    ``idx=None``: dense causal, query i (global position ``q_offset + i``) attends keys ``0 .. q_offset + i``
    (``q_offset`` is read only then). ``partial_dtype``: how the backward stores its per-pair dkv contributions
    (``kernel.PARTIAL_DTYPES``; the config key ``sparse_attn_dkv_contribution_dtype``); the dense causal mode has
    none. ``slot_bands``: where ``idx`` holds keys by position (``band.Band``, local ids; the DSv4 window and HCA's
    entries): the backward sums their dkv key-major instead of through per-pair contributions.
    """
    _validate(q, kv, idx, sink, d_v)
    batch, seq, heads, _ = q.shape
    q_flat, kv_flat, value, width_v = _padded(q, kv, d_v)
    if idx is None:
        out, lse = _CausalAttnTriton.apply(q_flat, kv_flat, sink, float(scale), width_v, seq, int(q_offset))
    else:
        if q_offset:
            raise ValueError(f"{_FN}: `q_offset` ({q_offset}) belongs to the dense causal mode (idx=None); an index "
                             "table carries the key ids itself")
        flat_idx = remap(idx, kv.shape[1])  # [B*S, K], invalid entries negative
        if not flat_idx.is_contiguous():
            flat_idx = flat_idx.contiguous()
        bands = SlotBands(seq, kv.shape[1], tuple(slot_bands)) if slot_bands else None
        out, lse = _SparseAttnTriton.apply(q_flat, kv_flat, flat_idx, sink, float(scale), width_v, partial_dtype,
                                           bands)
    if width_v != value:
        out = out[..., :value]
    return out.reshape([batch, seq, heads, value]), lse.reshape([batch, seq, heads])


def causal_probs_triton(
    q: paddle.Tensor, kv: paddle.Tensor, lse: paddle.Tensor, scale: float, q_offset: int = 0,
    n_cols: int | None = None, d_v: int | None = None,
) -> paddle.Tensor:
    """Head-summed dense causal probabilities [B, S, n_cols] fp32 (no gradient): ``sum_h exp(scale q_{t,h} . kv_j -
    lse_{t,h})`` for the first ``n_cols`` keys (default N), 0 past query t's position ``q_offset + t``.

    Same contract as ``reference.causal_attention_probs``; ``lse`` [B, S, H] is the attention's (sink-inclusive).
    """
    _validate(q, kv, None, None, d_v)
    batch, seq, heads, _ = q.shape
    if list(lse.shape) != [batch, seq, heads]:
        raise ValueError(f"causal_probs_triton: `lse` must be [{batch}, {seq}, {heads}], got {lse.shape}")
    with paddle.no_grad():
        q_flat, kv_flat, _, width_v = _padded(q.detach(), kv.detach(), d_v)
        lse_flat = lse.detach().astype("float32").reshape([batch * seq, heads]).contiguous()
        probs = causal.causal_probs(q_flat.contiguous(), kv_flat.contiguous(), lse_flat, scale, seq, int(q_offset),
                                    n_cols, d_v=width_v)
    return probs.reshape([batch, seq, probs.shape[-1]])
