"""Fused mHC kernels on CUDA (torch tensors, bf16 and fp32 streams) vs a float64 oracle and eager torch.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``.
Skipped without CUDA.

- Forward (pre op with Sinkhorn, head, combine) against the NumPy float64 oracle (``helpers.oracles``) computed
  from the very same (bf16- or fp32-valued) inputs. fp32 outputs (post, comb; the parameter gradients) use the
  fp32 ``mhc_fused`` entry (1e-5 of the largest entry) in both runs: with bf16 streams they are the same fp32
  maths on bf16-exact inputs (the kernels' tile products keep fp32 accuracy, ``split_dot._dot``). bf16 outputs
  use the bf16 ``mhc_fused`` entry (that plus one rounding to bf16).
- Gradients of every input against torch float64 autograd of the eager op sequence (``helpers.torch_mhc``,
  independent of the kernels), the same entries (the gains: ``mhc_fused_gain``, cancelling sums over tokens).
- Eager torch (the reference's op sequence in the streams' dtype) against the same oracle with the bounds its
  roundings allow: post, comb and the collapsed input are fp32 maths (rounded once), so the fused entries; the
  combine rounds post, comb, a product, the GEMM and the sum to bf16, so a per-element bound built from those
  roundings (``mhc_eager_combine``); and the fused combine (one rounding) is at least as close to float64 as
  eager's. Planted bugs fail these bounds (negative controls): a 1e-4 bias of the projection (the size of the
  error that bf16x3 products accumulated in the tensor cores gave), the mixing matrix transposed.
- Every tile-product mode the launchers offer (``kernel.PRODUCTS``/``TUNE``) and every launch geometry the H200
  sweep may pick (``kernel.GEOMETRY_VARIANTS``) within the same entries.
- The Hopper Gluon projection and streams' gradient (``kernel.GLUON``, the default here for bf16 streams of n = 4)
  and the Triton kernels, each forced, against float64 and against each other; the launch counters of every test
  expect the kernels the ``GLUON`` contract names.
- Determinism at the production shape (T = 16384 tokens x 4 streams x D = 4096, bf16): forward and backward
  byte-identical run to run (no atomics), at the defaults and at every geometry variant, and the Sinkhorn
  backward's stored and recomputed states give the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_bitwise, assert_close, expect_launches, torch_mhc
from helpers import oracles as orc
from helpers.gpu import CUDA_ONLY

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

from fleet_ext.ops.mhc.kernel import GEOMETRY_VARIANTS  # noqa: E402  (plain data; kernels are built where they run)

pytestmark = CUDA_ONLY
DEVICE = "cuda"
ITERS, EPS, NORM_EPS = 20, 1e-6, 1e-6
NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


@pytest.fixture(scope="module")
def kernel():
    from fleet_ext.ops.mhc import kernel as mhc_kernel  # imported only where it will run

    return mhc_kernel


def make(tokens, n, d, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape, scale=1.0, to=torch.float32):
        return (torch.randn(shape, generator=gen, device=DEVICE) * scale).to(to)

    nout = (2 + n) * n
    return {
        "x": randn(tokens, n, d, to=dtype), "f": randn(tokens, d, to=dtype),
        "fn": randn(nout, n * d, scale=0.1), "base": randn(nout, scale=0.5),
        "scale": torch.tensor([0.7, 1.3, 2.0], device=DEVICE),
        "head_fn": randn(n, n * d, scale=0.1), "head_base": randn(n, scale=0.5),
        "head_scale": torch.tensor([1.7], device=DEVICE),
        "g_post": randn(tokens, n), "g_comb": randn(tokens, n, n), "g_y": randn(tokens, d, to=dtype),
        "g_out": randn(tokens, n, d, to=dtype),
    }


def host(t):
    return t.detach().double().cpu().numpy()


def check(got, want, dtype, what, gain=False):
    """fp32 tensors against the fp32 entries; bf16 ones (one rounding of fp32 maths) against the bf16 entry."""
    table = "bf16" if got.dtype == torch.bfloat16 else "fp32"
    assert_close(got, want, table, "mhc_fused_gain" if gain else "mhc_fused", what=f"{NAMES[dtype]} {what}")


def _gluon_runs(kernel, x, kind: str, head: bool) -> bool:
    """The contract of ``kernel.GLUON``: "gluon", or "auto" with no Triton geometry for ``kind`` in ``TUNE``, for
    bf16 streams of n = 4 (not the head: its mix width pads to 8), whole tiles, the default bf16-piece products."""
    _, n, d = x.shape
    products = kernel.TUNE.get("dot", "bf16x3") == "bf16x3" and (kind == "proj" or
                                                                  kernel.TUNE.get("gx", "bf16x3") == "bf16x3")
    cfg = {**kernel.GPU_CONFIG[f"{kind}_gluon"], **kernel.TUNE.get(f"{kind}_gluon", {})}
    whole = (n * d) % cfg["BK"] == 0 if kind == "proj" else d % cfg["BD"] == 0
    fits = x.dtype == torch.bfloat16 and n == 4 and whole and products and not head
    return kernel.GLUON == "gluon" or (kernel.GLUON == "auto" and kind not in kernel.TUNE and fits)


def pre_fwd_kernels(kernel, x, head=False) -> tuple[str, ...]:
    """The pre forward's launches: fn's pieces and the Gluon projection, or the Triton one; then the collapse."""
    if _gluon_runs(kernel, x, "proj", head):
        return ("_mhc_fn_pieces", "_mhc_proj_gluon", "_mhc_pre_fwd")
    return ("_mhc_proj_fwd", "_mhc_pre_fwd")


def pre_bwd_kernels(kernel, x, head=False) -> tuple[str, ...]:
    """The pre backward's launches: ``_mhc_gates_bwd`` where ``gates`` splits the first pass off, then three: the
    streams' gradient in Gluon (several streams per program with ``SPP``) or in Triton (``_gluon_runs``)."""
    dx = "_mhc_dx_bwd"
    if _gluon_runs(kernel, x, "dx", head):
        spp = {**kernel.GPU_CONFIG["dx_gluon"], **kernel.TUNE.get("dx_gluon", {})}.get("SPP", 1)
        dx = "_mhc_dx_streams" if spp > 1 else "_mhc_dx_gluon"
    gate = ("_mhc_gates_bwd",) if kernel._config("gates", x.shape[1], x.shape[2])["SPLIT"] else ()
    return (*gate, "_mhc_pre_bwd", dx, "_mhc_params_bwd")


