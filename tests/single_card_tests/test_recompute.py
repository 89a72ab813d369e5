"""Recompute changes nothing but memory: loss and every parameter gradient byte-equal to no recompute (CPU fp32).

Every policy (full uniform / block, each selective module alone, all of them together) on the tiny DSv4 model
(window, CSA, HCA, full-causal layers, VHA postmix, mHC, hash and routed MoE with the sequence aux loss), with
the bitwise fusion switches off and on, and on the hybrid-MLA model in each DSA phase. The aux-free bias
counts, the logged aux and indexer losses are counted once. Routing replay: a router changed between the
forward and the backward re-run cannot change the gradients (and does without replay: negative control).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, move_constant_inits

from fleet_ext.config import load_config
from fleet_ext.models import DSv4ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
TINY = "fleet_ext/configs/dsv4_tiny_cpu.yaml"
HYBRID = "configs/dsv4_hybrid_mla_cpu.yaml"
TINY_MODEL = {"csa_compress_ratios": [0, 4, 128, -1], "use_vha_attention": True,
              "moe_router_load_balancing_type": "seq_aux_loss"}
BITWISE_FUSIONS = {"apply_rope_fusion": True, "fuse_inv_rope_into_vha_postmix": True,
                   "sparse_attn_global_kv_idx_remap_fusion": True, "dsv4_q_rms_norm_fusion": True}
FUSION_SETS = {  # each compared with itself without recompute
    "unfused": {},
    "fused": BITWISE_FUSIONS,
    "sink_grad": {"dsa_sink_grad_fusion": True},
    "triton_sparse_attn": {"csa_sparse_attn_backend": "triton", "sparse_attn_global_kv_idx_remap_fusion": True},
}
DSV4_MODULES = ["full_attn", "vha_postmix", "core_attn", "mhc", "moe", "moe_act"]
POLICIES = {
    "full_uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3},
    "full_block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    **{name: {"recompute_granularity": "selective", "recompute_modules": [name]} for name in DSV4_MODULES},
    "selective_all": {"recompute_granularity": "selective", "recompute_modules": DSV4_MODULES},
}
PHASES = {  # the hybrid-MLA YAML is the sparse phase as written
    "full_causal": {"hybrid_mla_attention": "mqa_full_causal", "dsa_indexer_use_sparse_loss": False,
                    "dsa_indexer_loss_coeff": 0.0},
    "warmup": {"dsa_indexer_use_sparse_loss": False, "train_indexer_only": True},
    "sparse": {},
}


def _step(source: str, overrides: dict, seq: int = 140, perturb=None) -> dict:
    """One training forward + backward from a fixed seed; what recompute must leave unchanged."""
    paddle.seed(11)
    model = DSv4ForCausalLM(load_config(source, **overrides))
    model.train()
    rng = np.random.default_rng(5)
    move_constant_inits(model, rng, 0.2)
    ids = paddle.to_tensor(rng.integers(1, model.config.model.vocab_size, size=(2, seq + 1)).astype("int64"))
    _, loss = model(ids[:, :-1], labels=ids[:, 1:])
    if perturb is not None:
        perturb(model)
    loss.backward()
    out = {"loss": loss.numpy(), **{k: v.numpy() for k, v in model.auxiliary_losses().items()}}
    out.update({f"count/{i}": m.tokens_per_expert.numpy() for i, m in enumerate(model.moe_layers())})
    out.update({f"grad/{n}": p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None})
    return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: different sets of gradients"
    for key in want:
        assert_bitwise(got[key], want[key], f"{what}: {key}")


_REFERENCES: dict[str, dict] = {}
# The interpreted Triton kernels are slow on CPU (their time grows with tokens and attended slots): the cases that run
# them take 26 tokens and a shorter window of 16 (still crossed), top-k 4 (below the 6 CSA entries and the 10 keys
# outside a -2 layer's forced window, so the picks are real) and HCA pooling 8 tokens (3 entries), each compressor
# with a partial last block. At 140 / 36-40 tokens with the YAML's window 32 they took ~60 s of CI.
SHORT_SEQ, SHORT = 26, {"csa_window_size": 16, "dsa_index_topk": 4, "hca_compress_ratio": 8}
KERNEL_SETS = ("fused", "triton_sparse_attn")


def _seq(fusions: str) -> int:
    return SHORT_SEQ if fusions in KERNEL_SETS else 140


def _model(fusions: str) -> dict:
    return {**TINY_MODEL, **FUSION_SETS[fusions], **(SHORT if fusions in KERNEL_SETS else {})}


def _reference(fusions: str) -> dict:
    if fusions not in _REFERENCES:
        _REFERENCES[fusions] = _step(TINY, _model(fusions), seq=_seq(fusions))
    return _REFERENCES[fusions]


# Every policy unfused; with Triton kernels on (the interpreter is slow on CPU): full recompute, the postmix alone
# (its fused op's own recompute) and every selective module at once (core_attn and full_attn included).
CASES = [(policy, "unfused") for policy in POLICIES] + [
    (policy, "fused") for policy in ("full_uniform", "vha_postmix", "selective_all")
] + [("full_uniform", "sink_grad"), ("full_uniform", "triton_sparse_attn")]


@pytest.mark.parametrize("policy, fusions", CASES, ids=[f"{p}-{f}" for p, f in CASES])
def test_tiny_model_is_bitwise_equal_under_recompute(policy, fusions):
    got = _step(TINY, {**_model(fusions), **POLICIES[policy]}, seq=_seq(fusions))
    _assert_same(got, _reference(fusions), f"{policy} ({fusions})")
    assert got["moe_aux_loss"].item() > 0, "the aux loss must be on for its once-only logging to be checked"


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("policy", ["full_uniform", "core_attn", "mla_up_proj", "selective_all"])
def test_hybrid_mla_phases_are_bitwise_equal_under_recompute(phase, policy):
    modules = {"core_attn": ["core_attn"], "mla_up_proj": ["mla_up_proj"],
               "selective_all": ["full_attn", "core_attn", "mla_up_proj", "mhc", "moe", "moe_act"]}
    if policy == "full_uniform":
        recompute = POLICIES["full_uniform"]
    else:
        recompute = {"recompute_granularity": "selective", "recompute_modules": modules[policy]}
    want = _step(HYBRID, PHASES[phase], seq=96)
    got = _step(HYBRID, {**PHASES[phase], **recompute}, seq=96)
    _assert_same(got, want, f"{phase} / {policy}")
    if phase != "full_causal":
        assert want["indexer_loss"].item() > 0, "the indexer KL must be on for its once-only logging to count"


def test_indexer_picks_are_saved_not_recomputed(monkeypatch):
    """Under full recompute the CSA indexer scores once per step: the re-run replays its picks."""
    from fleet_ext.layers.csa_indexer import CSAIndexer

    calls = []
    original = CSAIndexer.forward
    monkeypatch.setattr(CSAIndexer, "forward", lambda self, *a: calls.append(1) or original(self, *a))
    _step(TINY, TINY_MODEL)
    plain = len(calls)
    calls.clear()
    _step(TINY, {**TINY_MODEL, **POLICIES["full_uniform"]})
    assert plain == 1 and len(calls) == plain, (plain, len(calls))


@pytest.mark.parametrize("fusions", [{"apply_rope_fusion": True},
                                     {"mqa_sparse_attn_backend": "triton", "apply_rope_fusion": True}],
                         ids=["rope_fusion", "triton_latent_mqa"])
def test_hybrid_mla_sparse_phase_with_fused_kernels_under_recompute(fusions):
    """The -2 layers' fused paths (RoPE kernel, Triton latent-MQA sparse attention) re-run bitwise too."""
    seq, fusions = (96, fusions) if "mqa_sparse_attn_backend" not in fusions else (SHORT_SEQ, {**fusions, **SHORT})
    want = _step(HYBRID, fusions, seq=seq)
    got = _step(HYBRID, {**fusions, **POLICIES["full_uniform"]}, seq=seq)
    _assert_same(got, want, f"sparse phase, {fusions}, full recompute")


