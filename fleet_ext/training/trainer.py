"""The pretraining loop: data-parallel AdamW steps with gradient accumulation, evaluation, checkpoints.

One optimizer step on each rank:

1. ``gradient_accumulation_steps`` micro-batches; each runs forward (bf16 autocast on GPU when ``bf16``)
   and ``backward`` of its own mean token loss. Auxiliary losses (MoE sequence aux loss, the -2 layers'
   DSA indexer KL x ``dsa_indexer_loss_coeff``) join the gradients inside the model through their
   auto-scalers, whose backward scale is set to 1: the same scale as the main loss, because the
   average over micro-batches and ranks is taken once, below. Gradients accumulate in ``.grad``.
2. One all-reduce of the summed gradients, then a multiply by 1 / (accumulation x data-parallel size). (Sum
   first, scale once: with two addends the result is bitwise independent of how they were split over ranks
   and micro-batches, so DP=2 reproduces DP=1 with twice the accumulation exactly.) Under context parallelism
   (``world = dp x cp``, CP the inner group) the ``cp`` ranks of one data-parallel rank read the same samples
   and each feeds its contiguous chunk of every sequence; the model's loss is the whole sequences' mean on each
   of them and each rank's backward yields its chunk's share, so the same all-reduce also sums over CP.
3. One all-reduce of the loss and of the MoE routers' token counts. A non-finite loss stops the run
   here, before the optimizer step, with exit code 3 and every checkpoint untouched.
4. Global-norm clipping, AdamW step, LR schedule step, aux-loss-free expert-bias update from the
   all-reduced counts (so the bias stays identical on every rank).
"""

from __future__ import annotations

import collections
import contextlib
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from fleet_ext import capability
from fleet_ext.config import FleetExtConfig
from fleet_ext.config.parallel import check_expert_parallel
from fleet_ext.ops.launch import LAUNCH_COUNTS
from fleet_ext.parallel.distributed import DistEnv, ParallelTopology, env_world, init_distributed
from fleet_ext.parallel.expert_parallel import expert_grad_square_sums, reduce_expert_gradients_
from fleet_ext.registry import check_capability
from fleet_ext.training import checkpoint as ckpt
from fleet_ext.training import hf_interop
from fleet_ext.training.data import SampleOrder, TrainingData, prepare_data
from fleet_ext.training.faults import FaultPlan
from fleet_ext.training.metrics import LOSS_PLOT, MetricsLog, plot_loss
from fleet_ext.training.optim import build_optimizer, clip_grad_norm_
from fleet_ext.training.summary import startup_table

__all__ = ["AUX_LOSSES", "TrainingError", "Trainer", "check_runtime"]

# The auxiliary losses the model reports (``DSv4ForCausalLM.auxiliary_losses``), reduced with the LM loss.
AUX_LOSSES = ("moe_aux_loss", "indexer_loss", "indexer_loss_csa", "indexer_loss_mla", "mtp_loss")


class TrainingError(RuntimeError):
    """The run cannot continue (non-finite loss or gradient); checkpoints are left as they were."""


def check_runtime(config: FleetExtConfig) -> None:
    """The one check of rules that need this machine; raise ``ValueError`` naming key, reason and fix.

    Everything that needs only the config (``params_dtype``, ``max_seq_len`` vs ``max_position_embeddings``,
    ...) already failed in ``load_config``; left here: bf16 on the Paddle build, and every fusion switch's
    capability gate (``registry.check_capability``, the backend provider's gate, run without building a model).
    """
    cp = config.parallel.context_parallel_size
    _, world = env_world()
    if world % cp:
        raise ValueError(
            f"config key `context_parallel_size` = {cp} is invalid: allowed a divisor of the number of launched "
            f"processes ({world}), as world = data parallel x context parallel. Fix: launch a multiple of {cp} "
            "processes (--nproc_per_node) or change context_parallel_size"
        )
    check_expert_parallel(config.moe, config.parallel.expert_model_parallel_size, world, cp)
    if config.training.bf16 and not paddle.is_compiled_with_cuda():
        raise ValueError(
            "config key `bf16` = True cannot run on this machine: Paddle's CPU build has no bf16 matmul kernels. "
            "Fix: set `bf16: false` (CPU training runs in fp32)"
        )
    check_capability(config, capability.detect())  # tests fake the machine with capability.override


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    paddle.seed(seed)


