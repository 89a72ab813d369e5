"""The router's logits GEMM and its two backward GEMMs at fp32 accuracy on the tensor cores.

DeepSeek-style routers compute ``logits = x W^T`` in fp32 (the selections are precision-sensitive): hidden states
x [T, D] cast to fp32 and the fp32 router weight W [E, D]. Eager does that with a full-size fp32 copy of x and an
fp32 GEMM on the CUDA cores (~40 TFLOP/s measured on the H200), and its backward with another copy of x, an fp32
[T, D] input gradient and a cast back. Here (the fp32 operands split into bf16 pieces once per call, ``_split3``):

- ``logits`` [T, E] fp32 = x W^T, x read as stored (bf16 values are exact in bf16, so only W is split into bf16
  pieces: three bf16 products, ``split_dot.DOT_BF16X3``);
- ``d_w`` [E, D] fp32 = d_logits^T x (d_logits split: three products); its sum over tokens is split over
  programs for parallelism, the splits added in a fixed order by ``_sum_splits``: no atomics, byte-identical run
  to run;
- ``d_x`` [T, D] in x's dtype = ``d_logits W`` rounded once: the input gradient of the GEMM and of the cast to
  fp32 before it (the framework adds it to x's other gradients, as it would eager's). A result rounded to bf16
  needs ~2^-16 of accuracy: three products of both operands' pieces (``DOT_BF16X3_ROUNDED``).

Each tile's product is formed in a fresh accumulator and added to the running sum in fp32 (``split_dot._dot``).
Not bitwise against an fp32 library GEMM (another summation order): within fp32 rounding of it, measured in the
tests. The interpreter multiplies in IEEE fp32 (numpy); fp32 x on a GPU takes TF32x3 products, slower than the
library's fp32 GEMM in the backward (RESULTS.md), so the Paddle op keeps the library for it (``function.py``).
Framework-agnostic host launchers (Paddle or torch tensors, ``fleet_ext.ops.launch``); this module imports neither.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import (
    detached,
    dtype_name,
    empty_like,
    is_interpreted,
    is_paddle,
    launch,
    shape_of,
    strides_of,
)
from fleet_ext.ops.multiprocessors import multiprocessor_count
from fleet_ext.ops.split_dot import DOT_IEEE, DOT_TF32X3, _bf16_pieces, _dot

# Tiles (BM x BN, K step BK), warps and stages per GEMM on a GPU, for many experts and for at most SMALL_E (there
# the logits GEMM is a narrow one over a long K, d_x one K step per tile: more, smaller programs); the interpreter
# takes small tiles (``_tiles``). H200 sweeps: ``bench_moe.py --sections router_gemm`` (RESULTS.md).
SMALL_E = 64
TUNE: dict[str, dict[str, int]] = {
    "logits": dict(BM=128, BN=128, BK=64, warps=8, stages=3),
    "dx": dict(BM=64, BN=128, BK=32, warps=4, stages=3),
    "dw": dict(BM=64, BN=128, BK=32, warps=4, stages=4),
    "logits_small": dict(BM=64, BN=64, BK=64, warps=4, stages=4),
    "dx_small": dict(BM=64, BN=128, BK=32, warps=4, stages=2),
    "dw_small": dict(BM=64, BN=128, BK=32, warps=4, stages=4),
}
INTERPRETER_TILES = dict(BM=16, BN=16, BK=16, warps=4, stages=1)
# bf16 pieces (``_split3`` once per call, three bf16 tensor-core products per tile): "auto" = bf16 hidden states on
# a GPU; True forces them (CPU tests: the interpreter multiplies the pieces in fp32), False never.
PIECES: bool | str = "auto"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` for bf16 pieces: a tensor-core product, or (``IEEE``, the interpreter, whose bf16 products
    are not usable) fp32 products of the same values."""
    if IEEE:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit
