"""Triton sparse MQA attention with sink on a GPU (torch CUDA tensors, bf16), forward and deterministic backward.

Run on the H200 (torch + Triton, no Paddle):  python -m pytest -q tests/gpu/test_sparse_attn_gpu.py

Reference: the same maths in fp32 torch (dsv4_math.md §2.5 / §7) on the bf16 inputs upcast, chunked over
queries so the gathered [chunk, K, d] tensor stays small, gradients by autograd (fp32, TF32 off).

bf16 tolerances (relative Frobenius norm ``|x - ref| / |ref|``, plus max-abs for the LSE; the ``sparse_attn_*``
entries of tests/helpers/tolerances.py):
- ``out``: 1e-2. P is rounded to bf16 before the PV product (2^-9 relative per weight) and ``out`` is
  stored in bf16 (2^-9): the norm-wise error lands around 3e-3.
- ``lse``: 2e-3 absolute. Logits are exact bf16 products summed in fp32; only the summation order differs.
- ``dq``, ``dkv``: 2e-2. dS and P enter the gradient GEMMs in bf16 and the results are stored in bf16;
  ``dkv`` sums up to thousands of such contributions (in fp32) per row.
- ``d_sink``: 1e-2. It is computed from the bf16 ``out`` and ``d_out`` (``delta = rowsum(dO * O)``).
Determinism: two backward runs on the same inputs must agree byte for byte (no floating-point atomics).
Trailing bound: the default (``derive_bound=True``: each row stops at its last valid slot) and
``derive_bound=False`` (every slot up to ``K`` / ``topk_length``) must agree byte for byte, forward and backward.
Dense causal mode (``causal.py``, no index table; ``-k dense``): the same entries against an fp32 dense causal
reference (several sequences, a context-parallel query offset, query slices of the dkv pass), two backward runs
byte-identical, keys past every query's position with exactly zero gradient, and the head-summed probabilities
of the warm-up KL target within ``sparse_attn_probs`` (1e-2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import assert_bitwise, tolerance

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the Triton kernels are tested on CPU by "
                "tests/single_card_tests/test_sparse_attn_triton.py)", allow_module_level=True)

from fleet_ext import capability  # noqa: E402
from fleet_ext.ops import launch  # noqa: E402
from fleet_ext.ops.sparse_attn import kernel, kernel_config  # noqa: E402

TOL = {"out": tolerance("bf16", "sparse_attn_out").rtol, "lse_abs": tolerance("bf16", "sparse_attn_lse").atol,
       "dq": tolerance("bf16", "sparse_attn_grad").rtol, "dkv": tolerance("bf16", "sparse_attn_grad").rtol,
       "d_sink": tolerance("bf16", "sparse_attn_d_sink").rtol}
DEV = "cuda"


def causal_topk_index(seq: int, topk: int, window: int, gen: torch.Generator) -> torch.Tensor:
    """[seq, topk] int32: window of the `window` latest keys + top of random scores over the rest; -1 where hidden."""
    rows = []
    for t0 in range(0, seq, 1024):
        t = torch.arange(t0, min(seq, t0 + 1024), device=DEV)[:, None]
        j = torch.arange(seq, device=DEV)[None, :]
        score = torch.rand((t.shape[0], seq), device=DEV, generator=gen)
        score = torch.where(j <= t, score, float("-inf"))
        score = torch.where((j <= t) & (j > t - window), 2.0, score)
        val, idx = torch.topk(score, min(topk, seq), dim=-1)
        rows.append(torch.where(torch.isfinite(val), idx, -1))
    idx = torch.cat(rows).to(torch.int32)
    if idx.shape[1] < topk:
        idx = torch.cat([idx, idx.new_full((seq, topk - idx.shape[1]), -1)], 1)
    return idx.contiguous()


def reference(q, kv, idx, sink, scale, d_v, d_out, d_lse, topk_length=None, chunk=256):
    """fp32 forward (out, lse) and gradients (dq, dkv, d_sink) of sum(out*d_out) + sum(lse*d_lse)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    q32 = q.float()
    kv32 = kv.float().requires_grad_(True)
    sink32 = sink.float().requires_grad_(True)
    n_kv = kv.shape[0]
    outs, lses, dqs = [], [], []
    for t0 in range(0, q.shape[0], chunk):
        qc = q32[t0:t0 + chunk].clone().requires_grad_(True)
        ic = idx[t0:t0 + chunk].long()
        valid = (ic >= 0) & (ic < n_kv)
        if topk_length is not None:
            valid &= torch.arange(ic.shape[1], device=DEV)[None, :] < topk_length[t0:t0 + chunk, None]
        g = kv32[torch.where(valid, ic, 0)]  # [c, K, d]
        logits = torch.einsum("thd,tkd->thk", qc, g) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sink_col = sink32[None, :, None].expand(logits.shape[0], -1, 1)
        full = torch.cat([logits, sink_col], -1)
        lse = torch.logsumexp(full, -1)
        p = torch.exp(logits - lse[..., None])
        out = torch.einsum("thk,tkd->thd", p, g[..., :d_v])
        loss = (out * d_out[t0:t0 + chunk].float()).sum() + (lse * d_lse[t0:t0 + chunk]).sum()
        loss.backward()
        outs.append(out.detach())
        lses.append(lse.detach())
        dqs.append(qc.grad)
    return torch.cat(outs), torch.cat(lses), torch.cat(dqs), kv32.grad, sink32.grad


def rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_case(seq, heads, d_qk, d_v, topk, window, n_extra=0, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn((seq, heads, d_qk), device=DEV, generator=gen).to(torch.bfloat16)
    kv = torch.randn((seq + n_extra, d_qk), device=DEV, generator=gen).to(torch.bfloat16)
    idx = causal_topk_index(seq, topk, window, gen)
    sink = (torch.rand((heads,), device=DEV, generator=gen) * 3 - 1).float()
    d_out = torch.randn((seq, heads, d_v), device=DEV, generator=gen).to(torch.bfloat16)
    d_lse = torch.randn((seq, heads), device=DEV, generator=gen) * 0.1
    return q, kv, idx, sink, d_out, d_lse


def check(q, kv, idx, sink, d_v, d_out, d_lse, topk_length=None, **bwd_kw):
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=d_v, topk_length=topk_length)
    grads = kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_lse, d_v=d_v,
                                   topk_length=topk_length, **bwd_kw)
    grads2 = kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_lse, d_v=d_v,
                                    topk_length=topk_length, **bwd_kw)
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dkv", "d_sink"), grads, grads2):
        assert_bitwise(a, b, f"{name} differs between two runs (not deterministic)")
    del grads2
    out_f, lse_f = kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=d_v, topk_length=topk_length,
                                          derive_bound=False)
    grads_f = kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out_f, lse_f, d_out, d_lse, d_v=d_v,
                                     topk_length=topk_length, derive_bound=False, **bwd_kw)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "lse", "dq", "dkv", "d_sink"), (out, lse, *grads), (out_f, lse_f, *grads_f)):
        assert_bitwise(a, b, f"{name}: the derived trailing bound changed the result")
    del out_f, lse_f, grads_f
    r_out, r_lse, r_dq, r_dkv, r_sink = reference(q, kv, idx, sink, scale, d_v, d_out, d_lse, topk_length)
    errors = {"out": rel(out, r_out), "dq": rel(grads[0], r_dq), "dkv": rel(grads[1], r_dkv),
              "d_sink": rel(grads[2], r_sink)}
    finite = torch.isfinite(r_lse)
    errors["lse_abs"] = (lse[finite] - r_lse[finite]).abs().max().item()
    for name in ("out", "dq", "dkv"):
        assert torch.isfinite(dict(zip(("out", "dq", "dkv"), (out, *grads[:2])))[name].float()).all(), name
    print(f"[{tuple(q.shape)} K={idx.shape[1]} d_v={d_v}] errors: "
          + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= TOL[k]}
    assert not bad, f"errors over tolerance {bad} (all: {errors})"
    return errors


@pytest.mark.parametrize(
    "seq, heads, d_qk, d_v, topk, window, n_extra",
    [
        (4096, 128, 576, 512, 2048, 128, 0),  # V3.2 latent MQA, h = 128
        (4096, 64, 576, 512, 2048, 128, 0),  # V3.2 latent MQA, h = 64
        (4096, 64, 512, 512, 640, 128, 1024),  # V4 CSA (K = 128 + 512; kv = raw + compressed)
    ],
    ids=["v32_h128", "v32_h64", "v4_csa_h64"],
)
def test_production_shapes(seq, heads, d_qk, d_v, topk, window, n_extra, heavy_gpu_memory):
    q, kv, idx, sink, d_out, d_lse = make_case(seq, heads, d_qk, d_v, topk, window, n_extra)
    check(q, kv, idx, sink, d_v, d_out, d_lse)


