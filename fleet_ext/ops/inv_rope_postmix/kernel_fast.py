"""The fast mode of inverse RoPE + ungrouped VHA postmix: one pass forward, one pass backward, deterministic.

``inv_rope_postmix_mode: fast`` (``fleet_ext.registry.FUSION_MODES``). Not bitwise equal to the reference
(the GEMMs are Triton's, summed in another order than the library GEMM), within a documented tolerance and
byte-identical run to run. Per token ``t`` the op is a [h, h] x [h, d] product on the token's contiguous
[h, d] block, so every kernel reads ``[t, h, d]`` tiles as they lie in memory (no head-major transposes):

- forward: ``Y[t] = M . Xr[t]``, ``Xr`` = ``O`` with its pe channels inverse-rotated in registers as the
  tile is loaded (the rotation is the RoPE kernel's, op for op, and is rounded to the tensor dtype as the
  reference's rotated tensor is, so the MMA sees the reference's operands). Traffic: read O, write Y (2 N);
- backward, one kernel per (row split, channel block): ``dXr[t] = M^T . dY[t]`` with the forward rotation
  applied to the pe channels of the fp32 accumulator before the one rounding to the output dtype, and
  ``dM`` partials ``sum_{t in split, c in block} dY[t, :, c] Xr[t, :, c]^T`` accumulated in fp32 registers
  and written once per program; a second kernel sums the partials in a fixed order. No atomics, and the
  split layout depends on the shape only (never on the device or a tuner), so ``dM`` is byte-identical run
  to run. Traffic: read O and dY, write dO (3 N), plus the [splits, h, h] fp32 partials.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this module
imports neither Paddle nor torch. Rotation helpers and the argument checks are the RoPE kernel's.
"""

from __future__ import annotations

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
from fleet_ext.ops.rope import kernel as rope_kernel
from fleet_ext.ops.rounding import _add_rn, _mul_rn, _sub_rn

FAST_DTYPES = ("float32", "bfloat16", "float16")
MAX_HEADS = 128  # one [h, h] tile of M and of the fp32 dM accumulator per program, in registers


@triton.jit
def _narrow(v, dtype: tl.constexpr, DOWNCAST: tl.constexpr):
    """fp32 -> the tensor dtype, round to nearest even (eager's cast)."""
    if DOWNCAST:
        r = v.to(dtype, fp_downcast_rounding="rtne")
    else:
        r = v.to(dtype)
    return r


