"""Device helpers of the grouped expert GEMMs (``kernel.py``, ``kernel_bwd.py``): the tile map, the K loops, TMA.

- **Tile map, on the device.** The rows of expert ``e`` are the segment ``[sum(counts[:e]), sum(counts[:e + 1]))``
  cut at ``N``; each segment is cut into ``BM``-row tiles (its last tile masked, no padding to a capacity), and
  the rows past ``sum(counts)`` (if any) into zero tiles (expert ``E``: nothing read, zeros written).
  ``_segments`` builds the per-expert lanes (first row, rows, first and end tile) from ``counts`` once per
  program, ``_locate`` finds a tile's expert with one fused reduction (no search, no table in memory), and
  ``_tile_coords`` orders the (row tile, column tile) pairs ``GROUP_M`` row tiles at a time, so the weight
  columns of an expert are read by its row tiles together.
- **Two load paths, one result.** Pointer loads (``cp.async``, masked: rows past the read end read as 0) and,
  where the tensors allow it, TMA tensor descriptors (``*_tma``). A row tile's TMA load may read the next
  expert's rows: the row GEMMs zero those rows in the epilogue (``tl.where``) before the masked store. In the
  weight gradients the rows are the K dimension, so rows outside the segment must read as zero: those loads go
  through a *ragged* descriptor (two extra leading dimensions whose strides wrap the 64-bit address, so that
  the hardware bounds check is the segment's end: reading past it gives zeros).
- Host side: :func:`descriptor` / :func:`ragged_descriptor` build Triton's host TensorDescriptors (on torch views
  of Paddle tensors), :func:`tma_route` says where the TMA path may run, :func:`program_count` sizes persistent
  grids, ``PATH_COUNTS`` counts the launches per (kernel, load path, grid kind), so tests can assert which code
  path ran.
"""

from __future__ import annotations

import collections
from typing import Any

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fleet_ext import capability
from fleet_ext.ops.launch import route_of, shape_of, strides_of, torch_view
from fleet_ext.ops.multiprocessors import multiprocessor_count

RAGGED_ROWS = tl.constexpr(2**30)  # the ragged descriptor's row extent: a segment's rows sit at [2**30 - rows, 2**30)
RAGGED_OUTER = 0x7FFF0000  # extent of its two leading (address-wrapping) dimensions


@triton.jit
def _segments(counts_ptr, N, E, BM: tl.constexpr, E_PAD: tl.constexpr):
    """Per expert lane (first row, rows, first tile, end tile), with the counts cut at ``N``; the rows the experts
    hold, their tile count, and every row tile of the launch (zero tiles for the rows past the counts included)."""
    ex = tl.arange(0, E_PAD)
    return _segment_lanes(ex, tl.load(counts_ptr + ex, mask=ex < E, other=0).to(tl.int32), N, BM)


@triton.jit
def _segment_lanes(ex, c, N, BM: tl.constexpr):
    """:func:`_segments` from the loaded counts ``c`` (int32, one lane per expert ``ex``): no layout of its own, so
    the Gluon kernels call it too, on lanes in their partition's layout."""
    cum = tl.cumsum(c, axis=0)
    start = tl.minimum(cum - c, N)
    rows = tl.minimum(cum, N) - start
    tiles = (rows + BM - 1) // BM
    tile_end = tl.cumsum(tiles, axis=0)
    total = tl.sum(rows, axis=0)
    expert_tiles = tl.sum(tiles, axis=0)
    m_tiles = expert_tiles + (N - total + BM - 1) // BM
    return ex, start, rows, tile_end - tiles, tile_end, total, expert_tiles, m_tiles