def test_edges_padded_heads_topk_length_chunks_empty_rows_duplicates():
    seq, heads, d_qk, d_v, topk = 300, 20, 576, 512, 96  # 20 heads: masked in a 64-row tile
    q, kv, idx, sink, d_out, d_lse = make_case(seq, heads, d_qk, d_v, topk, 16, seed=1)
    idx[:7] = -1  # rows with no valid index: out = 0, lse = sink
    idx[50:60, 1::2] = idx[50:60, 0:1]  # the same kv row repeated within and across queries
    gen = torch.Generator(device=DEV).manual_seed(3)
    topk_length = torch.randint(0, topk + 1, (seq,), device=DEV, generator=gen, dtype=torch.int32)
    check(q, kv, idx, sink, d_v, d_out, d_lse, topk_length=topk_length, max_partial_bytes=8 << 20)


@pytest.fixture
def triton_forward():
    kernel_config.FWD_KERNEL = "triton"
    yield
    kernel_config.FWD_KERNEL = "auto"


def test_production_shape_triton_forward(triton_forward):
    """The Triton forward (the fallback off Hopper) with the backward, where the default would run the Gluon one."""
    q, kv, idx, sink, d_out, d_lse = make_case(4096, 64, 576, 512, 2048, 128)
    before = launch.LAUNCH_COUNTS["_sparse_attn_fwd_ws_kernel"]
    check(q, kv, idx, sink, 512, d_out, d_lse)
    assert launch.LAUNCH_COUNTS["_sparse_attn_fwd_ws_kernel"] == before


def _needs_hopper():
    if capability.detect().sm is None or capability.detect().sm[0] != 9:
        pytest.skip("the warp-specialised forward is Hopper-only (sm90): run on the H200")


