"""Triton attention-sink gradient: ``d_sink[h] = sum_{b,t} exp(sink_h - lse) * (d_lse - rowsum(dO * O))``.

Framework-agnostic host launcher (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this
module imports neither Paddle nor torch. See ``reference.py`` for the maths.

**Deterministic, no atomics.** Stage 1 (``_sink_grad_partial_kernel``): program ``(i, j)`` owns tokens
``[i*TOK, (i+1)*TOK)`` of the flattened ``B*S`` axis and heads block ``j``; ``BLOCK_T`` tokens at a time
(one on a GPU) it forms ``Delta`` over ``d`` in fp32 and adds ``p_sink * (d_lse - Delta)`` to per-(token
slot, head) fp32 accumulators, which it sums over the slots and writes to ``partials[i, heads]``. A small input
on a GPU takes all its tokens in one step and adds them in token order (``IN_ORDER``: the bits of one token a
step, one round of loads instead of one per token; :func:`config`). Stage 2
(``_sink_grad_reduce_kernel``) sums the partials of every head over ``i`` in a fixed blocked order. The
same inputs and shapes give byte-identical ``d_sink`` run after run. It is not bitwise equal to autograd
of the reference (a different summation order): fp32 rounding differences only.

Streaming: ``dO`` and ``O`` ([B, S, H, d], any strides, any float dtype, widened to fp32 in registers) are
read once; a token's [BLOCK_H, BLOCK_D] tiles are 16-byte vector loads when ``d`` is the contiguous axis.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import (
    Plan,
    dtype_name,
    empty_like,
    empty_same,
    fire,
    is_standard,
    layout_key,
    plan_cache,
    shape_of,
    strides_of,
)

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@triton.jit
def _terms(
    do_ptr, o_ptr, lse_ptr, dlse_ptr, sink, tt, hh, T, S, H,
    do_sb, do_ss, do_sh, do_sd, o_sb, o_ss, o_sh, o_sd, l_sb, l_ss, l_sh, dl_sb, dl_ss, dl_sh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DO: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """``p_sink * (d_lse - rowsum(dO * O))`` of tokens ``tt`` and heads ``hh`` (broadcast against each other: a
    [tokens, heads] or [heads, tokens] tile; ``sink`` broadcast like ``hh``), 0 outside the tensors."""
    b = tt // S
    s = tt - b * S
    mask = (tt < T) & (hh < H)
    lse = tl.load(lse_ptr + (b * l_sb + s * l_ss) + hh * l_sh, mask=mask, other=0.0)
    p_sink = tl.exp(sink - lse)
    weight = tl.full(lse.shape, 0.0, tl.float32)
    if HAS_DO:
        do_row = do_ptr + ((b * do_sb + s * do_ss) + hh * do_sh)[:, :, None]
        o_row = o_ptr + ((b * o_sb + s * o_ss) + hh * o_sh)[:, :, None]
        prod = tl.full([lse.shape[0], lse.shape[1], BLOCK_D], 0.0, tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            m3 = mask[:, :, None] & (cols < D)[None, None, :]
            do = tl.load(do_row + cols[None, None, :] * do_sd, mask=m3, other=0.0).to(tl.float32)
            o = tl.load(o_row + cols[None, None, :] * o_sd, mask=m3, other=0.0).to(tl.float32)
            prod += do * o
        weight -= tl.sum(prod, axis=2)
    if HAS_DLSE:
        weight += tl.load(dlse_ptr + (b * dl_sb + s * dl_ss) + hh * dl_sh, mask=mask, other=0.0)
    return tl.where(mask, p_sink * weight, 0.0)


@triton.jit
def _sink_grad_partial_kernel(
    do_ptr, o_ptr, lse_ptr, dlse_ptr, sink_ptr, part_ptr,
    T, S, H,
    do_sb, do_ss, do_sh, do_sd,
    o_sb, o_ss, o_sh, o_sd,
    l_sb, l_ss, l_sh,
    dl_sb, dl_ss, dl_sh,
    D: tl.constexpr, TOK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_DO: tl.constexpr, HAS_DLSE: tl.constexpr, IN_ORDER: tl.constexpr = False,
):
    """partials[i, h] = sum over tokens [i*TOK, (i+1)*TOK) of p_sink * (d_lse - rowsum(dO * O)), in fixed order.

    IN_ORDER (a small input: all its tokens in one step): the tile is [heads, tokens, d] (the warps go to the
    heads, a thread holds every token of its heads) and the BLOCK_T tokens are added to one accumulator one
    after the other, as BLOCK_T steps of one token would, over the same d reductions: the same bits."""
    pid_t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sink = tl.load(sink_ptr + heads, mask=heads < H, other=0.0)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    ordered = tl.zeros([BLOCK_H], dtype=tl.float32)
    for t0 in range(0, TOK, BLOCK_T):
        t = pid_t.to(tl.int64) * TOK + t0 + tl.arange(0, BLOCK_T)
        if IN_ORDER:
            terms = _terms(do_ptr, o_ptr, lse_ptr, dlse_ptr, sink[:, None], t[None, :], heads[:, None], T, S, H,
                           do_sb, do_ss, do_sh, do_sd, o_sb, o_ss, o_sh, o_sd, l_sb, l_ss, l_sh, dl_sb, dl_ss, dl_sh,
                           D, BLOCK_D, HAS_DO, HAS_DLSE)
            slot = tl.arange(0, BLOCK_T)[None, :]
            for i in tl.static_range(BLOCK_T):  # token i alone in its row of zeros: an exact extraction
                ordered = ordered + tl.sum(tl.where(slot == i, terms, 0.0), axis=1)
        else:
            acc += _terms(do_ptr, o_ptr, lse_ptr, dlse_ptr, sink[None, :], t[:, None], heads[None, :], T, S, H,
                          do_sb, do_ss, do_sh, do_sd, o_sb, o_ss, o_sh, o_sd, l_sb, l_ss, l_sh, dl_sb, dl_ss, dl_sh,
                          D, BLOCK_D, HAS_DO, HAS_DLSE)
    if IN_ORDER:
        # a -0.0 term comes out of its row as +0.0; the accumulator starts at +0.0 and so is never -0.0, and
        # adding +0.0 or -0.0 to it gives the same bits
        total = ordered
    else:
        total = tl.sum(acc, axis=0)
    tl.store(part_ptr + pid_t.to(tl.int64) * H + heads, total, mask=heads < H)


@triton.jit
def _sink_grad_reduce_kernel(part_ptr, out_ptr, H, P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[h] = sum_i partials[i, h], i in blocks of BLOCK_P (P constexpr: the interpreter needs static loop bounds)."""
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    acc = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        m = (rows < P)[:, None] & h_mask[None, :]
        acc += tl.load(part_ptr + rows[:, None].to(tl.int64) * H + heads[None, :], mask=m, other=0.0)
    tl.store(out_ptr + heads, tl.sum(acc, axis=0), mask=h_mask)


