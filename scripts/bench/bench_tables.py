"""Time the device-side table builders against the NumPy-then-copy path they replaced (issue 9 §3, GPU half).

Run on the H200 (torch + Triton, no Paddle):  python scripts/bench/bench_tables.py [--out DIR]

At DeepSeek-V4-Flash shapes (window 128, CSA ratio 4, HCA ratio 128, 256 routed experts, top-6) and
s = 4096 / 16384 tokens, each table is built two ways and checked equal before timing:

- **device**: torch mirrors of the Paddle op sequences in ``fleet_ext/layers/index_tables.py`` (``arange`` and
  elementwise ops on the GPU) and of the MoE grouping the layers now do on the device (stable sort by expert,
  ``searchsorted`` segment offsets);
- **numpy + copy**: the same values computed with NumPy on the host and copied to the device (what the tree did
  before: ``paddle.to_tensor`` of a host array, a pageable copy); for the MoE ordering the expert ids are first
  read back to the host, as the per-expert Python loop did.

The RoPE cos/sin tables stay NumPy-built on purpose (float64 angles on the host, rounded to fp32: a device
computation is not bit-identical to them; ``fleet_ext/layers/rope.py``), built once per (frequencies, range,
device) and cached; this script measures that one-time build and how many elements a float64 device build
would change, so the choice is priced.

Times are wall-clock medians (host and device, synchronised before and after each call: the host path's cost is
on the host), 20 repeats after 3 warm-ups. Prints one table last, writes bench_tables.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

WINDOW, CSA_RATIO, HCA_RATIO, EXPERTS, TOPK = 128, 4, 128, 256, 6
YARN_DIM, ROPE_BASE = 64, 160000.0


def wall_us(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


# ---- device builders (mirrors of fleet_ext/layers/index_tables.py, torch ops) ------------------------------
def _invalid_where(keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    keep, ids = torch.broadcast_tensors(keep, ids)
    return torch.where(keep, ids, torch.full_like(ids, -1)).to(torch.int32)


def window_device(s: int) -> torch.Tensor:
    t = torch.arange(s, device="cuda").unsqueeze(1)
    keys = t - WINDOW + 1 + torch.arange(WINDOW, device="cuda").unsqueeze(0)
    return _invalid_where(keys >= 0, keys)


def compressed_device(s: int, ratio: int) -> torch.Tensor:
    visible = torch.div(torch.arange(1, s + 1, device="cuda"), ratio, rounding_mode="floor")
    entries = torch.arange(s // ratio, device="cuda").unsqueeze(0)
    return _invalid_where(entries < visible.unsqueeze(1), entries + s)


def full_causal_device(s: int) -> torch.Tensor:
    keys = torch.arange(s, device="cuda").unsqueeze(0)
    return _invalid_where(keys <= torch.arange(s, device="cuda").unsqueeze(1), keys)


def moe_order_device(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.sort(indices.reshape(-1), stable=True)
    offsets = torch.searchsorted(order.values, torch.arange(EXPERTS + 1, device="cuda", dtype=order.values.dtype))
    return order.indices, offsets


# ---- the NumPy-then-copy path they replaced -----------------------------------------------------------------
def _np_where(keep: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.where(keep, ids, -1).astype(np.int32)


def window_numpy(s: int) -> torch.Tensor:
    keys = np.arange(s)[:, None] - WINDOW + 1 + np.arange(WINDOW)[None, :]
    return torch.from_numpy(_np_where(keys >= 0, keys)).to("cuda")


def compressed_numpy(s: int, ratio: int) -> torch.Tensor:
    visible = np.arange(1, s + 1) // ratio
    entries = np.arange(s // ratio)[None, :]
    return torch.from_numpy(_np_where(entries < visible[:, None], entries + s)).to("cuda")


def full_causal_numpy(s: int) -> torch.Tensor:
    keys = np.arange(s)[None, :]
    return torch.from_numpy(_np_where(keys <= np.arange(s)[:, None], keys)).to("cuda")


def moe_order_numpy(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = indices.reshape(-1).cpu().numpy()  # the device -> host read the loop needed
    order = np.argsort(flat, kind="stable")
    offsets = np.searchsorted(flat[order], np.arange(EXPERTS + 1))
    return torch.from_numpy(order).to("cuda"), torch.from_numpy(offsets).to("cuda")


def rope_inv_freq() -> np.ndarray:
    return 1.0 / (ROPE_BASE ** (np.arange(0, YARN_DIM, 2, dtype=np.float64) / YARN_DIM))


def rope_numpy(s: int, inv_freq: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    angles = np.arange(s, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (torch.from_numpy(np.cos(angles).astype(np.float32)).to("cuda"),
            torch.from_numpy(np.sin(angles).astype(np.float32)).to("cuda"))


def rope_device_f64(s: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(s, device="cuda", dtype=torch.float64).unsqueeze(1) * inv_freq.unsqueeze(0)
    return torch.cos(angles).float(), torch.sin(angles).float()


def rope_row(s: int, inv_freq: np.ndarray) -> dict:
    """The one-time RoPE table build both ways, and how many fp32 values a float64 device build would change."""
    freq_dev = torch.from_numpy(inv_freq).cuda()
    host_cos, host_sin = rope_numpy(s, inv_freq)
    dev_cos, dev_sin = rope_device_f64(s, freq_dev)
    differ = int((host_cos != dev_cos).sum() + (host_sin != dev_sin).sum())
    dev_us, np_us = wall_us(lambda: rope_device_f64(s, freq_dev)), wall_us(lambda: rope_numpy(s, inv_freq))
    return dict(s=s, table="RoPE cos/sin (built once, cached)", shape=f"2 x [{s}, {YARN_DIM // 2}] fp32",
                device_us=dev_us, numpy_copy_us=np_us, speedup=np_us / dev_us,
                equal=f"{differ} of {2 * host_cos.numel()} elements differ")


# ---- the run ---------------------------------------------------------------------------------------------------
def _equal(a, b) -> bool:
    a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
    return all(torch.equal(x.to(torch.int64) if not x.is_floating_point() else x,
                           y.to(torch.int64) if not y.is_floating_point() else y) for x, y in zip(a, b))


def cases(s: int) -> list[tuple[str, str, object, object]]:
    gen = torch.Generator(device="cuda").manual_seed(s)
    indices = torch.randint(0, EXPERTS, (s, TOPK), generator=gen, device="cuda")
    return [
        ("window table", f"[{s}, {WINDOW}] int32", lambda: window_device(s), lambda: window_numpy(s)),
        ("CSA visible entries", f"[{s}, {s // CSA_RATIO}] int32",
         lambda: compressed_device(s, CSA_RATIO), lambda: compressed_numpy(s, CSA_RATIO)),
        ("HCA all entries", f"[{s}, {s // HCA_RATIO}] int32",
         lambda: compressed_device(s, HCA_RATIO), lambda: compressed_numpy(s, HCA_RATIO)),
        ("full-causal table (-1/-2 layers)", f"[{s}, {s}] int32", lambda: full_causal_device(s),
         lambda: full_causal_numpy(s)),
        ("MoE grouping (stable sort, offsets)", f"[{s}, {TOPK}] ids, {EXPERTS} experts",
         lambda: moe_order_device(indices), lambda: moe_order_numpy(indices)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    rows = []
    inv_freq = rope_inv_freq()
    for s in args.lengths:
        for name, shape, device_fn, numpy_fn in cases(s):
            same = _equal(device_fn(), numpy_fn())
            dev_us, np_us = wall_us(device_fn), wall_us(numpy_fn)
            rows.append(dict(s=s, table=name, shape=shape, device_us=dev_us, numpy_copy_us=np_us,
                             speedup=np_us / dev_us, equal=same))
        rows.append(rope_row(s, inv_freq))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_tables.json"), "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), fh, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; wall-clock medians, µs")
    print("| s | table | shape | device ops | NumPy + copy | speed-up | same values |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['s']} | {r['table']} | {r['shape']} | {r['device_us']:.1f} | {r['numpy_copy_us']:.1f} | "
              f"{r['speedup']:.1f}x | {r['equal']} |")


if __name__ == "__main__":
    main()
