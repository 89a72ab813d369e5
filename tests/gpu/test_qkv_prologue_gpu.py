"""The fused attention prologue on CUDA (torch tensors, bf16 and fp32): vs the eager torch sequence and an oracle.

Run on the H200 (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu/test_qkv_prologue_gpu.py``.
Skipped without CUDA.

- **Eager torch sequence** (what the Paddle path runs, op by op): q: ``xf = x.float(); (xf * (1 / torch.sqrt(
  xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)`` then the RoPE's eager sequence
  (tests/helpers/torch_rope.py); kv: ``(w * (xf * (1 / sqrt(..)))).to(x.dtype)`` then the RoPE. Bitwise claims (where
  ``kernel.default_order`` says the order is modelled, ``order.exact``): ``y``, the fp32 ``r`` and ``dx`` (torch
  autograd of the sequence) byte for byte, the production shapes included. The kv gain's gradient is summed in a
  fixed blocked order, not torch's: within ``kv_prologue_dw`` (tests/helpers/tolerances.py) of float64 and of
  torch autograd's, byte-identical run to run.
- **Oracle** (NumPy float64, independent of torch and of the kernels; ml_dtypes for bf16): ``y`` is the
  float64 norm (rounded to bf16 where the op stores it, for bf16) rotated in float64, within ``qkv_prologue_y``
  of each row's largest value; ``dx`` the float64 gradient within ``q_rms_norm_dx``.
- **Anti-vacuity**: the same kernel summing in Paddle CPU's sequential order differs from eager torch on some
  rows, so the bitwise match is a property of the order, not of the data.
- **kv backward plans**: the gain gradient inside the row programs (``DW_FUSED``, the default: a partial per
  row block, a short last block, the partials' reduction in one or several steps) and in dedicated programs:
  dx bitwise vs eager torch, dw within ``kv_prologue_dw``, byte-identical run to run, the backward kernel and
  the partials' reduction each launched once a call.
- **r recomputed** (the training path: ``norm_rope_fused(.., keep_r=False)`` writes only ``y``; the backward given
  ``r=None`` recomputes ``r``): on every q and kv shape above and the production shapes, the backward's ``r``
  (``r_out``) equals the forward's byte for byte and its ``dx`` eager torch's; its ``dw`` is within
  ``kv_prologue_dw`` and byte-identical run to run, but not bitwise the ``dw`` computed with the forward's ``r``
  (the H200, 2026-12-01: 1-2 fp32 ulps apart on some columns; each kernel variant's ``tl.sum`` over a block's rows
  follows the register layout the compiler chose for it); a backward with another eps is caught. The kv plan with
  dedicated gain programs keeps ``r``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_bitwise, assert_close, expect_launches
from helpers import oracles as orc
from helpers.gpu import CUDA_ONLY
from helpers.torch_rope import eager_rope

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float32]
EPS = 1e-6


@pytest.fixture(scope="module")
def kernel():
    from fleet_ext.ops.qkv_prologue import kernel as prologue  # imported only where it will run

    assert not prologue.is_interpreted()
    return prologue


def _table(kind: str) -> str:
    return "bf16" if kind == torch.bfloat16 else "fp32"


def tables(seq: int, rd: int, offset: int = 7):
    """fp32 cos/sin [seq, rd/2] rounded once from float64 angles (as fleet_ext.layers.rope builds them)."""
    angles = orc.rope_angles(np.arange(seq) + offset, orc.plain_inv_freq(rd, 10000.0))
    return (torch.tensor(np.cos(angles), dtype=torch.float32, device=DEVICE),
            torch.tensor(np.sin(angles), dtype=torch.float32, device=DEVICE), angles)


def make(shape, dtype, seed=0, gain: bool = False):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = torch.rand(shape[:-1] + (1,), generator=gen, device=DEVICE) * 10 + 0.1
    x = (torch.randn(shape, generator=gen, device=DEVICE) * scale).to(dtype)
    g = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    w = 1 + 0.3 * torch.randn(shape[-1], generator=gen, device=DEVICE) if gain else None
    return x, g, w


def eager(x, cos, sin, w=None):
    """The separate ops' eager sequence: ``(y, r)``."""
    xf = x.float()
    r = 1 / torch.sqrt(xf.square().mean(-1, keepdim=True) + EPS)
    normed = xf * r
    return eager_rope((normed if w is None else w * normed).to(x.dtype), cos, sin), r


