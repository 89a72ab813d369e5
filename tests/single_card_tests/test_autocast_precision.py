"""What the trainer's ``bf16: true`` (Paddle's O1 autocast) does to the matmuls Paddle cannot see or must not cast
(CPU, PaddlePaddle 3.3.1): ``framework.precision.autocast_matmul_dtype`` and the routed experts' use of it, and the
fp32 references (mHC, the router's logits) running their matmuls with autocast off.

Why: under O1 the MoE rows (the fp32 residual stream) and the fp32 master weights reach the experts slot as fp32,
and Paddle's autocast never sees the slot's matmuls (a PyLayer, or the fused Triton op): the layer casts its operands
where a Paddle matmul would have been cast. The mHC and router references promise fp32 arithmetic, which O1 would
turn into bf16 matmuls: they switch autocast off around them.

Paddle's autocast is a no-op on the CPU (``amp_guard`` turns itself off there, with a warning), so these tests set
the tracer's AMP state the way ``amp_guard`` sets it on a GPU (``_amp_level`` and ``_amp_dtype``, which Paddle's own
``is_autocast_enabled`` / ``get_autocast_dtype`` read). The CPU build has no bf16 matmul, so the experts slot here
records what it is handed and computes in fp32 on those values. The bf16 kernels under autocast run only on a Paddle
GPU build: unverified, none is available here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise

from fleet_ext.config import load_config
from fleet_ext.framework.contracts import MoEOps
from fleet_ext.framework.precision import autocast_matmul_dtype
from fleet_ext.layers.moe import GroupedExperts
from fleet_ext.ops.moe_experts.reference import grouped_mlp
from fleet_ext.ops.moe_permute import reference as permute_reference


@contextlib.contextmanager
def paddle_amp_state(level: str, dtype: str) -> Iterator[None]:
    """Paddle's dygraph AMP state as ``paddle.amp.auto_cast(level=level, dtype=dtype)`` sets it on a GPU."""
    tracer = paddle.base.framework._dygraph_tracer()
    saved = tracer._amp_level, tracer._amp_dtype
    tracer._amp_level, tracer._amp_dtype = getattr(paddle.base.core.AmpLevel, level), dtype
    try:
        yield
    finally:
        tracer._amp_level, tracer._amp_dtype = saved


def test_autocast_matmul_dtype_follows_paddles_amp_state():
    x32 = paddle.ones([2, 2])
    assert autocast_matmul_dtype(x32) is None
    with pytest.warns(UserWarning, match="makes no effect"), paddle.amp.auto_cast(dtype="bfloat16", level="O1"):
        assert autocast_matmul_dtype(x32) is None  # the CPU: Paddle's autocast switched itself off
    with paddle_amp_state("O1", "bfloat16"):
        assert paddle.is_autocast_enabled()
        assert autocast_matmul_dtype(x32) == paddle.bfloat16
        assert autocast_matmul_dtype(x32.astype("bfloat16")) is None  # already low precision (O2 weights)
    with paddle_amp_state("O2", "float16"):
        assert autocast_matmul_dtype(x32) == paddle.float16
    with paddle_amp_state("O0", "bfloat16"):
        assert autocast_matmul_dtype(x32) is None


def _experts_layer(seen: list[tuple[str, ...]]) -> GroupedExperts:
    def recording_slot(rows, counts, weight1, weight2, limit, recompute_activation):
        """Records the dtypes it is handed; computes the reference in fp32 on those values (no bf16 matmul here)."""
        seen.append(tuple(str(t.dtype).split(".")[-1] for t in (rows, weight1, weight2)))
        return grouped_mlp(rows.astype("float32"), counts, weight1.astype("float32"), weight2.astype("float32"),
                           limit, recompute_activation)

    config = load_config(dict(hidden_size=16, vocab_size=40, num_hidden_layers=2, csa_compress_ratios=[0, 0],
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                              moe_n_hash_layers=0, init_method_std=0.5))
    ops = MoEOps(permute=permute_reference.permute, unpermute=permute_reference.unpermute, experts=recording_slot)
    return GroupedExperts(config, ops=ops)


