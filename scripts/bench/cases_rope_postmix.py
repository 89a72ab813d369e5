"""Benchmark cases for the RoPE and inverse-RoPE + VHA postmix fusions (``apply_rope_fusion``,
``fuse_inv_rope_into_vha_postmix``), for ``bench_fusions.py`` on the H200 (torch + Triton, no Paddle).

Production shapes (64K context, context_parallel_size 4): attention output / q [1, 16384, 64, 512] bf16
(1 GiB), kv [1, 16384, 512] bf16, pe = 64, fp32 cos/sin [16384, 32]. ``eager`` is the unfused eager torch op
sequence that mirrors the Paddle reference (``fleet_ext/ops/*/reference.py``); ``fused`` is the kernel path.

``bytes_moved`` is the minimum HBM traffic of the operation, not of a particular implementation:

- RoPE out of place: read x + write the result (2 N) + the cos/sin rows;
- RoPE in place: read + write only the rope channels (2 N * rd / d = N / 4 at rd / d = 1/8) + cos/sin. The
  in-place kernel touches nothing else, so its GB/s is honest, but it is N / 4 of traffic, not a copy's 2 N;
- inverse RoPE + postmix forward: read O + write Y (2 N), the floor of the bare postmix GEMM. The fused path
  actually moves 2.75 N (GEMM 2 N, rotated pe slice N / 4, narrow GEMM N / 4, trailing write N / 4), so its
  ``pct_copy`` is relative to the GEMM's floor; ``extra.bare_gemm`` times ``matmul(M, O)`` alone (the target
  is fused <= 1.15 x bare_gemm);
- inverse RoPE + postmix backward: read O and dY, write dO (3 N), the floor of the op. Both paths also
  materialise the rotated tensor and d(rotated) and run torch's matmul backward on them; the fused one
  rebuilds the rotation with the kernel instead of keeping it from the forward.
"""

from __future__ import annotations

import os
import sys

import torch

from fleet_ext import capability

# The eager baseline is the same op sequence the GPU tests hold the kernels to (torch only, no Paddle).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
from helpers.torch_rope import eager_rope  # noqa: E402

capability.prepare_triton()

from fleet_ext.ops.inv_rope_postmix import kernel as postmix_kernel  # noqa: E402
from fleet_ext.ops.rope import kernel as rope_kernel  # noqa: E402

SEQ, HEADS, DIM, PE = 16384, 64, 512, 64


def _tables(seq: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(seq, dtype=torch.float64, device="cuda")[:, None]
    angles = positions / (160000.0 ** (torch.arange(half, dtype=torch.float64, device="cuda") / half))
    return torch.cos(angles).float(), torch.sin(angles).float()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rope_cases(cos: torch.Tensor, sin: torch.Tensor, tables: int) -> list[dict]:
    """RoPE on q and kv, out of place and in place (the pe channels only)."""
    q = torch.randn(1, SEQ, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    q_inplace = q.clone()
    kv = torch.randn(1, SEQ, DIM, device="cuda", dtype=torch.bfloat16)
    kv_inplace = kv.clone()
    n_q, n_kv = _nbytes(q), _nbytes(kv)
    q_shape = f"q [1,{SEQ},{HEADS},{DIM}] bf16, pe {PE}"
    kv_shape = f"kv [1,{SEQ},{DIM}] bf16, pe {PE}"
    return [
        {
            "name": "rope q fwd (out of place)",
            "shape": q_shape,
            "eager": lambda: eager_rope(q, cos, sin),
            "fused": lambda: rope_kernel.rope(q, cos, sin),
            "bytes_moved": 2 * n_q + tables,
        },
        {
            "name": "rope q inverse (out of place)",
            "shape": q_shape,
            "eager": lambda: eager_rope(q, cos, sin, inverse=True),
            "fused": lambda: rope_kernel.rope(q, cos, sin, inverse=True),
            "bytes_moved": 2 * n_q + tables,
        },
        {
            "name": "rope q fwd (in place, pe only)",
            "shape": q_shape + "; bytes: pe channels only (N/4)",
            "eager": lambda: eager_rope(q, cos, sin),
            "fused": lambda: rope_kernel.rope_(q_inplace, cos, sin),
            "bytes_moved": 2 * n_q * PE // DIM + tables,
        },
        {
            "name": "rope kv fwd (out of place)",
            "shape": kv_shape,
            "eager": lambda: eager_rope(kv, cos, sin),
            "fused": lambda: rope_kernel.rope(kv, cos, sin),
            "bytes_moved": 2 * n_kv + tables,
        },
        {
            "name": "rope kv fwd (in place, pe only)",
            "shape": kv_shape + "; bytes: pe channels only",
            "eager": lambda: eager_rope(kv, cos, sin),
            "fused": lambda: rope_kernel.rope_(kv_inplace, cos, sin),
            "bytes_moved": 2 * n_kv * PE // DIM + tables,
        },
    ]


def _postmix_cases(cos: torch.Tensor, sin: torch.Tensor, tables: int) -> list[dict]:
    """Inverse RoPE + VHA postmix, forward and backward."""
    out = torch.randn(1, SEQ, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    u, v = 0.1 * torch.randn(HEADS, HEADS // 4, device="cuda"), 0.1 * torch.randn(HEADS, HEADS // 4, device="cuda")
    mix = (torch.eye(HEADS, device="cuda") + v @ u.T).to(torch.bfloat16)  # M = I + V U^T, cast like the reference
    grad = torch.randn_like(out)
    n_out = _nbytes(out)
    o_shape = f"O [1,{SEQ},{HEADS},{DIM}] bf16, M [{HEADS},{HEADS}], pe {PE}"

    # Backward of the unfused path through torch autograd (graph built once, replayed), vs the fused op's
    # backward: rebuild inv_rope(O) with the kernel, torch's matmul backward on it, the gradient rotation.
    out_leaf = out.clone().requires_grad_(True)
    mix_leaf = mix.clone().requires_grad_(True)
    unfused_y = torch.matmul(mix_leaf, eager_rope(out_leaf, cos, sin, inverse=True))

    def eager_backward():
        return torch.autograd.grad(unfused_y, [out_leaf, mix_leaf], grad, retain_graph=True)

    def fused_backward():
        rotated = rope_kernel.rope(out, cos, sin, inverse=True).requires_grad_(True)
        d_mix, d_rotated = torch.autograd.grad(torch.matmul(mix_leaf, rotated), [mix_leaf, rotated], grad)
        return rope_kernel.rope_grad(d_rotated, cos, sin, inverse=True), d_mix

    gemm_flops = 2 * SEQ * HEADS * HEADS * DIM
    return [
        {
            "name": "inv-rope + postmix fwd",
            "shape": o_shape + "; bytes: GEMM floor 2N (fused moves 2.75N)",
            "eager": lambda: torch.matmul(mix, eager_rope(out, cos, sin, inverse=True)),
            "fused": lambda: postmix_kernel.inv_rope_postmix_forward(out, cos, sin, mix, torch.matmul),
            "bytes_moved": 2 * n_out + tables,
            "flops": gemm_flops,
            "extra": {"bare_gemm": lambda: torch.matmul(mix, out)},
        },
        {
            "name": "inv-rope + postmix bwd",
            "shape": o_shape + "; bytes: floor 3N (read O, dY; write dO)",
            "eager": eager_backward,
            "fused": fused_backward,
            "bytes_moved": 3 * n_out + tables,
            "flops": 2 * gemm_flops,
        },
    ]


def cases() -> list[dict]:
    """Every case at the production shape; the random inputs are drawn from one seed in a fixed order."""
    torch.manual_seed(0)
    cos, sin = _tables(SEQ, PE // 2)
    tables = _nbytes(cos) + _nbytes(sin)
    return _rope_cases(cos, sin, tables) + _postmix_cases(cos, sin, tables)
