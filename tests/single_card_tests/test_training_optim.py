"""Warmup + decay schedule, the AdamW no-decay rule, global-norm clipping."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import paddle
from helpers import assert_close

from fleet_ext.config import load_config
from fleet_ext.models import DSv4ForCausalLM
from fleet_ext.training.optim import WarmupDecayLR, build_optimizer, clip_grad_norm_, lr_at, no_decay_reason

TINY = str(Path(__file__).resolve().parents[2] / "fleet_ext" / "configs" / "dsv4_tiny_cpu.yaml")


def test_warmup_then_cosine_reaches_min_lr_at_the_last_step():
    peak, low, warm, total = 1e-3, 1e-4, 10, 111  # decay over steps 10..110 (100 intervals)
    lrs = [lr_at(s, peak, low, warm, total, "cosine") for s in range(total)]
    for step, want in ((0, peak / 10), (9, peak), (10, peak), (-1, low), (60, (peak + low) / 2)):
        assert_close(lrs[step], want, "float64", "scalar_formula", what=f"cosine step {step}")
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert_close(lr_at(60, peak, low, warm, total, "linear"), (peak + low) / 2, "float64", "scalar_formula")
    assert lr_at(60, peak, low, warm, total, "constant") == peak


def test_scheduler_follows_lr_at_and_round_trips_its_state():
    t = load_config({"learning_rate": 2e-3, "min_lr": 1e-4, "warmup_steps": 3, "max_steps": 20}).training
    sched = WarmupDecayLR(t)
    got = []
    for _ in range(20):
        got.append(sched())
        sched.step()
    assert got == [lr_at(s, 2e-3, 1e-4, 3, 20, "cosine") for s in range(20)]
    again = WarmupDecayLR(t)
    again.set_state_dict(sched.state_dict())
    assert again() == sched() and again.last_epoch == 20


def test_no_weight_decay_on_norms_biases_sinks_position_biases_and_vectors():
    paddle.seed(0)
    model = DSv4ForCausalLM(TINY)
    reasons = {name: no_decay_reason(name, p) for name, p in model.named_parameters()}
    assert reasons["layers.0.input_layernorm.weight"] == "norm"
    assert reasons["layers.0.self_attention.core_attention.attn_sink"] == "attention sink"
    assert reasons["layers.1.self_attention.core_attention.compressor.ape"] == "position bias"
    assert reasons["layers.0.mhc_attn.base"] is not None
    for name in (
        "word_embeddings.weight",
        "layers.0.mlp.experts.weight1",
        "output_layer.weight",
        "layers.0.self_attention.linear_q_down_proj.weight",
        "layers.0.mhc_attn.fn",
    ):
        assert reasons[name] is None, name


def test_decoupled_decay_shrinks_matrices_only():
    """One AdamW step with zero gradients: Adam's update is 0, so only the decoupled decay moves parameters."""
    paddle.seed(0)
    model = DSv4ForCausalLM(TINY)
    t = load_config({"learning_rate": 0.1, "weight_decay": 0.5, "warmup_steps": 0, "max_steps": 10}).training
    opt, _, no_decay = build_optimizer(model, t)
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    for p in model.parameters():
        p._copy_gradient_from(paddle.zeros_like(p))
    opt.step()
    skipped = {n for n, _ in no_decay}
    for name, p in model.named_parameters():
        if name in skipped:
            np.testing.assert_array_equal(p.numpy(), before[name], err_msg=name)
        else:
            assert_close(p.numpy(), before[name] * (1 - 0.1 * 0.5), "fp32", "weight_decay", what=name)


def test_clip_grad_norm_matches_numpy_and_scales_only_above_the_limit():
    rng = np.random.default_rng(0)
    params = [paddle.create_parameter([4, 3], "float32"), paddle.create_parameter([5], "float32")]
    grads = [rng.standard_normal(p.shape).astype("float32") for p in params]
    for p, g in zip(params, grads):
        p._copy_gradient_from(paddle.to_tensor(g))
    want = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    assert_close(clip_grad_norm_(params, max_norm=1e6), want, "fp32", "grad_norm", what="norm, not clipped")
    np.testing.assert_array_equal(params[0].grad.numpy(), grads[0])
    assert_close(clip_grad_norm_(params, max_norm=1.0), want, "fp32", "grad_norm", what="norm before clipping")
    clipped = math.sqrt(sum(float((p.grad.numpy().astype(np.float64) ** 2).sum()) for p in params))
    assert_close(clipped, 1.0, "fp32", "clipped_grad_norm")
