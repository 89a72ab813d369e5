"""mHC (manifold-constrained hyper-connections) in pure Paddle: the unfused path and the fused kernels' reference.

The one copy of the maths (``fleet_ext.layers.mhc`` builds its layers on it). For streams X [b, s, n, D]:

- ``mhc_pre``: one projection of the RMS-normalised flattened streams (``fn`` [(2+n)n, nD]) gives, through
  ``scale`` [3] and ``base`` [(2+n)n], a pre gate ``sigmoid(.) + eps`` (collapse to the block input
  ``sum_j pre_j X_j``), a post gate ``2 sigmoid(.)`` and an n x n mixing matrix made doubly stochastic by
  Sinkhorn-Knopp (``sinkhorn``);
- ``mhc_combine``: after the block, ``X'_k = post_k f + sum_j comb[j, k] X_j``;
- ``mhc_head``: the final collapse with a pre gate only (``fn`` [n, nD], ``scale`` [1], ``base`` [n]).

All mHC arithmetic runs in fp32 (the combine's mix in the streams' dtype); the collapsed input and the combined
streams come back in the streams' dtype. Both matmuls run with Paddle's autocast off: under O1 it would run them in
bf16, rounding the gates' logits and the fp32 residual stream that O1 keeps (the fused kernels compute at fp32
accuracy either way).
"""

from __future__ import annotations

import paddle

from fleet_ext.ops.q_rms_norm.reference import rms_normalize


def sinkhorn(logits: paddle.Tensor, iterations: int, eps: float) -> paddle.Tensor:
    """Doubly-stochastic projection of [..., n, n] logits: row softmax, then alternate col/row normalising."""
    comb = paddle.nn.functional.softmax(logits, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(axis=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdim=True) + eps)
    return comb


def _mix(streams: paddle.Tensor, fn: paddle.Tensor, norm_eps: float) -> paddle.Tensor:
    """``rms_normalize(flatten(X)) @ fn^T``: [b, s, rows of fn], fp32."""
    batch, seq = streams.shape[0], streams.shape[1]
    flat = rms_normalize(streams.reshape([batch, seq, -1]).astype("float32"), norm_eps)
    with paddle.amp.auto_cast(enable=False):
        return paddle.matmul(flat, fn, transpose_y=True)


def _collapse(streams: paddle.Tensor, pre: paddle.Tensor) -> paddle.Tensor:
    return (pre.unsqueeze(-1) * streams.astype("float32")).sum(axis=2).astype(streams.dtype)


def mhc_pre(
    streams: paddle.Tensor,
    fn: paddle.Tensor,
    base: paddle.Tensor,
    scale: paddle.Tensor,
    iterations: int,
    eps: float,
    norm_eps: float,
) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """streams [b, s, n, D] -> (post [b, s, n], comb [b, s, n, n] fp32, collapsed block input [b, s, D])."""
    batch, seq, n, _ = streams.shape
    mix = _mix(streams, fn, norm_eps)
    pre_w, post_w, comb_w = paddle.split(mix, [n, n, n * n], axis=-1)
    pre_b, post_b, comb_b = paddle.split(base, [n, n, n * n])
    pre = paddle.nn.functional.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2.0 * paddle.nn.functional.sigmoid(post_w * scale[1] + post_b)
    comb_logits = (comb_w * scale[2] + comb_b).reshape([batch, seq, n, n])
    comb = sinkhorn(comb_logits, iterations, eps)
    return post, comb, _collapse(streams, pre)


def mhc_head(
    streams: paddle.Tensor, fn: paddle.Tensor, base: paddle.Tensor, scale: paddle.Tensor, eps: float, norm_eps: float
) -> paddle.Tensor:
    """streams [b, s, n, D] -> the final hidden state [b, s, D] (pre gate only, no Sinkhorn)."""
    pre = paddle.nn.functional.sigmoid(_mix(streams, fn, norm_eps) * scale + base)
    return _collapse(streams, pre + eps)


def mhc_combine(
    streams: paddle.Tensor, block_out: paddle.Tensor, post: paddle.Tensor, comb: paddle.Tensor
) -> paddle.Tensor:
    """``X'_k = post_k * f + sum_j comb[j, k] X_j`` for streams [b, s, n, D] and f [b, s, D]."""
    dtype = streams.dtype
    with paddle.amp.auto_cast(enable=False):
        mixed = paddle.matmul(comb.astype(dtype), streams, transpose_x=True)
    return post.astype(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed
