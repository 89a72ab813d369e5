"""The start-up table printed once on rank 0: model size, parallel layout, batch, optimizer, data,
checkpoints, then the fusion table (switch -> backend -> reason) from the model's backend provider."""

from __future__ import annotations

from collections import Counter
from typing import Any

from fleet_ext.config import recompute_plan
from fleet_ext.layer_kinds import kinds_of
from fleet_ext.registry import triton_switches

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


def _context_parallel_row(config: Any, cp: int) -> str:
    """What each rank holds and exchanges under context parallelism."""
    if cp == 1:
        return "off (each rank holds whole sequences)"
    seq = config.training.max_seq_len
    return (
        f"{cp} ranks per sequence, contiguous chunks of {seq // cp} tokens (rank r: positions r*{seq // cp}..); "
        f"window/CSA/HCA layers: halo of the previous rank's last {config.model.csa_window_size - 1} KV rows + "
        "all-gathered compressed entries (and CSA indexer keys); -1 / -2 layers: all-gathered keys; loss: mean "
        "over the whole sequences"
    )


def _expert_parallel_row(config: Any, world: int) -> str:
    """Which experts each rank owns and how tokens reach them under expert parallelism."""
    ep, n = config.parallel.expert_model_parallel_size, config.moe.n_routed_experts
    if ep == 1:
        return "off (every rank holds every expert)"
    return (
        f"experts over {ep} ranks ({config.parallel.moe_token_dispatcher_type}), {n // ep} of {n} routed experts per "
        f"rank and layer (rank r: experts r*{n // ep}..), expert-data-parallel {world // ep}; rows to the experts' "
        "owners and outputs back per layer; expert gradients summed over the expert-data-parallel group"
    )


def triton_route_summary(config: Any, cap: Any) -> str:
    """How Triton launches reach the device (``fleet_ext.capability``), and whether any switch uses Triton."""
    used = triton_switches(config)
    return cap.route_name() + (f" for {len(used)} switch(es)" if used else "; unused (no Triton switch on)")


def startup_table(
    config: Any, model: Any, env: Any, data: Any, no_decay: list, resume: Any, precision: str, device: str
) -> str:
    m, moe, par, t = config.model, config.moe, config.parallel, config.training
    total, trainable = count_parameters(model)
    kinds = Counter(kind.value for kind in kinds_of(m))
    layers = ", ".join(f"{n} {k}" for k, n in kinds.items())
    cp = par.context_parallel_size
    dp = env.world_size // cp  # world = data x context (the trainer checked it divides)
    per_step = t.per_device_train_batch_size * t.gradient_accumulation_steps * dp
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
            f"{env.world_size} process(es), backend {env.backend}, device {device}: data {dp} x tensor "
            f"{par.tensor_model_parallel_size} x pipeline {par.pipeline_model_parallel_size} x context "
            f"{cp} x expert {par.expert_model_parallel_size}",
        ),
        ("context parallel", _context_parallel_row(config, cp)),
        ("expert parallel", _expert_parallel_row(config, env.world_size)),
        (
            "batch",
            f"micro {t.per_device_train_batch_size} x accumulation {t.gradient_accumulation_steps} x data "
            f"{dp} = {per_step} sequences x {t.max_seq_len} tokens = {per_step * t.max_seq_len:,} "
            "tokens / step",
        ),
        ("precision", precision),
        ("triton", triton_route_summary(config, model.backend.capability)),
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
            f"moe {moe.moe_router_load_balancing_type} (coeff {moe.moe_aux_loss_coeff:g}), indexer KL (CSA, -2) coeff "
            f"{m.dsa_indexer_loss_coeff:g}, MTP x {m.num_nextn_predict_layers} depth(s) (weight "
            f"{m.mtp_loss_scaling_factor:g}): added to the gradients inside the model at the main loss's scale",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["fleet_ext pretraining", *(f"  {k.ljust(width)}  {v}" for k, v in rows), "", model.backend.format_table()]
    return "\n".join(lines)