def _shift_router_bias(model: DSv4ForCausalLM) -> None:
    """Between the forward and the backward: a bias step large enough to reroute most tokens."""
    for layer in model.moe_layers():
        bias = getattr(layer.router, "expert_bias", None)  # hash-routed layers have none
        if bias is not None:
            bias.set_value(paddle.to_tensor(np.linspace(-50, 50, bias.shape[0]).astype("float32")))


def test_routing_replay_keeps_the_forwards_experts():
    full = POLICIES["full_uniform"]
    want = _step(TINY, {**TINY_MODEL, **full})
    got = _step(TINY, {**TINY_MODEL, **full}, perturb=_shift_router_bias)
    _assert_same(got, want, "router changed before the backward, with replay")


NO_REPLAY = """
import sys
sys.path[:0] = ["tests", "tests/single_card_tests"]
import fleet_ext.layers.moe as moe
import test_recompute as t
policy = {**t.TINY_MODEL, **t.POLICIES["full_uniform"]}
want = t._step(t.TINY, policy, perturb=t._shift_router_bias)  # replayed: the forward's computation
moe.replayed = lambda owner, compute: (compute(), True)  # routing replay off
try:
    t._assert_same(t._step(t.TINY, policy, perturb=t._shift_router_bias), want, "without replay")
    print("BACKWARD UNCHANGED")
except AssertionError as exc:
    print("BACKWARD DIFFERS:", str(exc).splitlines()[0])
except Exception as exc:
    print("BACKWARD FAILED:", " ".join(str(exc).split())[:2000])
"""


def test_without_routing_replay_the_changed_router_breaks_the_backward():
    """Negative control: without replay the re-run routes by the changed bias, so the recomputed segment is no
    longer the forward's computation: the tensors the backward needs no longer match what the forward saved (Paddle
    refuses a changed shape; the grouped experts' slots point past the forward's expert capacity), or, where they
    happen to fit, the gradients are not the replayed run's. Run in its own process: a backward that fails inside
    recompute leaves Paddle's saved-tensor hooks registered for the rest of the process."""
    result = subprocess.run([sys.executable, "-c", NO_REPLAY], capture_output=True, text=True, timeout=300, cwd=ROOT)
    refused = "BACKWARD FAILED:" in result.stdout and any(
        why in result.stdout for why in ("saved by autograd", "index is out of bounds"))
    assert refused or "BACKWARD DIFFERS:" in result.stdout, result.stdout + result.stderr


def test_the_startup_table_shows_the_policy_per_layer():
    from fleet_ext.training.summary import recompute_summary

    full = load_config(TINY, **POLICIES["full_uniform"])
    assert recompute_summary(full) == "full; layers 0-2: full (chunk 0-2); layer 3: full (chunk 3)"
    selective = load_config(TINY, recompute_granularity="selective",
                            recompute_modules={"moe_act": "all", "core_attn": [1, 2]})
    assert recompute_summary(selective) == (
        "selective; layer 0: selective: moe_act; layers 1-2: selective: core_attn, moe_act; "
        "layer 3: selective: moe_act"
    )
    assert recompute_summary(load_config(TINY)).startswith("none")
