"""Triton MoE router: scoring, biased top-k (or a given / hashed selection), renormalised scaled weights and
per-expert counts in one forward kernel; the weights' (and scores') gradient in one backward kernel.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this module
imports neither Paddle nor torch. One program holds ``BLOCK_T`` tokens' whole rows of ``E`` experts.

Forward (``route``), the reference's (``reference.py``) maths op for op:

- ``score``: ``given`` (the input already holds the scores), or ``sqrtsoftplus`` / ``sigmoid`` / ``softmax``
  of the logits in the kernel (written out: the aux loss and the backward need them). On a GPU ``exp`` and
  ``log1p`` are libdevice's (CUDA's ``expf`` / ``log1pf``, which eager torch uses), divisions and square roots
  IEEE-rounded; the interpreter has no libdevice and uses numpy's ``exp`` and a ``log1p`` from ``log``.
- selection: ``k`` rounds of "largest biased score, lowest expert id among equals" (the reference's Paddle
  top-k orders tied experts its own way: a tie at the selection can change the slot order); or the given
  indices; or the hash table row ``table[ids[t]]``.
- weights: the unbiased scores of the selected experts, summed left to right over the slots from zero (as
  Paddle's reduction over k), ``w / (sum + eps)``, then ``* scaling + 0.0`` (Paddle's scale op).
- counts: per-block one-hot sums reduced over blocks in a fixed order (integers: exact).

Backward (``route_backward``) is Paddle autograd's backward of the reference, op for op: ``dq = dw * scaling
+ 0``; ``da = dq / b``; ``db = sum_k (-dq * q) / b`` (left to right), ``+ 0`` (the eps add's scale grad);
``d_sel = da + db``; ``d_scores`` = zeros with each slot's ``d_sel`` added at its expert in slot order (the
gather's gradient). With in-kernel scoring, the aux loss's ``d_scores`` is added, then the score function's
backward as eager torch writes it (``g / (2 s)`` then softplus's ``g z / (z + 1)``; ``g (1 - s) s``;
``s (g - sum g s)``), giving ``d_logits``.
"""

from __future__ import annotations

import sys
from typing import Any

import triton
import triton.language as tl
from triton.language.extra import libdevice

from fleet_ext.ops.launch import detached, dtype_name, empty_like, launch, shape_of, strides_of

SCORES = {"given": 0, "sqrtsoftplus": 1, "sigmoid": 2, "softmax": 3}
MODES = {"topk": 0, "given": 1, "hash": 2}
NORM_EPS = 1e-20
SOFTPLUS_THRESHOLD = 20.0  # torch's and Paddle's default: softplus(x) = x above it


@triton.jit
def _exp(x, USE_LIB: tl.constexpr):
    if USE_LIB:
        r = libdevice.exp(x)
    else:
        r = tl.exp(x)
    return r


@triton.jit
def _log1p(x, USE_LIB: tl.constexpr):
    """log(1 + x); without libdevice through log (``u = 1 + x; log(u) * x / (u - 1)``, exact where u == 1)."""
    if USE_LIB:
        r = libdevice.log1p(x)
    else:
        u = 1.0 + x
        r = tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))
    return r


@triton.jit
def _scores(x, e_mask, SCORE: tl.constexpr, USE_LIB: tl.constexpr):
    """Scores [BT, E_PAD] of the logits ``x`` (padded experts: 0)."""
    if SCORE == 1:  # sqrt(softplus(x)), softplus as torch: x above the threshold, else log1p(exp(x))
        sp = tl.where(x > 20.0, x, _log1p(_exp(tl.where(x > 20.0, 0.0, x), USE_LIB), USE_LIB))
        s = tl.sqrt_rn(sp)
    elif SCORE == 2:
        s = tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, USE_LIB))
    else:
        z = tl.where(e_mask[None, :], x, float("-inf"))
        p = _exp(z - tl.max(z, axis=1)[:, None], USE_LIB)
        s = tl.div_rn(p, tl.sum(p, axis=1)[:, None])
    return tl.where(e_mask[None, :], s, 0.0)


@triton.jit
def _column(tile, slots, i):
    """tile[:, i] exactly (one value plus zeros; int or float)."""
    return tl.sum(tl.where(slots[None, :] == i, tile, 0), axis=1)


