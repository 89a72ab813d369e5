"""Sparse attention with the attention-sink gradient from the deterministic Triton kernel (``kernel.py``).

``sparse_attention_fused_sink_grad`` has the signature and return of
``fleet_ext.ops.sparse_attn.reference.sparse_attention_with_sink``. It runs that reference with the sink
**detached**, so the forward ``out``/``lse`` and autograd's ``dq``/``dkv`` are byte-identical to the
reference's (the sink's branch of the graph never feeds q or kv), and attaches the sink's gradient
through two PyLayers that are identities on their forward values:

- ``_SinkGradFromOut`` on ``out``: its backward passes ``d_out`` through unchanged and adds
  ``-sum p_sink * rowsum(d_out * out)`` to ``sink``'s gradient (the kernel);
- ``_SinkGradFromLse`` on ``lse``: its backward passes ``d_lse`` through unchanged (so gradients through
  ``lse`` reach q and kv exactly as in the reference) and adds ``sum p_sink * d_lse`` (the same kernel).
  When the caller does not use ``lse`` (the DSv4 layers do not), this node is not in the graph and
  costs nothing.

``lse`` keeps its full gradient contract: w.r.t. q and kv from the reference graph, w.r.t. the sink from
the second PyLayer. ``d_sink`` is **not** bitwise equal to autograd of the reference (a fixed blocked
summation order instead of autograd's): fp32 rounding differences only, run-to-run deterministic.
"""

from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from fleet_ext import capability
from fleet_ext.ops.kv_idx_remap.reference import local_to_global_flat
from fleet_ext.ops.sparse_attn.reference import sparse_attention_with_sink

capability.prepare_triton()  # interpreter mode on a CPU machine; must precede the kernel import

from fleet_ext.ops.sink_grad import kernel  # noqa: E402


def _view(t: paddle.Tensor) -> paddle.Tensor:
    """A new tensor object on the same storage (a PyLayer must not return its input itself)."""
    return t.reshape(t.shape)


class _SinkGradFromOut(PyLayer):
    @staticmethod
    def forward(ctx, out, sink, lse):
        ctx.save_for_backward(out, lse, sink)
        ctx.out_needs_grad = not out.stop_gradient
        return _view(out)

    @staticmethod
    def backward(ctx, d_out):
        out, lse, sink = ctx.saved_tensor()
        d_sink = kernel.sink_grad(d_out, out, lse, sink)
        return (d_out if ctx.out_needs_grad else None), d_sink, None


class _SinkGradFromLse(PyLayer):
    @staticmethod
    def forward(ctx, lse, sink):
        ctx.save_for_backward(lse.detach(), sink)
        ctx.lse_needs_grad = not lse.stop_gradient
        return _view(lse)

    @staticmethod
    def backward(ctx, d_lse):
        lse, sink = ctx.saved_tensor()
        d_sink = kernel.sink_grad(None, None, lse, sink, d_lse=d_lse)
        return (d_lse if ctx.lse_needs_grad else None), d_sink


def sparse_attention_fused_sink_grad(
    q: paddle.Tensor,
    kv: paddle.Tensor,
    idx: paddle.Tensor,
    sink: paddle.Tensor,
    scale: float,
    remap=local_to_global_flat,
    d_v: int | None = None,
    slot_bands: tuple = (),
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """q [B, S, H, d], kv [B, N, d], idx [B, S, K] int (-1 invalid), sink [H] fp32 -> (out [B,S,H,d_v], lse [B,S,H]).

    Same contract as the reference (``slot_bands`` is the Triton backend's hint; the reference path reads the table
    alone); the sink's gradient comes from the Triton kernel (module docstring).
    """
    if not isinstance(sink, paddle.Tensor):
        raise ValueError(f"sparse_attention_fused_sink_grad: `sink` must be a paddle.Tensor, got {type(sink).__name__}")
    out, lse = sparse_attention_with_sink(q, kv, idx, sink.detach(), scale, remap=remap, d_v=d_v)
    if sink.stop_gradient or not paddle.is_grad_enabled():
        return out, lse
    if kernel.is_interpreted() and out.dtype != paddle.float32:
        raise ValueError(f"sparse_attention_fused_sink_grad: `q` must be float32 on CPU (the Triton interpreter's "
                         f"bf16/fp16 rounding is wrong; use a GPU), got {q.dtype}")
    out = _SinkGradFromOut.apply(out, sink, lse.detach())
    lse = _SinkGradFromLse.apply(lse, sink)
    return out, lse