def _split3(src_ptr, dst_ptr, N, BLOCK: tl.constexpr):
    """fp32 ``src`` [N] as its bf16 pieces ``dst`` [3, N] (hi, mid, lo), once per call for every program."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    hi, mid, lo = _bf16_pieces(tl.load(src_ptr + i, mask=mask, other=0.0))
    tl.store(dst_ptr + i, hi, mask=mask)
    tl.store(dst_ptr + N + i, mid, mask=mask)
    tl.store(dst_ptr + 2 * N + i, lo, mask=mask)


@triton.jit
def _router_logits(x_ptr, w_ptr, out_ptr, T, E, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, PIECES: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                   STAGES: tl.constexpr):
    """Program (m, n): logits[m BM : +BM, n BN : +BN] = x W^T over all of D. ``PIECES``: ``w_ptr`` holds W's bf16
    pieces [3, E, D] and x is exact in bf16 (three products, smallest first); else W fp32 and ``split_dot._dot``."""
    t = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    e = tl.program_id(1) * BN + tl.arange(0, BN)
    t_mask, e_mask = t < T, e < E
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, D, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        k_mask = k < D
        x = tl.load(x_ptr + t[:, None] * D + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        w_ptrs = w_ptr + e[None, :] * D + k[:, None]  # W^T's tile [BK, BN]
        w_mask = k_mask[:, None] & e_mask[None, :]
        if PIECES:
            part = tl.zeros([BM, BN], dtype=tl.float32)
            part = _mma(x, tl.load(w_ptrs + 2 * E * D, mask=w_mask, other=0.0), part, IEEE)
            part = _mma(x, tl.load(w_ptrs + E * D, mask=w_mask, other=0.0), part, IEEE)
            acc += _mma(x, tl.load(w_ptrs, mask=w_mask, other=0.0), part, IEEE)
        else:
            acc += _dot(x, tl.load(w_ptrs, mask=w_mask, other=0.0), DOT, 1)
    tl.store(out_ptr + t[:, None] * E + e[None, :], acc, mask=t_mask[:, None] & e_mask[None, :])


@triton.jit
def _router_dx(dl_ptr, w_ptr, out_ptr, T, E: tl.constexpr, D, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               PIECES: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr):
    """Program (m, n): d_x[m BM : +BM, n BN : +BN] = d_logits W (K = E), rounded to d_x's dtype. ``PIECES``: both
    operands as bf16 pieces ([3, T, E], [3, E, D]), the three products down to ~2^-16 (``DOT_BF16X3_ROUNDED``)."""
    t = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    d = tl.program_id(1) * BN + tl.arange(0, BN)
    t_mask, d_mask = t < T, d < D
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, E, BK, num_stages=STAGES):
        k = k0 + tl.arange(0, BK)
        k_mask = k < E
        dl_ptrs = dl_ptr + t[:, None] * E + k[None, :]
        dl_mask = t_mask[:, None] & k_mask[None, :]
        w_ptrs = w_ptr + k[:, None] * D + d[None, :]
        w_mask = k_mask[:, None] & d_mask[None, :]
        if PIECES:
            a_hi = tl.load(dl_ptrs, mask=dl_mask, other=0.0)
            b_hi = tl.load(w_ptrs, mask=w_mask, other=0.0)
            part = tl.zeros([BM, BN], dtype=tl.float32)
            part = _mma(tl.load(dl_ptrs + T * E, mask=dl_mask, other=0.0), b_hi, part, IEEE)
            part = _mma(a_hi, tl.load(w_ptrs + E * D, mask=w_mask, other=0.0), part, IEEE)
            acc += _mma(a_hi, b_hi, part, IEEE)
        else:
            acc += _dot(tl.load(dl_ptrs, mask=dl_mask, other=0.0), tl.load(w_ptrs, mask=w_mask, other=0.0), DOT, 0)
    tl.store(out_ptr + t[:, None] * D + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & d_mask[None, :])


@triton.jit
def _router_dw(dl_ptr, x_ptr, part_ptr, T, E, D: tl.constexpr, TOKENS_PER_SPLIT, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, PIECES: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
               STAGES: tl.constexpr):
    """Program (m, n, s): split s's share of d_w[m BM : +BM, n BN : +BN] = d_logits^T x over its run of tokens,
    into ``part[s]`` [E, D]. ``PIECES``: d_logits as bf16 pieces [3, T, E], x exact in bf16 (three products)."""
    e = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.program_id(2)
    e_mask, d_mask = e < E, d < D
    t0 = s.to(tl.int64) * TOKENS_PER_SPLIT
    t_end = tl.minimum(t0 + TOKENS_PER_SPLIT, T)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(t0, t_end, BK, num_stages=STAGES):
        t = k0 + tl.arange(0, BK)
        t_mask = t < t_end
        dl_ptrs = dl_ptr + t[None, :] * E + e[:, None]  # d_logits^T's tile [BM, BK]
        dl_mask = e_mask[:, None] & t_mask[None, :]
        x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        if PIECES:
            part = tl.zeros([BM, BN], dtype=tl.float32)
            part = _mma(tl.load(dl_ptrs + 2 * T * E, mask=dl_mask, other=0.0), x, part, IEEE)
            part = _mma(tl.load(dl_ptrs + T * E, mask=dl_mask, other=0.0), x, part, IEEE)
            acc += _mma(tl.load(dl_ptrs, mask=dl_mask, other=0.0), x, part, IEEE)
        else:
            acc += _dot(tl.load(dl_ptrs, mask=dl_mask, other=0.0), x, DOT, 2)
    out = part_ptr + s.to(tl.int64) * E * D + e[:, None] * D + d[None, :]
    tl.store(out, acc, mask=e_mask[:, None] & d_mask[None, :])


@triton.jit
def _sum_splits(part_ptr, out_ptr, SPLITS, N, BLOCK: tl.constexpr):
    """out[i] = part[0, i] + part[1, i] + ... in split order (a fixed order: the same bytes every run)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    acc = tl.load(part_ptr + i, mask=mask, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * N + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, acc, mask=mask)


