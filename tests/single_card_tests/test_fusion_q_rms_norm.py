"""Fused weightless q RMS norm (Triton, interpreter on CPU) vs the Paddle reference: bitwise, fp32.

The claim (registry ``bitwise_equal``) on CPU is forward AND backward byte-equal to the reference (the
backward being Paddle autograd of ``xf * inv_sqrt(mean(xf^2) + eps)``, ``reference.inv_sqrt``: ``1 / sqrt``
from correctly rounded ops). The kernels reproduce Paddle CPU's row sum (sequential fp32) and gradient formula
op for op; ``r`` is the reference's own ``inv_sqrt`` (``function.py``).
Tested over many head widths (1 .. 512, odd ones included), several programs, non-contiguous q, zero
rows, large and tiny magnitudes, and through an upstream matmul so the parameter gradient is compared.

The GPU configuration (torch CUDA's reduction order, one fused kernel) is exercised here too, in the
interpreter on torch CPU tensors, against a literal NumPy simulation of ``Reduce.cuh``'s threads (written
from the CUDA source, not from the kernel's reshape/split formulation): bitwise, ``1 / sqrt`` correctly rounded
as on the GPU (``div_rn(1, sqrt_rn(v))``, torch's ``1 / torch.sqrt``). The real GPU comparison is tests/gpu.
Every test of the fused function counts the forward and backward kernels' launches.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
import torch
from helpers import assert_bitwise, expect_launches

from fleet_ext import capability

capability.prepare_triton()

from fleet_ext.ops.q_rms_norm import function as fused  # noqa: E402
from fleet_ext.ops.q_rms_norm import kernel  # noqa: E402
from fleet_ext.ops.q_rms_norm import reference as ref  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

F32 = np.float32
EPS = 1e-6
FWD, BWD = "_q_rms_norm_fwd_kernel", "_q_rms_norm_bwd_kernel"


def run(fn, x: np.ndarray, g: np.ndarray, view=None):
    """(y, dx) of fn on a leaf made from ``x`` (optionally through a view), loss sum(y * g)."""
    leaf = paddle.to_tensor(x, stop_gradient=False)
    q = view(leaf) if view is not None else leaf
    y = fn(q, EPS)
    (y * paddle.to_tensor(g)).sum().backward()
    return y.numpy(), leaf.grad.numpy()


WIDTHS = [1, 2, 3, 7, 16, 17, 31, 32, 33, 48, 64, 100, 127, 128, 129, 192, 512]


@pytest.mark.parametrize("d", WIDTHS)
def test_bitwise_forward_and_backward_over_widths(d):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((2, 3, 2, d)) * rng.uniform(0.1, 10, (2, 3, 2, 1))).astype(F32)
    g = rng.standard_normal((2, 3, 2, d)).astype(F32)
    with expect_launches(FWD, exactly=2), expect_launches(BWD, exactly=1):  # stats + apply, one backward launch
        y, dx = run(fused.q_rms_norm, x, g)
    y_ref, dx_ref = run(ref.q_rms_norm, x, g)
    assert_bitwise(y, y_ref, f"y d={d}")
    assert_bitwise(dx, dx_ref, f"dx d={d}")
    assert np.abs(dx).max() > 0 and np.abs(y).max() > 0


def test_many_rows_several_programs_and_edge_magnitudes():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 7, 5, 40)).astype(F32)  # 105 rows: two programs of 64
    x[0, 0, 0] = 0.0  # mean 0: r = 1 / sqrt(eps), y = 0, gradient through eps only
    x[1, 2, 3] *= 1e18  # large
    x[2, 6, 4] *= 1e-18  # sum of squares below eps
    x[0, 1, 1, ::2] = 0.0
    g = rng.standard_normal(x.shape).astype(F32)
    g[1, 1, 1] = 0.0
    with expect_launches(FWD, BWD):
        y, dx = run(fused.q_rms_norm, x, g)
    y_ref, dx_ref = run(ref.q_rms_norm, x, g)
    assert_bitwise(y, y_ref, "y")
    assert_bitwise(dx, dx_ref, "dx")


@pytest.mark.parametrize(
    "name, view",
    [
        ("heads_seq_transposed", lambda t: t.transpose([0, 2, 1, 3])),
        ("strided_head_dim", lambda t: t[:, :, :, ::2]),
        ("offset_slice", lambda t: t[1:, 1:4, :, 3:27]),
    ],
)
def test_non_contiguous_q(name, view):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 5, 4, 30)).astype(F32)
    probe = view(paddle.to_tensor(x))
    assert not probe.is_contiguous(), name
    g = rng.standard_normal(probe.shape).astype(F32)
    with expect_launches(FWD, BWD):
        y, dx = run(fused.q_rms_norm, x, g, view)
    y_ref, dx_ref = run(ref.q_rms_norm, x, g, view)
    assert_bitwise(y, y_ref, f"y {name}")
    assert_bitwise(dx, dx_ref, f"dx {name}")


def test_parameter_gradient_through_an_upstream_matmul_is_bitwise():
    rng = np.random.default_rng(21)
    x = rng.standard_normal((2, 6, 24)).astype(F32)
    w = (rng.standard_normal((24, 4 * 32)) * 0.2).astype(F32)
    grads = []
    for fn, launches in ((ref.q_rms_norm, 0), (fused.q_rms_norm, None)):  # the reference launches nothing
        with expect_launches(FWD, BWD, exactly=launches):
            wt = paddle.to_tensor(w, stop_gradient=False)
            xt = paddle.to_tensor(x, stop_gradient=False)
            q = paddle.matmul(xt, wt).reshape([2, 6, 4, 32])
            y = fn(q, EPS)
            (y * y * 0.5 + y).sum().backward()
        grads.append((y.numpy(), wt.grad.numpy(), xt.grad.numpy()))
    for a, b, what in zip(*grads, ("y", "dW", "dx")):
        assert_bitwise(a, b, what)


def test_deterministic_two_runs():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 9, 3, 70)).astype(F32)
    g = rng.standard_normal(x.shape).astype(F32)
    with expect_launches(FWD, exactly=4), expect_launches(BWD, exactly=2):
        a = run(fused.q_rms_norm, x, g)
        b = run(fused.q_rms_norm, x, g)
    assert_bitwise(a[0], b[0], "y run 2")
    assert_bitwise(a[1], b[1], "dx run 2")


@pytest.mark.parametrize(
    "make, eps, match",
    [
        (lambda: paddle.zeros([2, 3, 4]), EPS, r"`q` must be \[b, s, h, d\] float, got shape \[2, 3, 4\]"),
        (lambda: paddle.zeros([1, 2, 3, 4], dtype="int32"), EPS, r"`q` must be \[b, s, h, d\] float .*got int32"),
        (lambda: paddle.zeros([1, 2, 3, 4], dtype="bfloat16"), EPS, r"`q` must be \[b, s, h, d\] float32 on CPU"),
        (lambda: paddle.zeros([1, 2, 3, 4]), -1.0, r"`eps` must be a float >= 0"),
        (lambda: paddle.zeros([1, 2, 3, 4]), "1e-6", r"`eps` must be a float >= 0"),
        (lambda: np.zeros([1, 2, 3, 4], dtype=F32), EPS, r"`q` must be \[b, s, h, d\] float paddle.Tensor"),
    ],
)
def test_bad_inputs_raise_naming_the_tensor(make, eps, match):
    with pytest.raises(ValueError, match="q_rms_norm: " + match):
        fused.q_rms_norm(make(), eps)


def test_kernel_level_errors_name_the_tensor():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"`dy` must have q's shape"):
        kernel.q_rms_norm_bwd(torch.zeros(1, 2, 3, 5), q, torch.zeros(1, 2, 3, 1))
    with pytest.raises(ValueError, match=r"`r` must be float32 \[1, 2, 3, 1\]"):
        kernel.q_rms_norm_bwd(q, q, torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"`r` must be float32"):
        kernel.q_rms_norm_apply(q, torch.zeros(1, 2, 3, 1, dtype=torch.float64))


def test_registry_entry_points_here():
    entry = FUSIONS["dsv4_q_rms_norm_fusion"]
    assert entry.load("fused") is fused.q_rms_norm and entry.load("reference") is ref.q_rms_norm


# --------------------------------------------------------------------------------------------------------
# The GPU configuration in the interpreter: torch CUDA's reduction order (Reduce.cuh), one fused kernel.
# --------------------------------------------------------------------------------------------------------
def cuda_row_sum(t: np.ndarray, lanes: int, vectorized: bool, halving: bool) -> np.ndarray:
    """Thread-by-thread simulation of Reduce.cuh for a contiguous fp32 [rows, d] summed over d.

    Lane ``lane`` of ``lanes``: when ``vectorized`` ``input_vectorized_thread_reduce_impl`` (4-wide vectors
    at a ``lanes``-vector stride, accumulator i takes vector element i), else ``thread_reduce_impl``
    (element ``idx + i*lanes`` into accumulator i, ``idx += 4*lanes``, then the tail). Accumulators
    combined left to right; ``block_x_reduce``: shared-memory halving while above 32 lanes, then the warp's
    ``shfl_down`` with offsets 16, 8, .., 1 (``halving``: torch >= 2.10, pytorch#164790) or 1, 2, .., 16
    (earlier releases); lane t adds lane t + offset.
    """
    rows, d = t.shape
    acc = np.zeros((rows, lanes, 4), F32)
    for lane in range(lanes):
        idx = lane
        if vectorized:
            while idx * 4 + 3 < d:
                for i in range(4):
                    acc[:, lane, i] = acc[:, lane, i] + t[:, idx * 4 + i]
                idx += lanes
        else:
            while idx + 3 * lanes < d:
                for i in range(4):
                    acc[:, lane, i] = acc[:, lane, i] + t[:, idx + i * lanes]
                idx += 4 * lanes
            for i in range(4):
                if idx >= d:
                    break
                acc[:, lane, i] = acc[:, lane, i] + t[:, idx]
                idx += lanes
    value = acc[:, :, 0]
    for i in range(1, 4):
        value = value + acc[:, :, i]
    dim_x = lanes
    if dim_x > 32:
        offset = dim_x // 2
        while offset >= 32:
            value = value.copy()
            value[:, :offset] = value[:, :offset] + value[:, offset:2 * offset]
            offset //= 2
        dim_x = 32
    value = value[:, :dim_x]
    offsets = []
    offset = dim_x // 2 if halving else 1
    while 0 < offset < dim_x:
        offsets.append(offset)
        offset = offset // 2 if halving else offset * 2
    for offset in offsets:
        shifted = value.copy()
        shifted[:, : dim_x - offset] = value[:, : dim_x - offset] + value[:, offset:dim_x]
        value = shifted
    return value[:, 0]


def test_torch_cuda_order_configurations():
    prod = kernel.torch_cuda_order(16384 * 64, 512)  # the DSv4 query at sq 16384
    assert (prod.lanes, prod.nacc, prod.acc_inner, prod.exact, prod.halving) == (32, 4, True, True, True)
    assert kernel.torch_cuda_order(64, 128).acc_inner  # torch 2.11 vectorises from d = 128 (dim0 >= 128)
    assert not kernel.torch_cuda_order(64, 128, vec_min_d=129).acc_inner  # older releases: d > 128
    assert prod.mean_factor == 2.0**-9 and prod.inv_d == 2.0**-9
    assert (kernel.torch_cuda_order(4096, 64).lanes, kernel.torch_cuda_order(4096, 64).acc_inner) == (32, False)
    assert kernel.torch_cuda_order(1, 512).lanes == 128  # one row: the block is all x
    assert kernel.torch_cuda_order(4, 7).lanes == 4
    assert not kernel.torch_cuda_order(64, 130).exact  # vector tail / misaligned rows: not modelled
    assert not kernel.torch_cuda_order(1, 8192).exact  # split across warps: not modelled
    assert kernel.torch_cuda_order(3, 100).mean_factor == np.float32(np.float32(3) / np.float32(300))


GPU_CASES = [((2, 3, 4), 64), ((1, 4, 4), 512), ((1, 1, 1), 512), ((2, 2, 1), 200), ((1, 2, 16), 100),
             ((1, 1, 3), 7), ((1, 2, 8), 576), ((1, 1, 1), 4096), ((1, 3, 7), 33), ((2, 3, 4), 128),
             ((1, 2, 4), 1024), ((1, 2, 1), 2048)]
# (vec_min_d, halving): torch 2.11 (the H200 image) and the older Reduce.cuh
VARIANTS = [(128, True), (129, False)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lead, d", GPU_CASES)
def test_gpu_configuration_matches_a_simulation_of_torch_cuda(lead, d, variant):
    vec_min_d, halving = variant
    rng = np.random.default_rng(d)
    x = (rng.standard_normal(lead + (d,)) * 3).astype(F32)
    g = rng.standard_normal(lead + (d,)).astype(F32)
    rows = int(np.prod(lead))
    order = kernel.torch_cuda_order(rows, d, vec_min_d=vec_min_d, halving=halving)
    assert order.exact
    xt = torch.from_numpy(x)
    with expect_launches(FWD, exactly=1):
        y, r = kernel.q_rms_norm_fused(xt, EPS, order)
    dx = kernel.q_rms_norm_bwd(torch.from_numpy(g), xt, r, order, eps=EPS)
    x2, g2 = x.reshape(rows, d), g.reshape(rows, d)
    eps = F32(EPS)
    vec = d >= vec_min_d
    ms = cuda_row_sum(x2 * x2, order.lanes, vec, halving) * F32(order.mean_factor)  # MeanOps::project: a * factor
    s_ref = np.sqrt(ms + eps)  # fp32 IEEE sqrt, then IEEE division: torch.sqrt and 1 / s on CUDA
    r_ref = F32(1) / s_ref
    y_ref = x2 * r_ref[:, None]
    g_r = cuda_row_sum(g2 * x2, order.lanes, vec, halving)  # MulBackward's sum_to_size, same reduction
    d_s = (-g_r) * (r_ref * r_ref)  # reciprocal_backward: -grad * (result * result)
    d_ms = d_s / (s_ref * F32(2))  # sqrt_backward: grad / (2 * result)
    d_sq = d_ms * F32(order.inv_d)  # mean_backward: / d as a multiply by fp32(1/d)
    dx_ref = g2 * r_ref[:, None] + d_sq[:, None] * (x2 * F32(2))  # + pow_backward
    assert_bitwise(r.numpy().reshape(rows), r_ref, f"r {order.name}")
    assert_bitwise(y.numpy().reshape(rows, d), y_ref, f"y {order.name}")
    assert_bitwise(dx.numpy().reshape(rows, d), dx_ref, f"dx {order.name}")
    # and the simulation is not the sequential order (the two configurations really differ)
    if order.lanes >= 4 and d >= 64:
        seq = np.zeros(rows, F32)
        for j in range(d):
            seq = seq + (x2 * x2)[:, j]
        assert not np.array_equal(seq, cuda_row_sum(x2 * x2, order.lanes, vec, halving))


def test_the_two_warp_trees_differ():
    """Anti-vacuity for the shuffle order: the two trees give other bits on some rows."""
    rng = np.random.default_rng(0)
    t = (rng.standard_normal((256, 512)) ** 2).astype(F32)
    assert not np.array_equal(cuda_row_sum(t, 32, True, True), cuda_row_sum(t, 32, True, False))


@pytest.mark.parametrize("lead, d", [((1, 5, 8), 512), ((2, 3, 3), 576), ((1, 17, 1), 64), ((2, 9, 4), 4096)])
def test_gpu_block_sizes_in_the_interpreter(monkeypatch, lead, d):
    """The GPU launch geometry (one-pass rows per program, or the streamed path's 256-column steps; for these few
    rows the forward's ``FWD_TINY_ROWS``, and without ``FWD_TINY`` the default) gives the same bits as the
    interpreter's."""
    monkeypatch.setattr(kernel, "is_interpreted", lambda: False)
    rng = np.random.default_rng(d + 1)
    x = rng.standard_normal(lead + (d,)).astype(F32)
    g = rng.standard_normal(lead + (d,)).astype(F32)
    rows = int(np.prod(lead))
    order = kernel.torch_cuda_order(rows, d)
    cfg, tiny = kernel._config(d, order), kernel._config(d, order, rows=rows)
    chunk = order.lanes * 4
    if cfg["ONE_PASS"]:
        assert cfg["BLOCK_R"] == max(1, kernel.FWD_ROWS * 128 // chunk)
        assert (tiny["BLOCK_R"], tiny["num_warps"]) == (max(1, kernel.FWD_TINY_ROWS * 128 // chunk), cfg["num_warps"])
        assert tiny["BLOCK_R"] < cfg["BLOCK_R"] or cfg["BLOCK_R"] == 1
    else:
        assert -(-d // chunk) > kernel.MAX_TILES and cfg["BLOCK_R"] == 2048 // chunk and cfg["BLOCK_D"] == 256
        assert tiny == cfg
    xt = torch.from_numpy(x)
    y, r = kernel.q_rms_norm_fused(xt, EPS, order)
    dx = kernel.q_rms_norm_bwd(torch.from_numpy(g), xt, r, order, eps=EPS)
    monkeypatch.setattr(kernel, "FWD_TINY", False)
    y_default, r_default = kernel.q_rms_norm_fused(xt, EPS, order)
    assert_bitwise(y_default.numpy(), y.numpy(), "y, default geometry")
    assert_bitwise(r_default.numpy(), r.numpy(), "r, default geometry")
    monkeypatch.undo()
    y2, r2 = kernel.q_rms_norm_fused(xt, EPS, order)
    dx2 = kernel.q_rms_norm_bwd(torch.from_numpy(g), xt, r2, order, eps=EPS)
    for a, b, what in ((y, y2, "y"), (r, r2, "r"), (dx, dx2, "dx")):
        assert_bitwise(a.numpy(), b.numpy(), what)


def test_one_pass_and_streamed_kernels_agree():
    """The one-pass kernels (row held in registers) and the streamed ones (row read twice) give the same bits."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy((rng.standard_normal((2, 3, 5, 512)) * 2).astype(F32))
    g = torch.from_numpy(rng.standard_normal((2, 3, 5, 512)).astype(F32))
    order = kernel.torch_cuda_order(30, 512)
    assert kernel._one_pass(512, order)
    y, r = kernel.q_rms_norm_fused(x, EPS, order)
    dx = kernel.q_rms_norm_bwd(g, x, r, order, eps=EPS)
    streamed = kernel.MAX_TILES
    try:
        kernel.MAX_TILES = 0
        assert not kernel._one_pass(512, order)
        y2, r2 = kernel.q_rms_norm_fused(x, EPS, order)
        dx2 = kernel.q_rms_norm_bwd(g, x, r2, order, eps=EPS)
    finally:
        kernel.MAX_TILES = streamed
    for a, b, what in ((y, y2, "y"), (r, r2, "r"), (dx, dx2, "dx")):
        assert_bitwise(a.numpy(), b.numpy(), what)


# (lead, d): the one-pass kernels unvectorised (4 accumulators by step) with one and with two chunks, with a
# tail, vectorised over 4 chunks, and 5 chunks at 576 (unrolled past 4)
RECOMPUTE_CASES = [((1, 2, 8), 64), ((2, 3, 4), 100), ((1, 3, 7), 33), ((1, 4, 4), 512), ((1, 2, 8), 576)]


@pytest.mark.parametrize("lead, d", RECOMPUTE_CASES)
def test_backward_recomputes_the_forwards_r_bitwise(lead, d):
    """Torch order, one-pass kernels (CPU interpreter, fp32): the forward without ``r`` (``keep_r=False``) writes
    the same ``y``; the backward given ``r=None`` recomputes ``r`` equal to the forward's byte for byte (written
    to ``r_out``) and the same ``dx`` as with the forward's ``r``. A backward with another eps (a planted
    difference) gives another ``r``, which the comparison catches."""
    rng = np.random.default_rng(d + 3)
    x = torch.from_numpy((rng.standard_normal(lead + (d,)) * rng.uniform(0.1, 10, lead + (1,))).astype(F32))
    g = torch.from_numpy(rng.standard_normal(lead + (d,)).astype(F32))
    order = kernel.torch_cuda_order(int(np.prod(lead)), d)
    assert kernel.recomputes_r(d, order)
    with expect_launches(FWD, exactly=2), expect_launches(BWD, exactly=2):
        y, r = kernel.q_rms_norm_fused(x, EPS, order)
        y_no_r, no_r = kernel.q_rms_norm_fused(x, EPS, order, keep_r=False)
        dx = kernel.q_rms_norm_bwd(g, x, r, order, eps=EPS)
        r_bwd = torch.full_like(r, -1.0)  # poisoned: every row must be written
        dx_rc = kernel.q_rms_norm_bwd(g, x, None, order, eps=EPS, r_out=r_bwd)
    assert no_r is None
    assert_bitwise(y_no_r, y, "y without r")
    assert_bitwise(r_bwd, r, "the backward's recomputed r vs the forward's")
    assert_bitwise(dx_rc, dx, "dx with r recomputed vs read")
    planted = torch.full_like(r, -1.0)
    kernel.q_rms_norm_bwd(g, x, None, order, eps=1e-2, r_out=planted)
    with pytest.raises(AssertionError):
        assert_bitwise(planted, r, "planted: another eps in the backward")


def test_recomputing_r_needs_eps_and_a_one_pass_plan(monkeypatch):
    """The streamed kernels (and the Paddle CPU order) keep and read ``r``: ``keep_r=False`` still returns it there,
    and a backward without ``r`` raises; so does one without the forward's ``eps``, and ``r_out`` beside an ``r``."""
    x, g = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64)
    order = kernel.torch_cuda_order(6, 64)
    with pytest.raises(ValueError, match=r"needs the forward's `eps`"):
        kernel.q_rms_norm_bwd(g, x, None, order)
    with pytest.raises(ValueError, match=r"`r` is given, and the gradient .* needs the forward's `eps`"):
        kernel.q_rms_norm_bwd(g, x, torch.ones(1, 2, 3, 1), order)  # sqrt(ms + eps): r does not determine it
    with pytest.raises(ValueError, match=r"`r_out` receives a recomputed r"):
        kernel.q_rms_norm_bwd(g, x, torch.ones(1, 2, 3, 1), order, eps=EPS, r_out=torch.ones(1, 2, 3, 1))
    assert kernel.q_rms_norm_fused(x, EPS, kernel.paddle_cpu_order(), keep_r=False)[1] is not None
    monkeypatch.setattr(kernel, "MAX_TILES", 0)  # the streamed kernels
    assert kernel.q_rms_norm_fused(x, EPS, order, keep_r=False)[1] is not None
    with pytest.raises(ValueError, match=r"take the streamed kernels, which read the forward.s r"):
        kernel.q_rms_norm_bwd(g, x, None, order, eps=EPS)


def test_the_gpu_training_path_keeps_no_r(monkeypatch):
    """The PyLayer with the GPU's order (torch CUDA's, forced here in the interpreter): the forward asks for no
    ``r`` and gets none, the backward recomputes it; ``y`` and the gradient equal the kernels run with ``r``."""
    calls = []
    fwd, bwd = kernel.q_rms_norm_fused, kernel.q_rms_norm_bwd

    def spy_fwd(*args, **kwargs):
        out = fwd(*args, **kwargs)
        calls.append(("fwd", out[1]))
        return out

    def spy_bwd(dy, q, r, *args, **kwargs):
        calls.append(("bwd", r))
        return bwd(dy, q, r, *args, **kwargs)

    monkeypatch.setattr(kernel, "default_order", lambda q: kernel.torch_cuda_order(12, 512))
    monkeypatch.setattr(kernel, "q_rms_norm_fused", spy_fwd)
    monkeypatch.setattr(kernel, "q_rms_norm_bwd", spy_bwd)
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((1, 3, 4, 512)) * 2).astype(F32)
    g = rng.standard_normal((1, 3, 4, 512)).astype(F32)
    with expect_launches(FWD, exactly=1), expect_launches(BWD, exactly=1):
        y, dx = run(fused.q_rms_norm, x, g)
    assert calls == [("fwd", None), ("bwd", None)], calls
    order = kernel.torch_cuda_order(12, 512)
    y_ref, r = fwd(torch.from_numpy(x), EPS, order)
    assert_bitwise(y, y_ref.numpy(), "y")
    assert_bitwise(dx, bwd(torch.from_numpy(g), torch.from_numpy(x), r, order, eps=EPS).numpy(), "dx")
