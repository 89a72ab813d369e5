"""Partial interleaved RoPE and its frequency tables vs the float64 oracle (dsv4_math.md §2.1, §2.6).

Tolerances (tests/helpers/tolerances.py): the layer rotates fp32 values with fp32 cos/sin (angles formed in
float64, then rounded), the oracle in float64 with exact angles: fp32 ``oracle_rope``; the cos/sin tables:
fp32 ``rope_table``; frequencies are float64 on both sides: float64 ``frequencies``.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_close, tiny_model
from helpers import oracles as orc

from fleet_ext.config import load_config
from fleet_ext.layer_kinds import layer_attention
from fleet_ext.layers.rope import RotaryTable, plain_inv_freq, yarn_inv_freq
from fleet_ext.ops.rope.reference import apply_partial_rope


def _cos_sin(angles: np.ndarray):
    return paddle.to_tensor(np.cos(angles).astype("float32")), paddle.to_tensor(np.sin(angles).astype("float32"))


def _inputs(shape, rope_dim, positions, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype("float32")
    angles = orc.rope_angles(positions, orc.plain_inv_freq(rope_dim, 10000.0))
    return x, angles


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(
    "shape,batched_positions",
    [((2, 5, 3, 12), False), ((2, 5, 3, 12), True), ((2, 5, 12), False), ((1, 4, 2, 8), False)],
)
def test_apply_partial_rope_matches_oracle(shape, batched_positions, inverse):
    rope_dim = 8
    b, s = shape[0], shape[1]
    rng = np.random.default_rng(1)
    if batched_positions:  # per-sample positions (e.g. packed documents / CP offsets), large to stress angles
        positions = rng.integers(0, 5000, size=(b, s))
        angles = orc.rope_angles(positions.reshape(-1), orc.plain_inv_freq(rope_dim, 10000.0)).reshape(b, s, -1)
    else:
        positions = np.arange(s) + 3
        angles = orc.rope_angles(positions, orc.plain_inv_freq(rope_dim, 10000.0))
    x = rng.standard_normal(shape).astype("float32")
    cos, sin = _cos_sin(angles)
    got = apply_partial_rope(paddle.to_tensor(x), cos, sin, inverse=inverse).numpy()
    oracle_angles = angles[..., None, :] if len(shape) == 4 else angles
    want = orc.rope(x, oracle_angles, inverse=inverse)
    assert got.dtype == np.float32 and got.shape == x.shape
    nope = shape[-1] - rope_dim
    assert np.abs(want[..., nope:] - x[..., nope:]).max() > 0.1, "the rotation must actually move the rope channels"
    assert_close(got, want, "fp32", "oracle_rope")
    np.testing.assert_array_equal(got[..., :nope], x[..., :nope], err_msg="nope channels must pass bit-exactly")


def test_rope_pairs_are_adjacent_channels():
    """A unit vector on the first rope channel rotates into (cos, sin) on channels (nope, nope+1): interleaved."""
    d, rope_dim, theta = 10, 6, 0.7
    x = np.zeros((1, 1, d), dtype="float32")
    x[..., d - rope_dim] = 1.0
    angles = np.array([[theta, 0.3, 0.1]])
    got = apply_partial_rope(paddle.to_tensor(x), *_cos_sin(angles)).numpy()[0, 0]
    want = np.zeros(d)
    want[d - rope_dim], want[d - rope_dim + 1] = np.cos(theta), np.sin(theta)
    assert_close(got, want, "fp32", "oracle_rope")


def test_inverse_undoes_forward():
    x, angles = _inputs((2, 6, 3, 16), 8, np.arange(6) * 37)
    cos, sin = _cos_sin(angles)
    xt = paddle.to_tensor(x)
    fwd = apply_partial_rope(xt, cos, sin)
    assert np.abs(fwd.numpy() - x).max() > 0.1
    back = apply_partial_rope(fwd, cos, sin, inverse=True).numpy()
    assert_close(back, x, "fp32", "oracle_rope")
    np.testing.assert_array_equal(x, xt.numpy(), err_msg="rope must be out of place")


def test_rope_gradient_is_inverse_rotation():
    x, angles = _inputs((2, 4, 2, 12), 8, np.arange(4) * 11, seed=3)
    g = np.random.default_rng(4).standard_normal(x.shape).astype("float32")
    xt = paddle.to_tensor(x, stop_gradient=False)
    (apply_partial_rope(xt, *_cos_sin(angles)) * paddle.to_tensor(g)).sum().backward()
    assert_close(xt.grad.numpy(), orc.rope(g, angles[:, None, :], inverse=True), "fp32", "oracle_rope")


# --------------------------------------------------------------------------------------------------
# Frequencies.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim,base", [(8, 10000.0), (64, 10000.0), (64, 160000.0), (6, 3.0)])
def test_plain_inv_freq(dim, base):
    assert_close(plain_inv_freq(dim, base), orc.plain_inv_freq(dim, base), "float64", "frequencies")


@pytest.mark.parametrize(
    "dim,base,factor,orig,fast,slow",
    [
        (64, 160000.0, 16.0, 65536, 32.0, 1.0),  # released V4 values: fractional ramp over pairs 15..25
        (64, 40000.0, 4.0, 4096, 32.0, 1.0),
        (8, 160000.0, 4.0, 64, 32.0, 1.0),  # the tiny test config: ramp jumps 0 -> 1
        (16, 10000.0, 8.0, 4, 32.0, 1.0),  # low == high == 0: the +0.001 ramp-width guard
        (16, 100.0, 8.0, 60000, 1000.0, 1.0),  # ceil(correction) = 16 is clamped to dim - 1 = 15
    ],
)
def test_yarn_inv_freq(dim, base, factor, orig, fast, slow):
    got = yarn_inv_freq(dim, base, factor, orig, fast, slow)
    want = orc.yarn_inv_freq(dim, base, factor, orig, fast, slow)
    assert_close(got, want, "float64", "frequencies")
    ratio = want / orc.plain_inv_freq(dim, base)
    assert np.any(ratio < 1.0 - 1e-6), "some pairs must be interpolated, else this only re-tests plain RoPE"
    if orig in (65536, 60000):
        assert np.any((ratio > 1.0 / factor + 1e-6) & (ratio < 1.0 - 1e-6)), "the ramp must be exercised"


def _config(**overrides):
    base = tiny_model(num_hidden_layers=3, csa_compress_ratios=[0, 4, 128], init_method_std=0.02)
    return load_config({**base, **overrides}).model


@pytest.mark.parametrize("ratio", [0, -1, 4, 128])
def test_rotary_table_for_layer(ratio):
    cfg = _config(qk_pos_emb_head_dim=16, dsa_index_head_dim=16, original_max_position_embeddings=256,
                  csa_compress_ratios=[ratio, 4, 128])
    table = RotaryTable.for_spec(layer_attention(cfg, 0).rope)
    if ratio <= 0:
        want = orc.plain_inv_freq(16, cfg.rotary_base)
    else:
        want = orc.yarn_inv_freq(16, cfg.csa_compress_rotary_base, cfg.rotary_scaling_factor,
                                 cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow)
    assert_close(table.inv_freq, want, "float64", "frequencies")
    positions = [0, 1, 7, 300, 4095]
    cos, sin = table.cos_sin_at(positions)
    assert cos.dtype == paddle.float32 and list(cos.shape) == [5, 8]
    angles = orc.rope_angles(positions, want)
    assert_close(cos.numpy(), np.cos(angles), "fp32", "rope_table", what="cos")
    assert_close(sin.numpy(), np.sin(angles), "fp32", "rope_table", what="sin")


@pytest.mark.parametrize("key,ratio", [("csa_rope_type", 4), ("hca_rope_type", 128)])
def test_rotary_table_plain_rope_on_compressed_layer(key, ratio):
    cfg = _config(**{key: "rope"}, csa_compress_ratios=[ratio, 4, 128])
    want = orc.plain_inv_freq(8, cfg.csa_compress_rotary_base)
    assert_close(RotaryTable.for_spec(layer_attention(cfg, 0).rope).inv_freq, want, "float64", "frequencies")
    assert not np.allclose(want, orc.plain_inv_freq(8, cfg.rotary_base)), "bases must differ for this to mean much"


# --------------------------------------------------------------------------------------------------
# Bad shapes.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "x_shape,cos_shape,sin_shape,name",
    [
        pytest.param((2, 5, 3, 6), (5, 4), (5, 4), "x", id="x_narrower_than_rope"),
        pytest.param((2, 6, 3, 16), (5, 4), (5, 4), "x", id="positions_differ"),
        pytest.param((2, 5, 16), (5, 4), (5, 3), "cos", id="cos_sin_differ"),
        pytest.param((2, 5, 3, 2, 16), (5, 4), (5, 4), "x", id="x_rank5"),
        # rank-5 x whose 4th dim equals s used to run and return a silently misbroadcast result
        pytest.param((2, 5, 3, 5, 16), (5, 4), (5, 4), "x", id="x_rank5_silent"),
        pytest.param((16,), (5, 4), (5, 4), "x", id="x_rank1"),
        pytest.param((2, 5, 16), (4,), (4,), "cos", id="cos_rank1"),
        pytest.param((2, 5, 16), (3, 5, 4), (3, 5, 4), "cos", id="cos_batch_differs"),
    ],
)
def test_apply_partial_rope_rejects_bad_shapes(x_shape, cos_shape, sin_shape, name):
    x = paddle.ones(list(x_shape))
    with pytest.raises(ValueError, match=f"`{name}`"):
        apply_partial_rope(x, paddle.ones(list(cos_shape)), paddle.zeros(list(sin_shape)))
