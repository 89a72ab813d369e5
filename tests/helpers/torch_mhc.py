"""The Paddle mHC reference's op sequence in eager torch (torch only: tests/gpu and the benchmark run without Paddle).

``fleet_ext/ops/mhc/reference.py`` op by op: the flattened streams cast to fp32 and RMS-normalised, the
projection, the gates, Sinkhorn (softmax + eps, column normalise, then row / column), the fp32 collapse cast
back; the combine as a matmul in the streams' dtype. Differentiable (torch autograd), any float dtype (float64
makes it a gradient oracle independent of the kernels).
"""

from __future__ import annotations

from typing import Any


def sinkhorn(logits: Any, iterations: int, eps: float) -> Any:
    import torch

    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _mix(streams: Any, fn: Any, norm_eps: float, compute: Any) -> Any:
    import torch

    flat = streams.reshape(*streams.shape[:-2], -1).to(compute)
    flat = flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)
    return flat @ fn.to(compute).T


def mhc_pre(streams: Any, fn: Any, base: Any, scale: Any, iterations: int, eps: float, norm_eps: float,
            compute: Any = None) -> tuple[Any, Any, Any]:
    """streams [..., n, D] -> (post [..., n], comb [..., n, n], collapsed [..., D] in the streams' dtype).

    ``compute``: the dtype of the mHC maths (fp32 as the reference; float64 for an oracle)."""
    import torch

    compute = compute or torch.float32
    n = streams.shape[-2]
    mix = _mix(streams, fn, norm_eps, compute)
    base, scale = base.to(compute), scale.to(compute)
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * torch.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = (mix[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(*mix.shape[:-1], n, n)
    comb = sinkhorn(logits, iterations, eps)
    collapsed = (pre.unsqueeze(-1) * streams.to(compute)).sum(dim=-2)
    return post, comb, collapsed.to(streams.dtype if compute == torch.float32 else compute)


def mhc_head(streams: Any, fn: Any, base: Any, scale: Any, eps: float, norm_eps: float, compute: Any = None) -> Any:
    import torch

    compute = compute or torch.float32
    pre = torch.sigmoid(_mix(streams, fn, norm_eps, compute) * scale.to(compute) + base.to(compute)) + eps
    collapsed = (pre.unsqueeze(-1) * streams.to(compute)).sum(dim=-2)
    return collapsed.to(streams.dtype if compute == torch.float32 else compute)


def mhc_combine(streams: Any, block_out: Any, post: Any, comb: Any) -> Any:
    """``X'_k = post_k f + sum_j comb[j, k] X_j`` in the streams' dtype (as the reference's matmul)."""
    dtype = streams.dtype
    mixed = comb.to(dtype).transpose(-1, -2) @ streams
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed
