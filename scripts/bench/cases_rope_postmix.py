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

Each inverse RoPE + postmix row runs in both modes of ``inv_rope_postmix_mode``, side by side: ``bitwise`` (the
rows above) and ``fast`` (``kernel_fast``: one pass forward, 2 N, and one pass backward, 3 N, with a
deterministic split-K d_M). Each of those rows carries the issue's goal (``goal``: forward <= 1.15 x the bare
GEMM; backward >= 5 x eager with a peak <= eager's), printed met or missed with the measured ratio.

Run alone (only these cases, goals last): ``PYTHONPATH=. python3 scripts/bench/cases_rope_postmix.py``.
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
from fleet_ext.ops.inv_rope_postmix import kernel_fast as postmix_fast  # noqa: E402
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


def forward_goal(row: dict) -> str:
    """Issue 16 §1: the forward within 1.15 x the bare postmix GEMM measured in the same run."""
    ratio = row["fused_us"] / row["bare_gemm_us"]
    return f"{'met' if ratio <= 1.15 else 'missed'}: {ratio:.2f}x the bare GEMM (goal <= 1.15x)"


def backward_goal(row: dict) -> str:
    """Issue 16 §1: the backward >= 5 x eager, with a peak no higher than eager's."""
    speedup, peak = row["eager_us"] / row["fused_us"], row["fused_peak_mib"] <= row["eager_peak_mib"]
    met = speedup >= 5 and peak
    return (f"{'met' if met else 'missed'}: {speedup:.2f}x eager (goal >= 5x), peak {row['fused_peak_mib']:.0f} vs "
            f"eager {row['eager_peak_mib']:.0f} MiB (goal <=)")


def _postmix_cases(cos: torch.Tensor, sin: torch.Tensor, tables: int) -> list[dict]:
    """Inverse RoPE + VHA postmix, forward and backward, in both modes."""
    out = torch.randn(1, SEQ, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    u, v = 0.1 * torch.randn(HEADS, HEADS // 4, device="cuda"), 0.1 * torch.randn(HEADS, HEADS // 4, device="cuda")
    mix32 = torch.eye(HEADS, device="cuda") + v @ u.T  # M = I + V U^T in fp32, what the layer hands the fast op
    mix = mix32.to(torch.bfloat16)  # cast like the reference
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
    eager_forward = lambda: torch.matmul(mix, eager_rope(out, cos, sin, inverse=True))  # noqa: E731
    bare_gemm = {"bare_gemm": lambda: torch.matmul(mix, out)}
    return [
        {
            "name": "inv-rope + postmix fwd (bitwise)",
            "shape": o_shape + "; bytes: GEMM floor 2N (fused moves 2.75N)",
            "eager": eager_forward,
            "fused": lambda: postmix_kernel.inv_rope_postmix_forward(out, cos, sin, mix, torch.matmul),
            "bytes_moved": 2 * n_out + tables,
            "flops": gemm_flops,
            "extra": bare_gemm,
            "goal": forward_goal,
        },
        {
            "name": "inv-rope + postmix fwd (fast)",
            "shape": o_shape + "; bytes: 2N (one pass: read O, write Y)",
            "eager": eager_forward,
            "fused": lambda: postmix_fast.forward(out, cos, sin, mix32),
            "bytes_moved": 2 * n_out + tables,
            "flops": gemm_flops,
            "extra": bare_gemm,
            "goal": forward_goal,
        },
        {
            "name": "inv-rope + postmix bwd (bitwise)",
            "shape": o_shape + "; bytes: floor 3N (read O, dY; write dO)",
            "eager": eager_backward,
            "fused": fused_backward,
            "bytes_moved": 3 * n_out + tables,
            "flops": 2 * gemm_flops,
            "goal": backward_goal,
        },
        {
            "name": "inv-rope + postmix bwd (fast)",
            "shape": o_shape + "; bytes: floor 3N (one pass: read O, dY; write dO; + fp32 dM partials)",
            "eager": eager_backward,
            "fused": lambda: postmix_fast.backward(out, cos, sin, mix32, grad),
            "bytes_moved": 3 * n_out + tables,
            "flops": 2 * gemm_flops,
            "goal": backward_goal,
        },
    ]


def cases() -> list[dict]:
    """Every case at the production shape; the random inputs are drawn from one seed in a fixed order."""
    torch.manual_seed(0)
    cos, sin = _tables(SEQ, PE // 2)
    tables = _nbytes(cos) + _nbytes(sin)
    return _rope_cases(cos, sin, tables) + _postmix_cases(cos, sin, tables)


if __name__ == "__main__":
    import bench_fusions  # scripts/bench is this file's directory, first on sys.path when run as a script

    copy_gbs = bench_fusions.copy_bandwidth_gbs()
    torch.manual_seed(0)
    cos_, sin_ = _tables(SEQ, PE // 2)
    for row in [bench_fusions.run_case(c, copy_gbs) for c in _postmix_cases(cos_, sin_, 2 * _nbytes(cos_))]:
        extra = f", bare GEMM {row['bare_gemm_us']:.1f} us" if "bare_gemm_us" in row else ""
        print(f"{row['name']:34} eager {row['eager_us']:8.1f} us  fused {row['fused_us']:8.1f} us{extra}  peak MiB "
              f"{row['eager_peak_mib']:.0f} / {row['fused_peak_mib']:.0f}  -> {row['goal']}")