class Trainer:
    """Builds the model, optimizer and data from one config and runs ``train()``."""

    def __init__(
        self,
        config: FleetExtConfig,
        env: DistEnv | None = None,
        data: TrainingData | None = None,
        faults: FaultPlan | None = None,
        log_stream: Any = None,
    ) -> None:
        config = hf_interop.resolve_config(config)  # model_name_or_path: the architecture of the HF directory
        check_runtime(config)  # before joining the process group or building the model
        self.config = config
        t = config.training
        self.data = data or prepare_data(t, config.model.vocab_size)
        self.env = env or init_distributed()
        par = config.parallel
        self.topology = ParallelTopology.build(
            self.env, par.context_parallel_size, par.expert_model_parallel_size, par.moe_token_dispatcher_type
        )
        self.faults = faults or FaultPlan([])
        self.out = Path(t.output_dir)
        self._log_stream = log_stream or sys.stdout
        self._bar = None
        # Same initial weights everywhere (same seed, then rank 0's copy broadcast), then per-rank seeds.
        _seed_all(t.seed)
        self.model = hf_interop.build_model(config)  # then the model_name_or_path weights, when set
        self.env.broadcast_parameters(self.model)
        self.model.use_context_parallel(self.topology.cp_group)
        self.model.use_expert_parallel(self.topology.ep_group)  # after the broadcast: slices of the final weights
        _seed_all(t.seed + self.env.rank)
        self.optimizer, self.scheduler, self.no_decay = build_optimizer(self.model, t)
        self.params = [p for p in self.model.parameters() if not p.stop_gradient]
        self.moe_layers = self.model.moe_layers()
        self.order = SampleOrder(
            len(self.data.train),
            t.per_device_train_batch_size,
            t.gradient_accumulation_steps,
            self.topology.dp_size,
            t.seed,
        )
        self.metrics = MetricsLog(self.out, self.env.is_main)
        self.global_step = 0
        self.consumed_samples = 0
        self.last_saved_step: int | None = None
        self.last_eval: dict[str, float] = {}

    # -- logging -------------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if not self.env.is_main:
            return
        if self._bar is not None:
            self._bar.write(message, file=self._log_stream)
        else:
            print(message, file=self._log_stream, flush=True)

    @property
    def precision(self) -> str:
        if self.config.training.bf16:
            return "bf16 autocast (O1), fp32 master weights and optimizer state"
        return "fp32"

    def _autocast(self) -> Any:
        if self.config.training.bf16:
            return paddle.amp.auto_cast(enable=True, dtype="bfloat16", level="O1")
        return contextlib.nullcontext()

    # -- one step ------------------------------------------------------------------------------------
    def _aux_losses(self) -> list[paddle.Tensor]:
        """Detached values of the last forward's auxiliary losses, for the metrics, in ``AUX_LOSSES`` order.

        They reach the gradients inside the model (their auto-scalers, each already multiplied by its
        coefficient, e.g. ``dsa_indexer_loss_coeff``, ``mtp_loss_scaling_factor``); the trainer only sets their
        backward scale (:meth:`_set_aux_loss_scales`) and logs them.
        """
        losses = self.model.auxiliary_losses()
        return [losses[name] for name in AUX_LOSSES]

    def _set_aux_loss_scales(self) -> None:
        """Auxiliary-loss gradients get the main loss's backward scale: 1, as each micro-batch's mean loss is
        back-propagated unscaled and the 1 / (accumulation x world) average is applied once to the summed
        gradients (see the module docstring)."""
        self.model.set_aux_loss_backward_scale(1.0)

    def train_step(self, step: int) -> dict[str, float]:
        """Compute global step ``step`` (1-based); return its metrics."""
        t, env = self.config.training, self.env
        self.faults.kill_point("kill", step, env.rank)
        self.model.train()
        sums = paddle.zeros([1 + len(AUX_LOSSES)], dtype="float32")  # the LM loss, then AUX_LOSSES
        for micro in range(t.gradient_accumulation_steps):
            ids = self.order.sample_ids(self.consumed_samples, micro, self.topology.dp_rank)
            inputs, labels = self._my_chunk(*self.data.train.get(ids))
            with self._autocast():
                _, loss = self.model(paddle.to_tensor(inputs), labels=paddle.to_tensor(labels))
            loss = self.faults.poison_loss(loss.astype("float32"), step, env.rank)
            loss.backward()
            sums = sums + paddle.concat([loss.detach().reshape([1]), *self._aux_losses()])
        # Every CP rank holds the whole sequences' loss; the aux losses are each rank's share (see the docstring).
        samples = t.gradient_accumulation_steps * self.topology.dp_size
        self._reduce_gradients(1.0 / samples)
        counts = [layer.tokens_per_expert.reshape([-1]) for layer in self.moe_layers]
        stats = env.all_reduce_sum_(paddle.concat([sums, *counts]))
        loss_sum, *aux_sums = stats[: 1 + len(AUX_LOSSES)].tolist()
        loss_value = loss_sum / (samples * self.topology.cp_size)
        aux = {name: value / samples for name, value in zip(AUX_LOSSES, aux_sums)}
        if not math.isfinite(loss_value):
            raise TrainingError(self._nonfinite("loss", loss_value, step))
        grad_norm = self._clip_gradients(t.max_grad_norm)
        if not math.isfinite(grad_norm):
            raise TrainingError(self._nonfinite("gradient norm", grad_norm, step))
        lr = self.scheduler()
        self.optimizer.step()
        self.optimizer.clear_grad(set_to_zero=False)  # None, not zeros: untouched parameters stay un-updated
        self.scheduler.step()
        offset = 1 + len(AUX_LOSSES)
        # Indexer warm-up freezes the backbone; the routing bias is part of it, so only its counts reset.
        frozen = self.config.model.train_indexer_only
        for layer in self.moe_layers:
            n = layer.tokens_per_expert.shape[0]
            if frozen:
                layer.router.reset_tokens_per_expert()
            else:
                layer.update_expert_bias(stats[offset : offset + n])
            offset += n
        self.consumed_samples += self.order.global_batch
        self.global_step = step
        return {"loss": loss_value, "lr": lr, "grad_norm": grad_norm, **self._aux_metrics(aux)}

    def _reduce_gradients(self, scale: float) -> None:
        """Dense gradients summed over the world; expert shards over the expert-data-parallel group (their expert
        group's sum happened in the dispatch's backward); the same ``scale`` for both."""
        ep = self.topology.ep_group
        if ep is None:
            self.env.reduce_gradients_(self.params, scale)
            return
        experts = {id(p) for p in self.model.expert_parameters()}
        self.env.reduce_gradients_([p for p in self.params if id(p) not in experts], scale)
        reduce_expert_gradients_([p for p in self.params if id(p) in experts], scale, ep)

    def _clip_gradients(self, max_norm: float) -> float:
        """Global-norm clipping; under expert parallelism each expert shard's term is its whole gradient's (so the
        norm is the unsharded run's)."""
        ep = self.topology.ep_group
        if ep is None:
            return clip_grad_norm_(self.params, max_norm)
        return clip_grad_norm_(self.params, max_norm, expert_grad_square_sums(self.model.expert_parameters(), ep))

    def _aux_metrics(self, aux: dict[str, float]) -> dict[str, float]:
        """The auxiliary losses this config trains, as logged (``aux``: sums over layers, averaged over samples)."""
        m, out = self.config.model, {}
        if self.config.moe.moe_router_load_balancing_type != "none":
            out["moe_aux_loss"] = aux["moe_aux_loss"]
        if m.dsa_indexer_loss_coeff > 0:  # means over the layers with an indexer KL: all of them, then by kind
            layers = self.model.indexer_layers()
            out["indexer_loss"] = aux["indexer_loss"] / max(sum(map(len, layers.values())), 1)
            out.update({f"indexer_loss_{k}": aux[f"indexer_loss_{k}"] / len(v) for k, v in layers.items() if v})
        if m.num_nextn_predict_layers:  # mean over the MTP depths, before mtp_loss_scaling_factor
            out["mtp_loss"] = aux["mtp_loss"]
        return out

    def _my_chunk(self, inputs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's contiguous chunk of each sequence under context parallelism (all of it otherwise)."""
        topo = self.topology
        if topo.cp_size == 1:
            return inputs, labels
        chunk = inputs.shape[1] // topo.cp_size
        keep = slice(topo.cp_rank * chunk, (topo.cp_rank + 1) * chunk)
        return inputs[:, keep], labels[:, keep]

    def _nonfinite(self, what: str, value: float, step: int) -> str:
        last = ckpt.find_latest_checkpoint(self.out)
        return (
            f"non-finite {what} ({value}) at step {step}: training stopped before the optimizer step. "
            f"The checkpoints in {self.out} are untouched (latest: {last.name if last else 'none'}). "
            "Fix: lower learning_rate or raise warmup_steps, check the data, then resume with "
            "`resume_from_checkpoint: auto`"
        )

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Mean held-out token loss over ``eval_iters`` batches per rank, and its perplexity."""
        t, env, held = self.config.training, self.env, self.data.eval
        if held is None or t.eval_iters == 0:
            return {}
        self.model.eval()
        total = paddle.zeros([1], dtype="float32")
        bs = t.per_device_eval_batch_size
        with paddle.no_grad():
            for i in range(t.eval_iters):
                base = (i * self.topology.dp_size + self.topology.dp_rank) * bs
                inputs, labels = self._my_chunk(*held.get([(base + j) % len(held) for j in range(bs)]))
                with self._autocast():
                    _, loss = self.model(paddle.to_tensor(inputs), labels=paddle.to_tensor(labels))
                total = total + loss.astype("float32").reshape([1])
        self.model.train()
        eval_loss = env.all_reduce_sum_(total).item() / (t.eval_iters * env.world_size)
        self.last_eval = {"eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}
        return self.last_eval

    # -- checkpoints ---------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        t = self.config.training
        return {
            "global_step": self.global_step,
            "consumed_samples": self.consumed_samples,
            "epoch": self.order.epoch(self.consumed_samples),
            "lr_scheduler": {k: v for k, v in self.scheduler.state_dict().items()},
            "global_batch_size": self.order.global_batch,
            "max_seq_len": t.max_seq_len,
            "train_dataset_path": t.train_dataset_path,
            "seed": t.seed,
            "last_eval": self.last_eval,
        }

    def save(self) -> Path:
        t = self.config.training
        path = ckpt.save_checkpoint(
            self.out,
            self.global_step,
            self.model,
            self.optimizer,
            self.trainer_state(),
            self.env,
            self.config,
            t.save_total_limit,
            self.faults,
        )
        self.last_saved_step = self.global_step
        if self.env.is_main:
            plot_loss(self.metrics.records, self.out / LOSS_PLOT, title=f"fleet_ext pretraining: {self.out.name}")
        self.log(f"saved {path}")
        return path

    def resume(self, path: Path) -> None:
        state = ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.env)
        t = self.config.training
        now = {
            "max_seq_len": t.max_seq_len,
            "train_dataset_path": t.train_dataset_path,
            "seed": t.seed,
            "global_batch_size": self.order.global_batch,
        }
        for key, value in now.items():
            if state.get(key) != value:
                self.log(
                    f"warning: {key} was {state.get(key)!r} in {path.name}, now {value!r}: training continues from "
                    f"sample {state['consumed_samples']} of the new order, not as the original run would have"
                )
        self.global_step = int(state["global_step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.last_saved_step = self.global_step
        self.last_eval = state.get("last_eval", {})
        if not state["rng_restored"]:
            self.log(
                f"note: {path.name} was saved by {state.get('world_size')} process(es), this run has "
                f"{self.env.world_size}: RNG states keep this run's per-rank seeds"
            )
        self.log(f"resumed from {path} at step {self.global_step} ({self.consumed_samples} samples consumed)")

    # -- the loop ------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Resume if asked, print the start-up table, run up to ``max_steps``; return the run's summary."""
        t = self.config.training
        self._prepare_run()
        launches_before = collections.Counter(LAUNCH_COUNTS)
        first_loss = last_loss = None
        tokens_per_step = self.order.global_batch * t.max_seq_len
        start_step = self.global_step
        if start_step >= t.max_steps:
            self.log(f"nothing to train: step {start_step} >= max_steps {t.max_steps}")
        self._bar = self._progress_bar(start_step)
        run_start = window_start = time.perf_counter()
        compute_time, window_steps = 0.0, 0
        try:
            for step in range(start_step + 1, t.max_steps + 1):
                step_start = time.perf_counter()
                out = self.train_step(step)
                now = time.perf_counter()
                compute_time += now - step_start
                window_steps += 1
                first_loss = out["loss"] if first_loss is None else first_loss
                last_loss = out["loss"]
                tokens_per_sec = window_steps * tokens_per_step / max(now - window_start, 1e-9)
                if self._bar is not None:
                    postfix = {"loss": f"{out['loss']:.4f}", "lr": f"{out['lr']:.2e}"}
                    self._bar.set_postfix({**postfix, "tok/s": f"{tokens_per_sec:,.0f}"}, refresh=False)
                    self._bar.update(1)
                if step % t.logging_steps == 0 or step == t.max_steps:
                    self._write_step_metrics(step, out, tokens_per_sec, now - run_start)
                    window_start, window_steps = time.perf_counter(), 0
                extra_start = time.perf_counter()  # evaluation and saving do not count towards tokens/s
                self._evaluate_and_save(step)
                window_start += time.perf_counter() - extra_start
        finally:
            if self._bar is not None:
                self._bar.close()
            self._bar = None
        steps_run = self.global_step - start_step
        launches = collections.Counter(LAUNCH_COUNTS) - launches_before  # this run's, not the process's
        if steps_run and launches:  # which fused kernels this rank ran: proof a switch really took effect
            self.metrics.write({"step": self.global_step, "kernel_launches": dict(sorted(launches.items()))})
        summary = {
            "steps": steps_run,
            "global_step": self.global_step,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "tokens_per_sec": steps_run * tokens_per_step / compute_time if compute_time else None,
            "checkpoint": str(self.out / f"{ckpt.CHECKPOINT_PREFIX}{self.last_saved_step}")
            if self.last_saved_step is not None
            else None,
            **self.last_eval,
        }
        if self.env.is_main and self.metrics.records:
            plot_loss(self.metrics.records, self.out / LOSS_PLOT, title=f"fleet_ext pretraining: {self.out.name}")
        return summary

    def _prepare_run(self) -> str | None:
        """Agree on the checkpoint to resume from, clear partial saves, print the start-up table, resume."""
        t, env = self.config.training, self.env
        resume_path = ckpt.resolve_resume(t.resume_from_checkpoint, self.out)
        resume_path = env.agree(str(resume_path) if resume_path else None, "the checkpoint to resume from")
        if env.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            removed = ckpt.remove_partial_checkpoints(self.out)
            if removed:
                self.log(f"removed partial checkpoint(s) left by an interrupted save: {', '.join(removed)}")
        env.barrier()
        device = paddle.get_device()
        self.log(
            startup_table(self.config, self.model, env, self.data, self.no_decay, resume_path, self.precision, device)
        )
        if resume_path:
            self.resume(Path(resume_path))
        self._set_aux_loss_scales()
        self.metrics.start(self.global_step if resume_path else None)
        return resume_path

    def _progress_bar(self, start_step: int) -> Any:
        """A tqdm bar on rank 0 (None elsewhere, with ``disable_tqdm``, or with nothing left to train)."""
        t = self.config.training
        if not self.env.is_main or t.disable_tqdm or start_step >= t.max_steps:
            return None
        from tqdm import tqdm

        return tqdm(total=t.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                    mininterval=0.5, file=sys.stderr)

    def _write_step_metrics(self, step: int, out: dict[str, float], tokens_per_sec: float, elapsed: float) -> None:
        t = self.config.training
        self.metrics.write(
            {
                "step": step,
                "loss": out["loss"],
                "lr": out["lr"],
                "grad_norm": out["grad_norm"],
                **{k: v for k, v in out.items() if k not in ("loss", "lr", "grad_norm")},
                "tokens_per_sec": tokens_per_sec,
                "tokens": self.consumed_samples * t.max_seq_len,
                "epoch": self.order.epoch(self.consumed_samples),
                "elapsed_s": elapsed,
            }
        )

    def _evaluate_and_save(self, step: int) -> None:
        """Held-out evaluation every ``eval_steps`` and a checkpoint every ``save_steps`` (both at the end)."""
        t = self.config.training
        is_last = step == t.max_steps
        if t.eval_iters and ((t.eval_steps and step % t.eval_steps == 0) or is_last):
            result = self.evaluate()
            self.metrics.write({"step": step, **result})
            self.log(f"step {step}: held-out loss {result['eval_loss']:.4f}, perplexity {result['eval_ppl']:.2f}")
        if (t.save_steps and step % t.save_steps == 0) or is_last:
            self.save()