@triton.jit
def _pick(s, idx, e):
    """s[t, idx[t, j]] for every slot: [BT, K_PAD] (exact: one value plus zeros)."""
    return tl.sum(tl.where(e[None, None, :] == idx[:, :, None], s[:, None, :], 0.0), axis=2)


@triton.jit
def _router_fwd(x_ptr, bias_ptr, idx_in_ptr, table_ptr, ids_ptr, scores_ptr, w_ptr, idx_ptr, hist_ptr,
                T, E, scaling, eps,
                K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                MODE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SCORE: tl.constexpr,
                USE_LIB: tl.constexpr):
    """Scores, selection, weights and this block's per-expert counts for BLOCK_T tokens."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    e = tl.arange(0, E_PAD)
    e_mask = e < E
    mask = t_mask[:, None] & e_mask[None, :]
    at = t64[:, None] * E + e[None, :]
    s = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if SCORE != 0:
        s = _scores(s, e_mask, SCORE, USE_LIB)
        tl.store(scores_ptr + at, s, mask=mask)
    slots = tl.arange(0, K_PAD)
    k_mask = t_mask[:, None] & (slots < K)[None, :]
    k_at = t64[:, None] * K + slots[None, :]
    if MODE == 0:
        sel = s
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + e, mask=e_mask, other=0.0)[None, :]
        sel = tl.where(mask, sel, float("-inf"))
        idx = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        for i in tl.static_range(K):
            best = tl.max(sel, axis=1)
            pick = tl.min(tl.where(sel == best[:, None], e[None, :], E_PAD), axis=1)
            sel = tl.where(e[None, :] == pick[:, None], float("-inf"), sel)
            idx = tl.where(slots[None, :] == i, pick[:, None], idx)
    elif MODE == 1:
        idx = tl.load(idx_in_ptr + k_at, mask=k_mask, other=0).to(tl.int32)
    else:
        tok = tl.load(ids_ptr + t64, mask=t_mask, other=0).to(tl.int64)
        idx = tl.load(table_ptr + tok[:, None] * K + slots[None, :], mask=k_mask, other=0).to(tl.int32)
    valid = k_mask & (idx >= 0) & (idx < E)
    s_sel = tl.where(valid, _pick(s, idx, e), 0.0)
    if NORM:
        den = tl.zeros([BLOCK_T], dtype=tl.float32)
        for i in tl.static_range(K):
            den = den + _column(s_sel, slots, i)
        s_sel = tl.div_rn(s_sel, (den + eps)[:, None])
    tl.store(w_ptr + k_at, s_sel * scaling + 0.0, mask=k_mask)
    tl.store(idx_ptr + k_at, idx.to(tl.int64), mask=k_mask)
    hits = tl.sum((valid[:, :, None] & (idx[:, :, None] == e[None, None, :])).to(tl.int32), axis=1)
    tl.store(hist_ptr + pid.to(tl.int64) * E + e, tl.sum(hits, axis=0), mask=e_mask)


@triton.jit
def _router_counts(hist_ptr, counts_ptr, NB, E, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[e] = sum over blocks of hist[b, e]."""
    ex = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = ex < E
    acc = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        bb = b0 + tl.arange(0, BLOCK_B)
        m = (bb < NB)[:, None] & e_mask[None, :]
        acc += tl.sum(tl.load(hist_ptr + bb[:, None].to(tl.int64) * E + ex[None, :], mask=m, other=0), axis=0)
    tl.store(counts_ptr + ex, acc.to(tl.int64), mask=e_mask)


