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
  fp32 ``[rows, d]`` reduced over ``d``: ``LANES`` threads share a row; for ``d >= 128`` each loads 4-wide
  vectors at a ``LANES``-vector stride into four accumulators indexed by the position in the vector, else
  single elements at a ``LANES`` stride into four accumulators indexed by the step; the four are combined
  left to right, then lanes above 32 are folded in halves (shared memory) and the last 32 by the warp's
  ``shfl_down`` tree. ``mean`` multiplies by ``factor = rows / (rows * d)`` (fp32). Two details changed
  across torch releases and are parameters: the vectorisation threshold (``dim0 >= 128`` now, ``> 128``
  before) and the shuffle offsets (16, 8, .., 1 since pytorch#164790, Oct 2025: lane t adds lane t + 16,
  then t + 8, .., i.e. halving all the way; 1, 2, .., 16 before: adjacent pairs). The defaults are torch
  2.11's (the H200 image), found by ``scripts/bench/fusion_cases_k1.py --probe`` on the H200: zero rows
  differ from eager ``mean`` over 11 shapes, while each other combination differs on hundreds of rows.

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

**One pass on the GPU.** With the torch order and at most ``MAX_TILES`` chunks of ``LANES * 4`` columns
per row (d <= 1024 at 32 lanes), the fused forward and the backward keep each row's chunks in registers:
every input byte is read once (the streamed path re-reads the row for the elementwise pass). Rows whose
offsets are uniformly strided (contiguous q, any row stride) skip the per-row index divisions. On the H200
at [1, 16384, 64, 512] bf16 (2026): forward 511-525 us over 4/8/16/32 rows per program and 2/4/8 warps
(a 1 GiB ``clone``: 504 us; torch.compile of the eager sequence: 507 us), backward 741-744 us (4350 GB/s,
torch.compile 743 us); evict-first loads with streaming stores lost 7-10%. The defaults, 4 rows and 2
warps per program (64 threads, four 16-byte loads per tensor each), were the fastest forward and tied for
the backward; ``bench_fusions.py``: forward 512.3 us (98% of the copy rate), backward 741.2 us.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from fleet_ext.ops.launch import detached, dtype_name, empty_like, is_paddle, launch, shape_of, strides_of

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
    halving: bool = True  # the last 32 lanes: shfl_down offsets 16, 8, .., 1 (True) or 1, 2, .., 16 (False)


def _f32(value: float) -> float:
    import struct

    return struct.unpack("f", struct.pack("f", value))[0]


def paddle_cpu_order() -> Order:
    return Order(lanes=1, nacc=1, acc_inner=True, flavor=FLAVOR_PADDLE, mean_factor=0.0, inv_d=0.0,
                 name="paddle_cpu")


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


# torch's Reduce.cuh as of the torch on the H200 image (2.11): vectorised input loads from ``d >= 128``
# (``dim0 >= 128``; older releases: ``> 128``) and the intra-warp tree with decreasing shuffle offsets
# (pytorch#164790, Oct 2025; older releases: increasing). Both are parameters of ``torch_cuda_order``.
TORCH_VEC_MIN_D = 128
TORCH_WARP_HALVING = True


def torch_cuda_order(rows: int, d: int, vec_min_d: int | None = None, halving: bool | None = None) -> Order:
    """torch's CUDA ``setReduceConfig`` for ``t.sum(-1)`` / ``t.mean(-1)`` over a contiguous fp32 ``[rows, d]``.

    Not modelled (``exact=False``): a vector head/tail (vectorised with ``d % 4 != 0``: rows start off
    16-byte alignment), and splits of a row across warps or blocks (very wide rows with few rows).
    """
    vec_min_d = TORCH_VEC_MIN_D if vec_min_d is None else vec_min_d
    halving = TORCH_WARP_HALVING if halving is None else halving
    vectorize = d >= vec_min_d
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
    tree = "16..1" if halving else "1..16"
    return Order(lanes=lanes, nacc=4, acc_inner=vectorize, flavor=FLAVOR_TORCH, mean_factor=factor, inv_d=inv_d,
                 exact=exact, name=f"torch_cuda(lanes={lanes}, {'vec4' if vectorize else 'vt0=4'}, shfl {tree})",
                 halving=halving)


