"""Benchmark cases for fusions 1, 4 and 5 (KV index remap, sink gradient, q RMS norm) at production shapes.

Consumed by ``bench_fusions.py`` on the H200 (torch + Triton, no Paddle). Each case: ``eager`` runs the
unfused eager torch op sequence that mirrors the Paddle path, ``fused`` the Triton kernel(s);
``bytes_moved`` is the minimum HBM traffic of the op (every input read once, every output written once,
no intermediates), the same figure for both, so GB/s compares with the device copy (read + write).

- remap: [B*S, K] int32 tables of the DSv4 HCA/CSA layers at sq 16384 (topk 640 and 2176),
  seqlen_kv = 65536 + 512; B = 1 (the context-parallel shard) and B = 4 (offsets non-zero).
- q RMS norm: the DSv4 query [1, 16384, 64, 512] bf16 at sq 16384, forward (also writes the fp32
  ``r`` [.., 1] the backward needs: counted) and backward (reads x, dy and r, writes dx).
- sink gradient: dO / O [16384, 64, 512] bf16 (as [1, 16384, 64, 512]) + lse [16384, 64] fp32 + sink [64].
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root

SEQLEN_KV = 65536 + 512
EPS = 1e-6


def _remap_cases(kernel) -> list[dict]:
    cases = []
    for batch, seq, topk in ((1, 16384, 640), (1, 16384, 2176), (4, 4096, 640)):
        idx = torch.randint(-1, SEQLEN_KV, (batch, seq, topk), dtype=torch.int32, device="cuda")

        def eager(idx=idx, batch=batch, seq=seq, topk=topk):
            offsets = (torch.arange(batch, dtype=idx.dtype, device=idx.device) * SEQLEN_KV).view(batch, 1, 1)
            return torch.where(idx >= 0, idx + offsets, idx).reshape(batch * seq, topk)

        cases.append(dict(
            name=f"kv_idx_remap B={batch} K={topk}",
            shape=f"[{batch}x{seq}, {topk}] int32, seqlen_kv {SEQLEN_KV}",
            eager=eager,
            fused=lambda idx=idx: kernel.local_to_global_flat(idx, SEQLEN_KV),
            bytes_moved=2 * idx.numel() * idx.element_size(),
        ))
    return cases


def _q_rms_cases(kernel) -> list[dict]:
    shape = (1, 16384, 64, 512)
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    dy = torch.randn(shape, device="cuda").to(torch.bfloat16)
    _, r = kernel.q_rms_norm_fused(x, EPS)
    n, rows, d = x.numel(), x.numel() // shape[-1], shape[-1]

    def eager_fwd():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)

    def eager_bwd():
        # what torch autograd runs for the forward above, op by op
        xf = x.float()
        g = dy.float()
        g_r = (g * xf).sum(-1, keepdim=True)
        d_sq = (-0.5 * g_r * r.pow(3)) / d
        return (g * r + d_sq * (2.0 * xf)).to(x.dtype)

    return [
        dict(name="q_rms_norm fwd", shape="[1, 16384, 64, 512] bf16", eager=eager_fwd,
             fused=lambda: kernel.q_rms_norm_fused(x, EPS), bytes_moved=2 * n * 2 + rows * 4),
        dict(name="q_rms_norm bwd", shape="[1, 16384, 64, 512] bf16", eager=eager_bwd,
             fused=lambda: kernel.q_rms_norm_bwd(dy, x, r), bytes_moved=3 * n * 2 + rows * 4),
    ]


def _sink_cases(kernel) -> list[dict]:
    shape = (1, 16384, 64, 512)
    out = torch.randn(shape, device="cuda").to(torch.bfloat16)
    d_out = torch.randn(shape, device="cuda").to(torch.bfloat16)
    sink = torch.randn(64, device="cuda")
    lse = sink + torch.rand(shape[:3], device="cuda") * 3

    def eager():
        delta = (d_out.float() * out.float()).sum(-1)
        return -(torch.exp(sink - lse) * delta).sum((0, 1))

    return [dict(
        name="sink_grad",
        shape="dO/O [16384, 64, 512] bf16, lse [16384, 64] fp32",
        eager=eager,
        fused=lambda: kernel.sink_grad(d_out, out, lse, sink),
        bytes_moved=2 * out.numel() * 2 + lse.numel() * 4 + 2 * sink.numel() * 4,
    )]


def cases() -> list[dict]:
    from fleet_ext.ops.kv_idx_remap import kernel as remap_kernel
    from fleet_ext.ops.q_rms_norm import kernel as q_kernel
    from fleet_ext.ops.sink_grad import kernel as sink_kernel

    return _remap_cases(remap_kernel) + _q_rms_cases(q_kernel) + _sink_cases(sink_kernel)
