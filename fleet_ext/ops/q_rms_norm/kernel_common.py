"""Device helpers shared by the q RMS norm kernels: the summation tree of an :class:`Order` and row I/O.

``_row_sum`` / ``_combine`` / ``_lanes_tree`` reproduce a reduction order (``kernel_order.py``) exactly;
``_tile`` / ``_put`` / ``_row_offsets`` / ``_narrow`` load and store row chunks. Device code only: no
Paddle or torch import, nothing decided about the machine at import.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Set when these kernels were decorated for Triton's interpreter (``fleet_ext.capability.prepare_triton`` runs
# first). There ``tl.cumsum`` is NumPy's ``cumsum``: a strictly sequential fp32 accumulation, so a one-lane order
# (Paddle CPU's) is one vectorised scan instead of D one-column steps. Compiled, a scan is a parallel tree: the
# branch that uses it is never compiled.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


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
def _sequential_sum(terms, col, D: tl.constexpr):
    """Interpreter only: ``((0 + t0) + t1) + ... + t(D-1)`` per row of ``terms`` [R, W], bit for bit: the scan's last
    column (its -0.0 for all-zero terms becomes +0.0 in the masked sum, as the loop from 0.0 gives)."""
    running = tl.cumsum(terms, axis=1)
    return tl.sum(tl.where((col == D - 1)[None, :], running, 0.0), axis=1)


@triton.jit
def _sequential_row_sum(a_ptr, a_row, a_sd, b_ptr, b_row, b_sd, row_mask, SQUARE: tl.constexpr, D: tl.constexpr):
    """:func:`_row_sum` in the one-lane order, interpreted: the whole row loaded once, then one scan."""
    col = tl.arange(0, triton.next_power_of_2(D))
    mask = row_mask[:, None] & (col < D)[None, :]
    a = tl.load(a_ptr + a_row[:, None] + col[None, :] * a_sd, mask=mask, other=0.0).to(tl.float32)
    if SQUARE:
        terms = a * a
    else:
        terms = tl.load(b_ptr + b_row[:, None] + col[None, :] * b_sd, mask=mask, other=0.0).to(tl.float32) * a
    return _sequential_sum(terms, col, D)


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
    if C == 1 and _INTERPRETED:
        return _sequential_row_sum(a_ptr, a_row, a_sd, b_ptr, b_row, b_sd, row_mask, SQUARE, D)
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
def _row_tiles(ptr, row_off, s_d, row_mask, C: tl.constexpr, D: tl.constexpr, NT: tl.constexpr, STREAM: tl.constexpr):
    """The one-pass kernels' row in registers: chunks 0 .. NT-1 (NT <= 8) of ``C`` columns, fp32 [R, C] each; the
    slots from NT on repeat chunk 0 (no load; the callers read only the first NT)."""
    x0 = _tile(ptr, row_off, s_d, row_mask, 0, C, D, STREAM)
    x1, x2, x3, x4, x5, x6, x7 = x0, x0, x0, x0, x0, x0, x0
    if NT > 1:
        x1 = _tile(ptr, row_off, s_d, row_mask, 1, C, D, STREAM)
    if NT > 2:
        x2 = _tile(ptr, row_off, s_d, row_mask, 2, C, D, STREAM)
    if NT > 3:
        x3 = _tile(ptr, row_off, s_d, row_mask, 3, C, D, STREAM)
    if NT > 4:
        x4 = _tile(ptr, row_off, s_d, row_mask, 4, C, D, STREAM)
    if NT > 5:
        x5 = _tile(ptr, row_off, s_d, row_mask, 5, C, D, STREAM)
    if NT > 6:
        x6 = _tile(ptr, row_off, s_d, row_mask, 6, C, D, STREAM)
    if NT > 7:
        x7 = _tile(ptr, row_off, s_d, row_mask, 7, C, D, STREAM)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _add_products(acc, a1, a2, a3, a4, a5, a6, a7, b1, b2, b3, b4, b5, b6, b7, NT: tl.constexpr):
    """``acc + a1 * b1 + ... `` over chunks 1 .. NT-1, left to right (one rounding per product and per add: the
    kernels are built without FMA contraction); the caller puts chunk 0's product in ``acc``."""
    if NT > 1:
        acc = acc + a1 * b1
    if NT > 2:
        acc = acc + a2 * b2
    if NT > 3:
        acc = acc + a3 * b3
    if NT > 4:
        acc = acc + a4 * b4
    if NT > 5:
        acc = acc + a5 * b5
    if NT > 6:
        acc = acc + a6 * b6
    if NT > 7:
        acc = acc + a7 * b7
    return acc