def eager_grads(x, g, cos, sin, w=None):
    """torch autograd of the eager sequence: ``(dx, dw)``."""
    leaf = x.detach().clone().requires_grad_(True)
    w_leaf = None if w is None else w.detach().clone().requires_grad_(True)
    eager(leaf, cos, sin, w_leaf)[0].backward(g)
    return leaf.grad, None if w is None else w_leaf.grad


# (shape, rope width, what it covers); kv shapes are [b, s, d]
Q_SHAPES = [
    ((2, 64, 16, 512), 64, "DSv4 head, vec4, 32 lanes"),
    ((1, 128, 8, 64), 16, "unvectorised, 2 steps"),
    ((3, 5, 7, 33), 8, "unvectorised with a tail, odd pass-through width"),
    ((1, 64, 16, 576), 64, "vec4, 576"),
    ((1, 1, 1, 512), 64, "one row: 128 lanes"),
    ((1, 1, 2, 4096), 64, "two rows: 256 lanes"),
]
KV_SHAPES = [
    ((2, 1024, 512), 64, "DSv4 kv head"),
    ((3, 50, 64), 16, "unvectorised"),
    ((2, 7, 33), 8, "odd width"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, rd, what", Q_SHAPES)
def test_q_bitwise_vs_eager_torch(kernel, shape, rd, what, dtype):
    x, g, _ = make(shape, dtype, seed=sum(shape))
    cos, sin, _ = tables(shape[1], rd)
    order = kernel.default_order(x)
    assert order.exact, what
    y, r = kernel.norm_rope_fused(x, EPS, cos, sin)
    y_eager, r_eager = eager(x, cos, sin)
    assert_bitwise(r, r_eager, f"r {what} {dtype}")
    assert_bitwise(y, y_eager, f"y {what} {dtype}")
    dx, dw = kernel.norm_rope_bwd(g, x, r, cos, sin, eps=EPS)
    assert dw is None
    assert_bitwise(dx, eager_grads(x, g, cos, sin)[0], f"dx {what} {dtype}")
    _check_recomputed_r(kernel, x, g, cos, sin, None, y, r, dx, None, f"{what} {dtype}")


def _check_recomputed_r(kernel, x, g, cos, sin, w, y, r, dx, dw_eager, what: str) -> None:
    """The training path: the forward without ``r`` (same ``y``), the backward recomputing it (one backward launch,
    plus the gain's reduction for kv): its ``r`` is the forward's byte for byte, ``dx`` the one computed with the
    forward's ``r`` (already checked against eager torch), ``dw`` within its tolerance and deterministic; a planted
    eps is caught."""
    assert kernel.recomputes_r(x.shape[-1], kernel.default_order(x), w is not None), what
    with expect_launches("_norm_rope_fwd_kernel", "_norm_rope_bwd_kernel", exactly=1):
        y_no_r, no_r = kernel.norm_rope_fused(x, EPS, cos, sin, w, keep_r=False)
        r_bwd = torch.full_like(r, -1.0)  # poisoned: every row must be written
        dx_rc, dw_rc = kernel.norm_rope_bwd(g, x, None, cos, sin, w, eps=EPS, r_out=r_bwd)
    assert no_r is None, what
    assert_bitwise(y_no_r, y, f"y without r {what}")
    assert_bitwise(r_bwd, r, f"the backward's recomputed r vs the forward's {what}")
    assert_bitwise(dx_rc, dx, f"dx, r recomputed {what}")
    if w is not None:
        _dw_checks(kernel, dw_rc, dw_eager, x, g, r, cos, sin, f"r recomputed {what}")
        assert_bitwise(kernel.norm_rope_bwd(g, x, None, cos, sin, w, eps=EPS)[1], dw_rc, f"dw run to run {what}")
    planted = torch.full_like(r, -1.0)
    kernel.norm_rope_bwd(g, x, None, cos, sin, w, eps=1e-2, r_out=planted)
    with pytest.raises(AssertionError):
        assert_bitwise(planted, r, f"planted: another eps {what}")


def _dw_checks(kernel, dw, dw_eager, x, g, r, cos, sin, what: str) -> None:
    """The gain's gradient within its tolerance of float64 and of torch autograd's, relative to sum |terms|."""
    from fleet_ext.ops.rope import kernel as rope_kernel

    d = x.shape[-1]
    g_rope = rope_kernel.rope_grad(g, cos, sin).double()  # bitwise the RoPE gradient autograd forms (test_rope_gpu)
    terms = (g_rope * (x.float() * r).double()).reshape(-1, d)
    scale = terms.abs().sum(0)
    assert_close(dw, terms.sum(0), "fp32", "kv_prologue_dw", what=f"dw vs float64 {what}", scale=scale)
    assert_close(dw, dw_eager, "fp32", "kv_prologue_dw", what=f"dw vs torch autograd {what}", scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, rd, what", KV_SHAPES)
def test_kv_vs_eager_torch_and_the_oracle(kernel, shape, rd, what, dtype):
    """y, r and dx bitwise vs eager torch; dw within its tolerance, deterministic."""
    x, g, w = make(shape, dtype, seed=sum(shape) + 1, gain=True)
    cos, sin, _ = tables(shape[1], rd)
    assert kernel.default_order(x).exact, what
    y, r = kernel.norm_rope_fused(x, EPS, cos, sin, w)
    y_eager, r_eager = eager(x, cos, sin, w)
    assert_bitwise(r, r_eager, f"r {what} {dtype}")
    assert_bitwise(y, y_eager, f"y {what} {dtype}")
    dx, dw = kernel.norm_rope_bwd(g, x, r, cos, sin, w, eps=EPS)
    dx_eager, dw_eager = eager_grads(x, g, cos, sin, w)
    assert_bitwise(dx, dx_eager, f"dx {what} {dtype}")
    _dw_checks(kernel, dw, dw_eager, x, g, r, cos, sin, f"{what} {dtype}")
    assert_bitwise(kernel.norm_rope_bwd(g, x, r, cos, sin, w, eps=EPS)[1], dw, f"dw run to run {what}")
    _check_recomputed_r(kernel, x, g, cos, sin, w, y, r, dx, dw_eager, f"{what} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_production_shapes(kernel, dtype, heavy_gpu_memory):
    """q [1, 16384, 64, 512] (1 GiB in bf16) and kv [1, 16384, 512], pe 64: bitwise (dw: its tolerance)."""
    cos, sin, _ = tables(16384, 64)
    x, g, _ = make((1, 16384, 64, 512), dtype, seed=7)
    y, r = kernel.norm_rope_fused(x, EPS, cos, sin)
    assert_bitwise(y, eager(x, cos, sin)[0], "q y production")
    dx = kernel.norm_rope_bwd(g, x, r, cos, sin, eps=EPS)[0]
    assert_bitwise(dx, eager_grads(x, g, cos, sin)[0], "q dx production")
    _check_recomputed_r(kernel, x, g, cos, sin, None, y, r, dx, None, "q production")
    del x, g, y, r, dx
    torch.cuda.empty_cache()
    x, g, w = make((1, 16384, 512), dtype, seed=8, gain=True)
    y, r = kernel.norm_rope_fused(x, EPS, cos, sin, w)
    assert_bitwise(y, eager(x, cos, sin, w)[0], "kv y production")
    dx, dw = kernel.norm_rope_bwd(g, x, r, cos, sin, w, eps=EPS)
    dx_eager, dw_eager = eager_grads(x, g, cos, sin, w)
    assert_bitwise(dx, dx_eager, "kv dx production")
    _dw_checks(kernel, dw, dw_eager, x, g, r, cos, sin, "production")
    _check_recomputed_r(kernel, x, g, cos, sin, w, y, r, dx, dw_eager, "kv production")


def test_the_order_matters(kernel):
    """Anti-vacuity: summing in Paddle CPU's sequential order gives other statistics on some rows."""
    from fleet_ext.ops.q_rms_norm.kernel_order import paddle_cpu_order

    x, _, _ = make((1, 256, 16, 512), torch.float32, seed=3)
    cos, sin, _ = tables(256, 64)
    _, r_seq = kernel.norm_rope_fused(x, EPS, cos, sin, order=paddle_cpu_order())
    _, r = kernel.norm_rope_fused(x, EPS, cos, sin)
    r_eager = eager(x, cos, sin)[1]
    assert_bitwise(r, r_eager, "r, torch order")
    assert (r_seq.view(torch.int32) != r_eager.view(torch.int32)).sum().item() > 0, "data too easy"


def _ml():
    return pytest.importorskip("ml_dtypes", reason="the bf16 oracle rounds with ml_dtypes")


def _oracle(x, g, w, angles):
    """float64 (y, dx); for bf16 the norm's output is rounded to bf16 before the rotation, as the op stores it."""
    heads = x.ndim == 4
    ang = angles[:, None, :] if heads else angles
    normed = orc.rms_norm(x, w, EPS)
    if x.dtype == torch.bfloat16:
        normed = normed.astype(_ml().bfloat16).astype(np.float64)
    y = orc.rope(normed, ang)
    x64, d = orc.f64(x), x.shape[-1]
    g64 = orc.rope(orc.f64(g), ang, inverse=True)  # the rotation's transpose is its inverse
    dn = g64 if w is None else g64 * orc.f64(w)
    r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS)
    dx = dn * r - x64 * (r**3) * (dn * x64).sum(-1, keepdims=True) / d
    return y, dx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, rd", [((2, 8, 4, 512), 64), ((1, 5, 3, 100), 16), ((2, 40, 512), 64),
                                       ((3, 9, 33), 8)])
def test_vs_numpy_oracle(kernel, shape, rd, dtype):
    x, g, w = make(shape, dtype, seed=11, gain=len(shape) == 3)
    cos, sin, angles = tables(shape[1], rd)
    y, r = kernel.norm_rope_fused(x, EPS, cos, sin, w)
    dx, _ = kernel.norm_rope_bwd(g, x, r, cos, sin, w, eps=EPS)
    y64, dx64 = _oracle(x, g, w, angles)
    row_max = np.abs(y64).max(-1, keepdims=True)
    assert_close(y, y64, _table(dtype), "qkv_prologue_y", what="y", scale=row_max)
    assert_close(dx, dx64, _table(dtype), "q_rms_norm_dx", what="dx")


def test_deterministic(kernel):
    cos, sin, _ = tables(512, 64)
    for shape, gain in (((1, 512, 16, 512), False), ((4, 512, 512), True)):
        x, g, w = make(shape, torch.bfloat16, seed=9, gain=gain)
        y1, r1 = kernel.norm_rope_fused(x, EPS, cos, sin, w)
        y2, r2 = kernel.norm_rope_fused(x, EPS, cos, sin, w)
        assert_bitwise(y1, y2, "y")
        for a, b, what in zip(kernel.norm_rope_bwd(g, x, r1, cos, sin, w, eps=EPS),
                              kernel.norm_rope_bwd(g, x, r2, cos, sin, w, eps=EPS), ("dx", "dw")):
            if a is not None:
                assert_bitwise(a, b, what)


KV_PLANS = [
    ({}, True),
    ({"kv_bwd_rows": 8, "kv_bwd_warps": 4}, True),  # the rows' partial summed across warps
    ({"kv_bwd_rows": 2, "kv_bwd_warps": 1, "reduce_block_c": 32, "reduce_segments": 64}, True),  # 4 reduce steps
    ({"dw_fused": False}, False),  # the dedicated gain programs
]


@pytest.mark.parametrize("settings, fused", KV_PLANS, ids=["default", "8 rows", "2 rows, 4 steps", "dedicated"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_backward_plans(kernel, monkeypatch, settings, fused, dtype):
    """Every kv backward plan: dx bitwise vs eager torch, dw within its tolerance, run to run identical; the
    plan really is the one named (fused or not) and launches the backward kernel and the reduction once each."""
    for key, value in settings.items():
        monkeypatch.setitem(kernel.TUNE, key, value)
    x, g, w = make((3, 150, 512), dtype, seed=21, gain=True)
    cos, sin, _ = tables(150, 64)
    y, r = kernel.norm_rope_fused(x, EPS, cos, sin, w)
    with expect_launches("_norm_rope_bwd_kernel", "_dw_reduce_kernel", exactly=2):
        dx, dw = kernel.norm_rope_bwd(g, x, r, cos, sin, w, eps=EPS)
        dx_2, dw_2 = kernel.norm_rope_bwd(g, x, r, cos, sin, w, eps=EPS)
    plan = next(p for k, p in kernel._BWD_PLANS.items() if k[0] == kernel.layout_key(g) and k[-1] == kernel._tuning())
    assert plan.meta["DW_FUSED"] is fused and plan.info[2] > 1, (plan.meta, plan.info)
    assert (kernel.norm_rope_fused(x, EPS, cos, sin, w, keep_r=False)[1] is None) is fused  # dedicated: r kept
    dx_eager, dw_eager = eager_grads(x, g, cos, sin, w)
    assert_bitwise(dx, dx_eager, f"dx {settings} {dtype}")
    _dw_checks(kernel, dw, dw_eager, x, g, r, cos, sin, f"{settings} {dtype}")
    assert_bitwise(dx_2, dx, "dx run to run")
    assert_bitwise(dw_2, dw, "dw run to run")