def _tiles(kernel: Any, name: str, experts: int) -> dict[str, int]:
    if is_interpreted(kernel):
        return INTERPRETER_TILES
    return TUNE[f"{name}_small" if experts <= SMALL_E else name]


def _mode(x: Any, kernel: Any) -> dict[str, Any]:
    """How the products keep fp32 accuracy: bf16 pieces for bf16 x on a GPU (``PIECES`` "auto"; True forces them,
    the interpreter then multiplying the pieces in fp32); else IEEE fp32 products in the interpreter, TF32x3 on a
    GPU (fp16 / fp32 x: not exact in bf16)."""
    interpreted = is_interpreted(kernel)
    pieces = PIECES is True or (PIECES == "auto" and not interpreted and dtype_name(x) == "bfloat16")
    if pieces and dtype_name(x) != "bfloat16":
        raise ValueError(f"router_logits: PIECES needs bf16 hidden states (exact in bf16), got {dtype_name(x)}")
    return dict(PIECES=pieces, IEEE=interpreted, DOT=DOT_IEEE if interpreted else DOT_TF32X3)


def _check(t: Any, name: str, shape: list[int | None], dtypes: tuple[str, ...], fn: str) -> list[int]:
    got = shape_of(t)
    if len(got) != len(shape) or any(s is not None and s != g for s, g in zip(shape, got)):
        raise ValueError(f"{fn}: `{name}` must have shape {shape} (None: any), got {got}")
    if dtype_name(t) not in dtypes:
        raise ValueError(f"{fn}: `{name}` must be {' / '.join(dtypes)}, got {dtype_name(t)}")
    if strides_of(t) != [got[1], 1]:
        raise ValueError(f"{fn}: `{name}` must be contiguous (make it so with .contiguous())")
    return got


def _pieces(t: Any) -> Any:
    """fp32 ``t`` as its bf16 pieces [3, *t.shape] (``_split3``)."""
    n = 1
    for size in shape_of(t):
        n *= size
    out = empty_like(t, shape=[3, *shape_of(t)], dtype=_bf16(t))
    launch(_split3, (triton.cdiv(n, 1024),), detached(t), out, n, BLOCK=1024, num_warps=4)
    return out


def _bf16(t: Any) -> Any:
    """The bf16 dtype of ``t``'s framework."""
    if is_paddle(t):
        import paddle

        return paddle.bfloat16
    import torch

    return torch.bfloat16


