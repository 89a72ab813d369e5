"""Benchmark cases for the q/kv attention prologue (norm + RoPE in one pass; registry ``DERIVED_FUSIONS``).

For ``bench_fusions.py`` on the H200 (torch + Triton, no Paddle). Production shapes (64K context,
context_parallel_size 4): q [1, 16384, 64, 512] bf16 (1 GiB), kv [1, 16384, 512] bf16, pe = 64, fp32 cos/sin
[16384, 32]. Per row, side by side:

- ``eager``: the unfused eager torch op sequence that mirrors the Paddle path (the norm's ops, then the RoPE's,
  tests/helpers/torch_rope.py); ``compile_us`` is ``torch.compile`` of that sequence (bench_fusions.py);
- ``extra.two_ops``: what the switches give one at a time: q, the q norm's kernel then the RoPE kernel (two
  passes); kv, the eager weighted RMSNorm (no kernel of its own) then the RoPE kernel;
- ``fused``: the prologue kernel (one pass; kv's backward: one kernel plus the small reduction of the gain
  gradient's row segments).

Backward baselines are the op sequence torch autograd runs for the forward above (RoPE gradient = the inverse
rotation; then the norm's gradient), written out so that ``torch.compile`` sees one graph.

``bytes_moved`` is the op's minimum HBM traffic (each input read once, each output written once): forward, read
x (+ the gain) and write y and the fp32 ``r`` [rows] the backward needs; backward, read dy, x, r (+ gain), write
dx (+ the gain's fp32 gradient); the cos/sin rows in both. GB/s is compared with a device copy in the same run.

Run alone (only these cases):  ``PYTHONPATH=. python3 scripts/bench/cases_qkv_prologue.py``.
"""

from __future__ import annotations

import os
import sys

import torch

from fleet_ext import capability

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
from helpers.torch_rope import eager_rope  # noqa: E402

capability.prepare_triton()

from fleet_ext.ops.q_rms_norm import kernel as q_kernel  # noqa: E402
from fleet_ext.ops.qkv_prologue import kernel as prologue  # noqa: E402
from fleet_ext.ops.rope import kernel as rope_kernel  # noqa: E402

SEQ, HEADS, DIM, PE = 16384, 64, 512, 64
EPS = 1e-6


def _tables(seq: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(seq, dtype=torch.float64, device="cuda")[:, None]
    angles = positions / (10000.0 ** (torch.arange(half, dtype=torch.float64, device="cuda") / half))
    return torch.cos(angles).float(), torch.sin(angles).float()


def _eager_norm(x: torch.Tensor, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)
    normed = xf * r
    return (normed if w is None else w * normed).to(x.dtype), r


def _eager_norm_grad(g: torch.Tensor, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor | None):
    """torch autograd's gradient of ``_eager_norm`` for the incoming ``g``: (dx, dw or None)."""
    xf, gf = x.float(), g.float()
    dn = gf if w is None else gf * w
    dw = None if w is None else (gf * (xf * r)).sum((0, 1))
    d_sq = (-0.5 * (dn * xf).sum(-1, keepdim=True) * r.pow(3)) / x.shape[-1]
    return (dn * r + d_sq * (2.0 * xf)).to(x.dtype), dw


def _case(name: str, x: torch.Tensor, w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> list[dict]:
    dy = torch.randn_like(x)
    _, r = prologue.norm_rope_fused(x, EPS, cos, sin, w)
    n, rows = x.numel() * x.element_size(), x.numel() // x.shape[-1]
    tables = 2 * cos.numel() * cos.element_size()
    gain = 0 if w is None else w.numel() * 4
    shape = f"{list(x.shape)} {str(x.dtype).rsplit('.', 1)[-1]}, pe {PE}"

    def two_ops_fwd():
        if w is None:
            return rope_kernel.rope(q_kernel.q_rms_norm_fused(x, EPS)[0], cos, sin)
        return rope_kernel.rope(_eager_norm(x, w)[0], cos, sin)

    def two_ops_bwd():
        g = rope_kernel.rope_grad(dy, cos, sin)
        return q_kernel.q_rms_norm_bwd(g, x, r) if w is None else _eager_norm_grad(g, x, r, w)

    return [
        dict(name=f"{name} norm+rope fwd", shape=shape, eager=lambda: eager_rope(_eager_norm(x, w)[0], cos, sin),
             fused=lambda: prologue.norm_rope_fused(x, EPS, cos, sin, w), extra={"two_ops": two_ops_fwd},
             bytes_moved=2 * n + rows * 4 + gain + tables),
        dict(name=f"{name} norm+rope bwd", shape=shape,
             eager=lambda: _eager_norm_grad(eager_rope(dy, cos, sin, inverse=True), x, r, w),
             fused=lambda: prologue.norm_rope_bwd(dy, x, r, cos, sin, w), extra={"two_ops": two_ops_bwd},
             bytes_moved=3 * n + rows * 4 + 2 * gain + tables),
    ]


def cases() -> list[dict]:
    """q and kv at the production shape, forward and backward; inputs from one seed in a fixed order."""
    torch.manual_seed(0)
    cos, sin = _tables(SEQ, PE // 2)
    q = torch.randn(1, SEQ, HEADS, DIM, device="cuda").to(torch.bfloat16)
    kv = torch.randn(1, SEQ, DIM, device="cuda").to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(DIM, device="cuda")
    return _case("q", q, None, cos, sin) + _case("kv", kv, w, cos, sin)


if __name__ == "__main__":
    import bench_fusions  # scripts/bench is this file's directory, first on sys.path when run as a script

    copy_gbs = bench_fusions.copy_bandwidth_gbs()
    print(f"device copy: {copy_gbs:.0f} GB/s")
    for row in [bench_fusions.run_case(c, copy_gbs) for c in cases()]:
        comp = row["compile_us"]
        print(f"{row['name']:22} eager {row['eager_us']:8.1f} us  compile {comp if comp is None else round(comp, 1)} us"
              f"  two ops {row['two_ops_us']:8.1f} us  fused {row['fused_us']:8.1f} us  {row['fused_gbs']:6.0f} GB/s "
              f"({row['pct_copy']:.0f} % of copy)  peak MiB {row['eager_peak_mib']:.0f} / {row['fused_peak_mib']:.0f}")
