"""Probe: where the mHC combine op's host time goes on the GPU machine (µs per call of each part, no sync).

    cd scripts/bench && python probe_host_parts.py

Each part is called 20,000 times in a row, median of five such runs (issue 16 §4, ``benchmarks/RESULTS.md``)."""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_launch_overhead as b  # noqa: E402
from probe_alloc import per_call  # noqa: E402

from fleet_ext import capability  # noqa: E402
from fleet_ext.ops import launch as L  # noqa: E402
from fleet_ext.ops.buffers import device_key  # noqa: E402
from fleet_ext.ops.mhc import kernel as mhc  # noqa: E402
from fleet_ext.ops.mhc.kernel_fwd import _mhc_combine_fwd  # noqa: E402


def main():
    tokens, n, d = 4, 4, 512
    x = torch.randn(tokens, n, d, device="cuda").to(torch.bfloat16)
    f = torch.randn(tokens, d, device="cuda").to(torch.bfloat16)
    post, comb = torch.randn(tokens, n, device="cuda"), torch.randn(tokens, n, n, device="cuda")
    out = mhc.combine_forward(x, f, post, comb)
    mhc.combine_backward(x, f, post, comb, out)  # both plans built and bound before anything is timed
    b._BARE_X.append(torch.zeros(16, device="cuda"))
    b.bare_launch()
    lk = L.layout_key
    key = (lk(x), lk(f), lk(post), lk(comb), False, device_key(x), mhc._tuning())
    plan = mhc._COMBINE_PLANS[key]
    bound = plan.bound
    tensors = (x, f, post, comb, out)
    entry = next(iter(bound.compiled.values()))
    raw, function, coop, pdl, packed = entry.direct
    ptrs = tuple(t.data_ptr() for t in tensors)
    rest = (*plan.scalars, *bound.tail)
    g = bound.grid3
    stream = torch.cuda.current_stream().cuda_stream
    driver = L.TRITON_RUNTIME.driver()
    parts = {
        "bare Triton launch (3 args)": b.bare_launch,
        "combine fwd (op)": lambda: mhc.combine_forward(x, f, post, comb),
        "combine bwd (op)": lambda: mhc.combine_backward(x, f, post, comb, out),
        "key (4 layout_key + device + tuning)": lambda: (lk(x), lk(f), lk(post), lk(comb), False, device_key(x),
                                                         mhc._tuning()),
        "layout_key x1": lambda: lk(x),
        "device_key": lambda: device_key(x),
        "_tuning": mhc._tuning,
        "plans.get": lambda: mhc._COMBINE_PLANS.get(key),
        "maker x1": plan.info[0],
        "capability.detect": capability.detect,
        "fire (whole)": lambda: L.fire(_mhc_combine_fwd, plan, *tensors),
        "Bound.fire": lambda: bound.fire(tensors, plan.scalars),
        "data_ptr x5 + is_cuda x5": lambda: (tuple(map(L._DATA_PTR, tensors)), all(map(L._IS_CUDA, tensors))),
        "driver + device + stream": lambda: driver.get_current_stream(driver.get_current_device()),
        "raw launcher alone": lambda: raw(g[0], g[1], g[2], stream, function, coop, pdl, None, None, packed, None,
                                          None, None, *ptrs, *rest),
        "torch.empty_like(x)": lambda: torch.empty_like(x),
    }
    print(f"{'part':40} {'us':>7}")
    for name, fn in parts.items():
        print(f"{name:40} {per_call(fn):7.2f}", flush=True)


if __name__ == "__main__":
    main()
