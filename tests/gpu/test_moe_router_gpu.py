"""Fused MoE router on CUDA (torch fp32 scores / logits): bitwise vs an eager mirror, and oracles.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``.
Skipped without CUDA. Routing runs in fp32 whatever the model's dtype (the layer casts before the gate).

- **Bitwise vs eager torch** from given scores (the path the Paddle layer takes): selected experts equal
  ``torch.topk`` of the biased scores (random data: no ties), weights equal the reference's op sequence in
  eager torch with the reference's (Paddle's) left-to-right sum over the k slots, counts equal ``bincount``;
  hash routing equals the table lookup; the scores' gradient equals Paddle autograd's formulas written as
  eager ops (``-dq * q / b``, the scale ops' ``+ 0``).
- **In-kernel scoring** (from logits, the benchmark's fused path): scores, weights and ``d_logits`` vs eager
  torch autograd within the fp32 ``oracle`` tolerance, the selection equal on rows without near-ties.
- Determinism: two runs byte-identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise, assert_close
from helpers.gpu import CUDA_ONLY

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"
EAGER_SCORES = {"sqrtsoftplus": lambda x: torch.sqrt(F.softplus(x)), "sigmoid": torch.sigmoid,
                "softmax": lambda x: torch.softmax(x, dim=-1)}


@pytest.fixture(scope="module")
def kernel():
    from fleet_ext.ops.moe_router import kernel as router_kernel  # imported only where it will run

    return router_kernel


def make(tokens, experts, topk, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE) * 2
    bias = torch.randn(experts, generator=gen, device=DEVICE) * 0.1
    grad = torch.randn(tokens, topk, generator=gen, device=DEVICE)
    return logits, bias, grad


def eager_weights(scores, idx, norm, scaling):
    """The reference's op sequence, the k-slot sum left to right from zero (Paddle's order)."""
    w = torch.gather(scores, 1, idx)
    if norm:
        den = torch.zeros_like(w[:, 0])
        for i in range(w.shape[1]):
            den = den + w[:, i]
        w = w / (den + 1e-20)[:, None]
    return w * scaling + 0.0


def eager_d_scores(d_w, scores, idx, norm, scaling):
    """Paddle autograd's backward of ``eager_weights``, op for op, in eager torch."""
    dq = d_w * scaling + 0.0
    if norm:
        a = torch.gather(scores, 1, idx)
        den = torch.zeros_like(a[:, 0])
        for i in range(a.shape[1]):
            den = den + a[:, i]
        b = (den + 1e-20)[:, None]
        terms = -dq * (a / b) / b
        db = torch.zeros_like(den)
        for i in range(a.shape[1]):
            db = db + terms[:, i]
        dq = dq / b + (db + 0.0)[:, None]
    out = torch.zeros_like(scores)
    for i in range(idx.shape[1]):  # the gather's gradient: each slot added at its expert, in slot order
        col = idx[:, i:i + 1]
        out.scatter_(1, col, out.gather(1, col) + dq[:, i:i + 1])
    return out


CASES = [(8192, 256, 6, True, 2.5), (8192, 32, 6, True, 2.5), (1000, 64, 8, False, 1.5), (37, 9, 1, True, 1.0),
         (300, 16, 16, True, 1.0)]