def logits(x: Any, weight: Any) -> Any:
    """``x`` [T, D] (bf16 / fp16 / fp32), ``weight`` [E, D] fp32 -> logits [T, E] fp32 = x W^T at fp32 accuracy."""
    tokens, dim = _check(x, "x", [None, None], FLOAT_DTYPES, "router_logits")
    experts = _check(weight, "weight", [None, dim], ("float32",), "router_logits")[0]
    out = empty_like(weight, shape=[tokens, experts])
    c, mode = _tiles(_router_logits, "logits", experts), _mode(x, _router_logits)
    if tokens == 0:  # (a rank's empty share of the tokens): nothing to launch
        return out
    launch(_router_logits, (triton.cdiv(tokens, c["BM"]), triton.cdiv(experts, c["BN"])), detached(x),
           _pieces(weight) if mode["PIECES"] else detached(weight), out, tokens, experts, D=dim, BM=c["BM"],
           BN=c["BN"], BK=c["BK"], STAGES=c["stages"], num_warps=c["warps"], **mode)
    return out


def _splits(tiles: int, tokens: int, bk: int, kernel: Any) -> int:
    """Token splits of the weight gradient: enough programs for two per SM, each split at least 8 K steps."""
    sms = multiprocessor_count(kernel, interpreted=2)
    return max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(tokens, 8 * bk)))


def logits_backward(d_logits: Any, x: Any, weight: Any, need_dx: bool = True,
                    need_dw: bool = True) -> tuple[Any, Any]:
    """(d_x [T, D] in x's dtype = d_logits W, d_w [E, D] fp32 = d_logits^T x): the backward of :func:`logits`
    (and of the cast of x to fp32 before it); a gradient not needed is None and not computed."""
    fn = "router_logits backward"
    tokens, dim = _check(x, "x", [None, None], FLOAT_DTYPES, fn)
    experts = _check(weight, "weight", [None, dim], ("float32",), fn)[0]
    _check(d_logits, "d_logits", [tokens, experts], ("float32",), fn)
    mode = _mode(x, _router_dx)
    d_logits_in = _pieces(d_logits) if mode["PIECES"] and (need_dx or need_dw) else detached(d_logits)
    return (_dx(d_logits_in, weight, x, mode) if need_dx else None,
            _dw(d_logits_in, x, weight, mode) if need_dw else None)


def _dx(d_logits_in: Any, weight: Any, x: Any, mode: dict[str, Any]) -> Any:
    tokens, dim = shape_of(x)
    experts = shape_of(weight)[0]
    d_x = empty_like(x)
    if tokens == 0:
        return d_x
    c = _tiles(_router_dx, "dx", experts)
    launch(_router_dx, (triton.cdiv(tokens, c["BM"]), triton.cdiv(dim, c["BN"])), d_logits_in,
           _pieces(weight) if mode["PIECES"] else detached(weight), d_x, tokens, E=experts, D=dim, BM=c["BM"],
           BN=c["BN"], BK=c["BK"], STAGES=c["stages"], num_warps=c["warps"], **mode)
    return d_x


def _dw(d_logits_in: Any, x: Any, weight: Any, mode: dict[str, Any]) -> Any:
    tokens, dim = shape_of(x)
    experts = shape_of(weight)[0]
    c = _tiles(_router_dw, "dw", experts)
    grid = (triton.cdiv(experts, c["BM"]), triton.cdiv(dim, c["BN"]))
    splits = _splits(grid[0] * grid[1], tokens, c["BK"], _router_dw)
    per_split = max(1, triton.cdiv(triton.cdiv(tokens, splits), c["BK"])) * c["BK"]
    splits = max(1, triton.cdiv(tokens, per_split))  # no tokens: one split of an empty run writes the zeros
    d_w = empty_like(weight)
    part = d_w if splits == 1 else empty_like(weight, shape=[splits, experts, dim])
    launch(_router_dw, (*grid, splits), d_logits_in, detached(x), part, tokens, experts, D=dim,
           TOKENS_PER_SPLIT=per_split, BM=c["BM"], BN=c["BN"], BK=c["BK"], STAGES=c["stages"], num_warps=c["warps"],
           **mode)
    if splits > 1:
        launch(_sum_splits, (triton.cdiv(experts * dim, 1024),), part, d_w, splits, experts * dim, BLOCK=1024,
               num_warps=4)
    return d_w
