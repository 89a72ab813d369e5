"""The start-up table printed once on rank 0: model size, parallel layout, batch, optimizer, data,
checkpoints, then the fusion table (switch -> backend -> reason) from the model's backend provider."""

from __future__ import annotations

from collections import Counter
from typing import Any

from fleet_ext.config import recompute_plan
from fleet_ext.layer_kinds import kinds_of

__all__ = ["startup_table", "count_parameters"]


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def count_parameters(model: Any) -> tuple[int, int]:
    """(all parameters, trainable parameters)."""
    total = trainable = 0
    for p in model.parameters():
        n = int(p.size)
        total += n
        trainable += 0 if p.stop_gradient else n
    return total, trainable


def recompute_summary(config: Any) -> str:
    """The recompute policy per layer: runs of layers with the same policy, e.g. ``layers 0-2: full (chunk 0-2)``."""
    plan = recompute_plan(config)
    if plan.granularity is None:
        return "none (every activation kept for the backward)"
    runs: list[tuple[int, int, str]] = []
    for layer in range(config.model.num_hidden_layers):
        text = plan.describe(layer)
        if runs and runs[-1][2] == text:
            runs[-1] = (runs[-1][0], layer, text)
        else:
            runs.append((layer, layer, text))
    parts = [f"layer {a}: {t}" if a == b else f"layers {a}-{b}: {t}" for a, b, t in runs]
    return f"{plan.granularity}; " + "; ".join(parts)


def startup_table(
    config: Any, model: Any, env: Any, data: Any, no_decay: list, resume: Any, precision: str, device: str
) -> str:
    m, moe, par, t = config.model, config.moe, config.parallel, config.training
    total, trainable = count_parameters(model)
    kinds = Counter(kind.value for kind in kinds_of(m))
    layers = ", ".join(f"{n} {k}" for k, n in kinds.items())
    per_step = t.per_device_train_batch_size * t.gradient_accumulation_steps * env.world_size
    rows = [
        ("model", f"DSv4ForCausalLM, {_human(total)} parameters ({_human(trainable)} trainable)"),
        ("layers", f"{m.num_hidden_layers} ({layers}); ratios {m.csa_compress_ratios}"),
        (
            "moe",
            f"{moe.n_routed_experts} routed experts, top-{moe.num_experts_per_tok}, {moe.n_shared_experts} shared, "
            f"{moe.moe_n_hash_layers} hash-routed layer(s), balancing: aux-free bias"
            + (" + seq aux loss" if moe.moe_router_load_balancing_type == "seq_aux_loss" else ""),
        ),
        ("mHC", f"{m.num_residual_streams} streams" if m.enable_hyper_connections else "off"),
        ("recompute", recompute_summary(config)),
        (
            "parallel",
            f"{env.world_size} process(es), backend {env.backend}, device {device}: data {env.world_size} x tensor "
            f"{par.tensor_model_parallel_size} x pipeline {par.pipeline_model_parallel_size} x context "
            f"{par.context_parallel_size} x expert {par.expert_model_parallel_size}",
        ),
        (
            "batch",
            f"micro {t.per_device_train_batch_size} x accumulation {t.gradient_accumulation_steps} x data "
            f"{env.world_size} = {per_step} sequences x {t.max_seq_len} tokens = {per_step * t.max_seq_len:,} "
            "tokens / step",
        ),
        ("precision", precision),
        (
            "optimizer",
            f"AdamW lr {t.learning_rate:g} ({t.lr_scheduler_type} to {t.min_lr:g}, warmup {t.warmup_steps}), "
            f"betas ({t.adam_beta1:g}, {t.adam_beta2:g}), eps {t.adam_epsilon:g}, weight decay {t.weight_decay:g} "
            f"({len(no_decay)} tensors without), clip {t.max_grad_norm:g}",
        ),
        ("steps", f"{t.max_steps} (log every {t.logging_steps}, eval every {t.eval_steps or 'end'} x {t.eval_iters})"),
        ("data", data.describe()),
        (
            "checkpoints",
            f"{t.output_dir}/checkpoint-<step> every {t.save_steps or 'end'} steps, keep "
            f"{t.save_total_limit or 'all'}; {'resume from ' + str(resume) if resume else 'fresh start'}",
        ),
        (
            "aux losses",
            f"moe {moe.moe_router_load_balancing_type} (coeff {moe.moe_aux_loss_coeff:g}), DSA indexer KL coeff "
            f"{m.dsa_indexer_loss_coeff:g}: added to the gradients inside the model at the main loss's scale",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["fleet_ext pretraining", *(f"  {k.ljust(width)}  {v}" for k, v in rows), "", model.backend.format_table()]
    return "\n".join(lines)
