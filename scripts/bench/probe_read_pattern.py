"""Probe: read bandwidth of X [16384, 16384] bf16 by tile shape and load mechanism (the mHC projection's pattern:
[BT tokens, BK channels] tiles, each token a row of 32 KB), against torch's copy and sum on the same GPU.

    python scripts/bench/probe_read_pattern.py

Pointer loads (``tl.load`` pipelined by ``tl.range(num_stages=)``: ``cp.async``) and TMA descriptor loads, each
program summing its tiles so that nothing is optimised away."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _read_ptr(x_ptr, out_ptr, T, K, KS, BT: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    t0 = tl.program_id(0) * BT
    k_begin = tl.program_id(1) * KS
    rows = t0 + tl.arange(0, BT)
    acc = tl.zeros([BT, BK], tl.float32)
    for k in tl.range(k_begin, k_begin + KS, BK, num_stages=STAGES):
        cols = k + tl.arange(0, BK)
        acc += tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc))


@triton.jit
def _read_tma(x_ptr, out_ptr, T, K, KS, BT: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[K, 1], block_shape=[BT, BK])
    t0 = tl.program_id(0) * BT
    k_begin = tl.program_id(1) * KS
    acc = tl.zeros([BT, BK], tl.float32)
    for k in tl.range(k_begin, k_begin + KS, BK, num_stages=STAGES):
        acc += desc.load([t0, k]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(acc))


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    T, K = 16384, 16384
    x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
    nbytes = x.numel() * 2
    y = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    copy_gbs = 2 * nbytes / copy_ms / 1e6
    sum_ms = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), return_mode="median")
    print(f"copy {copy_gbs:.0f} GB/s (read+write); torch sum reads {nbytes / sum_ms / 1e6:.0f} GB/s")
    rows = []
    for kind, fn in (("ptr", _read_ptr), ("tma", _read_tma)):
        for bt, bk, splits, stages, warps in ((128, 64, 4, 4, 8), (128, 128, 4, 3, 8), (64, 64, 4, 4, 4),
                                              (32, 64, 8, 3, 4), (32, 256, 8, 3, 4), (16, 512, 8, 3, 4),
                                              (4, 4096, 1, 2, 8), (128, 64, 8, 4, 8), (256, 64, 4, 4, 8)):
            grid = (T // bt, splits)
            out = torch.empty(grid[0] * grid[1], device="cuda")
            try:
                run = functools.partial(fn[grid], x, out, T, K, K // splits, BT=bt, BK=bk, STAGES=stages,
                                        num_warps=warps)
                ms = triton.testing.do_bench(run, return_mode="median")
            except Exception as err:  # noqa: BLE001 (a probe: report and go on)
                print(kind, bt, bk, "failed:", str(err)[:120])
                continue
            gbs = nbytes / ms / 1e6
            rows.append((kind, bt, bk, splits, stages, warps, ms * 1e3, gbs, 100 * gbs / copy_gbs))
            print(f"{kind} BT {bt:4d} BK {bk:5d} splits {splits} stages {stages} warps {warps}: {ms * 1e3:7.1f} us "
                  f"{gbs:6.0f} GB/s = {100 * gbs / copy_gbs:5.1f} % of copy", flush=True)


if __name__ == "__main__":
    main()
