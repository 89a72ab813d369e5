"""Host µs per call of the ways torch can hand out a tensor on the GPU (what chose ``fleet_ext.ops.buffers``).

Run on the H200 (torch, no Paddle): ``python scripts/bench/probe_alloc.py``; one line per way, medians of 5 x 20000
calls. Results: benchmarks/RESULTS.md, "Launch host overhead on the H200", run 9.
"""
import statistics
import time

import torch


def per_call(fn, n=20000):
    """Host µs per call of ``fn``: ``n`` calls in a row, median of five such runs (no sync in between)."""
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(runs)


def main() -> None:
    x = torch.randn(4, 4, 512, device="cuda").to(torch.bfloat16)
    f32 = torch.float32
    tmpl = torch.empty(1, device="cuda", dtype=f32).expand(4, 32)
    buf = torch.empty(1 << 20, device="cuda", dtype=torch.uint8)
    rows = []
    rows.append(("x.new_empty([4,32], dtype=f32)", per_call(lambda: x.new_empty([4, 32], dtype=f32))))
    rows.append(("x.new_empty((4,32), dtype=f32)", per_call(lambda: x.new_empty((4, 32), dtype=f32))))
    rows.append(("torch.empty((4,32), dtype, device)",
                 per_call(lambda: torch.empty((4, 32), dtype=f32, device=x.device))))
    rows.append(("torch.empty_like(x)", per_call(lambda: torch.empty_like(x))))
    rows.append(("torch.empty_like(expanded tmpl)", per_call(lambda: torch.empty_like(tmpl))))
    rows.append(("buf.data_ptr() + off", per_call(lambda: buf.data_ptr() + 4096)))
    rows.append(("buf[a:b]", per_call(lambda: buf[4096:8192])))
    rows.append(("buf.split_with_sizes 4",
                 per_call(lambda: buf.split_with_sizes([1024, 1024, 1024, (1 << 20) - 3072]))))
    flt = torch.empty(4096, device="cuda", dtype=f32)
    rows.append(("flt.view(4, 1024)", per_call(lambda: flt.view(4, 1024))))
    rows.append(("torch.as_strided", per_call(lambda: flt.as_strided((4, 32), (32, 1), 64))))
    rows.append(("x.shape, x.stride(), x.dtype", per_call(lambda: (x.shape, x.stride(), x.dtype))))
    rows.append(("x.data_ptr()", per_call(lambda: x.data_ptr())))
    rows.append(("torch.cuda.current_device()", per_call(torch.cuda.current_device)))
    for name, us in rows:
        print(f"{name:40s} {us:7.3f} us")


if __name__ == "__main__":
    main()
