"""AdamW with the DSv4 no-decay rule, warmup + decay learning-rate schedule, global-norm clipping."""

from __future__ import annotations

import math
from typing import Any

import paddle
from paddle.optimizer.lr import LRScheduler

__all__ = ["lr_at", "WarmupDecayLR", "no_decay_reason", "build_optimizer", "clip_grad_norm_"]

# Parameter leaf names that are position biases (the compressors' learnable absolute position embedding).
_POSITION_BIASES = ("ape",)


def lr_at(step: int, peak: float, min_lr: float, warmup: int, total: int, kind: str) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup to ``peak``, then ``kind`` to ``min_lr``.

    Warmup gives ``peak * (step + 1) / warmup`` for the first ``warmup`` steps (never 0); the decay runs
    over the remaining ``total - warmup`` steps and reaches ``min_lr`` at the last step.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant":
        return peak
    span = max(total - warmup - 1, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if kind == "cosine":
        return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return peak - (peak - min_lr) * progress
    raise ValueError(f"config key `lr_scheduler_type` = {kind!r} is invalid: allowed ['cosine', 'linear', 'constant']")


class WarmupDecayLR(LRScheduler):
    """Paddle LR scheduler for :func:`lr_at`; ``last_epoch`` is the index of the next optimizer step."""

    def __init__(self, training: Any) -> None:
        self.peak = training.learning_rate
        self.min_lr = training.min_lr
        self.warmup = training.warmup_steps
        self.total = training.max_steps
        self.kind = training.lr_scheduler_type
        super().__init__(learning_rate=training.learning_rate, last_epoch=-1)

    def get_lr(self) -> float:
        return lr_at(self.last_epoch, self.peak, self.min_lr, self.warmup, self.total, self.kind)


def no_decay_reason(name: str, param: paddle.Tensor) -> str | None:
    """Why parameter ``name`` gets no weight decay (norm, bias, sink, position bias, vector), or None if it does."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return "norm"
    if "bias" in leaf:
        return "bias"
    if "sink" in leaf:
        return "attention sink"
    if leaf in _POSITION_BIASES:
        return "position bias"
    if param.ndim < 2:
        return "vector (gain / scale / offset)"
    return None


def build_optimizer(model: paddle.nn.Layer, training: Any) -> tuple[paddle.optimizer.AdamW, WarmupDecayLR, list]:
    """AdamW over the trainable parameters with decoupled decay on matrices only; returns (optimizer, lr, no_decay)."""
    scheduler = WarmupDecayLR(training)
    params, decay_ids, no_decay = [], set(), []
    for name, param in model.named_parameters():
        if param.stop_gradient:
            continue
        params.append(param)
        reason = no_decay_reason(name, param)
        if reason is None:
            decay_ids.add(param.name)
        else:
            no_decay.append((name, reason))
    optimizer = paddle.optimizer.AdamW(
        learning_rate=scheduler,
        beta1=training.adam_beta1,
        beta2=training.adam_beta2,
        epsilon=training.adam_epsilon,
        parameters=params,
        weight_decay=training.weight_decay,
        apply_decay_param_fun=lambda pname: pname in decay_ids,
        grad_clip=None,  # clipped by clip_grad_norm_ after the data-parallel gradient all-reduce
    )
    return optimizer, scheduler, no_decay


def clip_grad_norm_(params: list, max_norm: float, square_sums: dict | None = None) -> float:
    """Global L2 norm of the gradients (fp32, fixed parameter order); scale them to ``max_norm`` if above it.

    ``square_sums`` ({id(param): fp32 scalar}) replaces a parameter's own term (expert shards: their whole
    gradient's, from ``parallel.expert_parallel.expert_grad_square_sums``). Returns the norm before clipping
    (``nan``/``inf`` when a gradient is not finite; nothing is scaled then).
    """
    square_sums = square_sums or {}
    live = [p for p in params if p.grad is not None]
    grads = [p.grad for p in live]
    if not grads:
        return 0.0
    terms = [square_sums.get(id(p)) for p in live]
    terms = [t if t is not None else paddle.sum(paddle.square(p.grad.astype("float32"))) for t, p in zip(terms, live)]
    total = paddle.sqrt(paddle.add_n(terms))
    norm = float(total)
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = paddle.to_tensor(max_norm / (norm + 1e-6), dtype="float32")
        for g in grads:
            paddle.assign(g * scale.astype(g.dtype), output=g)
    return norm
