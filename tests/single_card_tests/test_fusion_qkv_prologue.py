"""The fused attention prologue (q: norm + RoPE, kv: weighted norm + RoPE) vs the two separate ops: bitwise.

CPU fp32, Triton interpreter. The claims (registry ``DERIVED_FUSIONS``): forward AND backward (the kv gain's
gradient included) byte-equal to the composition of the two ops, both as pure Paddle (``reference.py``) and as
the two fused ops the switches select one by one; the fused path launches one prologue kernel each way where the
separate path launches the norm's and the RoPE's (the forward keeps the q norm's statistics launch on the CPU,
where ``r`` is the reference's own ``inv_sqrt``). Then: odd widths, per-batch tables, non-contiguous inputs, the
provider's resolution and start-up rows, and the DSv4 attention layer of every kind built twice from one seed (both
switches on: the prologue launched; vs both off) byte for byte.

The GPU configuration (torch CUDA's order, the one-pass kernels, the gain gradient's blocked order with its
segment reduction) runs here too, in the interpreter: bitwise against the two existing kernels composed in the
same order, and the gain gradient within its documented tolerance of float64. Negative controls: a planted
one-ulp change, a shifted rotary table and the other summation order are each caught.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
import torch
from helpers import assert_bitwise, assert_close, expect_launches, move_constant_inits, tiny_model

from fleet_ext import capability

capability.prepare_triton()

from fleet_ext.ops.q_rms_norm import function as q_rms_norm_fused  # noqa: E402
from fleet_ext.ops.q_rms_norm import kernel as q_kernel  # noqa: E402
from fleet_ext.ops.qkv_prologue import function as fused  # noqa: E402
from fleet_ext.ops.qkv_prologue import kernel  # noqa: E402
from fleet_ext.ops.qkv_prologue import reference as ref  # noqa: E402
from fleet_ext.ops.rope import function as rope_fused  # noqa: E402
from fleet_ext.ops.rope import kernel as rope_kernel  # noqa: E402
from fleet_ext.registry import DERIVED_FUSIONS  # noqa: E402

F32 = np.float32
EPS = 1e-6
FWD, BWD, STATS = "_norm_rope_fwd_kernel", "_norm_rope_bwd_kernel", "_q_rms_norm_fwd_kernel"
SEPARATE = ("_rope_kernel", "_q_rms_norm_bwd_kernel")


def _tables(batch: int, seq: int, half: int, per_batch: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, 4000, size=(batch, seq)) if per_batch else np.arange(seq) + 3
    angles = positions[..., None] * (1.0 / 10000.0 ** (np.arange(half) / half))
    return paddle.to_tensor(np.cos(angles).astype(F32)), paddle.to_tensor(np.sin(angles).astype(F32))


def _q_separate(q, eps, cos, sin):
    """The two fused ops the switches select one at a time (each bitwise to its reference)."""
    return rope_fused.apply_partial_rope(q_rms_norm_fused.q_rms_norm(q, eps), cos, sin)


def _kv_separate(kv, weight, eps, cos, sin):
    return rope_fused.apply_partial_rope(ref.rms_norm(kv, weight, eps), cos, sin)


def _run(fn, x: np.ndarray, g: np.ndarray, cos, sin, weight: np.ndarray | None = None, view=None) -> dict:
    """y and the gradients of ``sum(y * g)`` for x (through ``view``) and the gain, from fresh leaves."""
    leaf = paddle.to_tensor(x, stop_gradient=False)
    xt = view(leaf) if view is not None else leaf
    if weight is None:
        y = fn(xt, EPS, cos, sin)
        (y * paddle.to_tensor(g)).sum().backward()
        return {"y": y.numpy(), "dx": leaf.grad.numpy()}
    w = paddle.to_tensor(weight, stop_gradient=False)
    y = fn(xt, w, EPS, cos, sin)
    (y * paddle.to_tensor(g)).sum().backward()
    return {"y": y.numpy(), "dx": leaf.grad.numpy(), "dw": w.grad.numpy()}


def _same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert_bitwise(got[key], want[key], f"{what}: {key}")
        assert np.abs(want[key]).max() > 0, f"{what}: {key} is all zero"


def _scaled(shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * rng.uniform(0.1, 10, shape[:-1] + (1,))).astype(F32)


# (lead shape, d, rope width): the tiny model's head, odd widths (the pe pairs start at an odd channel), all
# channels rotated, a narrow rope, many rows (several programs), the production head width.
Q_CASES = [((2, 5, 3), 16, 8), ((2, 3, 2), 17, 8), ((1, 4, 3), 8, 8), ((2, 3, 2), 24, 2), ((3, 7, 5), 40, 8),
           ((1, 2, 2), 512, 64)]


@pytest.mark.parametrize("lead, d, rd", Q_CASES, ids=[f"{lead}-{d}-{rd}" for lead, d, rd in Q_CASES])
def test_q_forward_and_backward_are_bitwise_equal_to_the_two_ops(lead, d, rd):
    x, g = _scaled(lead + (d,), d), np.random.default_rng(d + 1).standard_normal(lead + (d,)).astype(F32)
    cos, sin = _tables(lead[0], lead[1], rd // 2)
    # two calls: per call one statistics and one apply launch forward, one launch backward, no RoPE launch
    with expect_launches(FWD, STATS, BWD, exactly=2), expect_launches(*SEPARATE, exactly=0):
        got = _run(fused.q_norm_rope, x, g, cos, sin)
        got_2 = _run(fused.q_norm_rope, x, g, cos, sin)
    with expect_launches("_rope_kernel", exactly=2), expect_launches("_q_rms_norm_bwd_kernel", exactly=1):
        separate = _run(_q_separate, x, g, cos, sin)  # the two ops: a RoPE launch each way, the norm's backward
    reference = _run(ref.q_norm_rope, x, g, cos, sin)
    _same(got, reference, "fused vs the pure-Paddle composition")
    _same(got, separate, "fused vs the two fused ops")
    _same(got_2, got, "run to run")


KV_CASES = [((2, 5), 16, 8, False), ((2, 9), 17, 8, True), ((3, 70), 24, 24, False), ((1, 3), 512, 64, True)]


@pytest.mark.parametrize("lead, d, rd, per_batch", KV_CASES, ids=[f"{lead}-{d}-{rd}" for lead, d, rd, _ in KV_CASES])
def test_kv_forward_and_backward_are_bitwise_equal_to_the_two_ops(lead, d, rd, per_batch):
    """The gain's gradient too: Paddle CPU sums it sequentially from 0 over the rows; so does the kernel."""
    x, g = _scaled(lead + (d,), d), np.random.default_rng(d + 2).standard_normal(lead + (d,)).astype(F32)
    w = (1 + 0.3 * np.random.default_rng(d).standard_normal(d)).astype(F32)
    cos, sin = _tables(lead[0], lead[1], rd // 2, per_batch)
    with expect_launches(STATS, exactly=1), expect_launches(FWD, exactly=1), expect_launches(BWD, exactly=1), \
            expect_launches(*SEPARATE, "_dw_reduce_kernel", exactly=0):
        got = _run(fused.kv_norm_rope, x, g, cos, sin, w)
    with expect_launches("_rope_kernel", exactly=2):
        separate = _run(_kv_separate, x, g, cos, sin, w)
    reference = _run(ref.kv_norm_rope, x, g, cos, sin, w)
    _same(got, reference, "fused vs the pure-Paddle composition")
    _same(got, separate, "fused vs the two ops")


@pytest.mark.parametrize("name, view", [
    ("heads_seq_transposed", lambda t: t.transpose([0, 2, 1, 3])),
    ("offset_slice", lambda t: t[1:, 1:4, :, 2:18]),
])
def test_q_non_contiguous(name, view):
    x = _scaled((3, 5, 4, 20), 9)
    probe = view(paddle.to_tensor(x))
    assert not probe.is_contiguous(), name
    g = np.random.default_rng(3).standard_normal(probe.shape).astype(F32)
    cos, sin = _tables(probe.shape[0], probe.shape[1], 4)
    with expect_launches(FWD, BWD):
        got = _run(fused.q_norm_rope, x, g, cos, sin, view=view)
    _same(got, _run(ref.q_norm_rope, x, g, cos, sin, view=view), name)


def test_kv_through_an_upstream_matmul_and_a_strided_view():
    """The parameter gradients upstream (a projection, as in the layer) and a kv that is a strided slice."""
    rng = np.random.default_rng(21)
    h, proj = rng.standard_normal((2, 6, 24)).astype(F32), (rng.standard_normal((24, 40)) * 0.2).astype(F32)
    w = (1 + 0.3 * rng.standard_normal(16)).astype(F32)
    cos, sin = _tables(2, 6, 4)
    results = []
    for fn in (fused.kv_norm_rope, ref.kv_norm_rope):
        with expect_launches(FWD, BWD, exactly=1 if fn is fused.kv_norm_rope else 0):
            ht, pt = paddle.to_tensor(h, stop_gradient=False), paddle.to_tensor(proj, stop_gradient=False)
            wt = paddle.to_tensor(w, stop_gradient=False)
            kv = paddle.matmul(ht, pt)[..., 3:35:2]  # [2, 6, 16], strided
            y = fn(kv, wt, EPS, cos, sin)
            (y * y * 0.5 + y).sum().backward()
        results.append({"y": y.numpy(), "dh": ht.grad.numpy(), "dproj": pt.grad.numpy(), "dw": wt.grad.numpy()})
    _same(results[0], results[1], "through a matmul")


def _edge_rows(shape) -> tuple[np.ndarray, np.ndarray]:
    """A zero row (r = 1 / sqrt(eps)), a row whose mean square overflows (r = 0), a tiny row, a row of zero gradient."""
    x = _scaled(shape, 4)
    x[0, 0] = 0.0
    x[1, 2] *= 1e19
    x[1, 3] *= 1e-18
    g = np.random.default_rng(4).standard_normal(x.shape).astype(F32)
    g[0, 1] = 0.0
    return x, g


def test_edge_rows_and_a_gain_without_gradient():
    """Signed zeros included (r = 0 and all-zero gradient rows with a negative gain: Paddle's ``ms + eps`` adds
    a zero in its backward); a frozen gain gets no gradient."""
    x, g = _edge_rows((2, 4, 16))
    w = np.random.default_rng(5).standard_normal(16).astype(F32)  # negative entries: -0 products
    cos, sin = _tables(2, 4, 4)
    outs = []
    for fn in (fused.kv_norm_rope, ref.kv_norm_rope):
        xt = paddle.to_tensor(x, stop_gradient=False)
        y = fn(xt, paddle.to_tensor(w), EPS, cos, sin)  # stop_gradient gain
        (y * paddle.to_tensor(g)).sum().backward()
        outs.append({"y": y.numpy(), "dx": xt.grad.numpy()})
    for key in ("y", "dx"):
        assert_bitwise(outs[0][key], outs[1][key], key)
    xq, gq = _edge_rows((2, 4, 3, 16))
    _same(_run(fused.q_norm_rope, xq, gq, cos, sin), _run(ref.q_norm_rope, xq, gq, cos, sin), "q edge rows")
    _same(_run(fused.kv_norm_rope, x, g, cos, sin, w), _run(ref.kv_norm_rope, x, g, cos, sin, w), "kv edge rows")


def test_negative_controls_catch_a_planted_difference():
    """The parity check can fail: one ulp in one input element, one incoming gradient element 0.1 % off, and a
    rotary table shifted by one position are each caught in the tensors they reach."""
    x, g = _scaled((2, 5, 16), 1), np.random.default_rng(2).standard_normal((2, 5, 16)).astype(F32)
    w = (1 + 0.3 * np.random.default_rng(3).standard_normal(16)).astype(F32)
    cos, sin = _tables(2, 5, 4)
    want = _run(ref.kv_norm_rope, x, g, cos, sin, w)
    assert_bitwise(_run(fused.kv_norm_rope, x, g, cos, sin, w)["y"], want["y"], "unplanted")
    planted_x, planted_g = x.copy(), g.copy()
    planted_x.view(np.int32)[1, 3, 14] += 1  # one ulp of one pe channel of the input
    planted_g[0, 2, 13] *= 1.001  # one pe channel of the incoming gradient, 0.1 % off
    shifted = paddle.to_tensor(cos.numpy()[[1, 2, 3, 4, 0]]), sin
    for what, got, keys in (("x + 1 ulp", _run(fused.kv_norm_rope, planted_x, g, cos, sin, w), ("y",)),
                            ("dy + 1 ulp", _run(fused.kv_norm_rope, x, planted_g, cos, sin, w), ("dx",)),
                            ("shifted table", _run(fused.kv_norm_rope, x, g, *shifted, w), ("y", "dx", "dw"))):
        for key in keys:
            with pytest.raises(AssertionError, match="differ"):
                assert_bitwise(got[key], want[key], f"{what}: {key}")


@pytest.mark.parametrize("make, match", [
    (lambda c, s: fused.q_norm_rope(paddle.zeros([2, 3, 16]), EPS, c, s), r"q_norm_rope: `x` must be \[b, s, h, d\]"),
    (lambda c, s: fused.kv_norm_rope(paddle.zeros([2, 3, 16]), paddle.ones([8]), EPS, c, s),
     r"kv_norm_rope: `weight` must be float32 \[16\]"),
    (lambda c, s: fused.kv_norm_rope(paddle.zeros([2, 3, 2, 16]), paddle.ones([16]), EPS, c, s),
     r"kv_norm_rope: `x` must be \[b, s, d\]"),
    (lambda c, s: fused.q_norm_rope(paddle.zeros([2, 3, 2, 16]), -1.0, c, s), r"`eps` must be a float >= 0"),
    (lambda c, s: fused.q_norm_rope(paddle.zeros([2, 4, 2, 16]), EPS, c, s), r"`x` has 4 positions, `cos` has 3"),
    (lambda c, s: fused.q_norm_rope(paddle.zeros([2, 3, 2, 16], dtype="bfloat16"), EPS, c, s),
     r"`x` must be float32 on CPU"),
])
def test_bad_inputs_raise_naming_the_tensor(make, match):
    cos, sin = _tables(2, 3, 4)
    with pytest.raises(ValueError, match=match):
        make(cos, sin)


def test_registry_entries_point_here():
    q, kv = DERIVED_FUSIONS["q_norm_rope"], DERIVED_FUSIONS["kv_norm_rope"]
    assert q.load("fused") is fused.q_norm_rope and q.load("reference") is ref.q_norm_rope
    assert kv.load("fused") is fused.kv_norm_rope and kv.load("reference") is ref.kv_norm_rope
    assert q.requires == kv.requires == ("dsv4_q_rms_norm_fusion", "apply_rope_fusion")


# --------------------------------------------------------------------------------------------------------
# The GPU configuration in the interpreter: torch CUDA's order, one-pass kernels, the blocked gain gradient.
# --------------------------------------------------------------------------------------------------------
GPU_CASES = [((2, 3, 4), 64, 8), ((1, 4, 4), 512, 64), ((2, 5), 512, 64), ((1, 3, 2), 200, 16), ((2, 3), 33, 4),
             ((1, 2, 2), 576, 64), ((1, 2, 1), 2048, 64)]


def _compose_torch_order(x, g, cos, sin, w, order):
    """The two existing kernels in ``order`` (the q norm's fused forward / backward, the RoPE's), composed."""
    x4 = x if x.ndim == 4 else x.unsqueeze(2)
    normed, r = q_kernel.q_rms_norm_fused(x4, EPS, order)
    normed = normed.reshape(x.shape)
    y = rope_kernel.rope(w * normed if w is not None else normed, cos, sin)
    g_rope = rope_kernel.rope_grad(g, cos, sin)
    g_norm = g_rope * w if w is not None else g_rope
    dx = q_kernel.q_rms_norm_bwd(g_norm if x.ndim == 4 else g_norm.unsqueeze(2), x4, r, order,
                                 eps=EPS).reshape(x.shape)
    return y, r.reshape(kernel._rows_shape(x)), dx, g_rope


@pytest.mark.parametrize("lead, d, rd", GPU_CASES, ids=[f"{lead}-{d}" for lead, d, _ in GPU_CASES])
def test_gpu_configuration_is_bitwise_the_two_kernels_in_torch_order(lead, d, rd):
    rng = np.random.default_rng(d)
    x = torch.from_numpy(_scaled(lead + (d,), d))
    g = torch.from_numpy(rng.standard_normal(lead + (d,)).astype(F32))
    w = torch.from_numpy((1 + 0.3 * rng.standard_normal(d)).astype(F32)) if x.ndim == 3 else None
    cos, sin = (torch.from_numpy(t.numpy()) for t in _tables(lead[0], lead[1], rd // 2))
    order = q_kernel.torch_cuda_order(int(np.prod(lead)), d)
    with expect_launches(FWD, exactly=1), expect_launches(STATS, *SEPARATE, exactly=0):
        y, r = kernel.norm_rope_fused(x, EPS, cos, sin, w, order)
    dx, dw = kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)
    y_ref, r_ref, dx_ref, g_rope = _compose_torch_order(x, g, cos, sin, w, order)
    for got, want, what in ((r, r_ref, "r"), (y, y_ref, "y"), (dx, dx_ref, "dx")):
        assert_bitwise(got, want, f"{what} {order.name}")
    if w is not None:
        products = g_rope.double() * (x.double() * r.double())  # g_rope is exact; x * r as the op rounds it
        dw64 = (g_rope.double() * (x * r).double()).reshape(-1, d).sum(0)
        assert_close(dw, dw64, "fp32", "kv_prologue_dw", what="dw", scale=products.abs().reshape(-1, d).sum(0))
    # anti-vacuity: Paddle CPU's sequential order gives other statistics on some rows of the wider cases
    if d >= 64 and int(np.prod(lead)) * d >= 2048:
        _, r_seq = kernel.norm_rope_fused(x, EPS, cos, sin, w, q_kernel.paddle_cpu_order())
        assert not torch.equal(r_seq, r)


@pytest.mark.parametrize("lead", [(2, 3, 5), (3, 7)], ids=["q", "kv"])
def test_one_pass_and_streamed_kernels_agree(monkeypatch, lead):
    """Torch order: the one-pass kernels (row in registers) and the streamed ones (wide rows) give the same bits."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy(_scaled(lead + (512,), 5))
    g = torch.from_numpy(rng.standard_normal(lead + (512,)).astype(F32))
    w = torch.from_numpy((1 + 0.3 * rng.standard_normal(512)).astype(F32)) if len(lead) == 2 else None
    cos, sin = (torch.from_numpy(t.numpy()) for t in _tables(lead[0], lead[1], 32))
    order = q_kernel.torch_cuda_order(int(np.prod(lead)), 512)
    results = []
    for max_tiles in (q_kernel.MAX_TILES, 0):
        monkeypatch.setattr(q_kernel, "MAX_TILES", max_tiles)
        assert kernel._config(512, order, kernel.PHASE_FUSED, backward=True)["ONE_PASS"] is (max_tiles > 0)
        y, r = kernel.norm_rope_fused(x, EPS, cos, sin, w, order)
        results.append((y, r, *kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)))
    for a, b, what in zip(*results, ("y", "r", "dx", "dw")):
        if a is not None:
            assert_bitwise(b, a, f"{what}: streamed vs one pass")


def test_gpu_gain_gradient_plan_segments_and_reduction(monkeypatch):
    """The GPU plan of the gain gradient (row segments, a fixed-order reduction launch) in the interpreter: dx
    unchanged, dw within its tolerance of float64, byte-identical run to run, and not Paddle CPU's bits."""
    rng = np.random.default_rng(11)
    x = torch.from_numpy(_scaled((2, 150, 64), 3))
    g = torch.from_numpy(rng.standard_normal((2, 150, 64)).astype(F32))
    w = torch.from_numpy((1 + 0.3 * rng.standard_normal(64)).astype(F32))
    cos, sin = (torch.from_numpy(t.numpy()) for t in _tables(2, 150, 8))
    order = kernel.default_order(x)
    y, r = kernel.norm_rope_fused(x, EPS, cos, sin, w, order)
    dx_seq, dw_seq = kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)
    monkeypatch.setattr(kernel, "is_interpreted", lambda: False)
    monkeypatch.setitem(kernel.TUNE, "dw_programs", 24)
    monkeypatch.setitem(kernel.TUNE, "dw_reduce_segments", 4)
    block_c, step, n_seg, seg_rows = kernel._dw_plan(300, 64)
    assert n_seg > 4 and step > 1, (block_c, step, n_seg, seg_rows)
    with expect_launches("_dw_reduce_kernel", BWD, exactly=2):
        dx_1, dw_1 = kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)
        dx_2, dw_2 = kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)
    assert_bitwise(dx_1, dx_seq, "dx, GPU plan")
    assert_bitwise(dw_2, dw_1, "dw run to run")
    g_rope = rope_kernel.rope_grad(g, cos, sin).double()
    products = g_rope * (x * r).double()
    assert_close(dw_1, products.reshape(-1, 64).sum(0), "fp32", "kv_prologue_dw", what="dw, GPU plan",
                 scale=products.abs().reshape(-1, 64).sum(0))
    assert not torch.equal(dw_1, dw_seq), "the blocked order happens to give the sequential bits: data too easy"