def _check_ws_forward(run, r_out, r_lse, label):
    """``run(scale_factor) -> (out, lse)`` through the default route: the Gluon kernel ran (launch counter) and is
    byte-identical run to run; fp32 reference within the forward tolerances, the Triton forward within them too; a
    5 % logit-scale error planted in the call lands over the tolerance (the check can fail)."""
    before = launch.LAUNCH_COUNTS["_sparse_attn_fwd_ws_kernel"]
    out, lse = run(1.0)
    out2, lse2 = run(1.0)
    bad_out, _ = run(1.05)
    assert launch.LAUNCH_COUNTS["_sparse_attn_fwd_ws_kernel"] == before + 3
    assert_bitwise(out, out2, "out differs between two runs")
    assert_bitwise(lse, lse2, "lse differs between two runs")
    kernel_config.FWD_KERNEL = "triton"
    try:
        out_t, _ = run(1.0)
    finally:
        kernel_config.FWD_KERNEL = "auto"
    assert launch.LAUNCH_COUNTS["_sparse_attn_fwd_ws_kernel"] == before + 3
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    errors = {"out": rel(out, r_out), "lse_abs": (lse[finite] - r_lse[finite]).abs().max().item(),
              "out_vs_triton": rel(out, out_t), "planted_out": rel(bad_out, r_out)}
    print(f"[ws fwd {label}] " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert errors["out"] <= TOL["out"] and errors["lse_abs"] <= TOL["lse_abs"], errors
    assert errors["out_vs_triton"] <= TOL["out"], errors
    assert errors["planted_out"] > TOL["out"], f"a 5 % logit-scale error went unnoticed: {errors}"


@pytest.mark.parametrize(
    "seq, heads, d_qk, topk, window, n_extra, edges",
    [(4096, 128, 576, 2048, 128, 0, False), (4096, 64, 512, 640, 128, 1024, False), (300, 20, 576, 96, 16, 0, True),
     (300, 64, 512, 300, 16, 0, True)],
    ids=["v32_h128", "v4_csa_h64", "edges_h20", "edges_5_blocks"],
)
def test_ws_forward(seq, heads, d_qk, topk, window, n_extra, edges):
    """The warp-specialised Gluon forward over an index table (kernel_fwd_ws.py), see ``_check_ws_forward``.
    ``edges_5_blocks``: ``topk_length`` gives every block count from 0 to 5, odd and even, the last one partial."""
    _needs_hopper()
    d_v = 512
    q, kv, idx, sink, d_out, d_lse = make_case(seq, heads, d_qk, d_v, topk, window, n_extra, seed=2)
    topk_length = None
    if edges:  # padded heads (20 of 64), empty rows, duplicates, topk_length
        idx[:7] = -1
        idx[50:60, 1::2] = idx[50:60, 0:1]
        gen = torch.Generator(device=DEV).manual_seed(3)
        topk_length = torch.randint(0, topk + 1, (seq,), device=DEV, generator=gen, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d_qk)
    r_out, r_lse = reference(q, kv, idx, sink, scale, d_v, d_out, d_lse, topk_length)[:2]
    _check_ws_forward(lambda f: kernel.sparse_attn_fwd(q, kv, idx, sink, scale * f, d_v=d_v, topk_length=topk_length),
                      r_out, r_lse, f"{tuple(q.shape)} K={topk}")


@pytest.mark.parametrize("batch, seq, heads, n_keys, q_offset, d_qk",
                         [(2, 384, 64, 512, 100, 576), (1, 200, 20, 200, 0, 512)], ids=["b2_offset_h64", "h20_k_eq_v"])
def test_ws_forward_dense_causal(batch, seq, heads, n_keys, q_offset, d_qk):
    """The same kernel in its dense causal mode (``causal.causal_attn_fwd``), see ``_check_ws_forward``."""
    from fleet_ext.ops.sparse_attn import causal

    _needs_hopper()
    d_v = 512
    gen = torch.Generator(device=DEV).manual_seed(4)
    q = torch.randn((batch * seq, heads, d_qk), device=DEV, generator=gen).to(torch.bfloat16)
    kv = torch.randn((batch * n_keys, d_qk), device=DEV, generator=gen).to(torch.bfloat16)
    sink = (torch.rand((heads,), device=DEV, generator=gen) * 3 - 1).float()
    d_out = torch.zeros((batch * seq, heads, d_v), device=DEV, dtype=torch.bfloat16)
    d_lse = torch.zeros((batch * seq, heads), device=DEV)
    scale = 1.0 / math.sqrt(d_qk)
    r_out, r_lse = causal_reference(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset)[:2]
    _check_ws_forward(lambda f: causal.causal_attn_fwd(q, kv, sink, scale * f, seq, q_offset, d_v=d_v), r_out, r_lse,
                      f"dense B={batch} S={seq} H={heads} N={n_keys} offset={q_offset} d={d_qk}")


@pytest.mark.parametrize(
    "seq, heads, d_qk, topk, window, n_extra, edges",
    [(4096, 128, 576, 2048, 128, 0, False), (4096, 64, 512, 640, 128, 1024, False), (300, 64, 576, 96, 16, 0, True)],
    ids=["v32_h128", "v4_csa_h64", "edges_h64"],
)
def test_ws_dq(seq, heads, d_qk, topk, window, n_extra, edges, monkeypatch):
    """The warp-specialised Gluon dq kernel (kernel_bwd_dq_ws.py) forced: the backward within the fp32 reference's
    bounds, byte-identical run to run and with / without the trailing bound (``check``); dq and dkv within the same
    bounds of the Triton dq kernel's on the same inputs (not bitwise: other MMA shapes); a 5 % logit-scale error
    planted in the backward call lands over the bound (the comparison can fail)."""
    _needs_hopper()
    d_v = 512
    q, kv, idx, sink, d_out, d_lse = make_case(seq, heads, d_qk, d_v, topk, window, n_extra, seed=6)
    topk_length = None
    if edges:  # empty rows, duplicates, topk_length (every block count, partial last blocks)
        idx[:7] = -1
        idx[50:60, 1::2] = idx[50:60, 0:1]
        gen = torch.Generator(device=DEV).manual_seed(7)
        topk_length = torch.randint(0, topk + 1, (seq,), device=DEV, generator=gen, dtype=torch.int32)
    monkeypatch.setattr(kernel_config, "DQ_KERNEL", "gluon")
    before = launch.LAUNCH_COUNTS["_bwd_dq_ws_kernel"]
    check(q, kv, idx, sink, d_v, d_out, d_lse, topk_length=topk_length)
    assert launch.LAUNCH_COUNTS["_bwd_dq_ws_kernel"] >= before + 3
    scale = 1.0 / math.sqrt(d_qk)
    out, lse = kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=d_v, topk_length=topk_length)

    def bwd(factor: float = 1.0):
        return kernel.sparse_attn_bwd(q, kv, idx, sink, scale * factor, out, lse, d_out, d_lse, d_v=d_v,
                                      topk_length=topk_length)

    ws, planted = bwd(), bwd(1.05)
    monkeypatch.setattr(kernel_config, "DQ_KERNEL", "triton")
    ref = bwd()
    errors = {"dq_vs_triton": rel(ws[0], ref[0]), "dkv_vs_triton": rel(ws[1], ref[1]),
              "planted_dq": rel(planted[0], ref[0])}
    print(f"[ws dq {tuple(q.shape)} K={topk}] " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert errors["dq_vs_triton"] <= TOL["dq"] and errors["dkv_vs_triton"] <= TOL["dkv"], errors
    assert errors["planted_dq"] > TOL["dq"], f"a 5 % logit-scale error went unnoticed: {errors}"


def hca_index(seq: int, window: int = 128, ratio: int = 128) -> torch.Tensor:
    """DSv4 HCA's table: the ``window`` latest raw keys, then every visible compressed entry (kv rows seq + c,
    c < (t + 1) / ratio): the compressed rows are read by nearly every query."""
    t = torch.arange(seq, device=DEV)[:, None]
    win = t - (window - 1) + torch.arange(window, device=DEV)[None, :]
    comp = torch.arange(seq // ratio, device=DEV)[None, :]
    comp = torch.where(comp < (t + 1) // ratio, seq + comp, -1)
    return torch.cat([torch.where(win >= 0, win, -1), comp], dim=1).to(torch.int32)


@pytest.mark.parametrize("chunk", [None, 64], ids=["auto_items", "items_of_64_pairs"])
def test_hca_rows_split_into_reduce_items(chunk, monkeypatch):
    """DSv4 HCA at s 4096: its compressed rows hold up to 4096 pairs, so the dkv reduce splits them into items
    (auto: 1024 pairs here; or 64) and adds the parts in order: within the reference's bounds, byte-identical run
    to run (``check``), the combine kernel launched."""
    monkeypatch.setattr(kernel, "REDUCE_CHUNK", chunk)
    seq, heads = 4096, 64
    q, kv, _, sink, d_out, d_lse = make_case(seq, heads, 512, 512, 160, 128, n_extra=seq // 128, seed=5)
    idx = hca_index(seq)
    assert kernel.reduce_chunk(seq * idx.shape[1], kv.shape[0]) == (chunk or 1024)
    pairs = torch.bincount(idx[idx >= 0].long(), minlength=kv.shape[0])
    assert int(pairs.max()) > 2 * (chunk or 1024)  # the first compressed row: split into several items
    before = launch.LAUNCH_COUNTS["_bwd_dkv_combine_kernel"]
    check(q, kv, idx, sink, 512, d_out, d_lse)
    assert launch.LAUNCH_COUNTS["_bwd_dkv_combine_kernel"] > before


def csa_index(seq: int, gen: torch.Generator, window: int = 128, ratio: int = 4, topk: int = 512) -> torch.Tensor:
    """DSv4 CSA's table: the ``window`` latest raw keys, then ``topk`` random visible compressed entries (kv rows
    seq + c, c < (t + 1) / ratio), -1 padded."""
    t = torch.arange(seq, device=DEV)[:, None]
    score = torch.rand((seq, seq // ratio), device=DEV, generator=gen)
    score = torch.where(torch.arange(seq // ratio, device=DEV)[None, :] < (t + 1) // ratio, score, -1.0)
    val, pick = torch.topk(score, topk, dim=-1)
    return torch.cat([hca_index(seq, window, ratio)[:, :window], torch.where(val >= 0, seq + pick, -1)],
                     dim=1).to(torch.int32).contiguous()


@pytest.mark.parametrize("poison", [False, True], ids=["select", "poison"])
@pytest.mark.parametrize("table", ["hca", "csa"])
def test_band_slots(table, poison, monkeypatch):
    """The window (and HCA's entries) as band slots (``band.SlotBands``), DSv4 shapes at s 4096 (below
    ``BAND_MIN_QUERIES_GPU``: the default keeps the CSR path there, byte-equal; lowered for the rest), in both modes
    of the band kernel: within the fp32 reference's bounds and byte-identical run to run (``check``), the band kernel
    launched; dq and d_sink byte-equal to the CSR path's; the poison mode's dkv byte-equal to the select mode's; a
    window band one key off lands over the dkv bound (poison: as NaN)."""
    from fleet_ext.ops.sparse_attn import band_bwd
    from fleet_ext.ops.sparse_attn.band import Band, SlotBands

    seq, heads, ratio = 4096, 64, 128 if table == "hca" else 4
    q, kv, _, sink, d_out, d_lse = make_case(seq, heads, 512, 512, 160, 128, n_extra=seq // ratio, seed=7)
    idx = hca_index(seq) if table == "hca" else csa_index(seq, torch.Generator(device=DEV).manual_seed(7))
    window = Band(0, 128, 1, -127)
    bands = SlotBands(seq, kv.shape[0], (window, Band(128, seq // 128, 0, seq - 128)) if table == "hca" else (window,))
    scale = 1.0 / math.sqrt(512)
    out, lse = kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=512)
    before = launch.LAUNCH_COUNTS["_bwd_dkv_band_kernel"]
    small = kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_lse, d_v=512, slot_bands=bands)
    assert launch.LAUNCH_COUNTS["_bwd_dkv_band_kernel"] == before, "bands below BAND_MIN_QUERIES_GPU"
    assert_bitwise(small[1], kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_lse, d_v=512)[1],
                   "dkv below BAND_MIN_QUERIES_GPU: the CSR path's")
    monkeypatch.setattr(band_bwd, "BAND_MIN_QUERIES_GPU", 0)
    monkeypatch.setitem(band_bwd.BAND_CONFIG_GPU, "POISON", False)
    selected = kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_lse, d_v=512, slot_bands=bands)
    monkeypatch.setitem(band_bwd.BAND_CONFIG_GPU, "POISON", poison)
    errors = check(q, kv, idx, sink, 512, d_out, d_lse, slot_bands=bands)
    assert launch.LAUNCH_COUNTS["_bwd_dkv_band_kernel"] > before
    banded, plain = (kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_lse, d_v=512, slot_bands=b)
                     for b in (bands, None))
    assert_bitwise(banded[0], plain[0], "dq: band slots vs the CSR path")
    assert_bitwise(banded[2], plain[2], "d_sink: band slots vs the CSR path")
    assert_bitwise(banded[1], selected[1], "dkv: poison vs select mode")
    print(f"[bands {table}] dkv {errors['dkv']:.2e}, moved {rel(banded[1], plain[1]):.2e} from the CSR path's")
    off = SlotBands(seq, kv.shape[0], (Band(0, 128, 1, -126), *bands.bands[1:]))
    r_out, r_lse, r_dq, r_dkv, r_sink = reference(q, kv, idx, sink, scale, 512, d_out, d_lse)
    planted = kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_lse, d_v=512, slot_bands=off)
    assert not rel(planted[1], r_dkv) <= TOL["dkv"], "a window band one key off went unnoticed"
    assert torch.isnan(planted[1].float()).any() == poison


@pytest.mark.parametrize("partial_dtype", ["bfloat16", "float24"])
def test_rounded_partials(partial_dtype, heavy_gpu_memory):
    """Contributions stored rounded: within the fp32 reference's bounds and byte-identical run to run (``check``);
    dq and d_sink byte-equal to the fp32 contributions' backward, and float24's dkv (bf16) within one bf16 rounding
    (2^-8, in norm) of it: rounding each contribution at 16 bits moves dkv by less than dkv's own rounding."""
    # the inputs of test_production_shapes[v32_h128] (same seed): its printed fp32-contribution errors compare 1:1
    q, kv, idx, sink, d_out, d_lse = make_case(4096, 128, 576, 512, 2048, 128)
    before = launch.LAUNCH_COUNTS["_bwd_dkv_partial_kernel"]
    check(q, kv, idx, sink, 512, d_out, d_lse, partial_dtype=partial_dtype)
    assert launch.LAUNCH_COUNTS["_bwd_dkv_partial_kernel"] > before
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = kernel.sparse_attn_fwd(q, kv, idx, sink, scale, d_v=512)
    rounded, full = (kernel.sparse_attn_bwd(q, kv, idx, sink, scale, out, lse, d_out, d_lse, d_v=512, partial_dtype=dt)
                     for dt in (partial_dtype, "float32"))
    assert_bitwise(rounded[0], full[0], "dq: rounded vs fp32 contributions")
    assert_bitwise(rounded[2], full[2], "d_sink: rounded vs fp32 contributions")
    moved = rel(rounded[1], full[1])
    print(f"[{partial_dtype} contributions] dkv moved {moved:.2e} from the fp32 contributions' dkv")
    assert moved > 0.0
    if partial_dtype == "float24":
        assert moved <= 2.0 ** -8, moved


def test_pack24_rounds_to_nearest_only_without_fma_contraction():
    """The float24 packing on the GPU, compiled as the contribution kernel is (``enable_fp_fusion=False``): every
    normal value to its nearest 16-bit-significand neighbour (float64 oracle); compiled with contraction, Veltkamp's
    split is not exact and some values miss it (why the kernel is built without it)."""
    from helpers import pack24

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-20, 20, 4096)).astype(np.float32)
    assert pack24.nearest_or_tie(pack24.roundtrip(x, DEV), x).all()
    fused = pack24.roundtrip(x, DEV, enable_fp_fusion=True)
    print(f"[pack24] with FMA contraction {int((~pack24.nearest_or_tie(fused, x)).sum())} of 4096 values off")
    assert not pack24.nearest_or_tie(fused, x).all()


# ------------------------------------------------------------------------------------------------------
# Dense causal mode (fleet_ext/ops/sparse_attn/causal.py): no index table, keys 0 .. position
# ------------------------------------------------------------------------------------------------------
def causal_reference(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset, chunk=256):
    """fp32 dense causal attention with sink over the flat layout (B = T / seq sequences, N = rows / B keys,
    query i at position q_offset + i): out, lse, dq, dkv, d_sink of sum(out*d_out) + sum(lse*d_lse), and the
    head-summed probabilities [T, N]; chunked over queries, autograd, TF32 off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = q.shape[0] // seq
    n_keys = kv.shape[0] // batch
    kv32 = kv.float().requires_grad_(True)
    sink32 = sink.float().requires_grad_(True)
    outs, lses, dqs, probs = [], [], [], []
    for b in range(batch):
        keys = kv32[b * n_keys:(b + 1) * n_keys]
        for i0 in range(0, seq, chunk):
            t0, c = b * seq + i0, min(chunk, seq - i0)
            qc = q[t0:t0 + c].float().requires_grad_(True)
            pos = q_offset + i0 + torch.arange(c, device=DEV)
            seen = torch.arange(n_keys, device=DEV)[None, :] <= pos[:, None]  # [c, N]
            logits = torch.einsum("thd,nd->thn", qc, keys) * scale
            logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
            lse = torch.logsumexp(torch.cat([logits, sink32[None, :, None].expand(c, -1, 1)], -1), -1)
            p = torch.exp(logits - lse[..., None])
            out = torch.einsum("thn,nd->thd", p, keys[:, :d_v])
            ((out * d_out[t0:t0 + c].float()).sum() + (lse * d_lse[t0:t0 + c]).sum()).backward()
            outs.append(out.detach())
            lses.append(lse.detach())
            dqs.append(qc.grad)
            probs.append(p.detach().sum(1))
    return torch.cat(outs), torch.cat(lses), torch.cat(dqs), kv32.grad, sink32.grad, torch.cat(probs)


def check_causal(batch, seq, heads, n_keys, q_offset, d_qk=576, d_v=512, dkv_splits=None, seed=0):
    from fleet_ext.ops.sparse_attn import causal

    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn((batch * seq, heads, d_qk), device=DEV, generator=gen).to(torch.bfloat16)
    kv = torch.randn((batch * n_keys, d_qk), device=DEV, generator=gen).to(torch.bfloat16)
    sink = (torch.rand((heads,), device=DEV, generator=gen) * 3 - 1).float()
    d_out = torch.randn((batch * seq, heads, d_v), device=DEV, generator=gen).to(torch.bfloat16)
    d_lse = torch.randn((batch * seq, heads), device=DEV, generator=gen) * 0.1
    scale = 1.0 / math.sqrt(d_qk)
    out, lse = causal.causal_attn_fwd(q, kv, sink, scale, seq, q_offset, d_v=d_v)
    kw = {"seq": seq, "q_offset": q_offset, "d_v": d_v, "dkv_splits": dkv_splits}
    grads = causal.causal_attn_bwd(q, kv, sink, scale, out, lse, d_out, d_lse, **kw)
    grads2 = causal.causal_attn_bwd(q, kv, sink, scale, out, lse, d_out, d_lse, **kw)
    probs = causal.causal_probs(q, kv, lse, scale, seq, q_offset, d_v=d_v)
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dkv", "d_sink"), grads, grads2):
        assert_bitwise(a, b, f"dense causal {name} differs between two runs (not deterministic)")
    del grads2
    r_out, r_lse, r_dq, r_dkv, r_sink, r_probs = causal_reference(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset)
    errors = {"out": rel(out, r_out), "dq": rel(grads[0], r_dq), "dkv": rel(grads[1], r_dkv),
              "d_sink": rel(grads[2], r_sink), "probs": rel(probs, r_probs),
              "lse_abs": (lse - r_lse).abs().max().item()}
    print(f"[dense causal B={batch} S={seq} H={heads} N={n_keys} offset={q_offset} splits={dkv_splits}] errors: "
          + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    bound = {**TOL, "probs": tolerance("bf16", "sparse_attn_probs").rtol}
    bad = {k: v for k, v in errors.items() if not v <= bound[k]}
    assert not bad, f"errors over tolerance {bad} (all: {errors})"
    unseen = torch.cat([torch.arange(b * n_keys + q_offset + seq, (b + 1) * n_keys) for b in range(batch)])
    assert not grads[1][unseen.to(DEV)].any(), "keys past every query's position must get zero gradient"


@pytest.mark.parametrize(
    "batch, seq, heads, n_keys, q_offset, dkv_splits",
    [
        (1, 4096, 128, 4096, 0, None),  # V3.2 latent MQA (576 / 512), h = 128
        (1, 4096, 64, 4096, 0, None),  # h = 64
        (1, 1024, 64, 4096, 3072, None),  # context parallelism: the last of 4 ranks, all-gathered keys
        (2, 300, 20, 300, 0, 3),  # two sequences, odd length, 20 heads (masked in a 64-row tile), 3 slices
    ],
    ids=["v32_h128", "v32_h64", "v32_cp4_last_rank", "edges_b2_odd_h20_slices"],
)
def test_dense_causal(batch, seq, heads, n_keys, q_offset, dkv_splits):
    check_causal(batch, seq, heads, n_keys, q_offset, dkv_splits=dkv_splits)


def test_dense_causal_k_eq_v():
    check_causal(1, 1024, 64, 1024, 0, d_qk=512, d_v=512, dkv_splits=1, seed=2)


@pytest.mark.parametrize("batch, seq, heads, n_keys, q_offset, d_qk",
                         [(2, 700, 96, 1024, 324, 576), (1, 2048, 64, 2048, 0, 512)],
                         ids=["b2_cp_offset_h96_v32", "dsv4_k_eq_v"])
def test_ws_dq_dense_causal(batch, seq, heads, n_keys, q_offset, d_qk, monkeypatch):
    """The warp-specialised dq kernel's dense causal mode forced (two sequences with a CP offset and 96 heads: a
    masked second head block; K = V): the backward within the fp32 reference's bounds and byte-identical run to run
    (``check_causal``, launch counter); dq within the same bound of the Triton dense dq kernel's; a 5 % scale error
    planted in the call lands over it."""
    from fleet_ext.ops.sparse_attn import causal

    _needs_hopper()
    monkeypatch.setattr(kernel_config, "DQ_KERNEL", "gluon")
    before = launch.LAUNCH_COUNTS["_bwd_dq_ws_kernel"]
    check_causal(batch, seq, heads, n_keys, q_offset, d_qk=d_qk, d_v=512, seed=3)
    assert launch.LAUNCH_COUNTS["_bwd_dq_ws_kernel"] >= before + 2
    gen = torch.Generator(device=DEV).manual_seed(4)
    q = torch.randn((batch * seq, heads, d_qk), device=DEV, generator=gen).to(torch.bfloat16)
    kv = torch.randn((batch * n_keys, d_qk), device=DEV, generator=gen).to(torch.bfloat16)
    sink = (torch.rand((heads,), device=DEV, generator=gen) * 3 - 1).float()
    d_out = torch.randn((batch * seq, heads, 512), device=DEV, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(d_qk)
    out, lse = causal.causal_attn_fwd(q, kv, sink, scale, seq, q_offset, d_v=512)

    def dq(factor: float = 1.0):
        return causal.causal_attn_bwd(q, kv, sink, scale * factor, out, lse, d_out, None, seq=seq,
                                      q_offset=q_offset, d_v=512)[0]

    ws, planted = dq(), dq(1.05)
    monkeypatch.setattr(kernel_config, "DQ_KERNEL", "triton")
    ref = dq()
    errors = {"dq_vs_triton": rel(ws, ref), "planted_dq": rel(planted, ref)}
    print(f"[ws dq dense B={batch} S={seq} H={heads} N={n_keys} offset={q_offset}] "
          + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert errors["dq_vs_triton"] <= TOL["dq"], errors
    assert errors["planted_dq"] > TOL["dq"], f"a 5 % scale error went unnoticed: {errors}"