@triton.jit
def _add5(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4


@triton.jit
def _locate(tile, ex, start, rows, tile_start, tile_end, total, expert_tiles, N, E, BM: tl.constexpr):
    """(expert, first row, read end, write end) of row tile ``tile``: one fused reduction over the expert lanes.

    A tile past the experts' tiles is a zero tile: expert ``E`` (no weight), nothing read, rows up to ``N`` written.
    """
    hit = (tile_start <= tile) & (tile < tile_end)  # one lane at most (empty experts own no tile)
    e, s, r, t, found = tl.reduce((tl.where(hit, ex, 0), tl.where(hit, start, 0), tl.where(hit, rows, 0),
                                   tl.where(hit, tile_start, 0), hit.to(tl.int32)), 0, _add5)
    is_expert = found > 0
    e = tl.where(is_expert, e, E)
    row0 = tl.where(is_expert, s + (tile - t) * BM, total + (tile - expert_tiles) * BM)
    read_end = tl.where(is_expert, s + r, total)
    write_end = tl.where(is_expert, s + r, N)
    return e, row0, read_end, write_end


@triton.jit
def _row_tile(tile_id, lanes, m_tiles, n_tiles, N, E, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """(expert, weight expert, first row, read end, write end, column tile) of row-GEMM tile ``tile_id``, from the
    :func:`_segments` lanes; a zero tile's weight expert is the last one (read, never used: its rows are zeroed)."""
    tile_m, tile_n = _tile_coords(tile_id, m_tiles, n_tiles, GROUP_M)
    ex, start, seg_rows, t0, t1, total, expert_tiles, _ = lanes
    e, row0, read_end, write_end = _locate(tile_m, ex, start, seg_rows, t0, t1, total, expert_tiles, N, E, BM)
    return e, tl.minimum(e, E - 1), row0, read_end, write_end, tile_n


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _weight_tile(tile_id, ex, start_e, rows_e, per_expert, tiles_n, BM: tl.constexpr, BN: tl.constexpr):
    """(expert, first row of the output tile, first column, the expert's first input row, its rows) of weight-gradient
    tile ``tile_id`` (expert-major, then row tiles, then column tiles: an expert's rows stay in L2 for its tiles)."""
    e = tile_id // per_expert
    m0 = ((tile_id % per_expert) // tiles_n) * BM
    n0 = (tile_id % tiles_n) * BN
    start, count = tl.reduce((tl.where(ex == e, start_e, 0), tl.where(ex == e, rows_e, 0)), 0, _add2)
    return e, m0, n0, start, count


@triton.jit
def _tile_coords(tile_id, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of ``tile_id``: ``GROUP_M`` row tiles sweep the column tiles together."""
    in_group = GROUP_M * n_tiles
    first = (tile_id // in_group) * GROUP_M
    size = tl.maximum(tl.minimum(m_tiles - first, GROUP_M), 1)
    return first + (tile_id % in_group) % size, (tile_id % in_group) // size


@triton.jit
def _swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
    """``silu(min(g, limit)) * clip(u, -limit, limit)`` in fp32 (no clamp without a limit)."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def _gate_up_epilogue(acc_g, acc_u, rows, cols, read_end, write_end, gu_ptr, h_ptr, INTER, s_gu, s_h, limit,
                      HAS_LIMIT: tl.constexpr):
    """The gate+up tile's epilogue (Triton and Gluon kernels alike): rows past ``read_end`` (the next expert's, read
    by TMA, or no expert's) zeroed; gate and up rounded to the output dtype and stored at columns n and I + n; h
    from the rounded values, as the reference computes it from the stored pre-activation."""
    dtype = gu_ptr.dtype.element_ty
    live = (rows < read_end)[:, None]
    g = tl.where(live, acc_g, 0.0).to(dtype)
    u = tl.where(live, acc_u, 0.0).to(dtype)
    r64 = rows.to(tl.int64)[:, None]
    mask = (rows < write_end)[:, None] & (cols < INTER)[None, :]
    tl.store(gu_ptr + r64 * s_gu + cols[None, :], g, mask=mask)
    tl.store(gu_ptr + r64 * s_gu + INTER + cols[None, :], u, mask=mask)
    h = _swiglu(g.to(tl.float32), u.to(tl.float32), limit, HAS_LIMIT)
    tl.store(h_ptr + r64 * s_h + cols[None, :], h.to(dtype), mask=mask)


@triton.jit
def _row_loop(a_ptr, b_ptr, rows, read_end, cols, K, NO, sa, sb_k, sb_n, acc, acc2, b2_off,
              TWO: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
              PREC: tl.constexpr):
    """Pointer path: ``acc += A[rows, :] @ B[:, cols]`` (and ``acc2`` with ``B[:, cols + b2_off]`` when ``TWO``)."""
    ks = tl.arange(0, BK)
    row_ok = rows < read_end
    col_ok = cols < NO
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * sa + ks[None, :]
    b_ptrs = b_ptr + ks[:, None] * sb_k + cols[None, :] * sb_n  # inside one expert's weight: < 2**31
    for k0 in range(0, K, BK):
        if EVEN_K:
            a_mask = row_ok[:, None]
            b_mask = col_ok[None, :]
        else:
            k_ok = (k0 + ks) < K
            a_mask = row_ok[:, None] & k_ok[None, :]
            b_mask = k_ok[:, None] & col_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if EVEN_N and EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        if TWO:
            if EVEN_N and EVEN_K:
                b2 = tl.load(b_ptrs + b2_off)
            else:
                b2 = tl.load(b_ptrs + b2_off, mask=b_mask, other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=PREC)
        a_ptrs += BK
        b_ptrs += BK * sb_k
    return acc, acc2


@triton.jit
def _row_loop_tma(a_desc, b_desc, row0, e, n0, K, acc, acc2, b2_off, TWO: tl.constexpr, B_NK: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """TMA path: the same sums, A through a [N, K] descriptor (rows past the segment are read: the caller zeroes
    them), B[e] through an [E, K, n] descriptor, or [E, n, K] when ``B_NK`` (a transposed weight). Columns and
    K past the tensor's end read as zero (the descriptor's bounds)."""
    for k0 in range(0, K, BK):
        a = a_desc.load([row0, k0])
        if B_NK:
            b = tl.trans(tl.reshape(b_desc.load([e, n0, k0]), [BN, BK]))
        else:
            b = tl.reshape(b_desc.load([e, k0, n0]), [BK, BN])
        acc = tl.dot(a, b, acc, input_precision=PREC)
        if TWO:
            b2 = tl.reshape(b_desc.load([e, k0, n0 + b2_off]), [BK, BN])
            acc2 = tl.dot(a, b2, acc2, input_precision=PREC)
    return acc, acc2


@triton.jit
def _load_ragged(desc, seg_start, seg_rows, row, col, BR: tl.constexpr, BC: tl.constexpr):
    """Rows ``[row, row + BR)`` of the segment ``[seg_start, seg_start + seg_rows)`` (relative), columns
    ``[col, col + BC)``, through a :func:`ragged_descriptor`: rows at or past the segment's end read as zero."""
    block = desc.load([RAGGED_ROWS, seg_start + seg_rows, RAGGED_ROWS - seg_rows + row, col])
    return tl.reshape(block, [BR, BC])


# -- host side ----------------------------------------------------------------------------------------------------
TMA_ROUTES = (capability.ROUTE_INTERPRETER, capability.ROUTE_TORCH, capability.ROUTE_TORCH_DLPACK)


def tma_route(kernel: Any, *tensors: Any) -> bool:
    """True where the TMA path can run: a route that hands Triton torch tensors (the interpreter, torch, torch via
    DLPack; the Paddle-proxy route keeps the pointer path: Triton's descriptors need torch's dtype objects) and
    tensors TMA can address (16-byte aligned base and leading strides, last stride 1)."""
    if route_of(kernel) not in TMA_ROUTES:
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or strides_of(t)[-1] != 1 or any(s * size % 16 for s in strides_of(t)[:-1]):
            return False
    return True


def _make_descriptor(base: Any, shape: list[int], strides: list[int], block: list[int], gluon: bool) -> Any:
    """Triton's host TensorDescriptor, or with ``gluon`` Gluon's, which carries the shared-memory layout its kernel
    allocates (the default NVMMA swizzle for ``block``)."""
    if not gluon:
        return TensorDescriptor(base, shape, strides, block)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    elem = {"bfloat16": gl.bfloat16, "float16": gl.float16, "float32": gl.float32}[str(base.dtype).rsplit(".", 1)[-1]]
    return GluonDescriptor(base, shape, strides, block, gl.NVMMASharedLayout.get_default_for(block, elem))


def descriptor(tensor: Any, block: list[int], gluon: bool = False) -> Any:
    """A host TMA descriptor of the whole (contiguous-last-dimension) tensor, loading ``block`` tiles (for a Gluon
    kernel with ``gluon``)."""
    base = torch_view(tensor)
    return _make_descriptor(base, shape_of(base), strides_of(base), list(block), gluon)


def ragged_descriptor(tensor: Any, block_rows: int, block_cols: int, gluon: bool = False) -> Any:
    """A descriptor of the 2-D ``tensor`` [N, C] for :func:`_load_ragged`: two leading dimensions of strides
    ``2**34 - s`` and ``s`` (``s`` the row stride) wrap the 64-bit address so that coordinates
    ``(2**30, start + rows, 2**30 - rows + r)`` address row ``start + r``, and the row extent ``2**30`` makes
    every row at or past ``start + rows`` out of bounds (zeros)."""
    base = torch_view(tensor)
    rows, cols = shape_of(base)
    if rows > RAGGED_ROWS.value:
        raise ValueError(f"moe_experts: a ragged descriptor holds at most 2**30 rows, got {rows}")
    stride = strides_of(base)[0]
    shape = [RAGGED_OUTER, RAGGED_OUTER, RAGGED_ROWS.value, cols]
    return _make_descriptor(base, shape, [2**34 - stride, stride, stride, 1], [1, 1, block_rows, block_cols], gluon)


PATH_COUNTS: collections.Counter[tuple[str, str, str]] = collections.Counter()
GRID_KINDS = ("per tile", "persistent", "persistent flattened")


def count_path(kernel: Any, tma: bool, persistent: int) -> None:
    """Count one launch of ``kernel`` by load path and grid kind (``PATH_COUNTS``)."""
    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
    PATH_COUNTS[(name, "tma" if tma else "pointer", GRID_KINDS[persistent])] += 1


def program_count(kernel: Any) -> int:
    """Programs of a persistent grid: one per multiprocessor (3 in the interpreter, so programs loop over tiles)."""
    return multiprocessor_count(kernel, interpreted=3)


def grid_size(persistent: bool, kernel: Any, tiles: int) -> int:
    """Programs of a launch of at most ``tiles`` tiles: one per tile, or a persistent grid."""
    return max(1, min(tiles, program_count(kernel))) if persistent else max(1, tiles)