def _forward(kernel, a):
    """The pre op, the head and the combine, each with its launch counters."""
    with expect_launches(*pre_fwd_kernels(kernel, a["x"]), exactly=1):
        post, comb, y, _, _ = kernel.pre_forward(a["x"], a["fn"], a["base"], a["scale"], ITERS, EPS, NORM_EPS)
    with expect_launches(*pre_fwd_kernels(kernel, a["x"], head=True), exactly=1):
        _, _, head, _, _ = kernel.pre_forward(a["x"], a["head_fn"], a["head_base"], a["head_scale"], ITERS, EPS,
                                              NORM_EPS, head=True)
    with expect_launches("_mhc_combine_fwd", exactly=1):
        out = kernel.combine_forward(a["x"], a["f"], post, comb)
    return post, comb, y, head, out


def _oracle_forward(a, post, comb):
    x = host(a["x"])[None]
    want_post, want_comb, want_y = orc.hc_pre(x, host(a["fn"]), host(a["base"]), host(a["scale"]), ITERS, EPS,
                                              NORM_EPS)
    want_head = orc.hc_head(x, host(a["head_fn"]), host(a["head_base"]), host(a["head_scale"]), EPS, NORM_EPS)
    want_out = orc.hc_post(x, host(a["f"])[None], host(post)[None], host(comb)[None])
    return {"post": want_post[0], "comb": want_comb[0], "collapsed": want_y[0], "head": want_head[0],
            "combine": want_out[0]}