@triton.jit
def _rotate_pe(v, cos_row, sin_row, c_sk, n_sk, d0, NOPE: tl.constexpr, HALF: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INVERSE: tl.constexpr, USE_PTX: tl.constexpr):
    """Rotate the pe pairs (channels >= NOPE) of an fp32 [BLOCK_H, BLOCK_D] tile of channels ``d0 ..``.

    The RoPE kernel's arithmetic: each product rounded on its own, ``sin`` negated for the inverse; other
    channels pass through unchanged (selected, not multiplied by 1). ``d0`` and NOPE are even.
    """
    even, odd = tl.split(tl.reshape(v, (BLOCK_H, BLOCK_D // 2, 2)))
    first = d0 + 2 * tl.arange(0, BLOCK_D // 2)  # channel of each pair's even member
    k = (first - NOPE) // 2
    is_pe = (first >= NOPE) & (k < HALF)
    cos = tl.load(cos_row + k * c_sk, mask=is_pe, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(sin_row + k * n_sk, mask=is_pe, other=0.0).to(tl.float32)[None, :]
    if INVERSE:
        sin = -sin
    rot_even = _sub_rn(_mul_rn(even, cos, USE_PTX), _mul_rn(odd, sin, USE_PTX), USE_PTX)
    rot_odd = _add_rn(_mul_rn(odd, cos, USE_PTX), _mul_rn(even, sin, USE_PTX), USE_PTX)
    rot_even = tl.where(is_pe[None, :], rot_even, even)
    rot_odd = tl.where(is_pe[None, :], rot_odd, odd)
    return tl.reshape(tl.join(rot_even, rot_odd), (BLOCK_H, BLOCK_D))


@triton.jit
def _fwd_rows(x_ptr, y_ptr, cos_ptr, sin_ptr, mix, pid_r, d0, hh, tile_ok, TOTAL, S,
              x_sb, x_ss, x_sh, x_sd, y_sb, y_ss, y_sh, y_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk,
              NOPE: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr, DOWNCAST: tl.constexpr,
              ROTATE: tl.constexpr, USE_PTX: tl.constexpr):
    dtype = x_ptr.dtype.element_ty
    cols = d0 + tl.arange(0, BLOCK_D)
    x_off = hh[:, None] * x_sh + cols[None, :] * x_sd
    y_off = hh[:, None] * y_sh + cols[None, :] * y_sd
    for i in tl.range(0, ROWS, num_stages=STAGES):
        r = pid_r.to(tl.int64) * ROWS + i
        mask = tile_ok & (r < TOTAL)
        r = tl.minimum(r, TOTAL - 1)  # a row past the end reads the last row's table entries (in bounds), masked
        b = r // S
        s = r - b * S
        x = tl.load(x_ptr + (b * x_sb + s * x_ss) + x_off, mask=mask, other=0.0)
        if ROTATE:
            x = _narrow(_rotate_pe(x.to(tl.float32), cos_ptr + b * c_sb + s * c_ss, sin_ptr + b * n_sb + s * n_ss,
                                   c_sk, n_sk, d0, NOPE, HALF, BLOCK_H, BLOCK_D, True, USE_PTX), dtype, DOWNCAST)
        acc = tl.dot(mix, x, input_precision=PRECISION)
        tl.store(y_ptr + (b * y_sb + s * y_ss) + y_off, _narrow(acc, dtype, DOWNCAST), mask=mask)


@triton.jit
def _postmix_fast_fwd_kernel(
    x_ptr, m_ptr, y_ptr, cos_ptr, sin_ptr,
    TOTAL, S, H,
    x_sb, x_ss, x_sh, x_sd,
    y_sb, y_ss, y_sh, y_sd,
    m_sr, m_sc,
    c_sb, c_ss, c_sk,
    n_sb, n_ss, n_sk,
    D: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr, DOWNCAST: tl.constexpr,
    MIX_DOWNCAST: tl.constexpr, USE_PTX: tl.constexpr,
):
    """Y[r, :, cols] = M . Xr[r, :, cols] for ROWS rows and one channel block (program ids: rows, block)."""
    pid_r = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    hh = tl.arange(0, BLOCK_H)
    cols = d0 + tl.arange(0, BLOCK_D)
    h_ok = hh < H
    tile_ok = h_ok[:, None] & (cols < D)[None, :]
    mix = tl.load(m_ptr + hh[:, None] * m_sr + hh[None, :] * m_sc, mask=h_ok[:, None] & h_ok[None, :], other=0.0)
    mix = _narrow(mix, x_ptr.dtype.element_ty, MIX_DOWNCAST)  # the reference's mix.astype(out.dtype)
    args = (x_ptr, y_ptr, cos_ptr, sin_ptr, mix, pid_r, d0, hh, tile_ok, TOTAL, S,
            x_sb, x_ss, x_sh, x_sd, y_sb, y_ss, y_sh, y_sd, c_sb, c_ss, c_sk, n_sb, n_ss, n_sk)
    if d0 + BLOCK_D > NOPE:  # the block holds pe channels
        _fwd_rows(*args, NOPE, HALF, ROWS, BLOCK_H, BLOCK_D, STAGES, PRECISION, DOWNCAST, True, USE_PTX)
    else:
        _fwd_rows(*args, NOPE, HALF, ROWS, BLOCK_H, BLOCK_D, STAGES, PRECISION, DOWNCAST, False, USE_PTX)


@triton.jit
def _bwd_rows(x_ptr, g_ptr, dx_ptr, cos_ptr, sin_ptr, mix_t, pid_r, d0, hh, tile_ok, TOTAL, S,
              x_sb, x_ss, x_sh, x_sd, g_sb, g_ss, g_sh, g_sd, dx_sb, dx_ss, dx_sh, dx_sd,
              c_sb, c_ss, c_sk, n_sb, n_ss, n_sk,
              NOPE: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr, DOWNCAST: tl.constexpr,
              NEED_DX: tl.constexpr, NEED_DM: tl.constexpr, ROTATE: tl.constexpr, USE_PTX: tl.constexpr):
    """The row loop of the backward; returns this program's fp32 dM partial [BLOCK_H, BLOCK_H]."""
    dtype = g_ptr.dtype.element_ty
    cols = d0 + tl.arange(0, BLOCK_D)
    x_off = hh[:, None] * x_sh + cols[None, :] * x_sd
    g_off = hh[:, None] * g_sh + cols[None, :] * g_sd
    dx_off = hh[:, None] * dx_sh + cols[None, :] * dx_sd
    acc_dm = tl.zeros([BLOCK_H, BLOCK_H], dtype=tl.float32)
    for i in tl.range(0, ROWS, num_stages=STAGES):
        r = pid_r.to(tl.int64) * ROWS + i
        mask = tile_ok & (r < TOTAL)
        r = tl.minimum(r, TOTAL - 1)  # a row past the end reads the last row's table entries (in bounds), masked
        b = r // S
        s = r - b * S
        cos_row = cos_ptr + b * c_sb + s * c_ss
        sin_row = sin_ptr + b * n_sb + s * n_ss
        g = tl.load(g_ptr + (b * g_sb + s * g_ss) + g_off, mask=mask, other=0.0)
        if NEED_DM:
            x = tl.load(x_ptr + (b * x_sb + s * x_ss) + x_off, mask=mask, other=0.0)
            if ROTATE:
                x = _narrow(_rotate_pe(x.to(tl.float32), cos_row, sin_row, c_sk, n_sk, d0, NOPE, HALF, BLOCK_H,
                                       BLOCK_D, True, USE_PTX), dtype, DOWNCAST)
            acc_dm = tl.dot(g, tl.trans(x), acc_dm, input_precision=PRECISION)
        if NEED_DX:
            dx = tl.dot(mix_t, g, input_precision=PRECISION)
            if ROTATE:  # the RoPE gradient of the inverse rotation: the forward rotation, on the fp32 sums
                dx = _rotate_pe(dx, cos_row, sin_row, c_sk, n_sk, d0, NOPE, HALF, BLOCK_H, BLOCK_D, False, USE_PTX)
            tl.store(dx_ptr + (b * dx_sb + s * dx_ss) + dx_off, _narrow(dx, dtype, DOWNCAST), mask=mask)
    return acc_dm


@triton.jit
def _postmix_fast_bwd_kernel(
    x_ptr, g_ptr, m_ptr, dx_ptr, part_ptr, cos_ptr, sin_ptr,
    TOTAL, S, H,
    x_sb, x_ss, x_sh, x_sd,
    g_sb, g_ss, g_sh, g_sd,
    dx_sb, dx_ss, dx_sh, dx_sd,
    m_sr, m_sc,
    c_sb, c_ss, c_sk,
    n_sb, n_ss, n_sk,
    D: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr, DOWNCAST: tl.constexpr,
    MIX_DOWNCAST: tl.constexpr, NEED_DX: tl.constexpr, NEED_DM: tl.constexpr, USE_PTX: tl.constexpr,
):
    """dO for ROWS rows and one channel block, and that (rows, block)'s dM partial (program ids: rows, block)."""
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    d0 = pid_d * BLOCK_D
    hh = tl.arange(0, BLOCK_H)
    cols = d0 + tl.arange(0, BLOCK_D)
    h_ok = hh < H
    hh_ok = h_ok[:, None] & h_ok[None, :]
    tile_ok = h_ok[:, None] & (cols < D)[None, :]
    mix_t = tl.load(m_ptr + hh[:, None] * m_sc + hh[None, :] * m_sr, mask=hh_ok, other=0.0)  # M^T
    mix_t = _narrow(mix_t, g_ptr.dtype.element_ty, MIX_DOWNCAST)
    args = (x_ptr, g_ptr, dx_ptr, cos_ptr, sin_ptr, mix_t, pid_r, d0, hh, tile_ok, TOTAL, S,
            x_sb, x_ss, x_sh, x_sd, g_sb, g_ss, g_sh, g_sd, dx_sb, dx_ss, dx_sh, dx_sd,
            c_sb, c_ss, c_sk, n_sb, n_ss, n_sk)
    if d0 + BLOCK_D > NOPE:  # the block holds pe channels
        acc_dm = _bwd_rows(*args, NOPE, HALF, ROWS, BLOCK_H, BLOCK_D, STAGES, PRECISION, DOWNCAST, NEED_DX, NEED_DM,
                           True, USE_PTX)
    else:
        acc_dm = _bwd_rows(*args, NOPE, HALF, ROWS, BLOCK_H, BLOCK_D, STAGES, PRECISION, DOWNCAST, NEED_DX, NEED_DM,
                           False, USE_PTX)
    if NEED_DM:
        part = part_ptr + (pid_r.to(tl.int64) * tl.num_programs(1) + pid_d) * H * H
        tl.store(part + hh[:, None] * H + hh[None, :], acc_dm, mask=hh_ok)


@triton.jit
def _postmix_fast_reduce_kernel(part_ptr, out_ptr, E, P: tl.constexpr, BLOCK_P: tl.constexpr,
                                BLOCK_E: tl.constexpr):
    """out[e] = sum_p partials[p, e] over p in [0, P): blocks of BLOCK_P in order, then one fixed tree."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    acc = tl.zeros([BLOCK_P, BLOCK_E], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(part_ptr + p[:, None].to(tl.int64) * E + e[None, :], mask=(p < P)[:, None] & e_ok[None, :],
                       other=0.0)
    tl.store(out_ptr + e, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=e_ok)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_fast_args(out: Any, cos: Any, sin: Any, mix: Any, fn: str = "inv_rope_postmix (fast)") -> None:
    """The RoPE checks, plus what the fast kernels need: [b, s, h, d], a float dtype, M [h, h], even nope width."""
    rope_kernel.check_args(out, cos, sin, fn)
    if out.ndim != 4:
        raise ValueError(f"{fn}: `out` must be [b, s, h, d], got shape {shape_of(out)}")
    b, s, h, d = shape_of(out)
    if dtype_name(out) not in FAST_DTYPES:
        raise ValueError(f"{fn}: `out` must be one of {', '.join(FAST_DTYPES)}, got {dtype_name(out)}; "
                         "set `inv_rope_postmix_mode: bitwise`")
    if shape_of(mix) != [h, h] or dtype_name(mix) not in FAST_DTYPES:
        raise ValueError(f"{fn}: `mix` must be a float [{h}, {h}] tensor, got {dtype_name(mix)} {shape_of(mix)}")
    if h > MAX_HEADS:
        raise ValueError(f"{fn}: at most {MAX_HEADS} heads (one M tile per program), got {h}; set "
                         "`inv_rope_postmix_mode: bitwise`")
    if (d - 2 * int(cos.shape[-1])) % 2:
        raise ValueError(f"{fn}: the pass-through width d - rd must be even (pe pairs on even channels), got "
                         f"d = {d}, rd = {2 * int(cos.shape[-1])}; set `inv_rope_postmix_mode: bitwise`")


def plan(rows: int, heads: int, d: int, backward: bool, fp32: bool = False) -> dict[str, int]:
    """Launch meta-parameters, a function of the shape and dtype only (the dM split layout must not depend on a
    tuner).

    GPU: one [h, BLOCK_D] tile per row step, ROWS rows per program pipelined over STAGES; fp32 (IEEE dots on
    the FMA units, register-hungry) takes narrower tiles and 8 warps. Interpreter: numpy pays per op, so whole
    rows at a time and many rows per program.
    """
    block_h = max(16, _pow2(heads))
    if not rope_kernel.USE_PTX:
        return {"ROWS": min(64, _pow2(rows)), "BLOCK_D": max(16, _pow2(d)), "BLOCK_H": block_h, "STAGES": 1,
                "num_warps": 4}
    block_d = max(16, min(_pow2(d), (2048 if fp32 else 8192) // block_h))
    warps = 4 if block_h <= 64 and not fp32 else 8
    if backward:
        # 1024 programs and 16 MiB of fp32 partials at 16384 x 64 x 512 in bf16 (2 % of the op's traffic); the
        # H200 sweep (scripts/bench/tune_inv_rope_postmix.py) put BLOCK_D 128 at 917 us against 1202 us for 64
        bwd_d = min(block_d // 2, 64) if fp32 else min(block_d, 128)
        return {"ROWS": 64, "BLOCK_D": max(16, bwd_d), "BLOCK_H": block_h, "STAGES": 2, "num_warps": warps}
    if rows < 16:  # a tiny input: fewer row steps and more programs (each row's result does not depend on either)
        return {"ROWS": _pow2(rows), "BLOCK_D": max(16, min(block_d, 64)), "BLOCK_H": block_h, "STAGES": 1,
                "num_warps": 4}
    return {"ROWS": 16, "BLOCK_D": block_d, "BLOCK_H": block_h, "STAGES": 2 if fp32 else 3, "num_warps": warps}


def _common(out: Any, cos: Any, mix: Any, meta: dict[str, int]) -> tuple[list[Any], dict[str, Any]]:
    """Shared scalar arguments (after the tensors) and constexprs of both kernels."""
    b, s, h, d = shape_of(out)
    half = int(cos.shape[-1])
    low = dtype_name(out) in ("bfloat16", "float16")
    scalars = [b * s, s, h]
    consts = {"D": d, "NOPE": d - 2 * half, "HALF": half, "PRECISION": "tf32" if low else "ieee",
              "DOWNCAST": low, "MIX_DOWNCAST": low and dtype_name(mix) == "float32", "USE_PTX": rope_kernel.USE_PTX,
              **meta}
    return scalars, consts


def _grid(out: Any, meta: dict[str, int]) -> tuple[int, int]:
    b, s, _, d = shape_of(out)
    return triton.cdiv(b * s, meta["ROWS"]), triton.cdiv(d, meta["BLOCK_D"])


def _tables(out: Any, cos: Any, sin: Any) -> list[int]:
    batch = shape_of(out)[0]
    return [*rope_kernel._table_strides(cos, batch), *rope_kernel._table_strides(sin, batch)]


# Plans per (layouts, flags, meta override): the checks and the launch configuration run once per key
# (``fleet_ext.ops.launch``: host cost); a repeat call allocates and launches.
_FWD_PLANS = plan_cache("inv_rope_postmix (fast)")
_BWD_PLANS = plan_cache("inv_rope_postmix (fast backward)")


def _meta_key(meta: dict[str, int] | None) -> Any:
    return tuple(sorted(meta.items())) if meta else None


def _prepare_fwd(key: tuple, out: Any, cos: Any, sin: Any, mix: Any, meta: dict[str, int] | None) -> Plan:
    check_fast_args(out, cos, sin, mix)
    b, s, h, d = shape_of(out)
    if b * s * h * d == 0:
        return _FWD_PLANS.add(key, Plan(None))
    meta = meta or plan(b * s, h, d, backward=False, fp32=dtype_name(out) == "float32")
    scalars, consts = _common(out, cos, mix, meta)
    strides = [*strides_of(out), *contiguous_strides([b, s, h, d]), *strides_of(mix), *_tables(out, cos, sin)]
    return _FWD_PLANS.add(key, Plan(_grid(out, meta), [*scalars, *strides], consts, standard=is_standard(out)))


def forward(out: Any, cos: Any, sin: Any, mix: Any, meta: dict[str, int] | None = None) -> Any:
    """``mix @ inv_rope(out)`` [b, s, h, d] in one pass; ``mix`` [h, h] any float dtype (rounded to out's)."""
    key = (layout_key(out), layout_key(cos), layout_key(sin), layout_key(mix), _meta_key(meta), rope_kernel.USE_PTX)
    fwd = _FWD_PLANS.get(key) or _prepare_fwd(key, out, cos, sin, mix, meta)
    y = empty_same(out, fwd.standard)
    fire(_postmix_fast_fwd_kernel, fwd, out, mix, y, cos, sin)
    return y


def _prepare_bwd(key: tuple, out: Any, cos: Any, sin: Any, mix: Any, grad: Any, need_out: bool, need_mix: bool,
                 meta: dict[str, int] | None) -> Plan:
    """Check and plan the backward launch; ``info``: (n_part, h, the reduce's plan or None)."""
    check_fast_args(out, cos, sin, mix, "inv_rope_postmix (fast backward)")
    if shape_of(grad) != shape_of(out) or dtype_name(grad) != dtype_name(out):
        raise ValueError(f"inv_rope_postmix (fast backward): `grad` must be {dtype_name(out)} {shape_of(out)}, "
                         f"got {dtype_name(grad)} {shape_of(grad)}")
    b, s, h, d = shape_of(out)
    if not (need_out or need_mix):
        return _BWD_PLANS.add(key, Plan(None, info=(0, h, None)))
    meta = meta or plan(b * s, h, d, backward=True, fp32=dtype_name(out) == "float32")
    grid = _grid(out, meta)
    n_part = grid[0] * grid[1] if need_mix and b * s * d else 0
    reduce = _reduce_plan(n_part, h * h) if need_mix else None
    if not b * s * h * d:
        return _BWD_PLANS.add(key, Plan(None, info=(n_part, h, reduce)))
    scalars, consts = _common(out, cos, mix, meta)
    dx_strides = contiguous_strides([b, s, h, d]) if need_out else strides_of(out)
    strides = [*strides_of(out), *strides_of(grad), *dx_strides, *strides_of(mix), *_tables(out, cos, sin)]
    return _BWD_PLANS.add(key, Plan(grid, [*scalars, *strides], dict(consts, NEED_DX=need_out, NEED_DM=need_mix),
                                    (n_part, h, reduce), is_standard(out)))


def backward(out: Any, cos: Any, sin: Any, mix: Any, grad: Any, need_out: bool = True, need_mix: bool = True,
             meta: dict[str, int] | None = None) -> tuple[Any, Any]:
    """(d_out like ``out`` or None, d_mix like ``mix`` or None) of ``mix @ inv_rope(out)`` for ``grad``."""
    need_out, need_mix = bool(need_out), bool(need_mix)
    key = (layout_key(out), layout_key(cos), layout_key(sin), layout_key(mix), layout_key(grad), need_out, need_mix,
           _meta_key(meta), rope_kernel.USE_PTX)
    bwd = _BWD_PLANS.get(key) or _prepare_bwd(key, out, cos, sin, mix, grad, need_out, need_mix, meta)
    n_part, h, reduce = bwd.info
    d_out = empty_same(out, bwd.standard) if need_out else None
    d_mix = empty_like(mix, shape=(h, h)) if need_mix else None
    if not (need_out or need_mix):
        return d_out, d_mix
    partials = empty_like(cos, shape=(max(1, n_part), h, h))  # fp32, cos's framework and device
    dx = d_out if need_out else out  # never written when NEED_DX is off
    fire(_postmix_fast_bwd_kernel, bwd, out, grad, mix, dx, partials, cos, sin)
    if reduce is not None:
        fire(_postmix_fast_reduce_kernel, reduce, partials, d_mix)
    return d_out, d_mix


def _reduce_plan(n_part: int, entries: int) -> Plan:
    """The fixed-order sum of the first ``n_part`` partials into d_mix (contiguous [h, h]; zeros when none)."""
    if entries == 0:
        return Plan(None)
    block_e = min(_pow2(entries), 64 if rope_kernel.USE_PTX else 1 << 14)  # GPU: h * h / 64 programs
    block_p = min(_pow2(max(n_part, 1)), 64 if rope_kernel.USE_PTX else 1 << 12)
    return Plan((triton.cdiv(entries, block_e),), (entries,), dict(P=n_part, BLOCK_P=block_p, BLOCK_E=block_e,
                                                                   num_warps=4))