@pytest.mark.parametrize("score", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("tokens, experts, topk, norm, scaling", CASES,
                         ids=[f"{c[0]}x{c[1]}-k{c[2]}-norm{int(c[3])}" for c in CASES])
def test_given_scores_bitwise_vs_the_eager_mirror(kernel, tokens, experts, topk, norm, scaling, score):
    logits, bias, grad = make(tokens, experts, topk, seed=tokens + experts)
    scores = EAGER_SCORES[score](logits).contiguous()
    _, weights, idx, counts = kernel.route(scores, bias, topk, norm, scaling)
    assert torch.equal(idx, torch.topk(scores + bias, topk, dim=-1).indices)
    assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=experts))
    assert_bitwise(weights, eager_weights(scores, idx, norm, scaling), "weights")
    d_scores = kernel.route_backward(grad, scores, idx, norm, scaling)
    assert_bitwise(d_scores, eager_d_scores(grad, scores, idx, norm, scaling), "d_scores")
    leaf = scores.clone().requires_grad_(True)  # torch autograd of the natural eager code (its own sum order)
    w = torch.gather(leaf, 1, idx)
    w = (w / (w.sum(-1, keepdim=True) + 1e-20) if norm else w) * scaling
    w.backward(grad)
    # Relative to each row's terms (dq / b and the sum of |dq q / b|): da + db cancels, so a one-ulp difference in
    # the denominator is not small next to the result; a wrong formula is off by O(1) of that scale.
    a, dq = torch.gather(scores, 1, idx).double(), grad.double() * scaling
    b = a.sum(-1, keepdim=True) if norm else torch.ones_like(a[:, :1])
    row_scale = (dq.abs() / b).amax(-1, keepdim=True) + (dq.abs() * a / b / b).sum(-1, keepdim=True)
    assert_close(d_scores.cpu().numpy(), leaf.grad.cpu().numpy(), "fp32", "oracle_grad",
                 scale=row_scale.cpu().numpy())


def test_hash_routing_and_replayed_selection(kernel):
    logits, _, grad = make(4096, 64, 6, seed=5)
    scores = torch.sqrt(F.softplus(logits))
    table = torch.randint(0, 64, (1000, 6), device=DEVICE)
    ids = torch.randint(0, 1000, (4096,), device=DEVICE)
    _, weights, idx, counts = kernel.route(scores, None, 6, True, 1.5, table=table, ids=ids)
    assert torch.equal(idx, table[ids]) and torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=64))
    assert_bitwise(weights, eager_weights(scores, idx, True, 1.5), "hash weights")
    _, again, _, _ = kernel.route(scores, None, 6, True, 1.5, indices=idx)
    assert_bitwise(again, weights, "given selection")


@pytest.mark.parametrize("experts", [256, 32])
@pytest.mark.parametrize("score", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_in_kernel_scoring_vs_eager_autograd(kernel, score, experts):
    logits, bias, grad = make(8192, experts, 6, seed=experts)
    scores, weights, idx, _ = kernel.route(logits, bias, 6, True, 2.5, score=score)
    leaf = logits.clone().requires_grad_(True)
    s = EAGER_SCORES[score](leaf)
    assert_close(scores.cpu().numpy(), s.detach().cpu().numpy(), "fp32", "oracle", what="scores")
    # Scores a few ulps apart from eager's may swap experts whose biased scores are closer than that: compare the
    # rows whose top 7 are at least 1e-5 apart (nearly all).
    top = torch.topk(s.detach() + bias, 7, dim=-1).values
    clear = (top[:, :-1] - top[:, 1:]).min(-1).values > 1e-5
    assert clear.float().mean().item() > 0.9
    assert torch.equal(idx[clear], torch.topk(s.detach() + bias, 6, dim=-1).indices[clear])
    w = torch.gather(s, 1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
    assert_close(weights.cpu().numpy(), w.detach().cpu().numpy(), "fp32", "oracle", what="weights")
    d_aux = torch.randn_like(logits)  # an aux loss's gradient on the scores, added before the score backward
    (w * grad).sum().add((s * d_aux).sum()).backward()
    d_logits = kernel.route_backward(grad, scores, idx, True, 2.5, score=score, logits=logits, d_scores=d_aux)
    assert_close(d_logits.cpu().numpy(), leaf.grad.cpu().numpy(), "fp32", "oracle", what="d_logits")


def test_deterministic_run_to_run(kernel):
    logits, bias, grad = make(8192, 256, 6, seed=1)

    def once():
        scores, weights, idx, counts = kernel.route(logits, bias, 6, True, 2.5, score="sqrtsoftplus")
        return scores, weights, idx, counts, kernel.route_backward(grad, scores, idx, True, 2.5, score="sqrtsoftplus",
                                                                   logits=logits)

    first = once()
    assert all(torch.equal(a, b) for a, b in zip(first, once()))