# ------------------------------------------------------------------------------------------------------
# Device code
# ------------------------------------------------------------------------------------------------------
@triton.jit
def _halve(v, BLOCK_R: tl.constexpr, W: tl.constexpr):
    """[R, W] -> [R, W/2]: v[:, :W/2] + v[:, W/2:] (shared-memory step / shfl_down by W/2).

    A sum over an axis of two is one addition, and IEEE addition is commutative: exact whatever the layout.
    """
    return tl.sum(tl.reshape(v, [BLOCK_R, 2, W // 2]), axis=1)


@triton.jit
def _pair(v, BLOCK_R: tl.constexpr, W: tl.constexpr):
    """[R, W] -> [R, W/2]: v[:, 0::2] + v[:, 1::2] (one level of the increasing-offset shuffle tree)."""
    a, b = tl.split(tl.reshape(v, [BLOCK_R, W // 2, 2]))
    return a + b


@triton.jit
def _lanes_tree(v, BLOCK_R: tl.constexpr, LANES: tl.constexpr, HALVING: tl.constexpr):
    """[R, LANES] -> [R]: halves down to 32 lanes (block_x_reduce's shared memory), then the warp tree:
    halves again (HALVING, shfl_down offsets 16 .. 1) or adjacent pairs (offsets 1 .. 16)."""
    if LANES >= 512:
        v = _halve(v, BLOCK_R, 512)
    if LANES >= 256:
        v = _halve(v, BLOCK_R, 256)
    if LANES >= 128:
        v = _halve(v, BLOCK_R, 128)
    if LANES >= 64:
        v = _halve(v, BLOCK_R, 64)
    if HALVING:
        if LANES >= 32:
            v = _halve(v, BLOCK_R, 32)
        if LANES >= 16:
            v = _halve(v, BLOCK_R, 16)
        if LANES >= 8:
            v = _halve(v, BLOCK_R, 8)
        if LANES >= 4:
            v = _halve(v, BLOCK_R, 4)
        if LANES >= 2:
            v = _halve(v, BLOCK_R, 2)
    else:
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
def _combine(acc, BLOCK_R: tl.constexpr, LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr,
             HALVING: tl.constexpr):
    """[R, LANES * NACC] chunk accumulators -> [R]: each lane's NACC accumulators left to right, then the lanes."""
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
    return _lanes_tree(lanes, BLOCK_R, LANES, HALVING)


@triton.jit
def _row_sum(
    a_ptr, a_row, a_sd, b_ptr, b_row, b_sd, row_mask,
    SQUARE: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
):
    """sum_j a[r, j] * b[r, j] (or a^2 with SQUARE) in fp32, in the order (LANES, NACC, ACC_INNER, HALVING).

    Streams the row chunk by chunk (any width); the one-pass kernels below keep the row in registers instead.
    """
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
    return _combine(acc, BLOCK_R, LANES, NACC, ACC_INNER, HALVING)


@triton.jit
def _narrow(v, dtype: tl.constexpr, DOWNCAST: tl.constexpr):
    if DOWNCAST:
        r = v.to(dtype, fp_downcast_rounding="rtne")
    else:
        r = v.to(dtype)
    return r


@triton.jit
def _row_offsets(rows, S, H, s_b, s_s, s_h, FLAT_ROWS: tl.constexpr):
    """Element offset of each row's first entry; FLAT_ROWS: rows are uniformly strided (s_b = S*s_s, s_s = H*s_h)."""
    if FLAT_ROWS:
        off = rows * s_h
    else:
        sh = S * H
        b = rows // sh
        rem = rows - b * sh
        s = rem // H
        h = rem - s * H
        off = b * s_b + s * s_s + h * s_h
    return off


@triton.jit
def _tile(ptr, row_off, s_d, row_mask, T: tl.constexpr, C: tl.constexpr, D: tl.constexpr, STREAM: tl.constexpr):
    """Chunk T of each row (columns T*C .. T*C + C - 1) as fp32 [R, C]; zeros past the row."""
    col = T * C + tl.arange(0, C)
    mask = row_mask[:, None] & (col < D)[None, :]
    ptrs = ptr + row_off[:, None] + col[None, :] * s_d
    if STREAM:  # read once: do not keep it in L2
        v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _put(ptr, rows, v, row_mask, T: tl.constexpr, C: tl.constexpr, D: tl.constexpr, DOWNCAST: tl.constexpr,
         STREAM: tl.constexpr):
    """Store chunk T of contiguous [rows, D] output rows, rounded once to the output dtype."""
    col = T * C + tl.arange(0, C)
    mask = row_mask[:, None] & (col < D)[None, :]
    out = _narrow(v, ptr.dtype.element_ty, DOWNCAST)
    if STREAM:
        tl.store(ptr + rows[:, None] * D + col[None, :], out, mask=mask, cache_modifier=".cs")
    else:
        tl.store(ptr + rows[:, None] * D + col[None, :], out, mask=mask)


MAX_TILES = 8  # one-pass kernels keep up to 8 chunks of LANES * 4 columns of each row in registers


@triton.jit
def _q_rms_norm_fwd_kernel(
    x_ptr, y_ptr, stat_ptr,
    n_rows, S, H, s_b, s_s, s_h, s_d,
    mean_factor, eps,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    PHASE: tl.constexpr, FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
    ONE_PASS: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr,
):
    """PHASE 0: stat = mean(x^2). PHASE 1: y = x * stat (stat = r). PHASE 2: stat = r = rsqrt(mean + eps), y.

    ONE_PASS (PHASE 2, torch order, NACC = 4, at most MAX_TILES chunks): each row is read once, its chunks
    held in registers for both the sum and y; else the row is streamed twice (sum, then y).
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, s_b, s_s, s_h, FLAT_ROWS)
    if ONE_PASS:
        C: tl.constexpr = LANES * 4
        NT: tl.constexpr = (D + C - 1) // C
        x0 = _tile(x_ptr, x_row, s_d, row_mask, 0, C, D, STREAM)
        if NT > 1:
            x1 = _tile(x_ptr, x_row, s_d, row_mask, 1, C, D, STREAM)
        if NT > 2:
            x2 = _tile(x_ptr, x_row, s_d, row_mask, 2, C, D, STREAM)
        if NT > 3:
            x3 = _tile(x_ptr, x_row, s_d, row_mask, 3, C, D, STREAM)
        if NT > 4:
            x4 = _tile(x_ptr, x_row, s_d, row_mask, 4, C, D, STREAM)
        if NT > 5:
            x5 = _tile(x_ptr, x_row, s_d, row_mask, 5, C, D, STREAM)
        if NT > 6:
            x6 = _tile(x_ptr, x_row, s_d, row_mask, 6, C, D, STREAM)
        if NT > 7:
            x7 = _tile(x_ptr, x_row, s_d, row_mask, 7, C, D, STREAM)
        acc = x0 * x0  # = 0 + x0^2 (squares are never -0)
        if NT > 1:
            acc = acc + x1 * x1
        if NT > 2:
            acc = acc + x2 * x2
        if NT > 3:
            acc = acc + x3 * x3
        if NT > 4:
            acc = acc + x4 * x4
        if NT > 5:
            acc = acc + x5 * x5
        if NT > 6:
            acc = acc + x6 * x6
        if NT > 7:
            acc = acc + x7 * x7
        total = _combine(acc, BLOCK_R, LANES, 4, ACC_INNER, HALVING)
        r = tl.math.rsqrt(total * mean_factor + eps)
        tl.store(stat_ptr + rows, r, mask=row_mask)
        rb = r[:, None]
        _put(y_ptr, rows, x0 * rb, row_mask, 0, C, D, DOWNCAST, STREAM)
        if NT > 1:
            _put(y_ptr, rows, x1 * rb, row_mask, 1, C, D, DOWNCAST, STREAM)
        if NT > 2:
            _put(y_ptr, rows, x2 * rb, row_mask, 2, C, D, DOWNCAST, STREAM)
        if NT > 3:
            _put(y_ptr, rows, x3 * rb, row_mask, 3, C, D, DOWNCAST, STREAM)
        if NT > 4:
            _put(y_ptr, rows, x4 * rb, row_mask, 4, C, D, DOWNCAST, STREAM)
        if NT > 5:
            _put(y_ptr, rows, x5 * rb, row_mask, 5, C, D, DOWNCAST, STREAM)
        if NT > 6:
            _put(y_ptr, rows, x6 * rb, row_mask, 6, C, D, DOWNCAST, STREAM)
        if NT > 7:
            _put(y_ptr, rows, x7 * rb, row_mask, 7, C, D, DOWNCAST, STREAM)
    else:
        if PHASE == 1:
            r = tl.load(stat_ptr + rows, mask=row_mask, other=0.0)
        else:
            total = _row_sum(x_ptr, x_row, s_d, x_ptr, x_row, s_d, row_mask, True, D, BLOCK_R, LANES, NACC,
                             ACC_INNER, HALVING)
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
def _dx_tile(g, x, r, d_sq, FLAVOR: tl.constexpr):
    if FLAVOR == 0:
        d2 = (d_sq[:, None] * 2.0) * x
    else:
        d2 = d_sq[:, None] * (x * 2.0)
    return g * r[:, None] + d2


@triton.jit
def _q_rms_norm_bwd_kernel(
    x_ptr, g_ptr, r_ptr, dx_ptr,
    n_rows, S, H,
    x_sb, x_ss, x_sh, x_sd,
    g_sb, g_ss, g_sh, g_sd,
    inv_d,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LANES: tl.constexpr, NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    FLAVOR: tl.constexpr, DOWNCAST: tl.constexpr,
    ONE_PASS: tl.constexpr, FLAT_ROWS: tl.constexpr, STREAM: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = _row_offsets(rows, S, H, x_sb, x_ss, x_sh, FLAT_ROWS)
    g_row = _row_offsets(rows, S, H, g_sb, g_ss, g_sh, FLAT_ROWS)
    r = tl.load(r_ptr + rows, mask=row_mask, other=0.0)
    if ONE_PASS:
        C: tl.constexpr = LANES * 4
        NT: tl.constexpr = (D + C - 1) // C
        g0 = _tile(g_ptr, g_row, g_sd, row_mask, 0, C, D, STREAM)
        x0 = _tile(x_ptr, x_row, x_sd, row_mask, 0, C, D, STREAM)
        if NT > 1:
            g1 = _tile(g_ptr, g_row, g_sd, row_mask, 1, C, D, STREAM)
            x1 = _tile(x_ptr, x_row, x_sd, row_mask, 1, C, D, STREAM)
        if NT > 2:
            g2 = _tile(g_ptr, g_row, g_sd, row_mask, 2, C, D, STREAM)
            x2 = _tile(x_ptr, x_row, x_sd, row_mask, 2, C, D, STREAM)
        if NT > 3:
            g3 = _tile(g_ptr, g_row, g_sd, row_mask, 3, C, D, STREAM)
            x3 = _tile(x_ptr, x_row, x_sd, row_mask, 3, C, D, STREAM)
        if NT > 4:
            g4 = _tile(g_ptr, g_row, g_sd, row_mask, 4, C, D, STREAM)
            x4 = _tile(x_ptr, x_row, x_sd, row_mask, 4, C, D, STREAM)
        if NT > 5:
            g5 = _tile(g_ptr, g_row, g_sd, row_mask, 5, C, D, STREAM)
            x5 = _tile(x_ptr, x_row, x_sd, row_mask, 5, C, D, STREAM)
        if NT > 6:
            g6 = _tile(g_ptr, g_row, g_sd, row_mask, 6, C, D, STREAM)
            x6 = _tile(x_ptr, x_row, x_sd, row_mask, 6, C, D, STREAM)
        if NT > 7:
            g7 = _tile(g_ptr, g_row, g_sd, row_mask, 7, C, D, STREAM)
            x7 = _tile(x_ptr, x_row, x_sd, row_mask, 7, C, D, STREAM)
        acc = tl.zeros([BLOCK_R, C], dtype=tl.float32) + g0 * x0  # the identity 0 first: -0 products become +0
        if NT > 1:
            acc = acc + g1 * x1
        if NT > 2:
            acc = acc + g2 * x2
        if NT > 3:
            acc = acc + g3 * x3
        if NT > 4:
            acc = acc + g4 * x4
        if NT > 5:
            acc = acc + g5 * x5
        if NT > 6:
            acc = acc + g6 * x6
        if NT > 7:
            acc = acc + g7 * x7
        g_r = _combine(acc, BLOCK_R, LANES, 4, ACC_INNER, HALVING)
    else:
        g_r = _row_sum(g_ptr, g_row, g_sd, x_ptr, x_row, x_sd, row_mask, False, D, BLOCK_R, LANES, NACC, ACC_INNER,
                       HALVING)
    if FLAVOR == 0:
        d_ms = (((-0.5 * g_r) * r) * r) * r
        d_sq = tl.math.div_rn(d_ms, tl.full([BLOCK_R], D, tl.float32))
    else:
        d_ms = (g_r * -0.5) * ((r * r) * r)
        d_sq = d_ms * inv_d
    if ONE_PASS:
        _put(dx_ptr, rows, _dx_tile(g0, x0, r, d_sq, FLAVOR), row_mask, 0, C, D, DOWNCAST, STREAM)
        if NT > 1:
            _put(dx_ptr, rows, _dx_tile(g1, x1, r, d_sq, FLAVOR), row_mask, 1, C, D, DOWNCAST, STREAM)
        if NT > 2:
            _put(dx_ptr, rows, _dx_tile(g2, x2, r, d_sq, FLAVOR), row_mask, 2, C, D, DOWNCAST, STREAM)
        if NT > 3:
            _put(dx_ptr, rows, _dx_tile(g3, x3, r, d_sq, FLAVOR), row_mask, 3, C, D, DOWNCAST, STREAM)
        if NT > 4:
            _put(dx_ptr, rows, _dx_tile(g4, x4, r, d_sq, FLAVOR), row_mask, 4, C, D, DOWNCAST, STREAM)
        if NT > 5:
            _put(dx_ptr, rows, _dx_tile(g5, x5, r, d_sq, FLAVOR), row_mask, 5, C, D, DOWNCAST, STREAM)
        if NT > 6:
            _put(dx_ptr, rows, _dx_tile(g6, x6, r, d_sq, FLAVOR), row_mask, 6, C, D, DOWNCAST, STREAM)
        if NT > 7:
            _put(dx_ptr, rows, _dx_tile(g7, x7, r, d_sq, FLAVOR), row_mask, 7, C, D, DOWNCAST, STREAM)
    else:
        for c0 in range(0, D, BLOCK_D):
            col = c0 + tl.arange(0, BLOCK_D)
            mask = row_mask[:, None] & (col < D)[None, :]
            x = tl.load(x_ptr + x_row[:, None] + col[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + g_row[:, None] + col[None, :] * g_sd, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + rows[:, None] * D + col[None, :], _narrow(_dx_tile(g, x, r, d_sq, FLAVOR),
                     dx_ptr.dtype.element_ty, DOWNCAST), mask=mask)


# ------------------------------------------------------------------------------------------------------
# Host launchers
# ------------------------------------------------------------------------------------------------------
def _float32_of(t: Any) -> Any:
    """fp32 in the framework of ``t`` (imported lazily: this module imports no framework)."""
    if is_paddle(t):
        import paddle

        return paddle.float32
    import torch

    return torch.float32


def is_interpreted() -> bool:
    return type(_q_rms_norm_fwd_kernel).__name__ == "InterpretedFunction"


def check_q(q: Any, name: str = "q", fn: str = "q_rms_norm") -> None:
    if q.ndim != 4:
        raise ValueError(f"{fn}: `{name}` must be [b, s, h, d] float, got shape {shape_of(q)}")
    if dtype_name(q) not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: `{name}` must be [b, s, h, d] float ({', '.join(FLOAT_DTYPES)}), "
                         f"got {dtype_name(q)}")


def default_order(q: Any) -> Order:
    """The order of the eager path this platform replaces: Paddle CPU when interpreted, torch CUDA else."""
    if is_interpreted():
        return paddle_cpu_order()
    b, s, h, d = shape_of(q)
    return torch_cuda_order(b * s * h, d)


# One-pass GPU geometry: rows per program for a 128-column chunk (scaled for other chunk widths) and warps.
# Tuned on the H200 for [1, 16384, 64, 512] bf16 (scripts/bench/fusion_cases_k1.py); TUNE overrides them
# (the benchmark's sweep) without editing the module.
FWD_ROWS, FWD_WARPS = 4, 2
BWD_ROWS, BWD_WARPS = 4, 2
STREAM = False  # evict-first loads / streaming stores in the one-pass kernels
TUNE: dict = {}


def _one_pass(d: int, order: Order, phase: int = PHASE_FUSED) -> bool:
    return phase == PHASE_FUSED and order.nacc == 4 and -(-d // (order.lanes * 4)) <= MAX_TILES


def _row_stride(shape: list[int], strides: list[int]) -> int | None:
    """The stride between consecutive rows of [b, s, h, d] when all rows are uniformly strided, else None."""
    b, s, h, _ = shape
    s_b, s_s, s_h, _ = strides
    step = s_h if h > 1 else (s_s if s > 1 else s_b)
    if (h > 1 and s_h != step) or (s > 1 and s_s != step * h) or (b > 1 and s_b != step * h * s):
        return None
    return step


def _config(d: int, order: Order, backward: bool = False, phase: int = PHASE_FUSED) -> dict:
    chunk = order.lanes * order.nacc
    one_pass = _one_pass(d, order, PHASE_FUSED if backward else phase)
    if is_interpreted():  # numpy per op: few, large programs
        block_r = 64
        block_d = triton.next_power_of_2(d)
        warps = 4
    elif one_pass:  # the row lives in registers: BLOCK_R * d values per program
        rows_128 = int(TUNE.get("bwd_rows" if backward else "fwd_rows", BWD_ROWS if backward else FWD_ROWS))
        warps = int(TUNE.get("bwd_warps" if backward else "fwd_warps", BWD_WARPS if backward else FWD_WARPS))
        block_r = max(1, min(64, rows_128 * 128 // chunk))
        block_d = min(triton.next_power_of_2(d), 256)
    else:  # ~2048 fp32 accumulators per program (16 per thread at 4 warps), 16-byte loads
        block_r = max(1, min(64, 2048 // chunk))
        block_d = min(triton.next_power_of_2(d), 256)
        warps = 4
    return dict(BLOCK_R=block_r, BLOCK_D=block_d, LANES=order.lanes, NACC=order.nacc, ACC_INNER=order.acc_inner,
                HALVING=order.halving, ONE_PASS=one_pass, STREAM=bool(TUNE.get("stream", STREAM)), num_warps=warps)


def _fwd(q: Any, y: Any, stat: Any, phase: int, order: Order, eps: float) -> None:
    b, s, h, d = shape_of(q)
    rows = b * s * h
    if rows == 0 or d == 0:
        return
    cfg = _config(d, order, phase=phase)
    s_b, s_s, s_h, s_d = strides_of(q)
    step = _row_stride(shape_of(q), strides_of(q))
    launch(
        _q_rms_norm_fwd_kernel, (triton.cdiv(rows, cfg["BLOCK_R"]),),
        detached(q), detached(y), detached(stat),
        rows, s, h, s_b, s_s, s_h if step is None else step, s_d,
        float(order.mean_factor), float(eps),
        D=d, PHASE=phase, FLAVOR=order.flavor, DOWNCAST=dtype_name(q) != "float32",
        FLAT_ROWS=step is not None, enable_fp_fusion=False, **cfg,
    )


def q_rms_norm_stats(q: Any, order: Order | None = None) -> Any:
    """``mean(q^2, -1)`` as a new contiguous fp32 [b, s, h, 1] tensor, summed in ``order``."""
    check_q(q)
    order = order or default_order(q)
    b, s, h, _ = shape_of(q)
    ms = empty_like(q, shape=[b, s, h, 1], dtype=_float32_of(q))
    _fwd(q, q, ms, PHASE_STATS, order, 0.0)
    return ms


def q_rms_norm_apply(q: Any, r: Any) -> Any:
    """``q * r`` (r fp32 [b, s, h, 1], contiguous) rounded to q's dtype, as a new contiguous tensor."""
    check_q(q)
    b, s, h, _ = shape_of(q)
    if shape_of(r) != [b, s, h, 1] or dtype_name(r) != "float32":
        raise ValueError(f"q_rms_norm: `r` must be float32 [{b}, {s}, {h}, 1], got {dtype_name(r)} {shape_of(r)}")
    y = empty_like(q)
    _fwd(q, y, _contiguous(r), PHASE_APPLY, paddle_cpu_order(), 0.0)
    return y


def q_rms_norm_fused(q: Any, eps: float, order: Order | None = None) -> tuple[Any, Any]:
    """One kernel: ``(y, r)`` with ``r = rsqrt(mean(q^2) + eps)`` fp32 [b, s, h, 1] and ``y = q * r``."""
    check_q(q)
    order = order or default_order(q)
    b, s, h, _ = shape_of(q)
    y = empty_like(q)
    r = empty_like(q, shape=[b, s, h, 1], dtype=_float32_of(q))
    _fwd(q, y, r, PHASE_FUSED, order, eps)
    return y, r


def q_rms_norm_bwd(dy: Any, q: Any, r: Any, order: Order | None = None) -> Any:
    """The gradient for ``q`` given ``dy`` (like q, any strides) and the forward's ``r``; a new contiguous tensor."""
    check_q(q)
    check_q(dy, "dy", "q_rms_norm (backward)")
    b, s, h, d = shape_of(q)
    if shape_of(dy) != [b, s, h, d]:
        raise ValueError(f"q_rms_norm (backward): `dy` must have q's shape {[b, s, h, d]}, got {shape_of(dy)}")
    if shape_of(r) != [b, s, h, 1] or dtype_name(r) != "float32":
        raise ValueError(f"q_rms_norm (backward): `r` must be float32 [{b}, {s}, {h}, 1], "
                         f"got {dtype_name(r)} {shape_of(r)}")
    order = order or default_order(q)
    dx = empty_like(q)
    rows = b * s * h
    if rows == 0 or d == 0:
        return dx
    cfg = _config(d, order, backward=True)
    x_strides, g_strides = strides_of(q), strides_of(dy)
    x_step, g_step = _row_stride(shape_of(q), x_strides), _row_stride(shape_of(dy), g_strides)
    flat = x_step is not None and g_step is not None
    if flat:
        x_strides[2], g_strides[2] = x_step, g_step
    launch(
        _q_rms_norm_bwd_kernel, (triton.cdiv(rows, cfg["BLOCK_R"]),),
        detached(q), detached(dy), detached(_contiguous(r)), dx,
        rows, s, h, *x_strides, *g_strides,
        float(order.inv_d),
        D=d, FLAVOR=order.flavor, DOWNCAST=dtype_name(dx) != "float32",
        FLAT_ROWS=flat, enable_fp_fusion=False, **cfg,
    )
    return dx


def _contiguous(t: Any) -> Any:
    return t if t.is_contiguous() else t.contiguous()
