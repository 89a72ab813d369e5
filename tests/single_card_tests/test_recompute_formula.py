"""The activation-memory formula equals the bytes autograd really keeps, per layer and per recompute setting.

``scripts/bench/recompute_formula.py`` prices every storage the forward saves for the backward from the
config's widths; ``scripts/bench/recompute_memory.py`` counts the real forward with
``paddle.autograd.saved_tensors_hooks`` (each storage once, only what a live grad node still holds, weights and
cached tables excluded, a recomputed segment's inputs and replayed decisions instead of its internals). They must
agree byte for byte on CPU fp32 for every decoder layer (window, CSA, HCA, full-causal) and for the embedding /
head / loss, at two sets of widths and shapes, for no recompute, full recompute (one layer and several layers per
chunk, uniform and block) and each selective module; with the fusion switches of the DSv4-Flash YAML; with the
Triton sparse-attention backend; with MTP depths (each counted apart, under its layer index after the backbone)
and the CSA indexer KL loss on, for every policy (under uniform full recompute a depth keeps only its unit's inputs,
its replayed decisions, the LM head's input and its loss: checked storage by storage). A formula with a planted
error (a term dropped, a Sinkhorn step missed, one MTP or KL storage left out) fails.
When a layer changes what it saves, this test fails until the formula follows.
"""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import tiny_model

from fleet_ext.config import load_config
from fleet_ext.layer_kinds import kinds_of
from fleet_ext.models import DSv4ForCausalLM
from fleet_ext.models.mtp import MultiTokenPredictionLayer

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


memory = _script("recompute_memory")
formula = _script("recompute_formula")

TINY = ROOT / "fleet_ext" / "configs" / "dsv4_tiny_cpu.yaml"
# (config source, overrides, batch, seq): the benchmark's model (YAML widths, VHA, hash + top-k MoE) with HCA and
# CSA entries and a ragged tail; other widths with a dense first layer, sigmoid scores, no renormalisation, no
# SwiGLU clamp, two shared experts and the sequence aux loss.
SHAPE_A = (TINY, {"csa_compress_ratios": [0, 4, 128, -1], "use_vha_attention": True}, 2, 300)
SHAPE_B = (TINY, tiny_model(use_vha_attention=True, moe_n_hash_layers=0, first_k_dense_replace=1,
                            scoring_func="sigmoid", norm_topk_prob=False, swiglu_limit=0.0, intermediate_size=24,
                            n_shared_experts=2, moe_router_load_balancing_type="seq_aux_loss"), 3, 257)
FLASH_SWITCHES = {"apply_rope_fusion": True, "dsv4_q_rms_norm_fusion": True, "dsa_sink_grad_fusion": True,
                  "sparse_attn_global_kv_idx_remap_fusion": True, "use_vha_attention": False,
                  "moe_router_load_balancing_type": "seq_aux_loss", "moe_router_fusion": True,
                  "moe_permute_fusion": True}
TRITON = {"csa_sparse_attn_backend": "triton", "sparse_attn_global_kv_idx_remap_fusion": True,
          "apply_rope_fusion": True, "dsv4_q_rms_norm_fusion": True}


def _full(method: str, layers: int) -> dict:
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": layers}


def _selective(*modules: str) -> dict:
    return {"recompute_granularity": "selective", "recompute_modules": list(modules)}


POLICIES = {
    "none": {},
    "full_uniform_1": _full("uniform", 1),
    "full_uniform_3": _full("uniform", 3),
    "full_block_2": _full("block", 2),
    **{module: _selective(module) for module in formula.MODULES},
    "selective_all": _selective(*formula.MODULES),
}


class _DepthCharged(memory.SavedBytes):
    """``SavedBytes`` whose latest instance ``_charging_mtp_depths`` points at each MTP depth in turn."""

    latest: memory.SavedBytes | None = None
    backbone = 0  # num_hidden_layers: depth k is charged under layer backbone + k - 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _DepthCharged.latest = self

    def checkpointed(self, fn, *args):
        """A depth recomputed as one unit (uniform full recompute) keeps its inputs: charge them to the depth."""
        if isinstance(fn, MultiTokenPredictionLayer) and not self.paused:
            self.layer = self.backbone + fn.depth - 1
        return super().checkpointed(fn, *args)


