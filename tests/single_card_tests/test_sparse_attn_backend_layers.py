"""The Triton sparse-attention backend inside the real layers (Triton interpreter, fp32).

``csa_sparse_attn_backend: triton`` drives the DSv4 window / CSA / HCA / full-causal cores and
``mqa_sparse_attn_backend: triton`` the latent MQA of -2 layers. Not bitwise (online softmax sums in
another order); the documented bound is fp32 ``triton_sparse_attn`` (tests/helpers/tolerances.py), relative
to each tensor's largest entry. The Triton forward and backward kernels must have run (launch counters).
Run-to-run byte identity of the backward is tested at kernel level (test_sparse_attn_triton.py).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import TINY_HYBRID_MLA, assert_close, expect_launches, tiny_model

pytest.importorskip("triton", reason="the Triton backend needs Triton (installed by the `test` extra)")

BASE = tiny_model()
HYBRID = {
    **TINY_HYBRID_MLA, "csa_compress_ratios": [0, -2, 128, -2], "hybrid_mla_attention": "mqa_dsa",
    "dsa_indexer_use_sparse_loss": True, "dsa_indexer_loss_coeff": 0.1, "hybrid_mla_rope_type": "rope",
    "add_full_attention_sink_bias": True,
}
SEQ = 136
TRITON_KERNELS = ("_sparse_attn_fwd_kernel", "_bwd_dq_kernel")  # forward, and the backward's dq pass


def _run(overrides: dict) -> dict[str, np.ndarray]:
    from fleet_ext.models import DSv4ForCausalLM

    paddle.seed(0)
    model = DSv4ForCausalLM({**BASE, **overrides})
    rng = np.random.default_rng(0)
    for name, tensor in model.state_dict().items():  # sinks, ape, norms off their constant init
        if tensor.dtype == paddle.float32 and (tensor.ndim == 1 or name.endswith(".ape")):
            tensor.set_value(tensor.numpy() + 0.3 * rng.standard_normal(tensor.shape).astype("float32"))
    ids = paddle.to_tensor(rng.integers(0, 64, (2, SEQ)))
    logits, loss = model(ids, labels=paddle.to_tensor(rng.integers(0, 64, (2, SEQ))))
    loss.backward()
    out = {"logits": logits.numpy()}
    out.update({f"grad:{n}": p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None})
    return out


def _close(reference: dict, fused: dict) -> None:
    assert reference.keys() == fused.keys(), sorted(reference.keys() ^ fused.keys())
    for key, ref in reference.items():
        assert_close(fused[key], ref, "fp32", "triton_sparse_attn", what=key)


@pytest.mark.parametrize(
    "model, switch",
    [({}, "csa_sparse_attn_backend"), (HYBRID, "mqa_sparse_attn_backend")],
    ids=["dsv4_window_csa_hca_full_causal", "hybrid_mla_sparse"],
)
def test_triton_backend_matches_the_reference_in_the_model(model, switch):
    reference = _run(model)
    with expect_launches(*TRITON_KERNELS):
        fused = _run({**model, switch: "triton"})
    _close(reference, fused)