@triton.jit
def _router_bwd(dw_ptr, s_ptr, idx_ptr, ds_ptr, x_ptr, out_ptr, T, E, scaling, eps,
                K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                NORM: tl.constexpr, SCORE: tl.constexpr, HAS_DS: tl.constexpr, USE_LIB: tl.constexpr):
    """d_scores (SCORE == 0) or d_logits for BLOCK_T tokens from d_weights (and the aux loss's d_scores)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    e = tl.arange(0, E_PAD)
    e_mask = e < E
    mask = t_mask[:, None] & e_mask[None, :]
    at = t64[:, None] * E + e[None, :]
    slots = tl.arange(0, K_PAD)
    k_mask = t_mask[:, None] & (slots < K)[None, :]
    k_at = t64[:, None] * K + slots[None, :]
    s = tl.load(s_ptr + at, mask=mask, other=0.0)
    idx = tl.load(idx_ptr + k_at, mask=k_mask, other=0).to(tl.int32)
    valid = k_mask & (idx >= 0) & (idx < E)
    dq = tl.load(dw_ptr + k_at, mask=k_mask, other=0.0).to(tl.float32) * scaling + 0.0
    if NORM:
        a = tl.where(valid, _pick(s, idx, e), 0.0)
        den = tl.zeros([BLOCK_T], dtype=tl.float32)
        for i in tl.static_range(K):
            den = den + _column(a, slots, i)
        b = (den + eps)[:, None]
        q = tl.div_rn(a, b)
        terms = tl.div_rn(-dq * q, b)
        db = tl.zeros([BLOCK_T], dtype=tl.float32)
        for i in tl.static_range(K):
            db = db + _column(terms, slots, i)
        dq = tl.div_rn(dq, b) + (db + 0.0)[:, None]
    g = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    for i in tl.static_range(K):
        hit = e[None, :] == _column(tl.where(valid, idx, -1), slots, i)[:, None]
        g = tl.where(hit, g + _column(dq, slots, i)[:, None], g)
    if HAS_DS:
        g = g + tl.load(ds_ptr + at, mask=mask, other=0.0)
    if SCORE == 1:  # sqrt's backward g / (2 s), then softplus's g * z / (z + 1), z = exp(x) (x below 20)
        x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        g = tl.div_rn(g, tl.where(mask, 2.0 * s, 1.0))  # padded experts: no 0 / 0
        z = _exp(tl.where(x > 20.0, 0.0, x), USE_LIB)
        g = tl.where(x > 20.0, g, tl.div_rn(g * z, z + 1.0))
    elif SCORE == 2:
        g = g * (1.0 - s) * s
    elif SCORE == 3:
        g = s * (g - tl.sum(g * s, axis=1)[:, None])
    tl.store(out_ptr + at, g, mask=mask)


def is_interpreted() -> bool:
    return type(_router_fwd).__name__ == "InterpretedFunction"


USE_LIB = not is_interpreted()  # libdevice exists only for compiled kernels
TUNE: dict[str, int] = {"block_t": 4, "warps": 4, "counts_block_b": 256, "counts_block_e": 32}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _dtype(tensor: Any, name: str) -> Any:
    return getattr(sys.modules[type(tensor).__module__.split(".")[0]], name)


def _contiguous_2d(t: Any, name: str, fn: str) -> None:
    if t.ndim != 2 or strides_of(t) != [shape_of(t)[1], 1]:
        raise ValueError(f"{fn}: `{name}` must be a contiguous 2-D tensor, got shape {shape_of(t)} "
                         f"strides {strides_of(t)}")


def check_args(x: Any, bias: Any, topk: int, score: str, indices: Any, table: Any, ids: Any,
               fn: str = "moe_route") -> tuple[int, int]:
    """(T, E); errors name the tensor and what was expected."""
    if score not in SCORES:
        raise ValueError(f"{fn}: `score` must be one of {list(SCORES)}, got {score!r}")
    _contiguous_2d(x, "scores" if score == "given" else "logits", fn)
    if dtype_name(x) != "float32":
        raise ValueError(f"{fn}: `{'scores' if score == 'given' else 'logits'}` must be float32 (routing decisions "
                         f"are precision-sensitive), got {dtype_name(x)}")
    tokens, experts = shape_of(x)
    if not 1 <= int(topk) <= experts:
        raise ValueError(f"{fn}: `topk` must lie in [1, {experts}], got {topk}")
    if bias is not None and (shape_of(bias) != [experts] or dtype_name(bias) != "float32"):
        raise ValueError(f"{fn}: `bias` must be float32 [{experts}], got {dtype_name(bias)} {shape_of(bias)}")
    if indices is not None:
        _contiguous_2d(indices, "indices", fn)
        if shape_of(indices) != [tokens, topk] or dtype_name(indices) not in ("int32", "int64"):
            raise ValueError(f"{fn}: `indices` must be int32/int64 [{tokens}, {topk}], got {dtype_name(indices)} "
                             f"{shape_of(indices)}")
    if table is not None:
        _contiguous_2d(table, "table", fn)
        if shape_of(table)[1] != topk or shape_of(ids) != [tokens] or strides_of(ids) != [1]:
            raise ValueError(f"{fn}: hash routing needs `table` [vocab, {topk}] and contiguous `ids` [{tokens}], "
                             f"got {shape_of(table)} and {shape_of(ids)}")
    return tokens, experts


def _block_t(tokens: int, experts: int) -> int:
    if is_interpreted():
        return min(64, _pow2(tokens))
    return max(1, min(TUNE["block_t"], 4096 // _pow2(experts)))


def route(x: Any, bias: Any, topk: int, norm_topk_prob: bool, scaling: float, score: str = "given",
          indices: Any = None, table: Any = None, ids: Any = None) -> tuple[Any, Any, Any, Any]:
    """(scores [T, E] fp32 or None when given, weights [T, k] fp32, indices [T, k] int64, counts [E] int64).

    ``x`` is the scores (``score="given"``) or the logits. Selection: top-k of the biased scores, or the
    given ``indices``, or ``table[ids]`` (hash routing).
    """
    tokens, experts = check_args(x, bias, topk, score, indices, table, ids)
    mode = "hash" if table is not None else "given" if indices is not None else "topk"
    block_t = _block_t(tokens, experts)
    n_blocks = triton.cdiv(tokens, block_t)
    int32, int64 = _dtype(x, "int32"), _dtype(x, "int64")
    scores = empty_like(x) if score != "given" else None
    weights = empty_like(x, shape=[tokens, topk])
    out_idx = empty_like(x, shape=[tokens, topk], dtype=int64)
    hist = empty_like(x, shape=[n_blocks, experts], dtype=int32)
    counts = empty_like(x, shape=[experts], dtype=int64)
    placeholder = detached(x)
    launch(_router_fwd, (n_blocks,), placeholder, bias if bias is not None else placeholder,
           indices if indices is not None else out_idx, table if table is not None else out_idx,
           ids if ids is not None else out_idx, scores if scores is not None else weights, weights, out_idx, hist,
           tokens, experts, float(scaling), NORM_EPS, K=int(topk), K_PAD=_pow2(topk), E_PAD=_pow2(experts),
           BLOCK_T=block_t, MODE=MODES[mode], HAS_BIAS=bias is not None and mode == "topk",
           NORM=bool(norm_topk_prob), SCORE=SCORES[score], USE_LIB=USE_LIB, num_warps=TUNE["warps"])
    block_e = min(TUNE["counts_block_e"], _pow2(experts))
    launch(_router_counts, (triton.cdiv(experts, block_e),), hist, counts, n_blocks, experts,
           BLOCK_B=min(TUNE["counts_block_b"], _pow2(n_blocks)), BLOCK_E=block_e, num_warps=4)
    return scores, weights, out_idx, counts


def route_backward(d_weights: Any, scores: Any, indices: Any, norm_topk_prob: bool, scaling: float,
                   score: str = "given", logits: Any = None, d_scores: Any = None) -> Any:
    """d_scores [T, E] (``score="given"``) or d_logits: Paddle/torch autograd's backward of the routing maths."""
    tokens, experts = shape_of(scores)
    topk = shape_of(indices)[1]
    if score == "sqrtsoftplus" and logits is None:
        raise ValueError("moe_route backward: `logits` are needed for the sqrtsoftplus backward")
    _contiguous_2d(d_weights, "d_weights", "moe_route backward")
    block_t = _block_t(tokens, experts)
    out = empty_like(scores)
    launch(_router_bwd, (triton.cdiv(tokens, block_t),), detached(d_weights), detached(scores), indices,
           detached(d_scores) if d_scores is not None else out, detached(logits) if logits is not None else out, out,
           tokens, experts, float(scaling), NORM_EPS, K=int(topk), K_PAD=_pow2(topk), E_PAD=_pow2(experts),
           BLOCK_T=block_t, NORM=bool(norm_topk_prob), SCORE=SCORES[score], HAS_DS=d_scores is not None,
           USE_LIB=USE_LIB, num_warps=TUNE["warps"])
    return out