@contextmanager
def _charging_mtp_depths(layers: int):
    """Count what each MTP depth saves (its projections, decoder layer, head and loss) under its layer index
    ``layers + depth - 1`` instead of the embedding / head / loss bucket (the counter hooks backbone layers only);
    from the end of the MTP loss on (its auto-scaler, the main loss) the bucket is None again."""
    originals = memory.SavedBytes, MultiTokenPredictionLayer.forward, DSv4ForCausalLM._mtp_loss

    def depth_forward(self, *args, **kwargs):
        if _DepthCharged.latest is not None:
            _DepthCharged.latest.layer = layers + self.depth - 1
        return originals[1](self, *args, **kwargs)

    def mtp_loss(self, *args, **kwargs):
        try:
            return originals[2](self, *args, **kwargs)
        finally:
            if _DepthCharged.latest is not None:
                _DepthCharged.latest.layer = None

    _DepthCharged.latest, _DepthCharged.backbone = None, layers
    memory.SavedBytes, MultiTokenPredictionLayer.forward, DSv4ForCausalLM._mtp_loss = (
        _DepthCharged, depth_forward, mtp_loss)
    try:
        yield
    finally:
        memory.SavedBytes, MultiTokenPredictionLayer.forward, DSv4ForCausalLM._mtp_loss = originals
        _DepthCharged.latest = None


def _compare(source, overrides: dict, batch: int, seq: int) -> tuple[dict, dict, list[str]]:
    """(counted, formula) bytes per layer, MTP depths after the backbone (None: embedding, head, loss) and the layer
    names for messages."""
    config = load_config(source, **overrides)
    layers = len(config.model.csa_compress_ratios)
    counted: dict = {layer: 0 for layer in [*range(layers), None]}
    with _charging_mtp_depths(config.model.num_hidden_layers):
        records = memory.saved_records(config, batch, seq)
    for layer, nbytes, *_ in records:
        counted[layer] += nbytes
    backbone = config.model.num_hidden_layers
    names = [f"layer {i} ({kind.value})" if i < backbone else f"MTP depth {i - backbone + 1} ({kind.value})"
             for i, kind in enumerate(kinds_of(config.model))]
    return counted, formula.model_bytes(config, batch, seq), names


def _assert_equal(source, overrides: dict, batch: int, seq: int) -> dict:
    counted, predicted, names = _compare(source, overrides, batch, seq)
    for layer, nbytes in counted.items():
        name = "embedding/head/loss" if layer is None else names[layer]
        assert predicted[layer] == nbytes, f"{name}: formula {predicted[layer]} B, counted {nbytes} B"
    return counted


@pytest.mark.parametrize("policy", list(POLICIES))
def test_formula_equals_counted_bytes_on_the_benchmark_model(policy):
    source, overrides, batch, seq = SHAPE_A
    counted = _assert_equal(source, {**overrides, **POLICIES[policy]}, batch, seq)
    assert all(counted[layer] > 0 for layer in counted), "every layer keeps something (its input at least)"


@pytest.mark.parametrize("policy", ["none", "full_uniform_3", "selective_all"])
def test_formula_equals_counted_bytes_at_other_widths(policy):
    source, overrides, batch, seq = SHAPE_B
    _assert_equal(source, {**overrides, **POLICIES[policy]}, batch, seq)


# MTP and the CSA indexer KL (both on in the DSv4-Flash YAML): one CSA MTP depth after the benchmark's layers (a
# ragged tail: 66 // 4 entries), and two MTP depths (window, HCA) at the other widths, where layer 0 is CSA.
MTP_KL = {"num_nextn_predict_layers": 1, "dsa_indexer_loss_coeff": 0.1}
SHAPE_MTP = (TINY, {**SHAPE_A[1], **MTP_KL, "csa_compress_ratios": [0, 4, 128, -1, 4]}, 2, 66)
SHAPE_MTP_B = (TINY, {**SHAPE_B[1], **MTP_KL, "num_nextn_predict_layers": 2,
                      "csa_compress_ratios": [4, 0, 128, -1, 0, 128]}, 3, 257)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_formula_with_mtp_and_the_indexer_kl(policy):
    source, overrides, batch, seq = SHAPE_MTP
    counted = _assert_equal(source, {**overrides, **POLICIES[policy]}, batch, seq)
    assert counted[4] > counted[0], "the MTP depth is counted apart (its layer, head and loss)"


@pytest.mark.parametrize("policy", ["none", "full_uniform_3", "selective_all"])
def test_formula_with_two_mtp_depths_and_the_indexer_kl_at_other_widths(policy):
    source, overrides, batch, seq = SHAPE_MTP_B
    _assert_equal(source, {**overrides, **POLICIES[policy]}, batch, seq)


# The Triton interpreter is slow on CPU: short sequences, with HCA compressing every 16 tokens to have entries.
SHORT = {"hca_compress_ratio": 16}


