"""Fused MoE permute / unpermute on CUDA (torch tensors, bf16 and fp32): bitwise vs an eager mirror, and oracles.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``.
Skipped without CUDA.

- **Routing** (rows per token, counts, offsets) equals ``torch.argsort(stable=True)`` / ``bincount`` exactly, alone
  (``route``) and fused with the copy (``route_permute``), under every launch setting the benchmark sweeps
  (programmatic dependent launch on and off, routing block, register cap, block width, warps, streaming hints).
- **Bitwise vs eager torch** in the reference's order (``fleet_ext/ops/moe_permute/reference.py``): the
  permuted rows (a gather), the combined output (``fp32(y) * w`` rounded to the output dtype, a token's rows
  added in ascending row order from zero, each add rounded to the output dtype: eager torch adds bf16 in fp32
  and rounds, as the kernel does), the hidden states' gradient (a token's row gradients added in row order)
  and ``d_y``. ``d_weights`` is a blocked fp32 sum over D on the GPU: vs float64 within ``oracle_grad``-style
  bounds (1e-5 of the sum of the terms' magnitudes, fp32 sums of exact products).
- Against eager ``index_add_`` (CUDA atomics, any order): fp32 within 1e-6 of the scale, bf16 within one
  bf16 ulp per add.
- Determinism: two runs byte-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_bitwise, assert_close, expect_launches
from helpers.gpu import CUDA_ONLY

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernel():
    from fleet_ext.ops.moe_permute import kernel as permute_kernel  # imported only where it will run

    return permute_kernel


def make(tokens, dim, experts, topk, dtype, routing="random", seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen, device=DEVICE).to(dtype)
    scores = torch.rand(tokens, experts, generator=gen, device=DEVICE)
    if routing == "empty_experts":
        scores[:, 1::2] = -1.0
    if routing == "one_expert_takes_all":
        scores[:, 3] = 2.0
    idx = scores.topk(topk, dim=-1).indices.contiguous()
    w = torch.rand(tokens, topk, generator=gen, device=DEVICE) + 0.05
    g = torch.randn(tokens, dim, generator=gen, device=DEVICE).to(dtype)
    return x, idx, w, g


def eager_plan(idx: torch.Tensor, experts: int):
    """(order, token_rows [T, k] ascending, counts, offsets) by torch's stable argsort."""
    tokens, topk = idx.shape
    order = torch.argsort(idx.reshape(-1), stable=True)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=idx.device)
    token_rows = row_of.view(tokens, topk).sort(dim=-1).values
    counts = torch.bincount(idx.reshape(-1), minlength=experts)
    return order, token_rows, counts, torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def eager_unpermute(y, w, order, token_rows, out_dtype):
    topk = token_rows.shape[1]
    scaled = (y.float() * w.reshape(-1)[order].float()[:, None]).to(out_dtype)
    out = torch.zeros(token_rows.shape[0], y.shape[1], dtype=out_dtype, device=y.device)
    for i in range(topk):  # ascending rows, each add rounded to the output dtype (as index_add in that dtype)
        out = out + scaled[token_rows[:, i]]
    return out


def eager_permute_grad(g_rows, token_rows):
    d_x = torch.zeros(token_rows.shape[0], g_rows.shape[1], dtype=g_rows.dtype, device=g_rows.device)
    for i in range(token_rows.shape[1]):
        d_x = d_x + g_rows[token_rows[:, i]]
    return d_x


CASES = [  # (tokens, dim, experts, k, routing)
    (8192, 4096, 256, 6, "random"),  # DSv4-Flash, EP 1
    (8192, 4096, 32, 6, "random"),  # EP 8
    (1000, 100, 7, 3, "random"),
    (37, 24, 8, 1, "random"),
    (513, 64, 16, 4, "empty_experts"),
    (300, 40, 8, 2, "one_expert_takes_all"),
]


def _poison(x, idx, experts) -> None:
    """Fill blocks of ``route_permute``'s output sizes with NaN / -7 and free them: the caching allocator likely
    hands them back to the next call, so an element it leaves unwritten shows in the exact comparison."""
    tokens, topk = idx.shape
    junk = [torch.full((tokens * topk, x.shape[1]), float("nan"), dtype=x.dtype, device=DEVICE),
            torch.full((2, tokens, topk), -7, dtype=torch.int32, device=DEVICE),
            torch.full((2 * experts + 1,), -7, dtype=torch.int64, device=DEVICE)]
    del junk