def _step(layer: GroupedExperts, x: np.ndarray, idx: np.ndarray, wts: np.ndarray) -> tuple[np.ndarray, ...]:
    layer.clear_gradients()
    out = layer(paddle.to_tensor(x), paddle.to_tensor(idx), paddle.to_tensor(wts))
    (out * out).sum().backward()
    return out.numpy(), layer.weight1.grad.numpy(), layer.weight2.grad.numpy()


def _bf16(a: np.ndarray) -> np.ndarray:
    return paddle.to_tensor(a).astype("bfloat16").astype("float32").numpy()


def test_routed_experts_compute_in_the_autocast_dtype():
    """Under bf16 autocast the slot gets bf16 rows and weights, and the fp32 weights get fp32 gradients: the same
    bytes as the fp32 computation on the bf16-rounded operands, with each weight gradient rounded once to bf16 (the
    cast's backward). Without autocast it gets fp32 and nothing changes."""
    seen: list[tuple[str, ...]] = []
    layer = _experts_layer(seen)
    r = np.random.default_rng(5)
    x = r.standard_normal((6, 16)).astype("float32")
    idx = np.stack([r.choice(4, size=2, replace=False) for _ in range(6)]).astype("int64")
    wts = r.uniform(0.2, 1.0, (6, 2)).astype("float32")
    plain = _step(layer, x, idx, wts)
    assert seen == [("float32",) * 3]

    with paddle_amp_state("O1", "bfloat16"):
        out, g1, g2 = _step(layer, x, idx, wts)
    assert seen[1:] == [("bfloat16",) * 3]
    assert layer.weight1.grad.dtype == layer.weight2.grad.dtype == paddle.float32

    w1, w2 = layer.weight1.numpy(), layer.weight2.numpy()
    layer.weight1.set_value(_bf16(w1))
    layer.weight2.set_value(_bf16(w2))
    want_out, want_g1, want_g2 = _step(layer, _bf16(x), idx, wts)
    layer.weight1.set_value(w1)
    layer.weight2.set_value(w2)
    assert_bitwise(out, want_out, "experts under autocast vs fp32 on bf16-rounded operands")
    assert_bitwise(g1, _bf16(want_g1), "weight1 gradient under autocast")
    assert_bitwise(g2, _bf16(want_g2), "weight2 gradient under autocast")
    assert not np.array_equal(out, plain[0]), "the planted-difference check: rounding must show at these values"


def test_fp32_references_run_their_matmuls_with_autocast_off(monkeypatch):
    """The mHC projection and combine and the router's logits GEMM promise fp32 (the combine: the streams' dtype)
    arithmetic; under O1 Paddle would run their matmuls in bf16. Each matmul records whether autocast was on when it
    ran (the CPU cannot show the cast itself); a bare matmul in the same state records True (the control)."""
    from fleet_ext.ops.mhc import reference as mhc_ref
    from fleet_ext.ops.moe_router import reference as router_ref

    seen: list[bool] = []
    matmul = paddle.matmul

    def recording_matmul(*args, **kwargs):
        seen.append(paddle.is_autocast_enabled())
        return matmul(*args, **kwargs)

    monkeypatch.setattr(paddle, "matmul", recording_matmul)
    r = np.random.default_rng(3)
    streams = paddle.to_tensor(r.standard_normal((1, 3, 4, 8)).astype("float32"))
    fn = paddle.to_tensor(0.1 * r.standard_normal((24, 32)).astype("float32"))
    base, scale = paddle.zeros([24]), paddle.ones([3])
    with paddle_amp_state("O1", "bfloat16"):
        paddle.matmul(streams, streams, transpose_y=True)
        assert seen == [True]
        post, comb, _ = mhc_ref.mhc_pre(streams, fn, base, scale, 3, 1e-6, 1e-6)
        mhc_ref.mhc_combine(streams, paddle.ones([1, 3, 8]), post, comb)
        router_ref.router_logits(paddle.ones([3, 8]), paddle.ones([5, 8]))
    assert len(seen) == 4 and not any(seen[1:]), seen
