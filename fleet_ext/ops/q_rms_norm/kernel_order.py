"""Summation orders of the q RMS norm: which eager reduction a kernel launch reproduces (host side).

A bitwise match with an eager framework means summing ``x^2`` (forward) and ``dy * x`` (backward) in that
framework's order, so the order is a parameter of the kernels (see ``kernel.py``'s docstring for the two
orders modelled and the general chunked form). :class:`Order` describes one; :func:`paddle_cpu_order` and
:func:`torch_cuda_order` compute the ones the platforms use. The device side of an order (the per-lane
accumulators and the lane tree) is in ``kernel_common.py``. Pure Python: no Paddle, torch or Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

FLAVOR_PADDLE, FLAVOR_TORCH = 0, 1
_MAX_THREADS = 512  # Reduce.cuh mnt_wrapper<float>::MAX_NUM_THREADS
_WARP = 32


@dataclass(frozen=True)
class Order:
    """How a row sum is ordered (``kernel.py``'s docstring) and which elementwise flavour goes with it.

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
    return _torch_cuda_order(int(rows), int(d), int(vec_min_d), bool(halving))


@functools.lru_cache(maxsize=1024)
def _torch_cuda_order(rows: int, d: int, vec_min_d: int, halving: bool) -> Order:
    """:func:`torch_cuda_order` with its defaults resolved; cached (a pure function of ints, asked every forward)."""
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