def _assert_fused_permute(fused, x, idx, experts) -> None:
    """``route_permute``'s rows, tables, counts and offsets equal the eager mirror's exactly."""
    out, rows, srcs, counts, offsets = fused
    order, token_rows, want_counts, want_offsets = eager_plan(idx, experts)
    assert torch.equal(rows.long(), token_rows), "token_rows"
    assert torch.equal(srcs.long(), order[token_rows]), "token_srcs"
    assert torch.equal(counts, want_counts) and torch.equal(offsets, want_offsets), "counts / offsets"
    assert_bitwise(out, x[order // idx.shape[1]], "fused permuted rows")


SETTINGS = [  # launch settings the benchmark sweeps: none may change a bit of the results
    {"pdl": 0}, {"route_block_t": 32}, {"route_block_t": 64}, {"permute_maxnreg": 32},
    {"permute_block_d": 2048}, {"permute_warps": 4}, {"permute_maxnreg": 48}, {"permute_stream": 1},
    {"permute_block_t": 2, "permute_block_d": 512}, {"scan_block_b": 8, "scan_block_e": 16},
]


@pytest.mark.parametrize("setting", SETTINGS, ids=["-".join(f"{k}{v}" for k, v in s.items()) for s in SETTINGS])
@pytest.mark.parametrize("tokens, dim, experts, topk, routing", [(8192, 1024, 256, 6, "random"),
                                                                 (1001, 96, 7, 6, "one_expert_takes_all")])
def test_launch_settings_give_the_same_bits(kernel, setting, tokens, dim, experts, topk, routing):
    x, idx, _, _ = make(tokens, dim, experts, topk, torch.bfloat16, routing, seed=11)
    saved = dict(kernel.TUNE)
    try:
        kernel.TUNE.update(setting)
        _poison(x, idx, experts)
        fused = kernel.route_permute(x, idx, experts)
        tables = kernel.route(idx.int(), experts)  # int32 ids, the tables alone (its own row kernel)
    finally:
        kernel.TUNE.update(saved)
    _assert_fused_permute(fused, x, idx, experts)
    assert all(torch.equal(a, b) for a, b in zip(tables, fused[1:])), "route() vs route_permute() tables"


def test_programmatic_dependent_launch_is_on_where_it_can_be(kernel):
    """The default launches overlap (PDL) on sm90+, and off by TUNE; both give the same bits (above)."""
    major = torch.cuda.get_device_capability()[0]
    assert kernel._use_pdl() == (bool(kernel.TUNE["pdl"]) and major >= 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens, dim, experts, topk, routing", CASES,
                         ids=[f"{c[0]}x{c[1]}-e{c[2]}-k{c[3]}-{c[4]}" for c in CASES])
def test_bitwise_vs_the_eager_mirror(kernel, tokens, dim, experts, topk, routing, dtype):
    x, idx, w, g = make(tokens, dim, experts, topk, dtype, routing, seed=tokens + experts)
    order, token_rows, counts, offsets = eager_plan(idx, experts)
    rows, srcs, k_counts, k_offsets = kernel.route(idx, experts)
    assert torch.equal(rows.long(), token_rows) and torch.equal(k_counts, counts) and torch.equal(k_offsets, offsets)
    assert torch.equal(srcs.long(), order[token_rows])
    permuted = kernel.permute(x, rows)
    assert_bitwise(permuted, x[order // topk], "permuted rows")
    _poison(x, idx, experts)
    with expect_launches("_route_hist", "_route_scan", "_permute_fwd", exactly=1):
        fused = kernel.route_permute(x, idx, experts)  # the routing and the copy in three launches
    _assert_fused_permute(fused, x, idx, experts)
    y = (permuted.float() * 1.25 - 0.5).to(dtype)  # a stand-in expert output
    out = kernel.unpermute(y, w, rows, srcs)
    assert_bitwise(out, eager_unpermute(y, w, order, token_rows, dtype), "combined output")
    assert_bitwise(kernel.permute_backward(y, rows, dtype), eager_permute_grad(y, token_rows), "d_hidden")
    d_y, d_w = kernel.unpermute_backward(g, y, w, rows, srcs)
    token_of = order // topk
    assert_bitwise(d_y, (g[token_of].float() * w.reshape(-1)[order][:, None]).to(dtype), "d_y")
    terms = g[token_of].double() * y.double()  # exact products of the fp32-widened inputs
    want = torch.zeros(tokens * topk, dtype=torch.float64, device=DEVICE)
    want[order] = terms.sum(-1)
    scale = torch.zeros_like(want)
    scale[order] = terms.abs().sum(-1)
    assert (d_w.reshape(-1).double() - want).abs().le(1e-5 * scale + 1e-30).all(), "d_weights vs float64"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_close_to_eager_index_add_and_an_oracle(kernel, dtype):
    x, idx, w, _ = make(4096, 512, 64, 6, dtype, seed=3)
    rows, srcs, _, _ = kernel.route(idx, 64)
    out = kernel.unpermute(kernel.permute(x, rows), w, rows, srcs)
    order = torch.argsort(idx.reshape(-1), stable=True)
    scaled = (x[order // 6].float() * w.reshape(-1)[order][:, None]).to(dtype)
    atomics = torch.zeros_like(x).index_add_(0, order // 6, scaled)
    oracle = (x.double() * w.double().sum(-1, keepdim=True)).cpu().numpy()
    if dtype == torch.float32:
        assert_close(out.cpu().numpy(), atomics.cpu().numpy(), "fp32", "oracle")
        assert_close(out.cpu().numpy(), oracle, "fp32", "oracle")
    else:  # six bf16-rounded adds: within 6 bf16 ulps of the largest value
        bound = 6 * 2.0**-8 * np.abs(oracle).max()
        assert np.abs(out.float().cpu().numpy() - oracle).max() <= bound
        assert (out.float() - atomics.float()).abs().max().item() <= bound


def test_deterministic_run_to_run(kernel):
    x, idx, w, g = make(8192, 4096, 256, 6, torch.bfloat16, seed=9)

    def once():
        y, rows, srcs, counts, _ = kernel.route_permute(x, idx, 256)
        return (rows, counts, y, kernel.unpermute(y, w, rows, srcs), *kernel.unpermute_backward(g, y, w, rows, srcs),
                kernel.permute_backward(y, rows, torch.bfloat16))

    first = once()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, once()))
