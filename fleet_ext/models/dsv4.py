"""DSv4 causal LM: embedding, decoder layers per ``csa_compress_ratios``, mHC head, final norm, LM head."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import paddle

from fleet_ext.config import FleetExtConfig, load_config, recompute_plan
from fleet_ext.framework.aux_loss import AuxLossAutoScaler
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.framework.spec import build_layer
from fleet_ext.layers.mhc import HyperHead
from fleet_ext.layers.norm import RMSNorm
from fleet_ext.models.mtp import MultiTokenPredictionLayer, shifted
from fleet_ext.parallel.cp_collectives import ContextParallelGroup, gather_sequence
from fleet_ext.parallel.expert_parallel import ExpertParallelGroup
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import checkpointed
from fleet_ext.specs.backend import BackendProvider
from fleet_ext.specs.layer_specs import decoder_layer_spec

IGNORE_INDEX = -100


class DSv4ForCausalLM(FleetLayer):
    """``model(input_ids)`` -> logits [b, s, vocab]; ``model(input_ids, labels)`` -> (logits, loss).

    ``labels`` are aligned with the inputs (Megatron convention: ``labels[:, t]`` is the token that
    follows position t); entries equal to -100 are ignored by the mean cross-entropy.

    Context parallelism (:meth:`use_context_parallel`): each rank of the group is given its contiguous chunk of
    every sequence (``input_ids`` [b, S / cp]) and returns its chunk's logits and the loss of the *whole*
    sequences, the same value on every rank of the group; each rank's backward of it yields its chunk's share of
    the gradients (summed over the group by the trainer's reduction).
    """

    def __init__(self, config: FleetExtConfig | dict | str | os.PathLike) -> None:
        super().__init__()
        if not isinstance(config, FleetExtConfig):
            config = load_config(config)
        self.config = config
        m = config.model
        self.backend = BackendProvider(config)
        std = paddle.nn.initializer.Normal(0.0, m.init_method_std)
        self.word_embeddings = paddle.nn.Embedding(m.vocab_size, m.hidden_size, weight_attr=std)
        self.layers = paddle.nn.LayerList(
            [build_layer(decoder_layer_spec(config, i, self.backend), config) for i in range(m.num_hidden_layers)]
        )
        # Full recompute: chunks of layers re-run in the backward; every other layer is its own chunk.
        plan = recompute_plan(config)
        self._recompute_chunks = frozenset(plan.chunks)
        # Under uniform full recompute each MTP depth is one more unit (as Megatron-core's MTP layers); ``block``
        # names the first recompute_num_layers layers only, and the depths come after the backbone.
        self._recompute_mtp = plan.granularity == "full" and config.recompute.recompute_method == "uniform"
        covered = {i for chunk in self._recompute_chunks for i in chunk}
        singles = [(i,) for i in range(m.num_hidden_layers) if i not in covered]
        self._layer_chunks = sorted([*self._recompute_chunks, *singles])
        self.mhc_head = HyperHead(m, self.backend.mhc_ops) if m.enable_hyper_connections else None
        self.final_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.output_layer = (
            None
            if m.tie_word_embeddings
            else paddle.nn.Linear(m.hidden_size, m.vocab_size, weight_attr=std, bias_attr=False)
        )
        self.cp_group: ContextParallelGroup | None = None
        self._expert_shards: dict[str, tuple] = {}  # structured name -> (local shape, global shape, offset)
        depths = range(1, m.num_nextn_predict_layers + 1)
        mtp = [MultiTokenPredictionLayer(config, k, self.backend) for k in depths]
        self.mtp_layers = paddle.nn.LayerList(mtp) if mtp else None
        self.mtp_loss: paddle.Tensor | None = None  # detached, mean over depths, before mtp_loss_scaling_factor
        self._aux_loss_backward_scale = 1.0
        if m.train_indexer_only:
            self.freeze_for_indexer_warmup()

    def use_context_parallel(self, group: ContextParallelGroup | None) -> None:
        """Split every sequence over ``group`` (None: this rank holds whole sequences). Each rank then passes
        only its chunk of the tokens: rank r of cp the r-th of cp equal contiguous chunks."""
        if group is not None and group.size != self.config.parallel.context_parallel_size:
            raise ValueError(
                f"DSv4ForCausalLM.use_context_parallel: the group has {group.size} ranks but the config key "
                f"`context_parallel_size` is {self.config.parallel.context_parallel_size}"
            )
        self.cp_group = group if group is not None and group.size > 1 else None

    def use_expert_parallel(self, group: ExpertParallelGroup | None) -> None:
        """Keep only this rank's routed experts of every MoE layer (``group``: its expert group; None: all of them).
        Call after the weights are final on every rank (the slices are taken from them) and before building the
        optimizer. The checkpoint keeps the stock names with each shard's global shape and offset."""
        from fleet_ext.layers.moe import GroupedExperts

        ep = self.config.parallel.expert_model_parallel_size
        if group is None or group.size == 1:
            return
        if group.size != ep:
            raise ValueError(
                f"DSv4ForCausalLM.use_expert_parallel: the group has {group.size} ranks but the config key "
                f"`expert_model_parallel_size` is {ep}"
            )
        for prefix, sub in self.named_sublayers():
            if isinstance(sub, GroupedExperts):
                sub.shard(group)
                for name in ("weight1", "weight2"):
                    local = getattr(sub, name)
                    shape = (sub.num_experts, *local.shape[1:])
                    offset = (sub.first_expert, *(0 for _ in local.shape[1:]))
                    self._expert_shards[f"{prefix}.{name}"] = (tuple(local.shape), shape, offset)

    def expert_parameters(self) -> list[paddle.Tensor]:
        """The expert shards (reduced over the expert-data-parallel group only); empty without expert parallelism."""
        named = dict(self.named_parameters())
        return [named[name] for name in self._expert_shards if name in named]

    def _shard_of(self, name: str, tensor: paddle.Tensor) -> tuple[tuple, tuple, tuple]:
        """Expert shards: their local shape, the stacked global shape and the first local expert's offset."""
        shard = getattr(self, "_expert_shards", {}).get(name)
        return shard if shard is not None else super()._shard_of(name, tensor)

    # -- indexer training: CSA lightning indexers and the -2 layers' DSA indexers --------------------------
    def freeze_for_indexer_warmup(self) -> list[str]:
        """Indexer warm-up (``train_indexer_only``): every parameter but the indexers (CSA layers' lightning
        indexers with their own compressors, -2 layers' DSA indexers) gets ``stop_gradient = True`` (no gradient,
        so the optimizer leaves it alone). Returns the trainable names."""
        from fleet_ext.layers.csa_indexer import CSAIndexer
        from fleet_ext.layers.dsa_indexer import DSAIndexer

        for param in self.parameters():
            param.stop_gradient = True
        trainable = []
        for prefix, sub in self.named_sublayers():
            if isinstance(sub, (CSAIndexer, DSAIndexer)):
                for name, param in sub.named_parameters(prefix=prefix):
                    param.stop_gradient = False
                    trainable.append(name)
        return trainable

    def indexer_losses(self) -> dict[int, paddle.Tensor]:
        """{layer number: detached indexer KL (before ``dsa_indexer_loss_coeff``)} of the last training forward,
        for the CSA and -2 layers that computed one; the trainer logs them (their mean as ``indexer_loss``)."""
        out = {}
        for i, layer in enumerate(self.layers):
            loss = getattr(layer.self_attention, "indexer_loss", None)
            if loss is not None:
                out[i] = loss
        return out

    def indexer_layers(self) -> dict[str, list[int]]:
        """The layers whose indexer the KL trains when ``dsa_indexer_loss_coeff > 0``, by kind: ``csa`` (a
        lightning indexer: CSA without ``csa_dense_mode``) and ``mla`` (-2 layers under ``mqa_dsa``)."""
        from fleet_ext.layer_kinds import LayerKind, layer_attention

        kinds = {LayerKind.CSA: "csa", LayerKind.HYBRID_MLA: "mla"}
        out: dict[str, list[int]] = {"csa": [], "mla": []}
        for i, layer in enumerate(self.layers):
            kind = kinds.get(layer_attention(self.config.model, i).kind)
            core = getattr(layer.self_attention, "core_attention", None)
            if kind is not None and getattr(core, "indexer", None) is not None:
                out[kind].append(i)
        return out

    def indexer_losses_by_kind(self) -> dict[str, dict[int, paddle.Tensor]]:
        """``indexer_losses()`` split by layer kind (keys of ``indexer_layers()``): {kind: {layer: KL}}."""
        losses = self.indexer_losses()
        return {kind: {i: losses[i] for i in layers if i in losses} for kind, layers in self.indexer_layers().items()}

    # -- auxiliary losses and MoE statistics: what the trainer reads, without reaching into layers ----------
    def moe_layers(self) -> list[paddle.nn.Layer]:
        """The MoE layers, in order (their ``tokens_per_expert`` and ``update_expert_bias`` drive balancing)."""
        from fleet_ext.layers.moe import MoELayer

        decoders = [*self.layers, *(mtp.decoder for mtp in self.mtp_layers or [])]
        return [layer.mlp for layer in decoders if isinstance(layer.mlp, MoELayer)]

    def auxiliary_losses(self) -> dict[str, paddle.Tensor]:
        """Detached sums over layers of the last training forward's auxiliary losses, for the metrics:
        ``moe_aux_loss`` (sequence-wise aux loss), ``indexer_loss`` (indexer KL before its coefficient; also split
        as ``indexer_loss_csa`` / ``indexer_loss_mla`` by layer kind) and ``mtp_loss`` (the MTP depths' mean
        cross-entropy before ``mtp_loss_scaling_factor``).

        All already reach the gradients inside the model through their auto-scalers; each sum is a [1] fp32
        tensor (zero when no layer computed one), so the trainer can reduce them with the LM loss in one call.
        """
        moe = [layer.aux_loss for layer in self.moe_layers() if layer.aux_loss is not None]
        indexer = list(self.indexer_losses().values())
        by_kind = {f"indexer_loss_{kind}": list(v.values()) for kind, v in self.indexer_losses_by_kind().items()}
        mtp = [self.mtp_loss] if self.mtp_loss is not None else []
        groups = {"moe_aux_loss": moe, "indexer_loss": indexer, **by_kind, "mtp_loss": mtp}
        return {
            name: paddle.add_n([x.astype("float32").reshape([1]) for x in group]) if group
            else paddle.zeros([1], "float32")
            for name, group in groups.items()
        }

    def set_aux_loss_backward_scale(self, scale: float) -> None:
        """Gradient scale of every auxiliary loss (MoE aux loss, DSA indexer KL, MTP): the main loss's backward
        scale (Megatron's ``main_loss_backward_scale``). Held by each layer instance, not by a global."""
        self._aux_loss_backward_scale = float(scale)  # the MTP loss's
        for layer in self.sublayers():
            if hasattr(layer, "set_aux_loss_backward_scale"):
                layer.set_aux_loss_backward_scale(scale)

    def _check_ids(self, name: str, ids: paddle.Tensor | None, shape: list[int] | None = None) -> None:
        if ids is None:
            return
        if not isinstance(ids, paddle.Tensor) or ids.ndim != 2 or ids.dtype not in (paddle.int32, paddle.int64):
            got = f"{ids.dtype} {ids.shape}" if isinstance(ids, paddle.Tensor) else type(ids).__name__
            raise ValueError(f"DSv4ForCausalLM: `{name}` must be an int32/int64 tensor [batch, seq], got {got}")
        if shape is not None and list(ids.shape) != shape:
            raise ValueError(f"DSv4ForCausalLM: `{name}` must have the shape of `input_ids` {shape}, got {ids.shape}")

    def _id_range_error(self, low: int, high: int) -> ValueError:
        vocab = self.config.model.vocab_size
        return ValueError(f"DSv4ForCausalLM: `input_ids` must lie in [0, {vocab}), got [{low}, {high}]")

    def _host_ids(self, name: str, ids: Any) -> Any:
        """Host (NumPy) ids: range-checked here, where reading them costs no device round trip, then copied to the
        device; anything else is returned as given."""
        if not isinstance(ids, np.ndarray):
            return ids
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            got = f"{ids.dtype} {ids.shape}"
            raise ValueError(f"DSv4ForCausalLM: `{name}` must be an integer array [batch, seq], got {got}")
        if name == "input_ids" and ids.size and (ids.min() < 0 or ids.max() >= self.config.model.vocab_size):
            raise self._id_range_error(int(ids.min()), int(ids.max()))
        return paddle.to_tensor(ids if ids.dtype in (np.int32, np.int64) else ids.astype(np.int64))

    def _embed(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        """Token embeddings; device ids are range-checked by the lookup itself, with no host round trip: Paddle's
        GPU kernel asserts ``0 <= id < vocab`` on the device (raised at the next synchronisation), the CPU kernel
        raises at once. Negative ids are sent to ``vocab`` first, as the CPU kernel takes -1 for "no padding row"
        and would return uninitialised memory instead of raising."""
        vocab = self.config.model.vocab_size
        ids = paddle.where(input_ids < 0, paddle.full_like(input_ids, vocab), input_ids)
        try:
            return self.word_embeddings(ids)
        except ValueError as error:  # the CPU lookup refused an id: name the tensor, the range and what was given
            low, high = int(input_ids.min()), int(input_ids.max())
            if 0 <= low and high < vocab:
                raise
            raise self._id_range_error(low, high) from error

    def _run_layers(
        self, hidden: paddle.Tensor, input_ids: paddle.Tensor, layout: SequenceLayout, chunk: tuple[int, ...]
    ) -> paddle.Tensor:
        for index in chunk:
            hidden = self.layers[index](hidden, input_ids=input_ids, layout=layout)
        return hidden

    def sequence_layout(self, seq_len: int) -> SequenceLayout:
        """The positions this rank's ``seq_len`` tokens hold, built once per forward and handed to every layer:
        the whole sequence, or under context parallelism this rank's chunk of ``seq_len x cp`` positions."""
        if self.cp_group is None:
            return SequenceLayout.whole(seq_len)
        cp = self.cp_group
        return SequenceLayout.contiguous_shard(seq_len * cp.size, cp.size, cp.rank, cp)

    def forward(self, input_ids: paddle.Tensor | np.ndarray, labels: paddle.Tensor | np.ndarray | None = None) -> Any:
        input_ids, labels = self._host_ids("input_ids", input_ids), self._host_ids("labels", labels)
        self._check_ids("input_ids", input_ids)
        self._check_ids("labels", labels, list(input_ids.shape))
        hidden = self._embed(input_ids)
        if self.mhc_head is not None:
            n_streams = self.config.model.num_residual_streams
            hidden = hidden.unsqueeze(2).expand([*hidden.shape[:2], n_streams, hidden.shape[-1]])
        layout = self.sequence_layout(input_ids.shape[1])
        for chunk in self._layer_chunks:
            if chunk in self._recompute_chunks:  # full recompute: keep the chunk's input only
                hidden = checkpointed(self._run_layers, hidden, input_ids, layout, chunk)
            else:
                hidden = self._run_layers(hidden, input_ids, layout, chunk)
        streams = hidden  # the MTP depths start from the residual streams, before the mHC head
        if self.mhc_head is not None:
            hidden = self.mhc_head(hidden)
        logits = self._lm_head(self.final_layernorm(hidden))
        if labels is None:
            return logits
        if self.mtp_layers is not None and self.training and paddle.is_grad_enabled():
            mtp = self._mtp_loss(streams, input_ids, labels, layout)
            weight = self.config.model.mtp_loss_scaling_factor
            logits = AuxLossAutoScaler.apply(logits, mtp * weight, self._aux_loss_backward_scale)
        return logits, self._mean_token_loss(logits, labels, layout)

    def _lm_head(self, normed: paddle.Tensor) -> paddle.Tensor:
        """The LM head (the embedding's transpose when tied), shared by the MTP depths."""
        if self.output_layer is None:
            return paddle.matmul(normed, self.word_embeddings.weight, transpose_y=True)
        return self.output_layer(normed)

    def _mtp_loss(
        self, streams: paddle.Tensor, input_ids: paddle.Tensor, labels: paddle.Tensor, layout: SequenceLayout
    ) -> paddle.Tensor:
        """Mean over the MTP depths of each depth's mean token loss (``fleet_ext.models.mtp``); the detached value
        is kept for the metrics (``mtp_loss``). Under uniform full recompute each depth (projections, decoder layer,
        its mHC head and norm) re-runs in the backward from its inputs, its routing and indexer picks replayed."""
        hidden, losses = streams, []
        for mtp in self.mtp_layers:
            ids_ahead = shifted(input_ids, mtp.depth)
            if self._recompute_mtp:  # keep the depth's inputs only; the shared LM head and the loss stay outside
                hidden, normed = checkpointed(mtp, hidden, ids_ahead, self.word_embeddings, layout)
            else:
                hidden, normed = mtp(hidden, ids_ahead, self.word_embeddings, layout)
            labels_ahead = shifted(labels, mtp.depth, IGNORE_INDEX)
            losses.append(self._mean_token_loss(self._lm_head(normed), labels_ahead, layout))
        loss = paddle.add_n(losses) / len(losses)
        self.mtp_loss = loss.detach()
        return loss

    def _mean_token_loss(self, logits: paddle.Tensor, labels: paddle.Tensor, layout: SequenceLayout) -> paddle.Tensor:
        """Mean cross-entropy over the kept tokens of the whole sequences.

        Under context parallelism the per-token losses and the kept flags of every rank's chunk are all-gathered
        (``b x S`` numbers) and reduced exactly as one process reduces the whole sequence; the gradient of the
        gathered losses is sliced back (every rank computes the same loss)."""
        batch, seq, vocab = logits.shape
        flat_labels = labels.reshape([-1]).astype("int64")
        per_token = paddle.nn.functional.cross_entropy(
            logits.reshape([-1, vocab]).astype("float32"), flat_labels, ignore_index=IGNORE_INDEX, reduction="none"
        )
        # Paddle's reduction="mean" divides by every position, ignored ones included; average over kept tokens.
        kept = (flat_labels != IGNORE_INDEX).astype("float32")
        if layout.cp_size > 1:
            per_token = gather_sequence(per_token.reshape([batch, seq]), layout, backward="slice")
            kept = gather_sequence(kept.reshape([batch, seq]), layout, backward="slice")
        return per_token.reshape([-1]).sum() / paddle.clip(kept.sum(), min=1.0)

    # -- Hugging Face interop -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides: Any) -> DSv4ForCausalLM:
        """Load a transformers DeepSeek-V4 or DeepSeek-V3.2 (all layers -2) checkpoint directory (config.json +
        *.safetensors); ``overrides`` are config keys applied on top of the directory's."""
        from fleet_ext.models.hf_dsv4 import load_hf_checkpoint

        return load_hf_checkpoint(cls, path, **overrides)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write a directory that transformers loads: ``DeepseekV32ForCausalLM`` when every layer is -2,
        ``DeepseekV4ForCausalLM`` otherwise."""
        from fleet_ext.models.hf_dsv4 import save_hf_checkpoint

        save_hf_checkpoint(self, path)
