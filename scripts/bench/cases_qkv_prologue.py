"""Benchmark cases for the q/kv attention prologue (norm + RoPE in one pass; registry ``DERIVED_FUSIONS``).

For ``bench_fusions.py`` on the H200 (torch + Triton, no Paddle). Two shapes per tensor, bf16, pe = 64, fp32
cos/sin [s, 32]: the production shape (64K context, context_parallel_size 4: s = 16384 per rank; q [1, 16384,
64, 512] is 1 GiB) and the training shape of ``configs/dsv4_flash_gpu.yaml`` (max_seq_len 4096, batch 1,
context_parallel_size 1: q [1, 4096, 64, 512], kv [1, 4096, 512] per rank). Per row, side by side:

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

Each row's goal (issue 16 §2): never slower than ``torch.compile`` (met / missed with compile / fused).

Run alone (only these cases):  ``PYTHONPATH=. python3 scripts/bench/cases_qkv_prologue.py``. Launch-setting
sweep (kv forward / backward at both shapes, q backward at 16384; do_bench medians, CUDA-graph replay time per
call over rotating inputs, host µs per call, each setting checked bitwise against the default's y / dx):
``--sweep`` (``--warm I/N``: compile the I-th of N shares of the settings only, to run beside other work).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
import triton

from fleet_ext import capability

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
from helpers.torch_rope import eager_rope  # noqa: E402

capability.prepare_triton()

from fleet_ext.ops.q_rms_norm import kernel as q_kernel  # noqa: E402
from fleet_ext.ops.qkv_prologue import kernel as prologue  # noqa: E402
from fleet_ext.ops.rope import kernel as rope_kernel  # noqa: E402

SEQ, TRAIN_SEQ, HEADS, DIM, PE = 16384, 4096, 64, 512, 64
EPS = 1e-6


def _tables(seq: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(seq, dtype=torch.float64, device="cuda")[:, None]
    angles = positions / (10000.0 ** (torch.arange(half, dtype=torch.float64, device="cuda") / half))
    return torch.cos(angles).float(), torch.sin(angles).float()


def _eager_norm(x: torch.Tensor, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    r = 1 / torch.sqrt(xf.square().mean(-1, keepdim=True) + EPS)
    normed = xf * r
    return (normed if w is None else w * normed).to(x.dtype), r


def _eager_norm_grad(g: torch.Tensor, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor | None):
    """torch autograd's gradient of ``_eager_norm`` for the incoming ``g``: (dx, dw or None)."""
    xf, gf = x.float(), g.float()
    dn = gf if w is None else gf * w
    dw = None if w is None else (gf * (xf * r)).sum((0, 1))
    s = torch.sqrt(xf.square().mean(-1, keepdim=True) + EPS)  # r = 1 / s: its gradient goes through s
    d_sq = ((-(dn * xf).sum(-1, keepdim=True) * (r * r)) / (2 * s)) / x.shape[-1]
    return (dn * r + d_sq * (2.0 * xf)).to(x.dtype), dw


def _goal(row: dict) -> str:
    comp = row.get("compile_us")
    if comp is None:
        return "n/a: torch.compile failed"
    ratio = comp / row["fused_us"]
    return f"{'met' if ratio >= 1.0 else 'missed'}: {ratio:.2f}x torch.compile ({row['fused_us']:.1f} vs {comp:.1f} us)"


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
        return q_kernel.q_rms_norm_bwd(g, x, r, eps=EPS) if w is None else _eager_norm_grad(g, x, r, w)

    return [
        dict(name=f"{name} norm+rope fwd", shape=shape, eager=lambda: eager_rope(_eager_norm(x, w)[0], cos, sin),
             fused=lambda: prologue.norm_rope_fused(x, EPS, cos, sin, w), extra={"two_ops": two_ops_fwd},
             bytes_moved=2 * n + rows * 4 + gain + tables, goal=_goal),
        dict(name=f"{name} norm+rope bwd", shape=shape,
             eager=lambda: _eager_norm_grad(eager_rope(dy, cos, sin, inverse=True), x, r, w),
             fused=lambda: prologue.norm_rope_bwd(dy, x, r, cos, sin, w, eps=EPS), extra={"two_ops": two_ops_bwd},
             bytes_moved=3 * n + rows * 4 + 2 * gain + tables, goal=_goal),
    ]


