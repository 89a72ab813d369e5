"""DESIGN.md rule 4 at layer and model level: each fusion switch off vs on, built from one seed.

For every fusion the registry marks ``bitwise_equal``: the real ``DSv4HybridSelfAttention`` (every
layer kind) and the whole tiny model are built twice from one seed, once per switch setting; the
output, the input gradient and every parameter gradient must be byte-equal. The test first checks
that two unfused runs agree, checks the fused kernel really ran (launch counter), and moves
zero-initialised parameters (VHA V, sinks, ape) off zero so no gradient is trivially 0. Fused kernels
run in the Triton interpreter here (fp32).
"""

from __future__ import annotations

import importlib

import numpy as np
import paddle
import pytest

pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")
pytest.importorskip("torch", reason="the Triton interpreter needs torch (installed by the `test` extra)")

from fleet_ext.ops.launch import LAUNCH_COUNTS  # noqa: E402
from fleet_ext.registry import FUSIONS  # noqa: E402

BASE = {
    "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "q_lora_rank": 16,
    "v_head_dim": 16, "qk_pos_emb_head_dim": 8, "csa_compress_ratios": [0, 4, 128, -1], "csa_window_size": 8,
    "o_groups": 2, "o_lora_rank": 8, "dsa_index_n_heads": 2, "dsa_index_head_dim": 8, "dsa_index_topk": 3,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_n_hash_layers": 1,
    "original_max_position_embeddings": 64, "rotary_scaling_factor": 4.0, "init_method_std": 0.1,
    "use_vha_attention": True,
}
SEQ = 136
# Switch sets under test; the inv-RoPE+postmix fusion builds on the fused RoPE (config gate).
SWITCH_SETS = {
    "sparse_attn_global_kv_idx_remap_fusion": {"sparse_attn_global_kv_idx_remap_fusion": True},
    "apply_rope_fusion": {"apply_rope_fusion": True},
    "fuse_inv_rope_into_vha_postmix": {"apply_rope_fusion": True, "fuse_inv_rope_into_vha_postmix": True},
    "dsv4_q_rms_norm_fusion": {"dsv4_q_rms_norm_fusion": True},
}
BITWISE = sorted(s for s, f in FUSIONS.items() if f.landed and f.bitwise_equal)


def test_every_bitwise_fusion_is_covered():
    assert sorted(SWITCH_SETS) == BITWISE


def _kernel_names(switch: str) -> set[str]:
    module = importlib.import_module(FUSIONS[switch].fused.split(":")[0].rsplit(".", 1)[0] + ".kernel")
    return {name for name, obj in vars(module).items() if hasattr(obj, "fn") or type(obj).__name__.endswith("Function")}


def _model(switches: dict, seed: int = 0):
    from fleet_ext.models import DSv4ForCausalLM

    paddle.seed(seed)
    model = DSv4ForCausalLM({**BASE, **switches})
    rng = np.random.default_rng(seed)
    for name, tensor in model.state_dict().items():  # sinks, ape, norms, VHA V off their constant init
        if tensor.dtype == paddle.float32 and (tensor.ndim == 1 or name.endswith((".ape", "vha_postmix_V"))):
            tensor.set_value(tensor.numpy() + 0.3 * rng.standard_normal(tensor.shape).astype("float32"))
    return model


def _attention_run(switches: dict, layer: int) -> dict[str, np.ndarray]:
    model = _model(switches)
    attention = model.layers[layer].self_attention
    rng = np.random.default_rng(7)
    x = paddle.to_tensor(rng.standard_normal((2, SEQ, 32)).astype("float32"), stop_gradient=False)
    weight = paddle.to_tensor(rng.standard_normal((2, SEQ, 32)).astype("float32"))
    out = attention(x)
    (out * weight).sum().backward()
    result = {"out": out.numpy(), "d_input": x.grad.numpy()}
    for name, param in attention.named_parameters():
        if param.grad is not None:
            result[f"grad:{name}"] = param.grad.numpy()
    return result


def _model_run(switches: dict) -> dict[str, np.ndarray]:
    model = _model(switches)
    rng = np.random.default_rng(3)
    ids = paddle.to_tensor(rng.integers(0, 64, (2, SEQ)))
    logits, loss = model(ids, labels=paddle.to_tensor(rng.integers(0, 64, (2, SEQ))))
    loss.backward()
    result = {"logits": logits.numpy()}
    for name, param in model.named_parameters():
        if param.grad is not None:
            result[f"grad:{name}"] = param.grad.numpy()
    return result


def _assert_bytes_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different gradient sets {sorted(a.keys() ^ b.keys())}"
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, f"{what}: {key} dtype/shape"
        if not np.array_equal(a[key].view(np.uint8), b[key].view(np.uint8)):
            diff = np.abs(a[key].astype(np.float64) - b[key].astype(np.float64))
            raise AssertionError(f"{what}: {key} differs in {int((diff > 0).sum())} elements, max {diff.max():.3e}")


def _nontrivial(result: dict) -> None:
    for key, value in result.items():
        if "indexer" in key:  # the indexer trains only through its KL loss (not built yet)
            continue
        assert np.abs(value).max() > 0, f"{key} is all zero: the comparison would be vacuous"


@pytest.mark.parametrize("layer", [0, 1, 2, 3], ids=["window", "csa", "hca", "full_causal"])
@pytest.mark.parametrize("switch", sorted(SWITCH_SETS))
def test_attention_layer_is_bitwise_equal_with_the_fusion(switch, layer):
    reference = _attention_run({}, layer)
    _assert_bytes_equal(reference, _attention_run({}, layer), "two unfused runs")
    _nontrivial(reference)
    assert "grad:postmix.vha_postmix_V" in reference and "grad:core_attention.attn_sink" in reference
    before = sum(LAUNCH_COUNTS[k] for k in _kernel_names(switch))
    fused = _attention_run(SWITCH_SETS[switch], layer)
    assert sum(LAUNCH_COUNTS[k] for k in _kernel_names(switch)) > before, f"{switch}: the fused kernel never ran"
    _assert_bytes_equal(reference, fused, f"{switch} on vs off")


def test_whole_model_all_bitwise_switches_at_once():
    everything = {k: v for switches in SWITCH_SETS.values() for k, v in switches.items()}
    reference = _model_run({})
    _nontrivial(reference)
    before = dict(LAUNCH_COUNTS)
    fused = _model_run(everything)
    for switch in SWITCH_SETS:
        names = _kernel_names(switch)
        assert sum(LAUNCH_COUNTS[k] - before.get(k, 0) for k in names) > 0, f"{switch}: kernel never ran"
    _assert_bytes_equal(reference, fused, "all bitwise switches on vs off")


def test_sink_grad_fusion_matches_within_its_documented_tolerance():
    """dsa_sink_grad_fusion is not bitwise (fixed block order vs autograd's): all else is, d_sink to rel 1e-5."""
    reference = _model_run({})
    fused = _model_run({"dsa_sink_grad_fusion": True})
    sink_keys = [k for k in reference if k.endswith("attn_sink")]
    assert sink_keys
    _assert_bytes_equal({k: v for k, v in reference.items() if k not in sink_keys},
                        {k: v for k, v in fused.items() if k not in sink_keys}, "non-sink tensors")
    for key in sink_keys:
        np.testing.assert_allclose(fused[key], reference[key], rtol=1e-5, atol=1e-7, err_msg=key)
