"""Launch-variant sweep of the warp-specialised sparse-attention forward (``kernel_fwd_ws.py``) on a Hopper GPU.

Run on the H200 from the repository root:

    python scripts/bench/tune_sparse_fwd_ws.py [--out DIR] [--shapes NAME ...] [--probe]

For each shape, each variant (slots per block, stage buffers, PV order, softmax form, register split) is checked
against the Triton forward on the same inputs (relative Frobenius error of ``out``, max |lse| difference) and timed
(median of ``triton.testing.do_bench``); the Triton forward is timed in the same run. Shapes: ``tl_h128`` /
``tl_h64`` are TileLang's own example inputs (S 4096, SKV 8192, top-2048, every slot valid: the side-by-side
shape of ``.anchors/sparse_mla/side_by_side.py``), the rest are ``bench_sparse_attn.py``'s. FLOPs count valid
pairs, fwd 2·H·(d_qk + d_v) each. Prints a table last and writes ``tune_sparse_fwd_ws.json``. ``--probe`` also
times the default with parts left out (``kernel_config.WS_FWD_PROBE``: no KV copies; no MMAs; only the stage
barriers): what the kernel would take if that part were free, its results wrong by design.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from bench_sparse_attn import _inputs, make_shape, median_ms  # noqa: E402

from fleet_ext.ops.sparse_attn import causal, kernel, kernel_config  # noqa: E402

# name, tiles, register split (right half, gather; the softmax warpgroup gets 3 x 168 minus both). Run 1 of
# 2026-12-01 (benchmarks/RESULTS.md) also measured 32-slot blocks with 4 stages, the (152, 96) split, and the
# previous block's PV deferred behind the next S: all slower than 64-slot blocks in order at every shape, so
# they are no longer kept; nor is run 7's (same day) next block's S issued before this block's PV is waited on:
# byte-identical, 4-6 % slower at all four shapes; nor run 8's ping-pong form (both consumers computing S on
# alternate blocks, commit e4ebc88): 0.71-0.77x the default at the four shapes, its consumers spilling.
# Nor run 9's persistent programs (one per SM taking tiles in turn): +7-10 % at HCA 16k, -14 % at tl_h64. Nor runs
# 11-12's masked QK accumulator with the scale in the exponent's FMA, lazy rescaling, or channels 256-511 on their
# own stage barriers (RESULTS.md, "What limits the forward").
# Each variant's tiles are overrides of kernel_config.WS_FWD_TILES; the first is the default.
VARIANTS = [
    ("default", {}, (168, 96)),
    ("psmem", {"P_IN_REGS": False}, (168, 96)),
]
PROBES = [("probe_no_kv_copies", 1), ("probe_no_mma", 2), ("probe_barriers_only", 3)]


def tilelang_inputs(seq: int, n_kv: int, heads: int, topk: int, seed: int = 0) -> tuple:
    """TileLang's example inputs (every slot valid: keys drawn with replacement from 0 .. t)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn((seq, heads, 576), device="cuda", generator=g) / 4).to(torch.bfloat16)
    kv = (torch.randn((n_kv, 576), device="cuda", generator=g) / 4).to(torch.bfloat16)
    vis = torch.arange(seq, device="cuda") + 1
    idx = (torch.rand((seq, topk), device="cuda", generator=g) * vis[:, None]).floor().to(torch.int32).contiguous()
    sink = torch.full((heads,), float("-inf"), device="cuda")
    return q, kv, idx, sink, 576 ** -0.5, 512


def shape_inputs(name: str) -> tuple:
    if name.startswith("tl_h"):
        return tilelang_inputs(4096, 8192, int(name[4:]), 2048)
    shape = make_shape(name)
    q, kv, idx, sink, _, scale = _inputs(shape)
    return q, kv, idx, sink, scale, shape["d_v"]


