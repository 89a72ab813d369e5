"""The Triton sparse-attention backend inside the real layers (Triton interpreter, fp32).

``csa_sparse_attn_backend: triton`` drives the DSv4 window / CSA / HCA / full-causal cores and
``mqa_sparse_attn_backend: triton`` the latent MQA of -2 layers. Not bitwise (online softmax sums in
another order); the documented fp32 bound is 1e-5 relative to each tensor's largest entry. Run-to-run
byte identity of the backward is tested at kernel level (test_sparse_attn_triton.py).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

pytest.importorskip("triton", reason="the Triton backend needs Triton (installed by the `test` extra)")

from fleet_ext.ops.launch import LAUNCH_COUNTS  # noqa: E402

BASE = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "q_lora_rank": 16,
    "v_head_dim": 16, "qk_pos_emb_head_dim": 8, "csa_compress_ratios": [0, 4, 128, -1], "csa_window_size": 8,
    "o_groups": 2, "o_lora_rank": 8, "dsa_index_n_heads": 2, "dsa_index_head_dim": 8, "dsa_index_topk": 3,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_n_hash_layers": 1,
    "original_max_position_embeddings": 64, "rotary_scaling_factor": 4.0, "init_method_std": 0.1,
}
HYBRID = {
    "csa_compress_ratios": [0, -2, 128, -2], "hybrid_mla_attention": "mqa_dsa", "dsa_indexer_use_sparse_loss": True,
    "dsa_indexer_loss_coeff": 0.1, "hybrid_mla_q_lora_rank": 12, "hybrid_mla_kv_lora_rank": 16,
    "hybrid_mla_qk_nope_head_dim": 8, "hybrid_mla_qk_rope_head_dim": 8, "hybrid_mla_v_head_dim": 8,
    "hybrid_mla_num_attention_heads": 4, "dsa_index_head_dim": 16, "dsa_index_topk": 5, "hybrid_mla_rope_type": "rope",
    "add_full_attention_sink_bias": True,
}
SEQ = 136
REL_TOL = 1e-5  # fp32 online softmax vs gather-softmax: measured ~1e-7 relative


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
        scale = max(np.abs(ref).max(), 1e-30)
        err = np.abs(fused[key] - ref).max() / scale
        assert err <= REL_TOL, f"{key}: relative error {err:.2e} > {REL_TOL}"


@pytest.mark.parametrize(
    "model, switch",
    [({}, "csa_sparse_attn_backend"), (HYBRID, "mqa_sparse_attn_backend")],
    ids=["dsv4_window_csa_hca_full_causal", "hybrid_mla_sparse"],
)
def test_triton_backend_matches_the_reference_in_the_model(model, switch):
    reference = _run(model)
    before = sum(LAUNCH_COUNTS.values())
    fused = _run({**model, switch: "triton"})
    assert sum(LAUNCH_COUNTS.values()) > before, "the Triton kernels never ran"
    _close(reference, fused)