def _inputs(seq: int, q: bool = True) -> tuple:
    """(q or None, kv, gain, cos, sin) at sequence length ``seq``, drawn in a fixed order after the caller's seed."""
    cos, sin = _tables(seq, PE // 2)
    xq = torch.randn(1, seq, HEADS, DIM, device="cuda").to(torch.bfloat16) if q else None
    kv = torch.randn(1, seq, DIM, device="cuda").to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(DIM, device="cuda")
    return xq, kv, w, cos, sin


def cases() -> list[dict]:
    """q and kv at the production and the training shape, forward and backward; one seed, a fixed order."""
    torch.manual_seed(0)
    out = []
    for seq in (SEQ, TRAIN_SEQ):
        xq, kv, w, cos, sin = _inputs(seq)
        out += _case(f"q s{seq}", xq, None, cos, sin) + _case(f"kv s{seq}", kv, w, cos, sin)
    return out


# ------------------------------------------------------------------------------------------------------------
# Launch-setting sweep (one device call): --sweep; --warm I/N compiles a share of the settings beforehand.
# ------------------------------------------------------------------------------------------------------------
KV_FWD = [dict(kv_fwd_rows=r, kv_fwd_warps=w) for r, w in ((4, 2), (4, 1), (2, 1), (8, 2))]
KV_BWD = [dict(kv_bwd_rows=r, kv_bwd_warps=w) for r, w in ((4, 1), (4, 2), (8, 2))] + [dict(dw_fused=False)]
KV_BWD += [dict(reduce_block_c=c, reduce_segments=n, reduce_warps=w) for c, n, w in
           ((8, 512, 4), (8, 2048, 8), (4, 2048, 8), (16, 1024, 8))]
Q_BWD = [dict(q_bwd_rows=r, q_bwd_warps=w) for r, w in ((2, 2), (4, 2), (2, 1), (1, 1), (4, 4))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _graph_us(fns: list) -> float | None:
    """Device µs per call: ``fns`` (one call per input set, rotating past the L2) captured in one CUDA graph."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        return _us(graph.replay) / len(fns)
    except Exception as exc:  # report, do not hide
        print(f"graph capture failed: {type(exc).__name__}: {exc}"[:200])
        return None


def _host_us(fn, calls: int = 200) -> float:
    """Host µs per call: back-to-back calls, one sync at the end (the device keeps up at these sizes)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / calls


def _with(settings: dict, fn):
    prologue.TUNE.clear()
    prologue.TUNE.update(settings)
    try:
        return fn()
    finally:
        prologue.TUNE.clear()


def _kv_sets(seq: int) -> list[tuple]:
    """Input sets (kv, dy, w, cos, sin, r) enough to exceed the L2 (60 MB) when rotated."""
    sets = []
    for _ in range(max(4, (96 << 20) // (seq * DIM * 2 * 2))):
        _, kv, w, cos, sin = _inputs(seq, q=False)
        dy = torch.randn_like(kv)
        sets.append((kv, dy, w, cos, sin, prologue.norm_rope_fused(kv, EPS, cos, sin, w)[1]))
    return sets


def _kv_line(seq: int, way: str, settings: dict, call, sets: list, want: torch.Tensor) -> str:
    got = _with(settings, lambda: call(sets[0]))[0]
    same = torch.equal(_bits(got), _bits(want))
    us = _with(settings, lambda: _us(lambda: call(sets[0])))
    graph = _with(settings, lambda: _graph_us([functools.partial(call, s) for s in sets]))
    label = " ".join(f"{k}={v}" for k, v in settings.items())
    return (f"kv s{seq} {way} {label:44} bench {us:7.1f} us  graph {graph or float('nan'):6.1f} us"
            f"{'' if same else '  MISMATCH vs the default'}")


def _kv_fwd(s: tuple):
    return prologue.norm_rope_fused(s[0], EPS, s[3], s[4], s[2])


def _kv_bwd(s: tuple):
    return prologue.norm_rope_bwd(s[1], s[0], s[5], s[3], s[4], s[2], eps=EPS)


def _sweep_kv(seq: int, share: tuple[int, int] | None, lines: list) -> None:
    sets = _kv_sets(seq)
    want = {"fwd": _kv_fwd(sets[0])[0], "bwd": _kv_bwd(sets[0])[0]}
    jobs = [("fwd", c, _kv_fwd) for c in KV_FWD] + [("bwd", c, _kv_bwd) for c in KV_BWD]
    for i, (way, settings, call) in enumerate(jobs):
        if share is None:
            lines.append(_kv_line(seq, way, settings, call, sets, want[way]))
        elif i % share[1] == share[0]:
            _with(settings, functools.partial(call, sets[0]))
    if share is None:
        for way, call in (("fwd", _kv_fwd), ("bwd", _kv_bwd)):
            one = functools.partial(call, sets[0])
            lines.append(f"kv s{seq} {way} default: host {_host_us(one):6.1f} us per call, graph on one input set "
                         f"(as the compile rows) {_graph_us([one] * 4) or float('nan'):6.1f} us")


def _sweep_compiled(lines: list, share: tuple[int, int] | None) -> None:
    """torch.compile of the eager sequences (the bench's baselines): warmed by share; timed for kv (do_bench,
    graph and host µs)."""
    for i, case in enumerate(cases()):
        if share is not None:
            if i % share[1] == share[0]:
                torch.compile(case["eager"])()
            continue
        if not case["name"].startswith("kv"):
            continue
        compiled = torch.compile(case["eager"])
        compiled()
        lines.append(f"{case['name']} torch.compile: bench {_us(compiled):7.1f} us  graph "
                     f"{_graph_us([compiled] * 4) or float('nan'):6.1f} us  host {_host_us(compiled):6.1f} us")


def _sweep_q(share: tuple[int, int] | None, lines: list) -> None:
    torch.manual_seed(1)
    xq, _, _, cos, sin = _inputs(SEQ)
    dy = torch.randn_like(xq)
    r = prologue.norm_rope_fused(xq, EPS, cos, sin)[1]
    dx_ref = prologue.norm_rope_bwd(dy, xq, r, cos, sin, eps=EPS)[0]
    for i, settings in enumerate(Q_BWD):
        if share is not None:
            if i % share[1] == share[0]:
                _with(settings, lambda: prologue.norm_rope_bwd(dy, xq, r, cos, sin, eps=EPS))
            continue
        same = torch.equal(_bits(_with(settings, lambda: prologue.norm_rope_bwd(dy, xq, r, cos, sin, eps=EPS))[0]),
                           _bits(dx_ref))
        us = _with(settings, lambda: _us(lambda: prologue.norm_rope_bwd(dy, xq, r, cos, sin, eps=EPS)))
        label = " ".join(f"{k}={v}" for k, v in settings.items())
        lines.append(f"q s{SEQ} bwd {label:44} bench {us:7.1f} us  {3 * xq.numel() * 2 / us / 1e3:6.0f} GB/s"
                     f"{'' if same else '  MISMATCH vs the default'}")


def sweep(share: tuple[int, int] | None = None) -> list[str]:
    """The launch-setting sweep's lines (``share``: compile that share of the settings only, no timing)."""
    lines: list[str] = []
    torch.manual_seed(2)
    for seq in (SEQ, TRAIN_SEQ):
        _sweep_kv(seq, share, lines)
        torch.cuda.empty_cache()
    _sweep_compiled(lines, share)
    _sweep_q(share, lines)
    return lines


if __name__ == "__main__":
    import argparse

    import bench_fusions  # scripts/bench is this file's directory, first on sys.path when run as a script

    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="time the launch settings")
    parser.add_argument("--warm", default=None, help="I/N: compile the I-th of N shares of the sweep, no timing")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.warm or args.sweep:
        share = tuple(int(v) for v in args.warm.split("/")) if args.warm else None
        lines = sweep(share)
        with open(os.path.join(args.out, "sweep_qkv_prologue.txt" if share is None else "warm.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
        print("\n".join(lines))
        sys.exit(0)
    copy_gbs = bench_fusions.copy_bandwidth_gbs()
    print(f"device copy: {copy_gbs:.0f} GB/s")
    for row in [bench_fusions.run_case(c, copy_gbs) for c in cases()]:
        comp = row["compile_us"]
        print(f"{row['name']:22} eager {row['eager_us']:8.1f} us  compile {comp if comp is None else round(comp, 1)} us"
              f"  two ops {row['two_ops_us']:8.1f} us  fused {row['fused_us']:8.1f} us  {row['fused_gbs']:6.0f} GB/s "
              f"({row['pct_copy']:.0f} % of copy)  peak MiB {row['eager_peak_mib']:.0f} / {row['fused_peak_mib']:.0f}")