@pytest.mark.parametrize("extras", [{}, {**MTP_KL, "csa_compress_ratios": [0, 4, 128, -1, 4]}], ids=["", "mtp_kl"])
def test_formula_with_the_flash_yaml_fusion_switches(extras):
    """Fused RoPE and q RMS norm, the sink-gradient fusion, the index remap kernel (Triton interpreter), the fused
    MoE router and permute, no VHA; with and without MTP and the indexer KL."""
    source, overrides, _, _ = SHAPE_A
    _assert_equal(source, {**overrides, **SHORT, **FLASH_SWITCHES, **_selective("mhc", "moe_act"), **extras}, 2, 40)


def test_formula_with_the_triton_sparse_attention_backend():
    source, overrides, _, _ = SHAPE_A
    _assert_equal(source, {**overrides, **SHORT, **TRITON}, 1, 24)


def _drop_first_term(original):
    """``original`` with the first storage it saves left out: a term forgotten in the formula."""

    def planted(tr, *args, **kwargs):
        save, dropped = tr.save, []

        def save_all_but_the_first(*tensors):
            if not dropped:
                dropped.append(tensors[0])
                tensors = tensors[1:]
            save(*tensors)

        tr.save = save_all_but_the_first
        try:
            return original(tr, *args, **kwargs)
        finally:
            tr.save = save

    return planted


@pytest.mark.parametrize("target", ["swiglu", "sinkhorn", "sparse_attention"])
def test_a_planted_formula_error_is_caught(monkeypatch, target):
    """Negative control: drop the first term one formula function saves; every layer using it must disagree."""
    monkeypatch.setattr(formula, target, _drop_first_term(getattr(formula, target)))
    source, overrides, batch, seq = SHAPE_A
    counted, predicted, names = _compare(source, overrides, batch, seq)
    wrong = [names[layer] for layer in range(4) if predicted[layer] != counted[layer]]
    assert wrong == names, f"planted error in {target} went unnoticed in {sorted(set(names) - set(wrong))}"


@pytest.mark.parametrize("term, policy, wrong", [
    ("kl.valid", "none", [1, 4]),  # the KL's valid-slot mask, in every CSA layer (the MTP depth's too)
    ("attn.loss_mask", "core_attn", [1, 4]),  # the core's extra input, kept only when the core is recomputed
    ("mtp.ids_ahead", "none", [4]),  # the MTP embedding lookup's shifted ids
    ("loss.labels", "full_uniform_1", [4]),  # the MTP cross-entropy's shifted labels
])
def test_a_planted_mtp_or_kl_error_is_caught(monkeypatch, term, policy, wrong):
    """Negative control: leave one MTP / KL storage out of the formula; exactly the layers that keep it disagree."""
    save = formula.Trace.save
    monkeypatch.setattr(formula.Trace, "save", lambda tr, *tensors: save(
        tr, *(t for t in tensors if t is None or t.name.split("#")[0] != term)))
    source, overrides, batch, seq = SHAPE_MTP
    counted, predicted, names = _compare(source, {**overrides, **POLICIES[policy]}, batch, seq)
    assert [layer for layer in counted if predicted[layer] != counted[layer]] == wrong


def test_a_recomputed_mtp_depth_keeps_its_inputs_its_decisions_and_its_loss_only():
    """Uniform full recompute: each MTP depth keeps its unit's inputs (the shifted ids; from depth 2 on the previous
    depth's streams, which that depth's recomputed head no longer keeps), the decisions its re-run replays (the CSA
    indexer's picks, the routed experts) and, outside the unit, the shared LM head's input and its cross-entropy
    (shifted labels, softmax, sum / count / mean): nothing of its projections, decoder layer or mHC head. Counted
    storages, by dtype and shape (depth 1 CSA, depth 2 window)."""
    source, overrides, batch, seq = SHAPE_MTP
    config = load_config(source, **{**overrides, "num_nextn_predict_layers": 2, **POLICIES["full_uniform_1"],
                                    "csa_compress_ratios": [0, 4, 128, -1, 4, 0]})
    m, rows = config.model, batch * seq
    with _charging_mtp_depths(m.num_hidden_layers):
        records = memory.saved_records(config, batch, seq)
    kept = {depth: sorted((dtype, shape) for layer, _, dtype, shape, _ in records if layer == 3 + depth)
            for depth in (1, 2)}
    k = config.moe.num_experts_per_tok
    loss = [("float32", [batch, seq, m.hidden_size]), ("int64", [rows, 1]), ("float32", [rows, m.vocab_size]),
            *[("float32", [])] * 3]
    ids, experts = ("int64", [batch, seq]), ("int64", [rows, k])
    picks = ("int32", [batch, seq, min(m.dsa_index_topk, seq // 4)])
    streams = ("float32", [batch, seq, m.num_residual_streams, m.hidden_size])
    assert kept[1] == sorted([ids, picks, experts, *loss]), kept[1]
    assert kept[2] == sorted([streams, ids, experts, *loss]), kept[2]