def is_interpreted() -> bool:
    return type(_sink_grad_partial_kernel).__name__ == "InterpretedFunction"


def check_args(d_out: Any, out: Any, lse: Any, sink: Any, d_lse: Any = None, fn: str = "sink_grad") -> None:
    """Shapes and dtypes; errors name the tensor."""
    ref = lse if out is None else out
    if out is not None:
        if out.ndim != 4 or dtype_name(out) not in FLOAT_DTYPES:
            raise ValueError(f"{fn}: `out` must be [B, S, H, d] float, got {dtype_name(out)} {shape_of(out)}")
        if d_out is None or shape_of(d_out) != shape_of(out) or dtype_name(d_out) not in FLOAT_DTYPES:
            got = "None" if d_out is None else f"{dtype_name(d_out)} {shape_of(d_out)}"
            raise ValueError(f"{fn}: `d_out` must be float with out's shape {shape_of(out)}, got {got}")
        bsh = shape_of(out)[:3]
    else:
        if lse is None or lse.ndim != 3:
            raise ValueError(f"{fn}: `lse` must be fp32 [B, S, H], got {None if lse is None else shape_of(lse)}")
        bsh = shape_of(ref)
    if shape_of(lse) != bsh or dtype_name(lse) != "float32":
        raise ValueError(f"{fn}: `lse` must be float32 {bsh}, got {dtype_name(lse)} {shape_of(lse)}")
    if shape_of(sink) != [bsh[2]] or dtype_name(sink) != "float32":
        raise ValueError(f"{fn}: `sink` must be float32 [{bsh[2]}], got {dtype_name(sink)} {shape_of(sink)}")
    if d_lse is not None and (shape_of(d_lse) != bsh or dtype_name(d_lse) != "float32"):
        raise ValueError(f"{fn}: `d_lse` must be float32 {bsh}, got {dtype_name(d_lse)} {shape_of(d_lse)}")


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def config(tokens: int, heads: int, dim: int) -> dict:
    """Fixed launch configuration (no autotuning)."""
    if is_interpreted():  # numpy per op: few programs, one step per program
        block_t = min(64, _pow2(tokens))
        return dict(TOK=block_t, BLOCK_T=block_t, BLOCK_H=_pow2(heads), BLOCK_D=_pow2(dim), num_warps=4)
    block_h = min(64, _pow2(heads))
    # one token per step, 8192 elements (16 KiB of bf16) per operand per d step: 32 per thread at 8 warps,
    # i.e. 4 x 16-byte loads per operand in flight; 16 tokens per program (1024 programs at 16384 tokens), fewer
    # when there are fewer tokens: the steps past the last token only add +0.0 (the same bits), but each is a
    # dependent round of loads (4 tokens: 10.5 us for 16 steps on the H200, benchmarks/RESULTS.md)
    block_d = min(_pow2(dim), max(16, 8192 // block_h))
    tok = min(16, _pow2(tokens))
    warps = 8
    if TINY_SPLIT_HEADS and tokens <= tok and heads > 1 and tok * _pow2(dim) <= TINY_ELEMENTS:
        # one token block: one program per head instead of one for all (a single program is issue-bound on one
        # SM), the warps cut so that a thread still holds 8 elements of a one-token d row (the layout condition
        # below)
        block_h, block_d = 1, _pow2(dim)
        warps = max(1, min(8, block_d // (8 * 32)))
    if TINY_ONE_STEP and tokens <= tok and tok * block_h * block_d <= TINY_ELEMENTS \
            and block_h * block_d >= 8 * 32 * warps:
        # a small input (one token block, at most TINY_ELEMENTS per operand): every token in one step, one round
        # of loads and one cross-warp reduction instead of one per token, the tokens still added in order
        # (IN_ORDER) to the same d reductions, so the same bits. The same d reductions need the same layout of
        # d: a one-token tile of at least 8 elements a thread (the widest vector, 8 x 16 bits) gets the layout
        # Triton gives the larger tile (smaller ones spread d over more threads, another summation tree).
        return dict(TOK=tok, BLOCK_T=tok, BLOCK_H=block_h, BLOCK_D=block_d, IN_ORDER=True, num_warps=warps)
    return dict(TOK=tok, BLOCK_T=1, BLOCK_H=block_h, BLOCK_D=block_d, IN_ORDER=False, num_warps=warps)


# Small inputs take one step for all their tokens (q [1, 4, 8, 512]: 4 steps of one token before, ~0.5 us each on
# the H200; benchmarks/RESULTS.md, "Tiny shapes against torch.compile"): 64 elements per thread and operand at
# 8 warps. The benchmark turns it off (then ``launch.clear_plans()``) to time both.
TINY_ONE_STEP = True
TINY_ELEMENTS = 16384
# Small inputs (one token block) also take one program per head (q [1, 4, 8, 512]: 8 programs of 2 warps instead
# of one of 8 warps). The benchmark turns it off to time both.
TINY_SPLIT_HEADS = True


# One plan pair (partials launch, reduce launch; no reduce for a single token block) per layouts of the arguments:
# the checks and the configuration run once per key (``fleet_ext.ops.launch``: host cost); a repeat call allocates
# its buffers and launches.
_PLANS = plan_cache("sink_grad")


def _key(t: Any) -> Any:
    return None if t is None else layout_key(t)


def _prepare(key: tuple, d_out: Any, out: Any, lse: Any, sink: Any, d_lse: Any) -> Plan:
    """Check (same messages), configure both launches. ``info``: (partials shape, the reduce's plan)."""
    check_args(d_out, out, lse, sink, d_lse)
    batch, seq, heads = shape_of(lse)
    dim = shape_of(out)[3] if out is not None else 1
    tokens = batch * seq
    cfg = config(tokens, heads, dim)
    n_part = max(1, triton.cdiv(tokens, cfg["TOK"]))
    if heads == 0:
        return _PLANS.add(key, Plan(None, info=((n_part, heads), None)))
    has_do = out is not None
    do_s = strides_of(d_out) if has_do else [0, 0, 0, 0]
    o_s = strides_of(out) if has_do else [0, 0, 0, 0]
    dl_s = strides_of(d_lse) if d_lse is not None else [0, 0, 0]
    meta = dict(D=dim, TOK=cfg["TOK"], BLOCK_T=cfg["BLOCK_T"], BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"],
                HAS_DO=has_do, HAS_DLSE=d_lse is not None, IN_ORDER=cfg.get("IN_ORDER", False),
                num_warps=cfg["num_warps"])
    partial = Plan((n_part, triton.cdiv(heads, cfg["BLOCK_H"])),
                   (tokens, seq, heads, *do_s, *o_s, *strides_of(lse), *dl_s), meta, standard=is_standard(sink))
    partial.info = ((n_part, heads), _prepare_reduce(n_part, heads) if n_part > 1 else None)
    return _PLANS.add(key, partial)


def _prepare_reduce(n_part: int, heads: int) -> Plan:
    """The fixed-order sum of ``n_part`` partial rows of ``heads`` values."""
    block_h = min(64, _pow2(heads))
    block_p = max(1, min(_pow2(n_part), 4096 // block_h))
    return Plan((triton.cdiv(heads, block_h),), (heads,), dict(P=n_part, BLOCK_P=block_p, BLOCK_H=block_h,
                                                               num_warps=4))


def sink_grad(d_out: Any, out: Any, lse: Any, sink: Any, d_lse: Any = None) -> Any:
    """``d_sink`` fp32 [H] (a new tensor like ``sink``); ``d_out``/``out`` may be None when only ``d_lse`` flows."""
    key = (_key(d_out), _key(out), _key(lse), _key(sink), _key(d_lse), is_interpreted())
    plan = _PLANS.get(key) or _prepare(key, d_out, out, lse, sink, d_lse)
    part_shape, reduce = plan.info
    d_sink = empty_same(sink, plan.standard)
    if plan.grid is None:
        return d_sink
    # one token block: its partial row is d_sink itself (the reduce would add +0.0 to it: the same bits, as a
    # partial is never -0.0, its accumulator starting at +0.0), so one launch and one buffer
    partials = d_sink if reduce is None else empty_like(sink, shape=part_shape)
    has_do = out is not None
    do_t, o_t = (d_out, out) if has_do else (lse, lse)  # placeholders, never read
    dl_t = d_lse if d_lse is not None else lse
    fire(_sink_grad_partial_kernel, plan, do_t, o_t, lse, dl_t, sink, partials)
    if reduce is not None:
        fire(_sink_grad_reduce_kernel, reduce, partials, d_sink)
    return d_sink
