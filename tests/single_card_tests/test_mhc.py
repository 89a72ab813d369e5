"""mHC hyper-connections and Sinkhorn vs the float64 oracle (dsv4_math.md §3).

Tolerances (tests/helpers/tolerances.py, fp32): the layer vs the float64 oracle, ``oracle`` (the mixing
projection contracts n*D = 128 O(1) terms and the 20 Sinkhorn iterations are well conditioned); gradients:
fp32 autograd vs central differences of the float64 oracle, ``fd_grad_of_max``; Sinkhorn row and column
sums, ``sinkhorn_*``.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_close, tiny_model
from helpers import oracles as orc

from fleet_ext.config import load_config
from fleet_ext.layers.mhc import HyperConnection, HyperHead, hyper_combine, sinkhorn

N, D = 4, 32


def make_config(**overrides):
    base = tiny_model(hidden_size=D, num_hidden_layers=3, csa_compress_ratios=[0, 4, 128], init_method_std=0.02)
    return load_config({**base, **overrides}).model


def randomize(layer, rng, scale_values):
    fn = (rng.standard_normal(layer.fn.shape) * 0.1).astype("float32")
    base = rng.standard_normal(layer.base.shape).astype("float32")
    scale = np.asarray(scale_values, dtype="float32")
    layer.fn.set_value(fn)
    layer.base.set_value(base)
    layer.scale.set_value(scale)
    return {"fn": fn.astype(np.float64), "base": base.astype(np.float64), "scale": scale.astype(np.float64)}


def assert_grad_close(got, want, name):
    scale = np.abs(want).max()
    assert scale > 1e-3, f"{name}: oracle gradient is ~0, the comparison would be vacuous"
    assert_close(got, want, "fp32", "fd_grad_of_max", what=name)


# --------------------------------------------------------------------------------------------------
# Sinkhorn.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("logit_scale", [1.0, 3.0])
def test_sinkhorn_doubly_stochastic_and_matches_oracle(logit_scale):
    logits = np.random.default_rng(0).standard_normal((6, N, N)) * logit_scale
    got = sinkhorn(paddle.to_tensor(logits.astype("float32")), 20, 1e-6).numpy()
    assert got.shape == (6, N, N)
    assert np.all(got > 0)
    assert_close(got, orc.sinkhorn(logits.astype("float32"), 20, 1e-6), "fp32", "oracle")
    # Columns are normalised last, so they sum to colsum / (colsum + eps) = 1 - O(eps) whatever the logits.
    assert_close(got.sum(-2), 1.0, "fp32", "sinkhorn_col_sums", what="column sums")
    # Rows: Sinkhorn converges linearly; 20 iterations reach 1e-5 for O(1) logits (the mHC regime), not for
    # logits of spread ~3 (the float64 oracle has the same residual there, checked just above).
    row_tol = "sinkhorn_row_sums" if logit_scale == 1.0 else "sinkhorn_row_sums_spread"
    assert_close(got.sum(-1), 1.0, "fp32", row_tol, what="row sums")
    # Non-vacuous: one pass (row softmax + one column normalisation) is not yet row-stochastic.
    one = sinkhorn(paddle.to_tensor(logits.astype("float32")), 1, 1e-6).numpy()
    assert np.abs(one.sum(-1) - 1.0).max() > 1e-2


def test_sinkhorn_eps_and_iterations_follow_the_formula():
    logits = np.random.default_rng(1).standard_normal((3, N, N)).astype("float32")
    for iters, eps in ((1, 1e-6), (3, 1e-2), (20, 0.5)):
        got = sinkhorn(paddle.to_tensor(logits), iters, eps).numpy()
        want = orc.sinkhorn(logits, iters, eps)
        assert_close(got, want, "fp32", "oracle", what=f"iters={iters} eps={eps}")


# --------------------------------------------------------------------------------------------------
# HyperConnection / hyper_combine / HyperHead forward.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hc_eps", [1e-6, 0.05])  # 0.05 makes the pre-gate floor and Sinkhorn eps visible
def test_hyper_connection_matches_oracle(hc_eps):
    cfg = make_config(mhc_eps=hc_eps)
    layer = HyperConnection(cfg)
    rng = np.random.default_rng(2)
    params = randomize(layer, rng, [0.7, 1.3, 2.0])
    streams = rng.standard_normal((2, 3, N, D)).astype("float32")
    post, comb, collapsed = (t.numpy() for t in layer(paddle.to_tensor(streams)))
    want_post, want_comb, want_y = orc.hc_pre(streams, params["fn"], params["base"], params["scale"],
                                              cfg.mhc_sinkhorn_iterations, cfg.mhc_eps, cfg.rms_norm_eps)
    assert post.shape == (2, 3, N) and comb.shape == (2, 3, N, N) and collapsed.shape == (2, 3, D)
    assert_close(post, want_post, "fp32", "oracle", what="post")
    assert_close(comb, want_comb, "fp32", "oracle", what="comb")
    assert_close(collapsed, want_y, "fp32", "oracle", what="collapsed")
    # base/scale must matter for this to test them.
    _, _, y_default = orc.hc_pre(streams, params["fn"], np.zeros(24), np.ones(3), 20, hc_eps, cfg.rms_norm_eps)
    assert np.abs(y_default - want_y).max() > 1e-2


def test_hyper_combine_matches_oracle():
    rng = np.random.default_rng(3)
    streams = rng.standard_normal((2, 3, N, D)).astype("float32")
    block_out = rng.standard_normal((2, 3, D)).astype("float32")
    post = rng.uniform(0, 2, (2, 3, N)).astype("float32")
    comb = rng.uniform(0, 1, (2, 3, N, N)).astype("float32")  # deliberately not symmetric
    got = hyper_combine(*(paddle.to_tensor(a) for a in (streams, block_out, post, comb))).numpy()
    want = orc.hc_post(streams, block_out, post, comb)
    assert_close(got, want, "fp32", "oracle")
    transposed = orc.hc_post(streams, block_out, post, np.swapaxes(comb, -1, -2))
    assert np.abs(transposed - want).max() > 1e-2, "comb orientation ([from i, to j]) must be distinguishable"


@pytest.mark.parametrize("hc_eps", [1e-6, 0.05])
def test_hyper_head_matches_oracle(hc_eps):
    cfg = make_config(mhc_eps=hc_eps)
    head = HyperHead(cfg)
    rng = np.random.default_rng(4)
    params = randomize(head, rng, [1.7])
    streams = rng.standard_normal((2, 3, N, D)).astype("float32")
    got = head(paddle.to_tensor(streams)).numpy()
    want = orc.hc_head(streams, params["fn"], params["base"], params["scale"], cfg.mhc_eps, cfg.rms_norm_eps)
    assert_close(got, want, "fp32", "oracle")


# --------------------------------------------------------------------------------------------------
# Gradients.
# --------------------------------------------------------------------------------------------------
def test_hyper_connection_gradients_vs_finite_differences():
    cfg = make_config()
    layer = HyperConnection(cfg)
    rng = np.random.default_rng(5)
    params = randomize(layer, rng, [0.7, 1.3, 2.0])
    streams = rng.standard_normal((2, 2, N, D)).astype("float32")
    g_post, g_comb, g_y = (rng.standard_normal(s) for s in ((2, 2, N), (2, 2, N, N), (2, 2, D)))
    post, comb, y = layer(paddle.to_tensor(streams))
    loss = (post * paddle.to_tensor(g_post.astype("float32"))).sum() \
        + (comb * paddle.to_tensor(g_comb.astype("float32"))).sum() \
        + (y * paddle.to_tensor(g_y.astype("float32"))).sum()
    loss.backward()

    def oracle_loss():
        p, c, yy = orc.hc_pre(streams, params["fn"], params["base"], params["scale"], cfg.mhc_sinkhorn_iterations,
                              cfg.mhc_eps, cfg.rms_norm_eps)
        return float((p * g_post).sum() + (c * g_comb).sum() + (yy * g_y).sum())

    grads = {"fn": layer.fn.grad, "base": layer.base.grad, "scale": layer.scale.grad}
    for name, grad in grads.items():
        assert grad is not None, f"no gradient reached {name}"
        grad = grad.numpy().reshape(-1)
        assert np.abs(grad).max() > 0, f"gradient of {name} is identically 0"
        n_rows = grad.size if name != "fn" else 0
        coords = list(range(n_rows)) if n_rows else list(rng.choice(grad.size, 64, replace=False))
        # fn rows 2n.. only reach the output through Sinkhorn: make sure some are sampled.
        if name == "fn":
            coords += [2 * N * N * D + k for k in range(0, 16 * N * D, 97)]
        fd = orc.central_fd(oracle_loss, params[name], coords)
        assert_grad_close(grad[coords], fd, f"d loss / d {name}")
    comb_base_grad = layer.base.grad.numpy()[2 * N :]
    assert np.abs(comb_base_grad).max() > 1e-4, "gradient must flow through Sinkhorn into the comb logits"


def test_hyper_head_gradients_nonzero_and_match_fd():
    cfg = make_config()
    head = HyperHead(cfg)
    rng = np.random.default_rng(6)
    params = randomize(head, rng, [1.7])
    streams = rng.standard_normal((2, 2, N, D)).astype("float32")
    g = rng.standard_normal((2, 2, D))
    (head(paddle.to_tensor(streams)) * paddle.to_tensor(g.astype("float32"))).sum().backward()

    def oracle_loss():
        return float((orc.hc_head(streams, params["fn"], params["base"], params["scale"], cfg.mhc_eps,
                                  cfg.rms_norm_eps) * g).sum())

    for name, param in (("fn", head.fn), ("base", head.base), ("scale", head.scale)):
        assert param.grad is not None and np.abs(param.grad.numpy()).max() > 0, f"no gradient reached {name}"
        grad = param.grad.numpy().reshape(-1)
        coords = list(range(min(grad.size, 48)))
        assert_grad_close(grad[coords], orc.central_fd(oracle_loss, params[name], coords), f"d loss / d {name}")
