"""DSv4 causal LM: embedding, decoder layers per ``csa_compress_ratios``, mHC head, final norm, LM head."""

from __future__ import annotations

import os
from typing import Any

import paddle

from fleet_ext.config import FleetExtConfig, load_config, recompute_plan
from fleet_ext.framework.layer import FleetLayer
from fleet_ext.framework.spec import build_layer
from fleet_ext.layers.mhc import HyperHead
from fleet_ext.layers.norm import RMSNorm
from fleet_ext.parallel.layout import SequenceLayout
from fleet_ext.parallel.recompute import checkpointed
from fleet_ext.specs.backend import BackendProvider
from fleet_ext.specs.layer_specs import decoder_layer_spec

IGNORE_INDEX = -100


class DSv4ForCausalLM(FleetLayer):
    """``model(input_ids)`` -> logits [b, s, vocab]; ``model(input_ids, labels)`` -> (logits, loss).

    ``labels`` are aligned with the inputs (Megatron convention: ``labels[:, t]`` is the token that
    follows position t); entries equal to -100 are ignored by the mean cross-entropy.
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
        self._recompute_chunks = frozenset(recompute_plan(config).chunks)
        covered = {i for chunk in self._recompute_chunks for i in chunk}
        singles = [(i,) for i in range(m.num_hidden_layers) if i not in covered]
        self._layer_chunks = sorted([*self._recompute_chunks, *singles])
        self.mhc_head = HyperHead(m) if m.enable_hyper_connections else None
        self.final_layernorm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.output_layer = (
            None
            if m.tie_word_embeddings
            else paddle.nn.Linear(m.hidden_size, m.vocab_size, weight_attr=std, bias_attr=False)
        )
        if m.train_indexer_only:
            self.freeze_for_indexer_warmup()

    # -- -2 layers: DSA indexer training --------------------------------------------------------------
    def freeze_for_indexer_warmup(self) -> list[str]:
        """Indexer warm-up (``train_indexer_only``): every parameter but the -2 layers' DSA indexers gets
        ``stop_gradient = True`` (no gradient, so the optimizer leaves it alone). Returns the trainable names."""
        from fleet_ext.layers.dsa_indexer import DSAIndexer

        for param in self.parameters():
            param.stop_gradient = True
        trainable = []
        for prefix, sub in self.named_sublayers():
            if isinstance(sub, DSAIndexer):
                for name, param in sub.named_parameters(prefix=prefix):
                    param.stop_gradient = False
                    trainable.append(name)
        return trainable

    def indexer_losses(self) -> dict[int, paddle.Tensor]:
        """{layer number: detached DSA indexer KL (before ``dsa_indexer_loss_coeff``)} of the last training
        forward, for the -2 layers that computed one; the trainer logs them (e.g. their mean as ``indexer_loss``)."""
        out = {}
        for i, layer in enumerate(self.layers):
            loss = getattr(layer.self_attention, "indexer_loss", None)
            if loss is not None:
                out[i] = loss
        return out

    # -- auxiliary losses and MoE statistics: what the trainer reads, without reaching into layers ----------
    def moe_layers(self) -> list[paddle.nn.Layer]:
        """The MoE layers, in order (their ``tokens_per_expert`` and ``update_expert_bias`` drive balancing)."""
        from fleet_ext.layers.moe import MoELayer

        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoELayer)]

    def auxiliary_losses(self) -> dict[str, paddle.Tensor]:
        """Detached sums over layers of the last training forward's auxiliary losses, for the metrics:
        ``moe_aux_loss`` (sequence-wise aux loss) and ``indexer_loss`` (DSA indexer KL before its coefficient).

        Both already reach the gradients inside the model through their auto-scalers; each sum is a [1] fp32
        tensor (zero when no layer computed one), so the trainer can reduce them with the LM loss in one call.
        """
        moe = [layer.aux_loss for layer in self.moe_layers() if layer.aux_loss is not None]
        indexer = list(self.indexer_losses().values())
        return {
            name: paddle.add_n([x.astype("float32").reshape([1]) for x in group]) if group
            else paddle.zeros([1], "float32")
            for name, group in (("moe_aux_loss", moe), ("indexer_loss", indexer))
        }

    def set_aux_loss_backward_scale(self, scale: float) -> None:
        """Gradient scale of every auxiliary loss (MoE aux loss, DSA indexer KL): the main loss's backward
        scale (Megatron's ``main_loss_backward_scale``). Held by each layer instance, not by a global."""
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

    def _run_layers(
        self, hidden: paddle.Tensor, input_ids: paddle.Tensor, layout: SequenceLayout, chunk: tuple[int, ...]
    ) -> paddle.Tensor:
        for index in chunk:
            hidden = self.layers[index](hidden, input_ids=input_ids, layout=layout)
        return hidden

    def sequence_layout(self, seq_len: int) -> SequenceLayout:
        """The positions this rank's ``seq_len`` tokens hold, built once per forward and handed to every layer.

        Without context parallelism (the only layout built so far) a rank holds the whole sequence.
        """
        return SequenceLayout.whole(seq_len)

    def forward(self, input_ids: paddle.Tensor, labels: paddle.Tensor | None = None) -> Any:
        self._check_ids("input_ids", input_ids)
        self._check_ids("labels", labels, list(input_ids.shape))
        vocab = self.config.model.vocab_size
        # One device-to-host transfer for both bounds (the range check syncs once per forward, not four times).
        low, high = paddle.stack([input_ids.min(), input_ids.max()]).numpy().tolist()
        if high >= vocab or low < 0:
            raise ValueError(f"DSv4ForCausalLM: `input_ids` must lie in [0, {vocab}), got [{low}, {high}]")
        hidden = self.word_embeddings(input_ids)
        if self.mhc_head is not None:
            streams = self.config.model.num_residual_streams
            hidden = hidden.unsqueeze(2).expand([*hidden.shape[:2], streams, hidden.shape[-1]])
        layout = self.sequence_layout(input_ids.shape[1])
        for chunk in self._layer_chunks:
            if chunk in self._recompute_chunks:  # full recompute: keep the chunk's input only
                hidden = checkpointed(self._run_layers, hidden, input_ids, layout, chunk)
            else:
                hidden = self._run_layers(hidden, input_ids, layout, chunk)
        if self.mhc_head is not None:
            hidden = self.mhc_head(hidden)
        hidden = self.final_layernorm(hidden)
        if self.output_layer is None:
            logits = paddle.matmul(hidden, self.word_embeddings.weight, transpose_y=True)
        else:
            logits = self.output_layer(hidden)
        if labels is None:
            return logits
        flat_labels = labels.reshape([-1]).astype("int64")
        per_token = paddle.nn.functional.cross_entropy(
            logits.reshape([-1, vocab]).astype("float32"), flat_labels, ignore_index=IGNORE_INDEX, reduction="none"
        )
        # Paddle's reduction="mean" divides by every position, ignored ones included; average over kept tokens.
        kept = (flat_labels != IGNORE_INDEX).astype("float32")
        loss = per_token.reshape([-1]).sum() / paddle.clip(kept.sum(), min=1.0)
        return logits, loss

    # -- Hugging Face interop -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides: Any) -> DSv4ForCausalLM:
        """Load a transformers DeepSeek-V4 checkpoint directory (config.json + *.safetensors)."""
        from fleet_ext.models.hf_dsv4 import load_hf_checkpoint

        return load_hf_checkpoint(cls, path, **overrides)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write a directory that ``transformers.DeepseekV4ForCausalLM.from_pretrained`` loads."""
        from fleet_ext.models.hf_dsv4 import save_hf_checkpoint

        save_hf_checkpoint(self, path)