def dense_case(name: str) -> tuple:
    """``dense_s{S}_h{H}``: the dense causal mode (``causal.causal_attn_fwd``) on one sequence, d_qk 576, d_v 512;
    FLOPs over the causal pairs S (S + 1) / 2."""
    seq, heads = (int(part[1:]) for part in name.split("_")[1:])
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn((seq, heads, 576), device="cuda", generator=g) / 4).to(torch.bfloat16)
    kv = (torch.randn((seq, 576), device="cuda", generator=g) / 4).to(torch.bfloat16)
    sink = torch.zeros((heads,), device="cuda")
    flop = 2 * heads * (576 + 512) * seq * (seq + 1) // 2
    return (lambda: causal.causal_attn_fwd(q, kv, sink, 576 ** -0.5, seq, 0, d_v=512)), flop, 64


def sweep(name: str, probe: bool = False) -> list[dict]:
    if name.startswith("dense_"):
        fwd, flop, tail = dense_case(name)
    else:
        q, kv, idx, sink, scale, d_v = shape_inputs(name)
        tail = q.shape[-1] - d_v
        pairs = int(((idx >= 0) & (idx < kv.shape[0])).sum().item())
        flop = 2 * q.shape[1] * (q.shape[-1] + d_v) * pairs

        def fwd():
            return kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=d_v)

    rows = []
    kernel_config.FWD_KERNEL = "triton"
    ref_out, ref_lse = fwd()
    ms = median_ms(fwd)
    rows.append({"shape": name, "variant": "triton", "ms": ms, "tflops": flop / ms / 1e9})
    kernel_config.FWD_KERNEL = "gluon"
    saved_tiles, saved_meta = dict(kernel_config.WS_FWD_TILES[tail]), dict(kernel_config.WS_FWD_META)
    first = None
    runs = [(vname, tiles, regs, 0) for vname, tiles, regs in VARIANTS]
    runs += [(vname, {}, VARIANTS[0][2], level) for vname, level in PROBES] if probe else []
    for vname, tiles, (right, gather), level in runs:
        kernel_config.WS_FWD_TILES[tail] = {**saved_tiles, **tiles}
        kernel_config.WS_FWD_META.update(RIGHT_REGS=right, GATHER_REGS=gather)
        kernel_config.WS_FWD_PROBE = level
        row = {"shape": name, "variant": vname}
        try:
            out, lse = fwd()
            finite = torch.isfinite(ref_lse)
            row["out_rel_vs_triton"] = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
            row["lse_maxabs_vs_triton"] = float((lse - ref_lse)[finite].abs().max()) if finite.any() else 0.0
            first = first or (out, lse)
            row["same_bytes_as_first_variant"] = bool(torch.equal(out, first[0]) and torch.equal(lse, first[1]))
            row["ms"] = median_ms(fwd)
            row["tflops"] = flop / row["ms"] / 1e9
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            kernel_config.WS_FWD_PROBE = 0
        rows.append(row)
        print(row, flush=True)
    kernel_config.WS_FWD_TILES[tail] = saved_tiles
    kernel_config.WS_FWD_META.clear()
    kernel_config.WS_FWD_META.update(saved_meta)
    kernel_config.FWD_KERNEL = "auto"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", nargs="*", default=["tl_h128", "tl_h64", "v4csa_s16384", "v4hca_s16384"],
                        help="also dense_s{S}_h{H}: the dense causal mode on one sequence")
    parser.add_argument("--probe", action="store_true", help="also time the default with parts left out")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = [r for name in args.shapes for r in sweep(name, args.probe)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_sparse_fwd_ws.json"), "w") as f:
        json.dump({"command": "python scripts/bench/tune_sparse_fwd_ws.py " + " ".join(sys.argv[1:]), "rows": rows},
                  f, indent=1)
    print("\nshape          variant                      ms       TFLOP/s  out rel vs triton  lse max|d|  = 1st")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:14s} {r['variant']:22s} ERROR {r['error'][:90]}")
            continue
        print(f"{r['shape']:14s} {r['variant']:26s} {r['ms']:8.3f} {r['tflops']:9.0f}  "
              f"{r.get('out_rel_vs_triton', 0.0):17.2e}  {r.get('lse_maxabs_vs_triton', 0.0):.2e}  "
              f"{r.get('same_bytes_as_first_variant', '')}")


if __name__ == "__main__":
    main()
