"""Triton weightless per-head RMS norm of the DSv4 query: ``y = x * rsqrt(mean(x^2) + eps)``, and its gradient.

Framework-agnostic host launchers (Paddle or torch tensors, through :mod:`fleet_ext.ops.launch`); this
module imports neither Paddle nor torch. Everything is computed in fp32 (inputs widened exactly), the
output is rounded once to the input dtype (round to nearest even), and no product is contracted into an
FMA (kernels are built with ``enable_fp_fusion=False``), so every rounding is one of eager's.

**Summation order is a parameter** (:class:`Order`), because a bitwise match with an eager framework means
summing ``x^2`` (forward) and ``dy * x`` (backward) in that framework's order:

- :func:`paddle_cpu_order` — Paddle CPU's mean / multiply_grad reductions: one sequential fp32 sum over
  the row, ``sum / d`` (measured on Paddle 3.3.1 CPU: the mean for widths up to 20000, forward and
  backward of the whole norm byte-equal for 139 widths up to 2048; ``test_fusion_q_rms_norm`` pins widths
  1 .. 512, so a Paddle upgrade that changes the order fails there);
- :func:`torch_cuda_order` — torch's CUDA reduction (``Reduce.cuh``: ``setReduceConfig`` /
  ``input_vectorized_thread_reduce_impl`` / ``thread_reduce_impl`` / ``block_x_reduce``) for a contiguous
  fp32 ``[rows, d]`` reduced over ``d``: ``LANES`` threads share a row; for ``d > 128`` each loads 4-wide
  vectors at a ``LANES``-vector stride into four accumulators indexed by the position in the vector, else
  single elements at a ``LANES`` stride into four accumulators indexed by the step; the four are combined
  left to right, then lanes above 32 are folded in halves (shared memory) and the last 32 by the warp
  shuffle tree that pairs adjacent lanes. ``mean`` multiplies by ``factor = rows / (rows * d)`` (fp32).

In general form a row is read in chunks of ``C = LANES * NACC`` consecutive elements, summed chunk after
chunk into ``C`` fp32 accumulators (sequentially: this is the per-thread loop), then the ``NACC``
accumulators of a lane are combined left to right and the lanes by the tree above. Paddle CPU's order is
``LANES = NACC = 1``.

**Where the rsqrt comes from.** On a GPU one kernel does it all (``fused`` phase) with ``tl.math.rsqrt``:
Triton emits ``rsqrt.approx.ftz.f32``, CUDA's ``rsqrtf`` (torch.rsqrt) ``rsqrt.approx.f32``; the same
MUFU.RSQ result for every normal input, and ``ms + eps`` is normal whenever ``eps >= 2**-126``. Paddle
CPU's ``rsqrt`` is not reproducible by any kernel: Eigen's packet path is the hardware ``rsqrtps``
estimate plus one Newton step (vendor specific, not correctly rounded) while the scalar tail of the same
tensor is ``1/sqrt``, so the result depends on the element's position. The CPU path therefore runs the
``stats`` phase (write ``mean(x^2)``), lets the caller apply Paddle's own ``rsqrt(ms + eps)`` to the
``[b, s, h, 1]`` tensor, and runs the ``apply`` phase (``x * r``).

**Gradient flavours** (elementwise, after the row sum ``g_r = sum(dy * x)`` in the same order):

- Paddle CPU autograd: ``d_ms = (((-0.5 * g_r) * r) * r) * r``; ``d_sq = d_ms / d``;
  ``dx = dy * r + (d_sq * 2) * x``;
- torch autograd: ``d_ms = (-0.5 * g_r) * ((r * r) * r)`` (rsqrt's ``-0.5 * grad * result.pow(3)``);
  ``d_sq = d_ms * fl(1/d)`` (mean_backward divides by a CPU scalar, which CUDA turns into a multiply by
  its reciprocal); ``dx = dy * r + d_sq * (2 * x)`` (pow_backward).

Layout: ``x`` is [b, s, h, d] with any strides; ``y``/``dx`` are new contiguous tensors like ``x``;
``r``/``ms`` are contiguous fp32 [b, s, h, 1]. One program handles ``BLOCK_R`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import empty_like, launch

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
PHASE_STATS, PHASE_APPLY, PHASE_FUSED = 0, 1, 2
FLAVOR_PADDLE, FLAVOR_TORCH = 0, 1
_MAX_THREADS = 512  # Reduce.cuh mnt_wrapper<float>::MAX_NUM_THREADS
_WARP = 32


@dataclass(frozen=True)
class Order:
    """How a row sum is ordered (module docstring) and which elementwise flavour goes with it.

    ``exact`` says whether this is the order the named framework really uses for the shape it was
    computed for (False: a configuration the emulation does not cover; the kernel still computes the
    norm, with this order, but no bitwise claim is made).
    """

    lanes: int
    nacc: int
    acc_inner: bool
    flavor: int
    mean_factor: float  # torch: fp32 rows / (rows * d); Paddle: unused (divides by d)
    inv_d: float  # torch: fp32 1 / d; Paddle: unused
    exact: bool = True
    name: str = ""


def _f32(value: float) -> float:
    import struct

    return struct.unpack("f", struct.pack("f", value))[0]


def paddle_cpu_order() -> Order:
    return Order(lanes=1, nacc=1, acc_inner=True, flavor=FLAVOR_PADDLE, mean_factor=0.0, inv_d=0.0,
                 name="paddle_cpu")


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def torch_cuda_order(rows: int, d: int) -> Order:
    """torch's CUDA ``setReduceConfig`` for ``t.sum(-1)`` / ``t.mean(-1)`` over a contiguous fp32 ``[rows, d]``.

    Not modelled (``exact=False``): a vector head/tail (``d > 128`` with ``d % 4 != 0``: rows start off
    16-byte alignment), and splits of a row across warps or blocks (very wide rows with few rows).
    """
    vectorize = d > 128
    dim0 = d // 4 if vectorize else d
    dim0_pow2 = _last_pow2(dim0) if dim0 < _MAX_THREADS else _MAX_THREADS
    dim1_pow2 = _last_pow2(rows) if rows < _MAX_THREADS else _MAX_THREADS
    lanes = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, _MAX_THREADS // lanes)
    lanes = min(dim0_pow2, _MAX_THREADS // height)
    values_per_thread = -(-d // lanes)
    split = values_per_thread >= min(height * 16, 256)
    exact = not split and not (vectorize and d % 4)
    factor = _f32(_f32(float(rows)) / _f32(float(rows * d))) if rows else 0.0
    inv_d = _f32(1.0 / _f32(float(d)))
    return Order(lanes=lanes, nacc=4, acc_inner=vectorize, flavor=FLAVOR_TORCH, mean_factor=factor, inv_d=inv_d,
                 exact=exact, name=f"torch_cuda(lanes={lanes}, {'vec4' if vectorize else 'vt0=4'})")


# ------------------------------------------------------------------------------------------------------
# Device code
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _halve(v, BLOCK_R: tl.constexpr, W: tl.constexpr):
    """[R, W] -> [R, W/2]: v[:, :W/2] + v[:, W/2:] (block_x_reduce's shared-memory step)."""
    a, b = tl.split(tl.permute(tl.reshape(v, [BLOCK_R, 2, W // 2]), (0, 2, 1)))
    return a + b


@triton.jit
def _pair(v, BLOCK_R: tl.constexpr, W: tl.constexpr):
    """[R, W] -> [R, W/2]: v[:, 0::2] + v[:, 1::2] (one level of the warp shuffle tree)."""
    a, b = tl.split(tl.reshape(v, [BLOCK_R, W // 2, 2]))
    return a + b


@triton.jit
def _lanes_tree(v, BLOCK_R: tl.constexpr, LANES: tl.constexpr):
    """[R, LANES] -> [R]: halves down to 32 lanes, then adjacent pairs (LANES a power of two <= 512)."""
    if LANES >= 512:
        v = _halve(v, BLOCK_R, 512)
    if LANES >= 256:
        v = _halve(v, BLOCK_R, 256)
    if LANES >= 128:
        v = _halve(v, BLOCK_R, 128)
    if LANES >= 64:
        v = _halve(v, BLOCK_R, 64)
    if LANES >= 32:
        v = _pair(v, BLOCK_R, 32)
    if LANES >= 16:
        v = _pair(v, BLOCK_R, 16)
    if LANES >= 8:
        v = _pair(v, BLOCK_R, 8)
    if LANES >= 4:
        v = _pair(v, BLOCK_R, 4)
    if LANES >= 2:
        v = _pair(v, BLOCK_R, 2)
    return tl.reshape(v, [BLOCK_R])


@triton.jit
def _row_sum(
    a_ptr, a_row, a_sd, b_ptr, b_row, b_sd, row_mask,
    SQUARE: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr,
):
    """sum_j a[r, j] * b[r, j] (or a^2 with SQUARE) in fp32, in the order (LANES, NACC, ACC_INNER)."""
    C: tl.constexpr = LANES * NACC
    NCHUNK: tl.constexpr = (D + C - 1) // C
    cols = tl.arange(0, C)
    acc = tl.zeros([BLOCK_R, C], dtype=tl.float32)
    if NCHUNK <= 16:
        for i in tl.static_range(NCHUNK):
            col = i * C + cols
            mask = row_mask[:, None] & (col < D)[None, :]
            a = tl.load(a_ptr + a_row[:, None] + col[None, :] * a_sd, mask=mask, other=0.0).to(tl.float32)
            if SQUARE:
                acc = acc + a * a
            else:
                b = tl.load(b_ptr + b_row[:, None] + col[None, :] * b_sd, mask=mask, other=0.0).to(tl.float32)
                acc = acc + b * a
    else:
        for i in range(NCHUNK):
            col = i * C + cols
            mask = row_mask[:, None] & (col < D)[None, :]
            a = tl.load(a_ptr + a_row[:, None] + col[None, :] * a_sd, mask=mask, other=0.0).to(tl.float32)
            if SQUARE:
                acc = acc + a * a
            else:
                b = tl.load(b_ptr + b_row[:, None] + col[None, :] * b_sd, mask=mask, other=0.0).to(tl.float32)
                acc = acc + b * a
    # the NACC accumulators of each lane, left to right
    if NACC == 4:
        if ACC_INNER:  # chunk element = lane * 4 + k (vectorised loads)
            quad = tl.reshape(acc, [BLOCK_R, LANES, 2, 2])
        else:  # chunk element = k * LANES + lane (accumulator k takes step k of every 4)
            quad = tl.reshape(tl.permute(tl.reshape(acc, [BLOCK_R, 4, LANES]), (0, 2, 1)), [BLOCK_R, LANES, 2, 2])
        even, odd = tl.split(quad)  # k = 0, 2 and k = 1, 3
        k0, k2 = tl.split(even)
        k1, k3 = tl.split(odd)
        lanes = ((k0 + k1) + k2) + k3
    else:
        lanes = tl.reshape(acc, [BLOCK_R, LANES])
    return _lanes_tree(lanes, BLOCK_R, LANES)


@triton.jit
def _narrow(v, dtype: tl.constexpr, DOWNCAST: tl.constexpr):
    if DOWNCAST:
        r = v.to(dtype, fp_downcast_rounding="rtne")
    else:
        r = v.to(dtype)
    return r


@triton.jit
def _row_offsets(rows, S, H, s_b, s_s, s_h):
    sh = S * H
    b = rows // sh
    rem = rows - b * sh
    s = rem // H
    h = rem - s * H
    return b * s_b + s * s_s + h * s_h


@triton.jit
def _q_rms_norm_fwd_kernel(
    x_ptr, y_ptr, stat_ptr,
    n_rows, S, H, s_b, s_s, s_h, s_d,
    mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr,
    PHASE: tl.constexpr, FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
):
    """PHASE 0: stat = mean(x^2). PHASE 1: y = x * stat (stat = r). PHASE 2: stat = r = rsqrt(mean + eps), y."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, s_b, s_s, s_h)
    if PHASE == 1:
        r = tl.load(stat_ptr + rows, mask=row_mask, other=0.0)
    else:
        total = _row_sum(x_ptr, x_row, s_d, x_ptr, x_row, s_d, row_mask, True, D, BLOCK_R, LANES, NACC, ACC_INNER)
        if FLAVOR == 0:
            ms = tl.math.div_rn(total, tl.full([BLOCK_R], D, tl.float32))
        else:
            ms = total * mean_factor
        if PHASE == 0:
            tl.store(stat_ptr + rows, ms, mask=row_mask)
        else:
            r = tl.math.rsqrt(ms + eps)
            tl.store(stat_ptr + rows, r, mask=row_mask)
    if PHASE != 0:
        out_dtype = y_ptr.dtype.element_ty
        for c0 in range(0, D, BLOCK_D):
            col = c0 + tl.arange(0, BLOCK_D)
            mask = row_mask[:, None] & (col < D)[None, :]
            x = tl.load(x_ptr + x_row[:, None] + col[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
            y = _narrow(x * r[:, None], out_dtype, DOWNCAST)
            tl.store(y_ptr + rows[:, None] * D + col[None, :], y, mask=mask)


@triton.jit
def _q_rms_norm_bwd_kernel(
    x_ptr, g_ptr, r_ptr, dx_ptr,
    n_rows, S, H,
    x_sb, x_ss, x_sh, x_sd,
    g_sb, g_ss, g_sh, g_sd,
    inv_d,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr,
    FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, x_sb, x_ss, x_sh)
    g_row = _row_offsets(rows, S, H, g_sb, g_ss, g_sh)
    g_r = _row_sum(g_ptr, g_row, g_sd, x_ptr, x_row, x_sd, row_mask, False, D, BLOCK_R, LANES, NACC, ACC_INNER)
    r = tl.load(r_ptr + rows, mask=row_mask, other=0.0)
    if FLAVOR == 0:
        d_ms = (((-0.5 * g_r) * r) * r) * r
        d_sq = tl.math.div_rn(d_ms, tl.full([BLOCK_R], D, tl.float32))
    else:
        d_ms = (g_r * -0.5) * ((r * r) * r)
        d_sq = d_ms * inv_d
    out_dtype = dx_ptr.dtype.element_ty
    for c0 in range(0, D, BLOCK_D):
        col = c0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (col < D)[None, :]
        x = tl.load(x_ptr + x_row[:, None] + col[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + g_row[:, None] + col[None, :] * g_sd, mask=mask, other=0.0).to(tl.float32)
        if FLAVOR == 0:
            d2 = (d_sq[:, None] * 2.0) * x
        else:
            d2 = d_sq[:, None] * (x * 2.0)
        dx = _narrow(g * r[:, None] + d2, out_dtype, DOWNCAST)
        tl.store(dx_ptr + rows[:, None] * D + col[None, :], dx, mask=mask)


# ------------------------------------------------------------------------------------------------------
# Host launchers
# ------------------------------------------------------------------------------------------------------
def _dtype_name(t: Any) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


def _shape(t: Any) -> list[int]:
    return [int(n) for n in t.shape]


def _strides(t: Any) -> list[int]:
    strides = getattr(t, "strides", None)  # Paddle: a list attribute; torch: the stride() method
    return [int(s) for s in (strides if strides is not None and not callable(strides) else t.stride())]


def _detached(t: Any) -> Any:
    """The same storage without autograd (Paddle refuses to DLPack-export a tensor that requires grad)."""
    return t.detach() if getattr(t, "stop_gradient", True) is False or getattr(t, "requires_grad", False) else t


def _float32_of(t: Any) -> Any:
    """fp32 in the framework of ``t`` (imported lazily: this module imports no framework)."""
    if type(t).__module__.startswith("paddle"):
        import paddle

        return paddle.float32
    import torch

    return torch.float32


def is_interpreted() -> bool:
    return type(_q_rms_norm_fwd_kernel).__name__ == "InterpretedFunction"


def check_q(q: Any, name: str = "q", fn: str = "q_rms_norm") -> None:
    if q.ndim != 4:
        raise ValueError(f"{fn}: `{name}` must be [b, s, h, d] float, got shape {_shape(q)}")
    if _dtype_name(q) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `{name}` must be [b, s, h, d] float ({', '.join(FLOAT_DTYPES)}), "
                         f"got {_dtype_name(q)}")


def default_order(q: Any) -> Order:
    """The order of the eager path this platform replaces: Paddle CPU when interpreted, torch CUDA else."""
    if is_interpreted():
        return paddle_cpu_order()
    b, s, h, d = _shape(q)
    return torch_cuda_order(b * s * h, d)


def _config(d: int, order: Order) -> dict:
    chunk = order.lanes * order.nacc
    if is_interpreted():  # numpy per op: few, large programs
        block_r = 64
        block_d = triton.next_power_of_2(d)
    else:  # ~2048 fp32 accumulators per program (16 per thread at 4 warps), 16-byte loads
        block_r = max(1, min(64, 2048 // chunk))
        block_d = min(triton.next_power_of_2(d), 256)
    return dict(BLOCK_R=block_r, BLOCK_D=block_d, LANES=order.lanes, NACC=order.nacc, ACC_INNER=order.acc_inner)


def _fwd(q: Any, y: Any, stat: Any, phase: int, order: Order, eps: float) -> None:
    b, s, h, d = _shape(q)
    rows = b * s * h
    if rows == 0 or d == 0:
        return
    cfg = _config(d, order)
    s_b, s_s, s_h, s_d = _strides(q)
    launch(
        _q_rms_norm_fwd_kernel, (triton.cdiv(rows, cfg["BLOCK_R"]),),
        _detached(q), _detached(y), _detached(stat),
        rows, s, h, s_b, s_s, s_h, s_d,
        float(order.mean_factor), float(eps),
        D=d, PHASE=phase, FLAVOR=order.flavor, DOWNCAST=_dtype_name(q) != "float32",
        num_warps=4, enable_fp_fusion=False, **cfg,
    )


def q_rms_norm_stats(q: Any, order: Order | None = None) -> Any:
    """``mean(q^2, -1)`` as a new contiguous fp32 [b, s, h, 1] tensor, summed in ``order``."""
    check_q(q)
    order = order or default_order(q)
    b, s, h, _ = _shape(q)
    ms = empty_like(q, shape=[b, s, h, 1], dtype=_float32_of(q))
    _fwd(q, q, ms, PHASE_STATS, order, 0.0)
    return ms


def q_rms_norm_apply(q: Any, r: Any) -> Any:
    """``q * r`` (r fp32 [b, s, h, 1], contiguous) rounded to q's dtype, as a new contiguous tensor."""
    check_q(q)
    b, s, h, _ = _shape(q)
    if _shape(r) != [b, s, h, 1] or _dtype_name(r) != "float32":
        raise ValueError(f"q_rms_norm: `r` must be float32 [{b}, {s}, {h}, 1], got {_dtype_name(r)} {_shape(r)}")
    y = empty_like(q)
    _fwd(q, y, _contiguous(r), PHASE_APPLY, paddle_cpu_order(), 0.0)
    return y


def q_rms_norm_fused(q: Any, eps: float, order: Order | None = None) -> tuple[Any, Any]:
    """One kernel: ``(y, r)`` with ``r = rsqrt(mean(q^2) + eps)`` fp32 [b, s, h, 1] and ``y = q * r``."""
    check_q(q)
    order = order or default_order(q)
    b, s, h, _ = _shape(q)
    y = empty_like(q)
    r = empty_like(q, shape=[b, s, h, 1], dtype=_float32_of(q))
    _fwd(q, y, r, PHASE_FUSED, order, eps)
    return y, r


def q_rms_norm_bwd(dy: Any, q: Any, r: Any, order: Order | None = None) -> Any:
    """The gradient for ``q`` given ``dy`` (like q, any strides) and the forward's ``r``; a new contiguous tensor."""
    check_q(q)
    check_q(dy, "dy", "q_rms_norm (backward)")
    b, s, h, d = _shape(q)
    if _shape(dy) != [b, s, h, d]:
        raise ValueError(f"q_rms_norm (backward): `dy` must have q's shape {[b, s, h, d]}, got {_shape(dy)}")
    if _shape(r) != [b, s, h, 1] or _dtype_name(r) != "float32":
        raise ValueError(f"q_rms_norm (backward): `r` must be float32 [{b}, {s}, {h}, 1], "
                         f"got {_dtype_name(r)} {_shape(r)}")
    order = order or default_order(q)
    dx = empty_like(q)
    rows = b * s * h
    if rows == 0 or d == 0:
        return dx
    cfg = _config(d, order)
    launch(
        _q_rms_norm_bwd_kernel, (triton.cdiv(rows, cfg["BLOCK_R"]),),
        _detached(q), _detached(dy), _detached(_contiguous(r)), dx,
        rows, s, h, *_strides(q), *_strides(dy),
        float(order.inv_d),
        D=d, FLAVOR=order.flavor, DOWNCAST=_dtype_name(dx) != "float32",
        num_warps=4, enable_fp_fusion=False, **cfg,
    )
    return dx


def _contiguous(t: Any) -> Any:
    return t if t.is_contiguous() else t.contiguous()
