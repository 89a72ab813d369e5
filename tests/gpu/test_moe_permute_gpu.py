"""Fused MoE permute / unpermute on CUDA (torch tensors, bf16 and fp32): bitwise vs an eager mirror, and oracles.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``.
Skipped without CUDA.

- **Routing** (rows per token, counts, offsets) equals ``torch.argsort(stable=True)`` / ``bincount`` exactly.
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
from helpers import assert_bitwise, assert_close
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
        rows, srcs, counts, _ = kernel.route(idx, 256)
        y = kernel.permute(x, rows)
        return (rows, counts, y, kernel.unpermute(y, w, rows, srcs), *kernel.unpermute_backward(g, y, w, rows, srcs),
                kernel.permute_backward(y, rows, torch.bfloat16))

    first = once()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, once()))