def test_gpu_fused_gain_gradient_plan(monkeypatch):
    """The GPU plan of the kv backward with the gain gradient inside the row programs (``DW_FUSED``: torch order,
    the one-pass kernel; 10 blocks of 8 rows, the last one short, each writing a partial; the reduction in 3
    steps of 4 partials) in the interpreter: dx bitwise the dedicated programs' plan, dw within its tolerance of
    float64 (a planted change of 2e-5 of one column's scale is caught), byte-identical run to run, one backward
    and one reduction launch a call."""
    rng = np.random.default_rng(12)
    x = torch.from_numpy(_scaled((2, 37, 512), 4))
    g = torch.from_numpy(rng.standard_normal((2, 37, 512)).astype(F32))
    w = torch.from_numpy((1 + 0.3 * rng.standard_normal(512)).astype(F32))
    cos, sin = (torch.from_numpy(t.numpy()) for t in _tables(2, 37, 32))
    order = q_kernel.torch_cuda_order(74, 512)
    _, r = kernel.norm_rope_fused(x, EPS, cos, sin, w, order)
    dx_ref, _ = kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)  # interpreted: the dedicated gain programs
    monkeypatch.setattr(kernel, "is_interpreted", lambda: False)
    monkeypatch.setitem(kernel.TUNE, "kv_bwd_rows", 8)
    monkeypatch.setitem(kernel.TUNE, "reduce_segments", 4)
    with expect_launches(BWD, "_dw_reduce_kernel", exactly=2):
        dx_1, dw_1 = kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)
        dx_2, dw_2 = kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)
    plan = kernel._BWD_PLANS[(kernel.layout_key(g), kernel.layout_key(x), kernel.layout_key(r), kernel.layout_key(cos),
                              kernel.layout_key(sin), kernel.layout_key(w), order, EPS, None, kernel._tuning())]
    assert plan.meta["DW_FUSED"] and plan.grid == (10,) and plan.meta["BLOCK_R"] == 8, (plan.grid, plan.meta)
    assert plan.info[3].grid == (512 // kernel.REDUCE_BLOCK_C,) and plan.info[3].meta["BLOCK_S"] == 4
    assert_bitwise(dx_1, dx_ref, "dx, fused gain plan")
    assert_bitwise(dx_2, dx_1, "dx run to run")
    assert_bitwise(dw_2, dw_1, "dw run to run")
    products = rope_kernel.rope_grad(g, cos, sin).double() * (x * r).double()
    dw64, scale = products.reshape(-1, 512).sum(0), products.abs().reshape(-1, 512).sum(0)
    assert_close(dw_1, dw64, "fp32", "kv_prologue_dw", what="dw, fused gain plan", scale=scale)
    planted = dw_1.clone()
    planted[7] += 2e-5 * float(scale[7])
    with pytest.raises(AssertionError):
        assert_close(planted, dw64, "fp32", "kv_prologue_dw", what="planted", scale=scale)


# --------------------------------------------------------------------------------------------------------
# The provider and the layer.
# --------------------------------------------------------------------------------------------------------
BOTH = {"apply_rope_fusion": True, "dsv4_q_rms_norm_fusion": True}


@pytest.mark.parametrize("switches, on", [(BOTH, True), ({"apply_rope_fusion": True}, False),
                                          ({"dsv4_q_rms_norm_fusion": True}, False), ({}, False)])
def test_the_provider_resolves_the_prologue_only_with_both_switches(switches, on):
    from fleet_ext.config import load_config
    from fleet_ext.specs.backend import BackendProvider

    provider = BackendProvider(load_config(tiny_model(**switches)))
    rows = {r.switch: r for r in provider.resolved}
    ops = provider.attention_ops
    for slot, fn in (("q_norm_rope", fused.q_norm_rope), ("kv_norm_rope", fused.kv_norm_rope)):
        row = rows[slot]
        assert row.value is on and (getattr(ops, slot) is fn) is on, (slot, row)
        if on:
            assert row.backend == "Triton interpreter (CPU, slow)"
            assert row.reason.startswith("`dsv4_q_rms_norm_fusion` and `apply_rope_fusion` are on: one kernel")
            assert "CPU fp32: yes" in row.reason and "here: CPU fp32" in row.reason
        else:  # the composition of the ops the switches resolved to
            assert getattr(ops, slot).func is getattr(ref, slot) and getattr(ops, slot).keywords["rope"] is ops.rope
            assert row.backend == ("reference (pure Paddle)" if not switches else "the separate ops, as resolved above")
    if not on:
        assert ops.q_norm_rope.keywords["q_rms_norm"] is ops.q_rms_norm


SEQ = 136  # past the HCA ratio (128): every kind has compressed entries


def _attention_run(switches: dict, layer: int) -> dict[str, np.ndarray]:
    from fleet_ext.models import DSv4ForCausalLM

    paddle.seed(0)
    model = DSv4ForCausalLM(tiny_model(use_vha_attention=True, **switches))
    move_constant_inits(model, np.random.default_rng(0), 0.3)  # the kv gain and sinks off their constants
    attention = model.layers[layer].self_attention
    rng = np.random.default_rng(7)
    x = paddle.to_tensor(rng.standard_normal((2, SEQ, 32)).astype(F32), stop_gradient=False)
    out = attention(x)
    (out * paddle.to_tensor(rng.standard_normal((2, SEQ, 32)).astype(F32))).sum().backward()
    result = {"out": out.numpy(), "d_input": x.grad.numpy()}
    result.update({f"grad:{n}": p.grad.numpy() for n, p in attention.named_parameters() if p.grad is not None})
    return result


@pytest.mark.parametrize("layer", [0, 1, 2, 3], ids=["window", "csa", "hca", "full_causal"])
def test_attention_layer_is_bitwise_equal_with_the_prologue(layer):
    """Both switches on (the prologue fusion: one forward and one backward launch for q and kv each) vs off."""
    reference = _attention_run({}, layer)
    again = _attention_run({}, layer)
    for key in reference:
        assert_bitwise(again[key], reference[key], f"two unfused runs: {key}")
    assert "grad:kv_layernorm.weight" in reference and np.abs(reference["grad:kv_layernorm.weight"]).max() > 0
    with expect_launches(FWD, exactly=2), expect_launches(BWD, exactly=2), \
            expect_launches("_q_rms_norm_bwd_kernel", exactly=0):
        fused_run = _attention_run(BOTH, layer)
    assert fused_run.keys() == reference.keys()
    for key in reference:
        assert_bitwise(fused_run[key], reference[key], f"prologue on vs off: {key}")


# (lead, d, rope width): q unvectorised, q at the production head width, kv with a tail, kv at 512 (several
# row blocks: the gain's partials reduced in a second launch)
RECOMPUTE_CASES = [((2, 3, 4), 64, 8), ((1, 4, 4), 512, 64), ((2, 3), 33, 4), ((2, 21), 512, 64)]


@pytest.mark.parametrize("lead, d, rd", RECOMPUTE_CASES, ids=[f"{lead}-{d}" for lead, d, _ in RECOMPUTE_CASES])
def test_backward_recomputes_the_forwards_r_bitwise(monkeypatch, lead, d, rd):
    """Torch order, one-pass kernels (CPU interpreter, fp32; kv with the GPU's plan, the gain gradient inside the
    row programs): the forward without ``r`` (``keep_r=False``) writes the same ``y``; the backward given
    ``r=None`` recomputes ``r`` equal to the forward's byte for byte (``r_out``) and the same ``dx`` and ``dw``
    as with the forward's ``r``. A backward with another eps (a planted difference) is caught."""
    kv = len(lead) == 2
    if kv:  # the GPU plan of the kv backward (interpreted, its gain gradient takes the dedicated programs)
        monkeypatch.setattr(kernel, "is_interpreted", lambda: False)
    rng = np.random.default_rng(d + 7)
    x = torch.from_numpy(_scaled(lead + (d,), d))
    g = torch.from_numpy(rng.standard_normal(lead + (d,)).astype(F32))
    w = torch.from_numpy((1 + 0.3 * rng.standard_normal(d)).astype(F32)) if kv else None
    cos, sin = (torch.from_numpy(t.numpy()) for t in _tables(lead[0], lead[1], rd // 2))
    order = q_kernel.torch_cuda_order(int(np.prod(lead)), d)
    assert kernel.recomputes_r(d, order, kv)
    with expect_launches(FWD, exactly=2), expect_launches(BWD, exactly=2):
        y, r = kernel.norm_rope_fused(x, EPS, cos, sin, w, order)
        y_no_r, no_r = kernel.norm_rope_fused(x, EPS, cos, sin, w, order, keep_r=False)
        dx, dw = kernel.norm_rope_bwd(g, x, r, cos, sin, w, order, eps=EPS)
        r_bwd = torch.full_like(r, -1.0)  # poisoned: every row must be written
        dx_rc, dw_rc = kernel.norm_rope_bwd(g, x, None, cos, sin, w, order, eps=EPS, r_out=r_bwd)
    assert no_r is None
    assert_bitwise(y_no_r, y, "y without r")
    assert_bitwise(r_bwd, r, "the backward's recomputed r vs the forward's")
    assert_bitwise(dx_rc, dx, "dx with r recomputed vs read")
    if kv:  # the interpreter's row sums are layout-free; compiled, the two variants' may differ (tests/gpu: tolerance)
        assert_bitwise(dw_rc, dw, "dw with r recomputed vs read")
    planted = torch.full_like(r, -1.0)
    kernel.norm_rope_bwd(g, x, None, cos, sin, w, order, eps=1e-2, r_out=planted)
    with pytest.raises(AssertionError):
        assert_bitwise(planted, r, "planted: another eps in the backward")


def test_kv_dedicated_gain_programs_keep_r(monkeypatch):
    """The kv backward's dedicated gain programs read ``r``: with them (here: the interpreter's plan) the forward
    returns ``r`` even without ``keep_r`` and a backward without it raises."""
    x, g = torch.from_numpy(_scaled((1, 4, 64), 1)), torch.randn(1, 4, 64)
    w, (cos, sin) = torch.rand(64) + 0.5, (torch.from_numpy(t.numpy()) for t in _tables(1, 4, 4))
    order = q_kernel.torch_cuda_order(4, 64)
    assert not kernel.recomputes_r(64, order, True) and kernel.recomputes_r(64, order, False)
    assert kernel.norm_rope_fused(x, EPS, cos, sin, w, order, keep_r=False)[1] is not None
    with pytest.raises(ValueError, match=r"kv gain's dedicated programs, which read the forward's r"):
        kernel.norm_rope_bwd(g, x, None, cos, sin, w, order, eps=EPS)


@pytest.mark.parametrize("kv", [False, True], ids=["q", "kv"])
def test_the_gpu_training_path_keeps_no_r(monkeypatch, kv):
    """The PyLayers with the GPU's order and plans (forced here in the interpreter): the forward asks for no ``r``
    and gets none, the backward recomputes it; ``y`` and the gradients equal the kernels run with ``r``."""
    calls = []
    fwd, bwd = kernel.norm_rope_fused, kernel.norm_rope_bwd
    lead, d = ((2, 5), 512) if kv else ((1, 3, 4), 512)
    order = q_kernel.torch_cuda_order(int(np.prod(lead)), d)

    def spy_fwd(*args, **kwargs):
        out = fwd(*args, **kwargs)
        calls.append(("fwd", out[1]))
        return out

    def spy_bwd(dy, x, r, *args, **kwargs):
        calls.append(("bwd", r))
        return bwd(dy, x, r, *args, **kwargs)

    monkeypatch.setattr(kernel, "is_interpreted", lambda: False)
    monkeypatch.setattr(kernel, "default_order", lambda x: order)
    monkeypatch.setattr(kernel, "norm_rope_fused", spy_fwd)
    monkeypatch.setattr(kernel, "norm_rope_bwd", spy_bwd)
    rng = np.random.default_rng(9)
    x, g = _scaled(lead + (d,), 9), rng.standard_normal(lead + (d,)).astype(F32)
    w = (1 + 0.3 * rng.standard_normal(d)).astype(F32) if kv else None
    cos, sin = _tables(lead[0], lead[1], 32)
    with expect_launches(FWD, exactly=1), expect_launches(BWD, exactly=1):
        got = _run(fused.kv_norm_rope if kv else fused.q_norm_rope, x, g, cos, sin, w)
    assert calls == [("fwd", None), ("bwd", None)], calls
    xt, gt, wt = torch.from_numpy(x), torch.from_numpy(g), None if w is None else torch.from_numpy(w)
    ct, st = (torch.from_numpy(t.numpy()) for t in (cos, sin))
    y, r = fwd(xt, EPS, ct, st, wt, order)
    dx, dw = bwd(gt, xt, r, ct, st, wt, order, eps=EPS)
    want = {"y": y.numpy(), "dx": dx.numpy(), **({"dw": dw.numpy()} if kv else {})}
    _same(got, want, "GPU training path")
