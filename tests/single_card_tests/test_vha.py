"""VHA linear postmix O' = (I + V U^T) O over the head axis vs the float64 oracle (dsv4_math.md §5).

Tolerances (tests/helpers/tolerances.py, fp32): identity at init is exact (1 * x + 0 * y is exact in fp32).
Otherwise fp32 vs float64 over contractions of <= 8 heads of O(1) values: ``oracle``. Gradients vs the
analytic oracle dV = dM U, dU = dM^T V with dM = sum_tokens dO' O^T: ``oracle_grad`` (of the largest entry).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_close, tiny_model
from helpers import oracles as orc

from fleet_ext.config import load_config
from fleet_ext.layers.vha import VHAPostmix

HEADS, GROUPS = 8, 2


def make_config(grouped: bool, rank=None):
    return load_config(tiny_model(
        num_hidden_layers=3, num_attention_heads=HEADS, csa_compress_ratios=[0, 4, 128], o_groups=GROUPS,
        init_method_std=0.02, use_vha_attention=True, vha_postmix_grouped=grouped, vha_postmix_rank=rank,
    )).model


def o_input(seed=0, shape=(2, 3, HEADS, 16)):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_identity_at_init(grouped):
    layer = VHAPostmix(make_config(grouped))
    assert np.all(layer.vha_postmix_V.numpy() == 0.0), "V must start at exactly 0"
    assert np.abs(layer.vha_postmix_U.numpy()).max() > 0, "U starts random (N(0, 0.01^2))"
    want_shape = [GROUPS, HEADS // GROUPS, 2] if grouped else [HEADS, 2]  # rank defaults to heads // 4
    assert list(layer.vha_postmix_U.shape) == want_shape and list(layer.vha_postmix_V.shape) == want_shape
    o = o_input()
    got = layer(paddle.to_tensor(o)).numpy()
    np.testing.assert_array_equal(got, o, err_msg="postmix with V = 0 must be the exact identity")


@pytest.mark.parametrize("rank", [None, 3])
@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_postmix_matches_oracle_off_zero(grouped, rank):
    layer = VHAPostmix(make_config(grouped, rank))
    rng = np.random.default_rng(1)
    u = rng.standard_normal(layer.vha_postmix_U.shape).astype("float32") * 0.5
    v = rng.standard_normal(layer.vha_postmix_V.shape).astype("float32") * 0.5
    layer.vha_postmix_U.set_value(u)
    layer.vha_postmix_V.set_value(v)
    o = o_input(2)
    got = layer(paddle.to_tensor(o)).numpy()
    groups = GROUPS if grouped else 1
    want = orc.vha_postmix(o, u, v, groups)
    assert_close(got, want, "fp32", "oracle")
    assert np.abs(want - o).max() > 0.1, "the mix must move the output away from the identity"
    if grouped:  # block-diagonal: heads of group 0 never see heads of group 1
        o2 = o.copy()
        o2[:, :, HEADS // GROUPS :] += 3.0
        np.testing.assert_array_equal(layer(paddle.to_tensor(o2)).numpy()[:, :, : HEADS // GROUPS],
                                      got[:, :, : HEADS // GROUPS], err_msg="grouped postmix leaked across groups")
        dense = orc.vha_postmix(o, np.concatenate(list(u)), np.concatenate(list(v)), 1)
        assert np.abs(dense - want).max() > 1e-2, "dense and block-diagonal mixes must be distinguishable"


def _oracle_grads(o, g, u, v, groups):
    """dM[h, h'] = sum_{b,s,d} dO'[h] O[h']; per group block: dV = dM U, dU = dM^T V."""
    o, g, u, v = (x.astype(np.float64) for x in (o, g, u, v))
    dm = np.einsum("bshd,bskd->hk", g, o)
    u3, v3 = (u[None], v[None]) if u.ndim == 2 else (u, v)
    per = o.shape[2] // groups
    du, dv = np.zeros_like(u3), np.zeros_like(v3)
    for k in range(groups):
        block = dm[k * per : (k + 1) * per, k * per : (k + 1) * per]
        dv[k] = block @ u3[k]
        du[k] = block.T @ v3[k]
    return du.reshape(u.shape), dv.reshape(v.shape)


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_gradients_to_u_and_v(grouped):
    layer = VHAPostmix(make_config(grouped))
    groups = GROUPS if grouped else 1
    rng = np.random.default_rng(3)
    o, g = o_input(4), rng.standard_normal((2, 3, HEADS, 16)).astype("float32")
    ot = paddle.to_tensor(o, stop_gradient=False)

    # At init (V = 0): dV = dM U is non-zero, dU = dM^T V is exactly 0, dO = dO'.
    (layer(ot) * paddle.to_tensor(g)).sum().backward()
    u0 = layer.vha_postmix_U.numpy()
    du, dv = _oracle_grads(o, g, u0, np.zeros_like(u0), groups)
    assert np.abs(layer.vha_postmix_V.grad.numpy()).max() > 0, "V must get gradient at init"
    assert_close(layer.vha_postmix_V.grad.numpy(), dv, "fp32", "oracle_grad", what="dV at init")
    assert np.all(layer.vha_postmix_U.grad.numpy() == 0.0), "dU = dM^T V must be exactly 0 while V = 0"
    np.testing.assert_array_equal(ot.grad.numpy(), g)

    # Move V off zero (DESIGN rule 4) so neither gradient is trivially 0.
    layer.clear_gradients()
    ot.clear_gradient()
    u = rng.standard_normal(u0.shape).astype("float32") * 0.5
    v = rng.standard_normal(u0.shape).astype("float32") * 0.5
    layer.vha_postmix_U.set_value(u)
    layer.vha_postmix_V.set_value(v)
    (layer(ot) * paddle.to_tensor(g)).sum().backward()
    du, dv = _oracle_grads(o, g, u, v, groups)
    got_du, got_dv = layer.vha_postmix_U.grad.numpy(), layer.vha_postmix_V.grad.numpy()
    assert np.abs(got_du).max() > 1e-3 and np.abs(got_dv).max() > 1e-3, "grads to U and V must be non-zero"
    assert_close(got_du, du, "fp32", "oracle_grad", what="dU")
    assert_close(got_dv, dv, "fp32", "oracle_grad", what="dV")
    # dO = M^T dO'
    want_do = orc.vha_postmix(g, v, u, groups)  # (I + V U^T)^T = I + U V^T
    assert_close(ot.grad.numpy(), want_do, "fp32", "oracle", what="dO")
