"""The ``training`` section: the pretraining job (PaddleFormers/PaddleNLP trainer names)."""

from __future__ import annotations

from dataclasses import dataclass

from fleet_ext.config.fields import NON_NEGATIVE, POSITIVE, Section, at_least, fail, interval, key_field

__all__ = ["LR_SCHEDULER_TYPES", "RESUME_AUTO", "TrainingConfig"]

_key = key_field
RESUME_AUTO = "auto"
LR_SCHEDULER_TYPES = ("cosine", "linear", "constant")
_BETA = interval(0.0, 1.0, high_open=True)
_BETA_FIX = "use 0.9 / 0.95 / 0.999"
# Paddle's generator takes an unsigned 64-bit seed and each rank adds its rank: stay below 2**63.
_SEED = interval(0, 2**63 - 1)


@dataclass
class TrainingConfig(Section):
    """Pretraining job (PaddleFormers/PaddleNLP trainer names): data, optimizer, schedule, logging, checkpoints."""

    output_dir: str = _key("out", "Directory of metrics.jsonl, loss.png and the checkpoint-<step>/ directories.")
    train_dataset_path: str = _key(
        "builtin",
        "Training tokens: 'builtin' (the shipped public-domain corpus, byte tokens) or a token file made by "
        "`python -m fleet_ext.training.data` (memory-mapped).",
    )
    model_name_or_path: str | None = _key(
        None,
        "Hugging Face DeepSeek-V4 or DeepSeek-V3.2 directory (config.json + *.safetensors) to start from: its "
        "config.json sets the architecture keys (replacing the YAML's), its weights are loaded before the first "
        "step; null: random initialisation.",
    )
    eval_dataset_path: str | None = _key(
        None, "Held-out token file; null holds out the last eval_split_ratio of the training tokens."
    )
    eval_split_ratio: float = _key(
        0.05,
        "Share of the training tokens held out for evaluation (when no eval file).",
        domain=interval(0.0, 0.5, high_open=True),
        fix="use e.g. 0.05",
    )
    max_seq_len: int = _key(256, "Tokens per packed training sequence (<= max_position_embeddings).", domain=POSITIVE)
    per_device_train_batch_size: int = _key(
        1, "Sequences per micro-batch on each data-parallel rank.", domain=POSITIVE
    )
    per_device_eval_batch_size: int = _key(1, "Sequences per evaluation batch on each rank.", domain=POSITIVE)
    gradient_accumulation_steps: int = _key(1, "Micro-batches per optimizer step on each rank.", domain=POSITIVE)
    max_steps: int = _key(1000, "Optimizer steps to train for.", domain=POSITIVE)
    learning_rate: float = _key(3e-4, "Peak learning rate (after warmup).", domain=POSITIVE, fix="use e.g. 3.0e-4")
    min_lr: float = _key(0.0, "Learning rate at the end of the decay.", domain=NON_NEGATIVE)
    warmup_steps: int = _key(0, "Linear warmup steps from 0 to learning_rate.", domain=NON_NEGATIVE)
    lr_scheduler_type: str = _key("cosine", "Decay after warmup, down to min_lr at max_steps.", LR_SCHEDULER_TYPES)
    weight_decay: float = _key(
        0.0,
        "AdamW decoupled weight decay (not on norms, biases, sinks, position biases).",
        domain=NON_NEGATIVE,
        fix="set `weight_decay` to 0 to disable",
    )
    adam_beta1: float = _key(0.9, "AdamW beta1.", domain=_BETA, fix=_BETA_FIX)
    adam_beta2: float = _key(0.999, "AdamW beta2.", domain=_BETA, fix=_BETA_FIX)
    adam_epsilon: float = _key(1e-8, "AdamW epsilon.", domain=POSITIVE, fix="use 1.0e-8")
    max_grad_norm: float = _key(
        1.0,
        "Clip gradients to this global L2 norm; 0 disables clipping.",
        domain=NON_NEGATIVE,
        fix="set `max_grad_norm` to 0 to disable",
    )
    seed: int = _key(
        42, "Seed of parameter init (same on every rank) and data order; ranks add their rank to it.", domain=_SEED
    )
    logging_steps: int = _key(1, "Write a metrics.jsonl record every this many steps.", domain=POSITIVE)
    eval_steps: int = _key(
        0, "Evaluate held-out perplexity every this many steps (0: only at the end).", domain=NON_NEGATIVE
    )
    eval_iters: int = _key(
        4, "Held-out batches per evaluation on each rank; 0 disables evaluation.", domain=NON_NEGATIVE
    )
    save_steps: int = _key(0, "Save a checkpoint every this many steps (0: only at the end).", domain=NON_NEGATIVE)
    save_total_limit: int | None = _key(
        None,
        "Keep at most this many checkpoints (oldest deleted first); null: all.",
        domain=at_least(1),
        fix="use null to keep all",
    )
    resume_from_checkpoint: str | None = _key(
        None,
        "null: start fresh (refuses an output_dir that holds checkpoints); 'auto': the newest complete "
        "checkpoint-<step> in output_dir, or fresh if there is none; or a checkpoint directory.",
    )
    bf16: bool = _key(False, "bf16 autocast, fp32 master weights (GPU only: Paddle's CPU build has no bf16 matmul).")
    disable_tqdm: bool = _key(False, "No progress bar on rank 0.")

    def validate(self) -> None:
        for key in ("output_dir", "train_dataset_path"):
            if not getattr(self, key).strip():
                fail(key, getattr(self, key), "a non-empty path", f"set `{key}`")
        if self.model_name_or_path is not None and not self.model_name_or_path.strip():
            fail(
                "model_name_or_path",
                self.model_name_or_path,
                "null or a Hugging Face checkpoint directory",
                "use null to start from random weights",
            )
        if self.eval_dataset_path is not None and not self.eval_dataset_path.strip():
            fail("eval_dataset_path", self.eval_dataset_path, "null or a token file", "use null to hold out a split")
        if self.eval_iters and self.eval_dataset_path is None and self.eval_split_ratio == 0.0:
            fail(
                "eval_split_ratio",
                0.0,
                "> 0 while eval_iters > 0 and eval_dataset_path is null (nothing would be held out)",
                "set eval_split_ratio (e.g. 0.05), give eval_dataset_path, or set eval_iters: 0",
            )
        if self.min_lr > self.learning_rate:
            fail("min_lr", self.min_lr, f"a number in [0, learning_rate = {self.learning_rate}]", "lower min_lr")
        if self.warmup_steps > self.max_steps:
            fail("warmup_steps", self.warmup_steps, f"<= max_steps ({self.max_steps})", "shorten the warmup")
        if self.resume_from_checkpoint is not None and not self.resume_from_checkpoint.strip():
            fail(
                "resume_from_checkpoint",
                self.resume_from_checkpoint,
                f"null, '{RESUME_AUTO}' or a checkpoint directory",
                "use null to start fresh",
            )