def _eager_combine_scale(a, post, comb):
    """Per element of the combine, |e| + 2 |post f| + 3 sum_j |comb_jk x_j| (float64): what eager's roundings
    are bounded by, ``mhc_eager_combine`` (tolerances.py)."""
    x, f, p, c = host(a["x"]), host(a["f"]), host(post), host(comb)
    e = orc.hc_post(x[None], f[None], p[None], c[None])[0]
    return np.abs(e) + 2 * np.abs(p[:, :, None] * f[:, None, :]) + 3 * np.einsum("tjk,tjd->tkd", np.abs(c), np.abs(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, n, d", [(1024, 4, 4096), (77, 4, 100), (33, 3, 64), (5, 1, 16)])
def test_forward_vs_float64_oracle_and_eager(kernel, tokens, n, d, dtype):
    a = make(tokens, n, d, dtype, seed=tokens + n + d)
    post, comb, y, head, out = _forward(kernel, a)
    want = _oracle_forward(a, post, comb)
    for what, got in (("post", post), ("comb", comb), ("collapsed", y), ("head", head), ("combine", out)):
        assert got.dtype == (torch.float32 if what in ("post", "comb") else dtype), what
        check(got, want[what], dtype, what)
    # Eager torch, the reference's op sequence, against the same oracle, each output within what its own
    # roundings allow: post, comb and the collapsed input are fp32 maths (the fused entries).
    e_post, e_comb, e_y = torch_mhc.mhc_pre(a["x"], a["fn"], a["base"], a["scale"], ITERS, EPS, NORM_EPS)
    for what, got in (("post", e_post), ("comb", e_comb), ("collapsed", e_y)):
        check(got, want[what], dtype, f"eager {what}")
    e_out = torch_mhc.mhc_combine(a["x"], a["f"], post, comb)
    if dtype == torch.float32:
        check(e_out, want["combine"], dtype, "eager combine")
        return
    assert_close(e_out, want["combine"], "bf16", "mhc_eager_combine", what="eager bf16 combine",
                 scale=_eager_combine_scale(a, post, comb))
    fused_err = np.linalg.norm(host(out) - want["combine"])
    eager_err = np.linalg.norm(host(e_out) - want["combine"])
    assert fused_err <= eager_err, f"fused combine further from float64 than eager: {fused_err:.3e} > {eager_err:.3e}"


def test_planted_bugs_fail_the_bounds(kernel):
    """Negative controls at V4's width (K = n D = 16384, bf16 streams): a 1e-4 relative bias of the projection
    (as the tensor cores' accumulation of bf16x3 products gave) fails the fp32 entry on comb; the mixing matrix
    transposed fails the bf16 entry on the fused combine and the eager bound on eager's."""
    a = make(256, 4, 4096, torch.bfloat16, seed=5)
    with expect_launches(*pre_fwd_kernels(kernel, a["x"]), exactly=1):
        post, comb, _, _, _ = kernel.pre_forward(a["x"], a["fn"] * (1 - 1e-4), a["base"], a["scale"], ITERS, EPS,
                                                 NORM_EPS)
    want = _oracle_forward(a, post, comb)
    with pytest.raises(AssertionError, match="outside fp32 'mhc_fused'"):
        check(comb, want["comb"], torch.bfloat16, "planted: projection biased by 1e-4")
    comb_t = comb.transpose(1, 2).contiguous()
    with expect_launches("_mhc_combine_fwd", exactly=1):
        out = kernel.combine_forward(a["x"], a["f"], post, comb_t)
    with pytest.raises(AssertionError, match="outside bf16 'mhc_fused'"):
        check(out, want["combine"], torch.bfloat16, "planted: comb transposed (fused)")
    with pytest.raises(AssertionError, match="outside bf16 'mhc_eager_combine'"):
        assert_close(torch_mhc.mhc_combine(a["x"], a["f"], post, comb_t), want["combine"], "bf16",
                     "mhc_eager_combine", what="planted: comb transposed (eager)",
                     scale=_eager_combine_scale(a, post, comb))


def _oracle_grads(a):
    """Torch float64 autograd of the eager op sequence: gradients of every input of pre + head, and of the combine
    (on its own inputs: the kernel's fp32 post and comb, the block output f)."""
    leaves = {k: a[k].detach().double().requires_grad_() for k in
              ("x", "fn", "base", "scale", "head_fn", "head_base", "head_scale")}
    post, comb, y = torch_mhc.mhc_pre(leaves["x"], leaves["fn"], leaves["base"], leaves["scale"], ITERS, EPS,
                                      NORM_EPS, compute=torch.float64)
    head = torch_mhc.mhc_head(leaves["x"], leaves["head_fn"], leaves["head_base"], leaves["head_scale"], EPS,
                              NORM_EPS, compute=torch.float64)
    loss = (post * a["g_post"].double()).sum() + (comb * a["g_comb"].double()).sum() + (y * a["g_y"].double()).sum()
    (loss + (head * a["g_y"].double()).sum()).backward()
    combine = {k: a[k].detach().double().requires_grad_() for k in ("x", "f", "post", "comb")}
    (torch_mhc.mhc_combine(*combine.values()) * a["g_out"].double()).sum().backward()
    return {k: v.grad for k, v in leaves.items()}, {k: v.grad for k, v in combine.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, n, d", [(512, 4, 4096), (77, 4, 100), (33, 3, 64)])
def test_gradients_vs_float64_autograd(kernel, tokens, n, d, dtype):
    a = make(tokens, n, d, dtype, seed=7 * tokens + d)
    post, comb, _, mix, r = kernel.pre_forward(a["x"], a["fn"], a["base"], a["scale"], ITERS, EPS, NORM_EPS)
    _, _, _, head_mix, head_r = kernel.pre_forward(a["x"], a["head_fn"], a["head_base"], a["head_scale"], ITERS,
                                                   EPS, NORM_EPS, head=True)
    a["post"], a["comb"] = post, comb
    with expect_launches(*pre_bwd_kernels(kernel, a["x"]), exactly=1):
        pre = kernel.pre_backward(a["x"], a["fn"], a["base"], a["scale"], mix, r, a["g_post"], a["g_comb"],
                                  a["g_y"], ITERS, EPS)
    with expect_launches(*pre_bwd_kernels(kernel, a["x"], head=True), exactly=1):
        hd = kernel.pre_backward(a["x"], a["head_fn"], a["head_base"], a["head_scale"], head_mix, head_r, None,
                                 None, a["g_y"], ITERS, EPS, head=True)
    with expect_launches("_mhc_combine_bwd", exactly=1):
        comb_grads = kernel.combine_backward(a["x"], a["f"], post, comb, a["g_out"])
    want_pre, want_comb = _oracle_grads(a)
    if dtype == torch.float32:  # bf16: each op's streams gradient is rounded on its own (the next test)
        check(pre[0] + hd[0], want_pre["x"].cpu().numpy(), dtype, "d streams (pre + head)")
    for what, got, want in (("d fn", pre[1], want_pre["fn"]), ("d base", pre[2], want_pre["base"]),
                            ("d head_fn", hd[1], want_pre["head_fn"]), ("d head_base", hd[2], want_pre["head_base"])):
        check(got, want.cpu().numpy(), dtype, what)
    check(pre[3], want_pre["scale"].cpu().numpy(), dtype, "d scale", gain=True)
    check(hd[3], want_pre["head_scale"].cpu().numpy(), dtype, "d head_scale", gain=True)
    for what, got, want in zip(("d x", "d f", "d post", "d comb"), comb_grads, want_comb.values()):
        check(got, want.cpu().numpy(), dtype, f"combine {what}")


def _assert_pre_op_matches_float64(kernel, a, label: str) -> None:
    """The pre op forward and backward (bf16 streams) under the current ``kernel.TUNE`` vs torch float64 autograd:
    its outputs, its streams gradient (rounded to bf16 once: alone, without the head's) and the parameter
    gradients, the fused entries."""
    with expect_launches(*pre_fwd_kernels(kernel, a["x"]), *pre_bwd_kernels(kernel, a["x"]), exactly=1):
        post, comb, y, mix, r = kernel.pre_forward(a["x"], a["fn"], a["base"], a["scale"], ITERS, EPS, NORM_EPS)
        g_x, g_fn, g_base, g_scale = kernel.pre_backward(a["x"], a["fn"], a["base"], a["scale"], mix, r, a["g_post"],
                                                         a["g_comb"], a["g_y"], ITERS, EPS)
    leaves = [a["x"].detach().double().requires_grad_()] + [a[k].double().requires_grad_() for k in
                                                            ("fn", "base", "scale")]
    p, c, yy = torch_mhc.mhc_pre(*leaves, ITERS, EPS, NORM_EPS, compute=torch.float64)
    ((p * a["g_post"].double()).sum() + (c * a["g_comb"].double()).sum() + (yy * a["g_y"].double()).sum()).backward()
    for what, got, want in (("post", post, p), ("comb", comb, c), ("collapsed", y, yy), ("d streams (pre)", g_x,
                            leaves[0].grad), ("d fn", g_fn, leaves[1].grad), ("d base", g_base, leaves[2].grad)):
        check(got, want.detach().cpu().numpy(), torch.bfloat16, f"{what} [{label}]")
    check(g_scale, leaves[3].grad.cpu().numpy(), torch.bfloat16, f"d scale [{label}]", gain=True)


@pytest.mark.parametrize("dot, gx", [("bf16x3", "bf16x3"), ("tf32x3", "bf16x6"), ("bf16x3", "tf32x3")])
def test_product_modes_in_bf16(kernel, monkeypatch, dot, gx):
    """Each tile-product mode the launchers offer, at V4's width."""
    monkeypatch.setattr(kernel, "TUNE", {"dot": dot, "gx": gx})
    _assert_pre_op_matches_float64(kernel, make(256, 4, 4096, torch.bfloat16, seed=3), f"{dot}/{gx}")


@pytest.mark.parametrize("tokens, d", [(256, 4096), (1000, 128), (77, 64), (5, 64)])
def test_gluon_kernels_match_triton_and_float64(kernel, monkeypatch, tokens, d):
    """The projection and the streams' gradient from the Gluon kernels and from the Triton ones (``GLUON`` forced
    each way), same inputs (token tails within a split and across splits, fewer tokens than one tile, one or
    several channel tiles, K split):
    each within the fused entries of float64 autograd, with launch counters; and against each other: the
    projection's outputs ``mix`` and ``r`` within 1e-5 / 1e-6 of their largest entries, ``g_x`` within one bf16
    rounding per element (the fp32 sums differ in MMA order only; plus 1e-5 of the largest entry where a sum
    cancels), ``g_fn`` within 1e-5 of its largest entry. A 3 % error in any of them fails that comparison."""
    a = make(tokens, 4, d, torch.bfloat16, seed=5 + tokens)
    runs = {}
    for which in ("gluon", "triton"):
        monkeypatch.setattr(kernel, "GLUON", which)
        _assert_pre_op_matches_float64(kernel, a, f"GLUON {which}")
        _, _, _, mix, r = kernel.pre_forward(a["x"], a["fn"], a["base"], a["scale"], ITERS, EPS, NORM_EPS)
        runs[which] = (mix, r, *kernel.pre_backward(a["x"], a["fn"], a["base"], a["scale"], mix, r, a["g_post"],
                                                    a["g_comb"], a["g_y"], ITERS, EPS)[:2])

    def agree(got) -> bool:
        mix, r, g_x, g_fn = got
        w_mix, w_r, w_x, w_fn = (v.float() for v in runs["triton"])
        floor = 1e-5 * w_x.abs().max()  # sums that cancel: the fp32 difference against the terms, not the sum
        return (bool(((g_x.float() - w_x).abs() <= 2 ** -7 * w_x.abs() + floor).all())
                and all(float((v - w).abs().max()) <= bound * float(w.abs().max())
                        for v, w, bound in ((mix, w_mix, 1e-5), (r, w_r, 1e-6), (g_fn, w_fn, 1e-5))))

    assert agree(runs["gluon"]), "the Gluon and the Triton kernels differ by more than their roundings"
    for i in range(4):  # negative controls: each output off by 3 %
        planted = list(runs["gluon"])
        planted[i] = planted[i] * 1.03
        assert not agree(planted), f"the comparison misses a 3 % error in output {i}"


@pytest.mark.parametrize("tokens, d", [(256, 4096), (77, 64)])
@pytest.mark.parametrize("spp", [2, 4])
def test_streams_per_program_are_byte_identical(kernel, monkeypatch, tokens, d, spp):
    """The streams' gradient with two or four streams per program (``kernel_dx_streams.py``, ``dx_gluon`` ``SPP``)
    computes every element as the one-stream kernel does: ``g_x`` and ``g_fn`` byte-equal, with launch counters. The
    control: the same comparison against another split of the tokens (``SPLITS`` 4: ``g_fn``'s sums in another
    order) does see a difference."""
    a = make(tokens, 4, d, torch.bfloat16, seed=3 + tokens)
    _, _, _, mix, r = kernel.pre_forward(a["x"], a["fn"], a["base"], a["scale"], ITERS, EPS, NORM_EPS)

    def backward(tune: dict, name: str) -> tuple:
        monkeypatch.setattr(kernel, "TUNE", {"dx_gluon": tune})
        with expect_launches(name, exactly=1):
            return kernel.pre_backward(a["x"], a["fn"], a["base"], a["scale"], mix, r, a["g_post"], a["g_comb"],
                                       a["g_y"], ITERS, EPS)[:2]

    want = backward({"SPP": 1}, "_mhc_dx_gluon")
    got = backward({"SPP": spp}, "_mhc_dx_streams")
    for what, g, w in zip(("g_x", "g_fn"), got, want):
        assert_bitwise(g, w, f"{what}, {spp} streams per program against one")
    if tokens > 32 * 4:  # more than one token tile per split at SPLITS 4: the control can differ
        other = backward({"SPP": spp, "SPLITS": 4}, "_mhc_dx_streams")
        assert not torch.equal(other[1], want[1]), "the byte comparison cannot see another summation order"


def test_repeat_launches_are_bound_gluon_kernels_included(kernel):
    """Each launch plan of the pre op and the combine (``kernel._FWD_PLANS``, ...) goes through Triton's
    ``kernel[grid]`` once (it compiles) and straight to the compiled kernel after that (``launch.Bound``), the Gluon
    projection and streams' gradient too; the outputs of a bound call equal the first call's bytes."""
    from fleet_ext.ops import launch

    launch.clear_plans()
    a = make(512, 4, 4096, torch.bfloat16, seed=7)
    first = _step(kernel, a)
    for _ in range(2):
        for i, (got, want) in enumerate(zip(_step(kernel, a), first)):
            assert_bitwise(got, want, f"output {i}, bound launch vs the first call")
    plans = [p for cache in (kernel._FWD_PLANS, kernel._BWD_PLANS, kernel._COMBINE_PLANS) for entry in cache.values()
             for p in ([entry] if isinstance(entry, launch.Plan) else
                       [getattr(entry, s) for s in entry.__slots__ if isinstance(getattr(entry, s), launch.Plan)])]
    names = {"_mhc_proj_gluon", *pre_bwd_kernels(kernel, a["x"])} & {"_mhc_proj_gluon", "_mhc_dx_gluon",
                                                                      "_mhc_dx_streams"}
    bound = {p.bound.name for p in plans if p.grid is not None and p.bound.misses == 1 and p.bound.compiled}
    assert len(plans) >= 8 and names <= bound, (sorted(bound), [(p.bound.name, p.bound.misses) for p in plans])
    assert all(p.bound.misses == 1 for p in plans if p.grid is not None)


def _variant_id(variant: dict) -> str:
    return "-".join(f"{key}-" + "-".join(f"{k}{v}" for k, v in cfg.items()) for key, cfg in variant.items())


@pytest.mark.parametrize("variant", GEOMETRY_VARIANTS, ids=_variant_id)
def test_launch_geometries_in_bf16(kernel, monkeypatch, variant):
    """Every launch geometry the H200 sweep may make a default (``kernel.GEOMETRY_VARIANTS``), at V4's width: the
    pre op vs float64 as above, and the combine backward's four gradients vs float64 autograd, the same entries as
    the defaults'; and byte-identical run to run at the production shape."""
    monkeypatch.setattr(kernel, "TUNE", dict(variant))
    a = make(256, 4, 4096, torch.bfloat16, seed=11)
    _assert_pre_op_matches_float64(kernel, a, _variant_id(variant))
    post, comb, _, _, _ = kernel.pre_forward(a["x"], a["fn"], a["base"], a["scale"], ITERS, EPS, NORM_EPS)
    with expect_launches("_mhc_combine_bwd", exactly=1):
        got = kernel.combine_backward(a["x"], a["f"], post, comb, a["g_out"])
    leaves = [t.detach().double().requires_grad_() for t in (a["x"], a["f"], post, comb)]
    (torch_mhc.mhc_combine(*leaves) * a["g_out"].double()).sum().backward()
    for what, g, leaf in zip(("d x", "d f", "d post", "d comb"), got, leaves):
        check(g, leaf.grad.cpu().numpy(), torch.bfloat16, f"combine {what} [{_variant_id(variant)}]")
    _assert_deterministic(kernel, make(16384, 4, 4096, torch.bfloat16, seed=1), 2, f" [{_variant_id(variant)}]")


def _step(kernel, a) -> tuple:
    """Every output of the pre op, the combine and their backwards (one token batch of ``a``)."""
    post, comb, y, mix, r = kernel.pre_forward(a["x"], a["fn"], a["base"], a["scale"], ITERS, EPS, NORM_EPS)
    out = kernel.combine_forward(a["x"], a["f"], post, comb)
    grads = kernel.pre_backward(a["x"], a["fn"], a["base"], a["scale"], mix, r, a["g_post"], a["g_comb"],
                                a["g_y"], ITERS, EPS)
    return (post, comb, y, out, *grads, *kernel.combine_backward(a["x"], a["f"], post, comb, a["g_out"]))


def _assert_deterministic(kernel, a, runs: int, what: str) -> tuple:
    with expect_launches(*pre_fwd_kernels(kernel, a["x"]), *pre_bwd_kernels(kernel, a["x"]), "_mhc_combine_fwd",
                         "_mhc_combine_bwd", exactly=1):
        first = _step(kernel, a)
    for _ in range(runs - 1):
        for i, (got, want) in enumerate(zip(_step(kernel, a), first)):
            assert_bitwise(got, want, f"output {i}, run after run{what}")
    return first


def test_production_shape_is_deterministic(kernel, monkeypatch):
    a = make(16384, 4, 4096, torch.bfloat16, seed=1)
    first = _assert_deterministic(kernel, a, 3, "")
    # The Sinkhorn backward's three ways to its states (kept in registers, stored to scratch, recomputed): the same
    # bytes.
    default = kernel.GPU_CONFIG["pre_bwd"]["STATES"]
    for states in {0, 1, 2} - {default}:
        monkeypatch.setattr(kernel, "TUNE", {"pre_bwd": {"STATES": states}})
        for i, (got, want) in enumerate(zip(_step(kernel, a), first)):
            assert_bitwise(got, want, f"output {i}, Sinkhorn states mode {states} vs {default}")
