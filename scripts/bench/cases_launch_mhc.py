"""The mHC rows of ``bench_launch_overhead.py``: the fused pre and combine ops forward + backward at a tiny shape
(host cost per call, issue 16 §4), beside the eager torch mirror (``tests/helpers/torch_mhc.py``)."""

from __future__ import annotations

import torch
from bench_mhc import with_backward
from helpers import torch_mhc

from fleet_ext.ops.mhc import kernel as mhc


def mhc_cases(tokens: int, d: int, eps: float) -> list[dict]:
    """The mHC pre and combine ops forward + backward at ``tokens`` x 4 streams x ``d`` (bf16; the Gluon kernels run):
    seven and two launches, held to as many bare launches."""
    n, iters, nout = 4, 20, 24
    x = torch.randn(tokens, n, d, device="cuda").to(torch.bfloat16)
    f, g_y = (torch.randn(tokens, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    fn, base = 0.02 * torch.randn(nout, n * d, device="cuda"), 0.5 * torch.randn(nout, device="cuda")
    scale = torch.tensor([0.7, 1.3, 2.0], device="cuda")
    g_post, g_comb = torch.randn(tokens, n, device="cuda"), torch.randn(tokens, n, n, device="cuda")
    post, comb = mhc.pre_forward(x, fn, base, scale, iters, eps, eps)[:2]
    g_out = torch.randn_like(x)

    def pre_step():
        post, comb, _, mix, r = mhc.pre_forward(x, fn, base, scale, iters, eps, eps)
        return mhc.pre_backward(x, fn, base, scale, mix, r, g_post, g_comb, g_y, iters, eps)

    def eager_pre(*args):
        return torch_mhc.mhc_pre(*args, iters, eps, eps)

    return [
        dict(name="mhc pre fwd+bwd", launches=7, fused=pre_step,
             eager=with_backward(eager_pre, [x, fn, base, scale], [g_post, g_comb, g_y])),
        dict(name="mhc combine fwd+bwd", launches=2,
             fused=lambda: mhc.combine_backward(x, f, post, comb, mhc.combine_forward(x, f, post, comb)),
             eager=with_backward(torch_mhc.mhc_combine, [x, f, post, comb], [g_out])),
    ]
