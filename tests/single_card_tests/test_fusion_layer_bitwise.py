"""DESIGN.md rule 4 at layer and model level: each fusion switch off vs on, built from one seed.

For every fusion the registry marks ``bitwise_equal``: the real ``DSv4HybridSelfAttention`` (every
layer kind) and the whole tiny model are built twice from one seed, once per switch setting; the
output, the input gradient and every parameter gradient must be byte-equal. The test first checks
that two unfused runs agree, checks the fused kernel really ran (launch counter), and moves
zero-initialised parameters (VHA V, sinks, ape) off zero so no gradient is trivially 0. Fused kernels
run in the Triton interpreter here (fp32). The sink-gradient fusion (not bitwise in d_sink) is held to
the fp32 ``sink_grad_model`` tolerance (tests/helpers/tolerances.py), its kernels counted too.
"""

from __future__ import annotations

import importlib

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, assert_close, expect_launches, move_constant_inits, tiny_model

pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")
pytest.importorskip("torch", reason="the Triton interpreter needs torch (installed by the `test` extra)")

from fleet_ext.registry import FUSIONS  # noqa: E402

BASE = tiny_model(use_vha_attention=True, hca_compress_ratio=8)
SEQ = 38  # past the window (8), CSA and HCA (pooling 8) with entries; 2 x 38 tokens take the sink gradient's reduce
# Switch sets under test; the inv-RoPE+postmix fusion builds on the fused RoPE (config gate).
SWITCH_SETS = {
    "sparse_attn_global_kv_idx_remap_fusion": {"sparse_attn_global_kv_idx_remap_fusion": True},
    "apply_rope_fusion": {"apply_rope_fusion": True},
    "fuse_inv_rope_into_vha_postmix": {"apply_rope_fusion": True, "fuse_inv_rope_into_vha_postmix": True},
    "dsv4_q_rms_norm_fusion": {"dsv4_q_rms_norm_fusion": True},
}
# The MoE fusions act on the MoE layer, not attention: their layer-level tests are test_fusion_moe_*.py.
BITWISE = sorted(s for s, f in FUSIONS.items() if f.landed and f.bitwise_equal and not s.startswith("moe_"))


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
    move_constant_inits(model, rng, 0.3)
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
        assert_bitwise(a[key], b[key], f"{what}: {key}")


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
    with expect_launches(_kernel_names(switch)):
        fused = _attention_run(SWITCH_SETS[switch], layer)
    _assert_bytes_equal(reference, fused, f"{switch} on vs off")


def test_whole_model_all_bitwise_switches_at_once():
    everything = {k: v for switches in SWITCH_SETS.values() for k, v in switches.items()}
    reference = _model_run({})
    _nontrivial(reference)
    with expect_launches(*(_kernel_names(switch) for switch in SWITCH_SETS)):  # each switch's kernels ran
        fused = _model_run(everything)
    _assert_bytes_equal(reference, fused, "all bitwise switches on vs off")


def test_sink_grad_fusion_matches_within_its_documented_tolerance():
    """dsa_sink_grad_fusion is not bitwise (fixed block order vs autograd's): all else is, d_sink within
    ``sink_grad_model``; the sink-gradient kernels must have run, or a silent fallback would pass."""
    reference = _model_run({})
    with expect_launches("_sink_grad_partial_kernel", "_sink_grad_reduce_kernel"):
        fused = _model_run({"dsa_sink_grad_fusion": True})
    sink_keys = [k for k in reference if k.endswith("attn_sink")]
    assert sink_keys
    _assert_bytes_equal({k: v for k, v in reference.items() if k not in sink_keys},
                        {k: v for k, v in fused.items() if k not in sink_keys}, "non-sink tensors")
    for key in sink_keys:
        assert_close(fused[key], reference[key], "fp32", "sink_grad_model", what=key)
