"""The gradient reduction with one process (``DistEnv.reduce_gradients_``): it only scales, in place, bit for bit as
the flat fp32 copy it replaced did; and how parameters are cut into buckets. The 2-rank all-reduce is tested in
``tests/multi_card_tests/test_grad_buckets.py``."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise

from fleet_ext.parallel.distributed import DistEnv, _buckets

SCALE = 1.0 / 6.0


def _params(with_grad: list[bool]) -> list:
    rng = np.random.default_rng(0)
    params = []
    for i, has in enumerate(with_grad):
        p = paddle.create_parameter([3 + i, 2], "float32")
        if has:
            (p * paddle.to_tensor(rng.standard_normal(p.shape).astype("float32") * 1e3)).sum().backward()
        params.append(p)
    return params


def _old_scaling(params: list, scale: float) -> list:
    """What the flat reduction computed with one process: concat of fp32 copies, times scale, per parameter."""
    flat = paddle.concat([p.grad.astype("float32").reshape([-1]) for p in params if p.grad is not None]) * scale
    out, offset = [], 0
    for p in params:
        if p.grad is None:
            out.append(None)
            continue
        n = int(p.size)
        out.append(flat[offset : offset + n].reshape(p.shape).numpy())
        offset += n
    return out


def test_one_process_scales_in_place_bitwise_as_the_flat_copy_did():
    params = _params([True, False, True, True])
    want = _old_scaling(params, SCALE)
    pointers = [p.grad.data_ptr() if p.grad is not None else None for p in params]
    DistEnv(0, 1, "none").reduce_gradients_(params, SCALE)
    for i, (p, w, ptr) in enumerate(zip(params, want, pointers)):
        if w is None:
            assert p.grad is None, f"parameter {i} had no gradient and must keep none"
            continue
        assert p.grad.data_ptr() == ptr, f"parameter {i}: the gradient was replaced, not scaled where it lies"
        assert_bitwise(p.grad.numpy(), w, f"parameter {i}")


def test_negative_control_a_planted_one_ulp_scale_fails():
    params = _params([True, True])
    want = _old_scaling(params, SCALE)
    DistEnv(0, 1, "none").reduce_gradients_(params, float(np.nextafter(np.float32(SCALE), np.float32(1))))
    with pytest.raises(AssertionError):
        for p, w in zip(params, want):
            assert_bitwise(p.grad.numpy(), w, "planted")


def test_scale_one_with_one_process_touches_nothing():
    params = _params([True, False])
    before = params[0].grad.numpy().copy()
    DistEnv(0, 1, "none").reduce_gradients_(params, 1.0)
    assert_bitwise(params[0].grad.numpy(), before, "scale 1")
    assert params[1].grad is None


@pytest.mark.parametrize(
    "sizes, limit, want",
    [
        ([3, 4, 5], 100, [[3, 4, 5]]),
        ([3, 4, 5], 7, [[3, 4], [5]]),
        ([3, 40, 5], 7, [[3], [40], [5]]),  # a gradient larger than a bucket travels alone
        ([3, 4, 5], 1, [[3], [4], [5]]),
        ([], 8, []),
    ],
)
def test_buckets_cut_in_order_at_the_limit(sizes, limit, want):
    params = [paddle.create_parameter([n], "float32") for n in sizes]
    got = [[int(p.size) for p in bucket] for bucket in _buckets(params, limit)]
    assert got == want