@triton.jit
def _inv_sqrt(v):
    """``r = 1 / sqrt(v)`` from two correctly rounded fp32 operations, ``div_rn(1, sqrt_rn(v))``: bit for bit the
    references' ``inv_sqrt`` (``fleet_ext.ops.q_rms_norm.reference``) and torch's eager ``1 / torch.sqrt(v)``."""
    return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), tl.math.sqrt_rn(v))


@triton.jit
def _d_v(g_r, r, v, FLAVOR: tl.constexpr):
    """The gradient reaching ``v = ms + eps`` from ``g_r`` (the gradient reaching ``r = 1 / sqrt(v)``), in the
    flavour's operations. Paddle CPU autograd of ``reciprocal(fp32(sqrt(fp64(v))))``: the reciprocal's
    ``((g * -1) * r) * r`` in fp32, the fp64 square root's ``(0.5 * d) / sqrt(v)`` in fp64 (IEEE: an fp64 ``sqrt``
    and ``/``, compiled or interpreted), rounded to fp32. torch autograd of ``1 / torch.sqrt(v)``: the reciprocal's
    ``-g * (r * r)``, the square root's ``d / (2 * sqrt(v))`` (both fp32, correctly rounded)."""
    if FLAVOR == 0:
        d_s = ((g_r * -1.0) * r) * r
        d_v = ((d_s.to(tl.float64) * 0.5) / tl.sqrt(v.to(tl.float64))).to(tl.float32)
    else:
        d_v = tl.math.div_rn(-g_r * (r * r), tl.math.sqrt_rn(v) * 2.0)
    return d_v


@triton.jit
def _row_v(
    x_ptr, x_row, x_sd, row_mask, mean_factor, eps, D: tl.constexpr, BLOCK_R: tl.constexpr, LANES: tl.constexpr,
    NACC: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr, FLAVOR: tl.constexpr,
):
    """``v = mean(x^2) + eps`` per row, the row streamed: the sum in the order, then the flavour's mean (Paddle
    CPU: ``sum / d``; torch: ``sum * factor``)."""
    total = _row_sum(x_ptr, x_row, x_sd, x_ptr, x_row, x_sd, row_mask, True, D, BLOCK_R, LANES, NACC, ACC_INNER,
                     HALVING)
    if FLAVOR == 0:
        ms = tl.math.div_rn(total, tl.full([BLOCK_R], D, tl.float32))
    else:
        ms = total * mean_factor
    return ms + eps


@triton.jit
def _one_pass_v(
    x0, x1, x2, x3, x4, x5, x6, x7, mean_factor, eps, NT: tl.constexpr, BLOCK_R: tl.constexpr,
    LANES: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
):
    """``v = mean(x^2) + eps`` per row from the row's chunks (torch order, 4 accumulators a lane).

    The one place this is computed on the one-pass path: the forwards and the backwards (which need ``sqrt(v)``
    for the gradient and may recompute ``r`` instead of reading it, ``RECOMPUTE_R``) run this same code on the
    same fp32 chunks, so they get the same bits (kernels built without FMA contraction; tests compare them)."""
    acc = _add_products(x0 * x0, x1, x2, x3, x4, x5, x6, x7, x1, x2, x3, x4, x5, x6, x7, NT)  # squares: never -0
    return _combine(acc, BLOCK_R, LANES, 4, ACC_INNER, HALVING) * mean_factor + eps


@triton.jit
def _bwd_r(
    r_ptr, rows, row_mask, x0, x1, x2, x3, x4, x5, x6, x7, mean_factor, eps, NT: tl.constexpr,
    BLOCK_R: tl.constexpr, LANES: tl.constexpr, ACC_INNER: tl.constexpr, HALVING: tl.constexpr,
    RECOMPUTE_R: tl.constexpr, STORE_R: tl.constexpr,
):
    """A one-pass backward's ``(r, v)``: ``v`` recomputed from the row's x chunks by :func:`_one_pass_v` with the
    forward's ``mean_factor`` and ``eps`` (the gradient of ``1 / sqrt(v)`` needs ``sqrt(v)``, which ``r`` does not
    determine); ``r`` read from ``r_ptr``, or (RECOMPUTE_R) ``1 / sqrt(v)`` as the forward computes it, and then
    (STORE_R) written to ``r_ptr``."""
    v = _one_pass_v(x0, x1, x2, x3, x4, x5, x6, x7, mean_factor, eps, NT, BLOCK_R, LANES, ACC_INNER, HALVING)
    if RECOMPUTE_R:
        r = _inv_sqrt(v)
        if STORE_R:
            tl.store(r_ptr + rows, r, mask=row_mask)
    else:
        r = tl.load(r_ptr + rows, mask=row_mask, other=0.0)
    return r, v


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
