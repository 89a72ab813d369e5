"""Triton partial interleaved RoPE: forward, inverse, its gradient, in place, and the trailing-channel slice.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this
module imports neither Paddle nor torch. The arithmetic is the reference's (``reference.py``) op for op,
so the result is bitwise equal to eager:

- load in the tensor dtype, convert to fp32 (exact for bf16/fp16; fp64 rounds to fp32 as the reference's
  ``astype`` does), ``sin`` negated for the inverse (exact);
- ``even*cos - odd*sin`` and ``odd*cos + even*sin`` with each product rounded to fp32 on its own. On a
  GPU the compiler would contract ``a*b - c*d`` into an FMA (one rounding fewer than eager's separate
  multiply and subtract kernels), so there every product, sum and difference is an inline-PTX
  ``mul.rn`` / ``sub.rn`` / ``add.rn`` (explicit rounding modifiers are never contracted, never
  flushed); the interpreter (numpy, one rounding per op) uses plain operators — a constexpr picks;
- the store narrows fp32 -> bf16/fp16 round-to-nearest-even, as eager's cast does (NaN payloads aside:
  PTX ``cvt.rn`` returns the canonical NaN);
- the gradient is the opposite rotation, plus autograd's accumulation of the sliced gradients into
  zeros: ``g + 0.0`` turns a ``-0.0`` into ``+0.0`` on every channel (pass-through ones included), which
  is what Paddle's slice/concat backward produces (``rope_grad``).

Layout: ``x`` is [b, s, h, d] or [b, s, d] with any strides; ``cos``/``sin`` are fp32 [s, rd/2] or
[b|1, s, rd/2]; the rotated channels are the trailing ``rd = 2 * cos.shape[-1]`` ones, pairs (2i, 2i+1)
of that slice. One program handles a block of consecutive (batch, position, head) vectors; on a GPU, for a small
input, one block of their pass-through channels or their rotation (a second grid axis), so that no program walks
the pass-through in dependent steps (the launch is latency-bound there, not bandwidth-bound). The bits do not
depend on the tiling: every element is computed by the same operations whichever program holds it.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import (
    Plan,
    contiguous_strides,
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
from fleet_ext.ops.multiprocessors import H200_SMS, multiprocessor_count
from fleet_ext.ops.rounding import _add_rn, _mul_rn, _plus_zero, _sub_rn
from fleet_ext.ops.strides import uniform_row_step

_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


@triton.jit
def _split_heads(m, H, HEADS_LOG2: tl.constexpr):
    """``(m // H, m % H)`` of the flat (batch, position, head) index: a shift and a mask when H = 2**HEADS_LOG2
    (HEADS_LOG2 >= 0; a run-time division takes ~20 dependent instructions before the table loads)."""
    if HEADS_LOG2 >= 0:
        row = m >> HEADS_LOG2
        head = m & ((1 << HEADS_LOG2) - 1)
    else:
        row = m // H
        head = m - row * H
    return row, head


@triton.jit
def _copy_step(x_vec, o_vec, m_mask, n0, x_sd, o_sd, NOPE: tl.constexpr, SHIFT: tl.constexpr,
               BLOCK_N: tl.constexpr, ZERO_FIX: tl.constexpr, USE_PTX: tl.constexpr):
    """Pass-through channels ``n0 .. n0 + BLOCK_N`` (below NOPE) of each vector, copied to ``n - SHIFT``."""
    n = n0 + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (n < NOPE)[None, :]
    v = tl.load(x_vec + n[None, :] * x_sd, mask=mask)
    if ZERO_FIX:
        v = _plus_zero(v, USE_PTX)  # exact, so the plain narrowing below is too
    tl.store(o_vec + (n - SHIFT)[None, :] * o_sd, v.to(o_vec.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(
    x_vec, o_vec, cos_ptr, sin_ptr, m, m_mask, S, H, x_sd, o_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk,
    NOPE: tl.constexpr, SHIFT: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    INVERSE: tl.constexpr, ZERO_FIX: tl.constexpr, DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr,
    ONE_BATCH: tl.constexpr, HEADS_LOG2: tl.constexpr,
):
    """The trailing 2 * HALF channels of each vector, rotated by its position's cos/sin, stored at NOPE - SHIFT on.

    The vector's own loads do not wait for the table's index (a shift or a division, one more without ONE_BATCH)."""
    ch = tl.arange(0, 2 * BLOCK_K)
    mask = m_mask[:, None] & (ch < 2 * HALF)[None, :]
    pairs = tl.load(x_vec + (NOPE + ch)[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
    row, _ = _split_heads(m, H, HEADS_LOG2)
    if ONE_BATCH:  # b = 0: the position is the row
        b = row * 0
        s = row
    else:
        b = row // S
        s = row - b * S
    k = tl.arange(0, BLOCK_K)
    k_mask = m_mask[:, None] & (k < HALF)[None, :]
    cos = tl.load(cos_ptr + (b * c_sb + s * c_ss)[:, None] + (k * c_sk)[None, :], mask=k_mask, other=0.0)
    sin = tl.load(sin_ptr + (b * n_sb + s * n_ss)[:, None] + (k * n_sk)[None, :], mask=k_mask, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    if INVERSE:
        sin = -sin
    even, odd = tl.split(tl.reshape(pairs, (BLOCK_M, BLOCK_K, 2)))
    rot_even = _sub_rn(_mul_rn(even, cos, USE_PTX), _mul_rn(odd, sin, USE_PTX), USE_PTX)
    rot_odd = _add_rn(_mul_rn(odd, cos, USE_PTX), _mul_rn(even, sin, USE_PTX), USE_PTX)
    rotated = tl.reshape(tl.join(rot_even, rot_odd), (BLOCK_M, 2 * BLOCK_K))
    out_dtype = o_vec.dtype.element_ty
    if DOWNCAST:  # fp32 -> bf16/fp16 round to nearest even, as eager's cast
        rotated = rotated.to(out_dtype, fp_downcast_rounding="rtne")
    else:
        rotated = rotated.to(out_dtype)
    if ZERO_FIX:  # after the narrowing: a tiny negative may round to -0.0 in bf16, which autograd's add fixes
        rotated = _plus_zero(rotated, USE_PTX).to(out_dtype)
    tl.store(o_vec + (NOPE - SHIFT + ch)[None, :] * o_sd, rotated, mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr,
    TOTAL, S, H,
    x_sb, x_ss, x_sh, x_sd,
    o_sb, o_ss, o_sh, o_sd,
    c_sb, c_ss, c_sk,
    n_sb, n_ss, n_sk,
    COPY_START: tl.constexpr, NOPE: tl.constexpr, SHIFT: tl.constexpr,
    HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    INVERSE: tl.constexpr, ZERO_FIX: tl.constexpr, DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr,
    SPLIT: tl.constexpr, FLAT: tl.constexpr, WIDE: tl.constexpr, ONE_BATCH: tl.constexpr, HEADS_LOG2: tl.constexpr,
):
    """out[..., c - SHIFT] = x[..., c] for c in [COPY_START, NOPE); rotated x[..., NOPE:] at NOPE - SHIFT on.

    Each program takes BLOCK_M consecutive (batch, position, head) vectors of the flattened index space: all
    their channels, or (SPLIT, small inputs) one BLOCK_N block of pass-through channels each along grid axis 1
    and the rotation for the last index, so no program walks a chain of dependent copy steps. FLAT: x's and
    out's vectors are uniformly strided (x_sh / o_sh hold the step), no index division for them. Index
    arithmetic in int32 unless WIDE (an offset may pass 2**31). Every element's value is computed the same way
    whatever the tiling.
    """
    if WIDE:
        m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < TOTAL
    if FLAT:
        x_vec = x_ptr + (m * x_sh)[:, None]
        o_vec = out_ptr + (m * o_sh)[:, None]
    else:
        row, head = _split_heads(m, H, HEADS_LOG2)
        b = row // S
        s = row - b * S
        x_vec = x_ptr + (b * x_sb + s * x_ss + head * x_sh)[:, None]
        o_vec = out_ptr + (b * o_sb + s * o_ss + head * o_sh)[:, None]
    if SPLIT:
        part = tl.program_id(1)
        if part * BLOCK_N < NOPE - COPY_START:  # a pass-through block
            _copy_step(x_vec, o_vec, m_mask, COPY_START + part * BLOCK_N, x_sd, o_sd, NOPE, SHIFT, BLOCK_N,
                       ZERO_FIX, USE_PTX)
        else:  # the last index along axis 1: the rotation
            _rotate(x_vec, o_vec, cos_ptr, sin_ptr, m, m_mask, S, H, x_sd, o_sd, c_sb, c_ss, c_sk, n_sb, n_ss,
                    n_sk, NOPE, SHIFT, HALF, BLOCK_M, BLOCK_K, INVERSE, ZERO_FIX, DOWNCAST, USE_PTX, ONE_BATCH,
                    HEADS_LOG2)
    else:
        # Pass-through channels (an out-of-place copy; empty range in place and for the bare pe slice).
        for n0 in range(COPY_START, NOPE, BLOCK_N):
            _copy_step(x_vec, o_vec, m_mask, n0, x_sd, o_sd, NOPE, SHIFT, BLOCK_N, ZERO_FIX, USE_PTX)
        _rotate(x_vec, o_vec, cos_ptr, sin_ptr, m, m_mask, S, H, x_sd, o_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk,
                NOPE, SHIFT, HALF, BLOCK_M, BLOCK_K, INVERSE, ZERO_FIX, DOWNCAST, USE_PTX, ONE_BATCH, HEADS_LOG2)


# The interpreter runs numpy (one rounding per op, no contraction, no inline asm); a compiled kernel
# takes the PTX route. Decided by how Triton built the kernel, i.e. by TRITON_INTERPRET at import.
USE_PTX = type(_rope_kernel).__name__ != "InterpretedFunction"


def check_args(x: Any, cos: Any, sin: Any, fn: str = "apply_partial_rope") -> int:
    """The reference's validation (same messages: shapes print as the framework prints them), plus dtype limits.

    Returns rd/2.
    """
    if x.ndim not in (3, 4):
        raise ValueError(f"{fn}: `x` must be [b, s, h, d] or [b, s, d], got shape {x.shape}")
    if cos.ndim not in (2, 3) or (cos.ndim == 3 and cos.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"{fn}: `cos` must be [s, rd/2] or [b, s, rd/2] with b={x.shape[0]}, "
                         f"got shape {cos.shape}")
    half = int(cos.shape[-1])
    rope_dim = 2 * half
    if x.shape[-1] < rope_dim:
        raise ValueError(f"{fn}: `x` last dim {x.shape[-1]} is smaller than the rope width {rope_dim}")
    if shape_of(cos) != shape_of(sin):
        raise ValueError(f"{fn}: `cos` {cos.shape} and `sin` {sin.shape} differ")
    if x.shape[1] != cos.shape[-2]:
        raise ValueError(f"{fn}: `x` has {x.shape[1]} positions, `cos` has {cos.shape[-2]}")
    if dtype_name(x) not in _FLOAT_DTYPES:
        raise ValueError(f"{fn}: `x` must be a floating tensor ({', '.join(_FLOAT_DTYPES)}), got {dtype_name(x)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if dtype_name(table) != "float32":
            raise ValueError(f"{fn}: `{name}` must be float32 (the rotation runs in fp32), got {dtype_name(table)}")
    return half


def _geometry(t: Any) -> tuple[int, int, int, int, list[int]]:
    """(b, s, h, d, [sb, ss, sh, sd]) with h = 1 for [b, s, d]."""
    shape, strides = shape_of(t), strides_of(t)
    if len(shape) == 4:
        return shape[0], shape[1], shape[2], shape[3], strides
    return shape[0], shape[1], 1, shape[2], [strides[0], strides[1], 0, strides[2]]


def _table_strides(table: Any, batch: int) -> list[int]:
    strides = strides_of(table)
    if table.ndim == 2:
        return [0, strides[0], strides[1]]
    return [strides[0] if table.shape[0] == batch and batch > 1 else 0, strides[1], strides[2]]


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


# Small inputs (fewer than ~4 programs per SM at the smallest row block): each program copies one BLOCK_N block of
# the pass-through channels or rotates, along a second grid axis, instead of walking the pass-through in dependent
# copy steps before the rotation (q [1, 4, 8, 512], pe 64: 7 steps; benchmarks/RESULTS.md, "Tiny shapes against
# torch.compile"). The benchmark turns it off (then ``launch.clear_plans()``) to time both.
TINY_SPLIT = True
_WAVES = 4  # programs per SM (multiprocessors.multiprocessor_count; the H200's count in the interpreter)
TUNE: dict = {}  # the benchmark's sweep of the split launch: "split_rows" (BLOCK_M), "split_warps"


@functools.lru_cache(maxsize=1024)
def _plan(total: int, d: int, half: int, copy_start: int, use_ptx: bool, split: bool = True) -> dict[str, int]:
    """Block sizes for one launch (constexpr meta-parameters); cached, so callers copy it (``**``), never edit it.

    ``NCOPY``: the pass-through blocks when SPLIT (the grid's second axis is NCOPY + 1), else 0."""
    nope = d - 2 * half
    copy_width = nope - copy_start
    block_k = _pow2(half)
    block_n = min(128, _pow2(copy_width))
    while block_n > 32 and copy_width % block_n:  # a block that tiles the pass-through exactly (448 -> 64)
        block_n //= 2
    if copy_width % block_n:
        block_n = min(128, _pow2(copy_width))
    few = _WAVES * multiprocessor_count(_rope_kernel, H200_SMS)
    if use_ptx:
        # GPU: ~4096 elements per loop iteration (16-byte accesses for 4 warps), a few waves of programs.
        width = max(2 * block_k, block_n if copy_width > 0 else 1)
        block_m = _pow2_floor(4096 // width)
        while block_m > 8 and triton.cdiv(total, block_m) < few:
            block_m //= 2
    else:
        # Interpreter: numpy pays per op, not per element, so take big tiles.
        block_m = _pow2_floor((1 << 17) // (2 * block_k + (_pow2(copy_width) if copy_width > 0 else 0)))
    block_m = min(block_m, _pow2(total))
    split = split and use_ptx and copy_width > 0 and triton.cdiv(total, block_m) < few
    return {"BLOCK_M": block_m, "BLOCK_K": block_k, "BLOCK_N": block_n, "SPLIT": split,
            "NCOPY": triton.cdiv(copy_width, block_n) if split else 0}


def _extent(shape: list[int], strides: list[int], rows: int) -> int:
    """The largest element offset of a tensor, plus ``rows`` rows (masked lanes past the end still form offsets)."""
    return sum((max(n, 1) - 1 + rows) * abs(st) for n, st in zip(shape, strides))


# One plan per (x, cos, sin layouts, entry point, start, inverse): the checks, the geometry and the block sizes
# run once per key (``fleet_ext.ops.launch``: host cost); a repeat call looks the plan up, allocates and launches.
_PLANS = plan_cache("rope")
_ROPE, _GRAD, _IN_PLACE, _TAIL = "apply_partial_rope", "apply_partial_rope (backward)", "apply_partial_rope_", \
    "rope_tail"


def _prepare(key: tuple, x: Any, cos: Any, sin: Any, fn: str, start: int, inverse: bool) -> Plan:
    """Validate (the same checks and messages as an uncached call) and plan one launch; cached under ``key``.

    ``fn`` picks the variant: out of place, its gradient (opposite rotation, -0.0 -> +0.0), in place, or the
    trailing channels from ``start`` on. ``info`` of the plan: the output's shape (None: in place)."""
    half = check_args(x, cos, sin, fn)
    b, s, h, d, x_strides = _geometry(x)
    nope = d - 2 * half
    if fn == _TAIL and not 0 <= start <= nope:
        raise ValueError(f"rope_tail: `start` must be in [0, {nope}] (the pass-through width), got {start}")
    copy_start = nope if fn == _IN_PLACE else start
    shift = start if fn == _TAIL else 0
    out_shape = None if fn == _IN_PLACE else shape_of(x)[:-1] + [d - shift]
    o_strides = x_strides if out_shape is None else contiguous_strides(out_shape)
    if len(o_strides) == 3:
        o_strides = [o_strides[0], o_strides[1], 0, o_strides[2]]
    total = b * s * h
    if total == 0:
        return _PLANS.add(key, Plan(None, info=out_shape))
    blocks = dict(_plan(total, d, half, copy_start, USE_PTX, TINY_SPLIT))
    warps = 4
    if blocks["SPLIT"] and TUNE:
        blocks["BLOCK_M"] = min(int(TUNE.get("split_rows", blocks["BLOCK_M"])), _pow2(total))
        warps = int(TUNE.get("split_warps", warps))
    grid = (triton.cdiv(total, blocks["BLOCK_M"]), blocks.pop("NCOPY") + 1)
    x_step, o_step = uniform_row_step([b, s, h, d], x_strides), uniform_row_step([b, s, h, d], o_strides)
    flat = x_step is not None and o_step is not None
    tables = _table_strides(cos, b), _table_strides(sin, b)
    rows = blocks["BLOCK_M"]
    wide = max(_extent([b, s, h, d], x_strides, rows), _extent([b, s, h, d - shift], o_strides, rows),
               *(_extent([b, s, half], t, rows) for t in tables), total + rows) >= 2**31
    meta = dict(COPY_START=copy_start, NOPE=nope, SHIFT=shift, HALF=half, **blocks,
                INVERSE=bool(inverse) != (fn == _GRAD), ZERO_FIX=fn == _GRAD,
                DOWNCAST=dtype_name(x) in ("bfloat16", "float16"), USE_PTX=USE_PTX, FLAT=flat, WIDE=wide,
                ONE_BATCH=b == 1, HEADS_LOG2=h.bit_length() - 1 if h & (h - 1) == 0 else -1, num_warps=warps)
    if flat:  # the row step rides in the head-stride slot
        x_strides, o_strides = x_strides[:2] + [x_step, x_strides[3]], o_strides[:2] + [o_step, o_strides[3]]
    scalars = (total, s, h, *x_strides, *o_strides, *tables[0], *tables[1])
    standard = shift == 0 and out_shape is not None and is_standard(x)  # the output takes x's shape and strides
    return _PLANS.add(key, Plan(grid, scalars, meta, out_shape, standard))


def _planned(x: Any, cos: Any, sin: Any, fn: str, start: int, inverse: bool) -> Plan:
    key = (layout_key(x), layout_key(cos), layout_key(sin), fn, start, bool(inverse))
    return _PLANS.get(key) or _prepare(key, x, cos, sin, fn, start, inverse)


def _run(plan: Plan, x: Any, out: Any, cos: Any, sin: Any) -> None:
    fire(_rope_kernel, plan, x, out, cos, sin)


def check_cached(x: Any, cos: Any, sin: Any, fn: str = _ROPE) -> None:
    """:func:`check_args` at the cost of a plan lookup once these layouts passed (the Paddle wrappers' pre-check)."""
    if fn in (_ROPE, _GRAD, _IN_PLACE):
        _planned(x, cos, sin, fn, 0, False)
    else:
        check_args(x, cos, sin, fn)


def rope(x: Any, cos: Any, sin: Any, inverse: bool = False) -> Any:
    """Out of place: a new contiguous tensor like ``x`` with its trailing rd channels rotated."""
    plan = _planned(x, cos, sin, _ROPE, 0, inverse)
    out = empty_same(x, plan.standard)
    _run(plan, x, out, cos, sin)
    return out


def rope_grad(grad: Any, cos: Any, sin: Any, inverse: bool = False) -> Any:
    """The gradient of :func:`rope` (``inverse`` as in the forward): the opposite rotation, -0.0 -> +0.0."""
    plan = _planned(grad, cos, sin, _GRAD, 0, inverse)
    out = empty_same(grad, plan.standard)
    _run(plan, grad, out, cos, sin)
    return out


def rope_(x: Any, cos: Any, sin: Any, inverse: bool = False) -> Any:
    """In place: rotates only the trailing rd channels of ``x`` (any strides); returns ``x``."""
    _run(_planned(x, cos, sin, _IN_PLACE, 0, inverse), x, x, cos, sin)
    return x


def rope_tail(x: Any, cos: Any, sin: Any, start: int, inverse: bool = False) -> Any:
    """A new contiguous ``[..., d - start]`` tensor: channels ``start:`` of ``x`` with the rope ones rotated.

    ``start`` is at most ``d - rd``; channels ``start .. d - rd`` are copied as they are. With
    ``start = d - rd`` it is the bare rotated pe slice; it never materialises the full width unless
    ``start == 0``.
    """
    plan = _planned(x, cos, sin, _TAIL, int(start), inverse)
    out = empty_like(x, plan.info)
    _run(plan, x, out, cos, sin)
    return out
