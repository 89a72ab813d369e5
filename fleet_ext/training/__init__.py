"""fleet_ext.training: the pretraining job (no Paddle import here; see DESIGN.md).

- ``cli``: ``scripts/pretrain.py``'s command line (``--config`` + ``--key value`` overrides, exit codes).
- ``trainer``: ``Trainer(config).train()``, the data-parallel loop (accumulation, clipping, AdamW, MoE bias
  updates, evaluation, checkpoints, metrics).
- ``data``: byte tokenizer, memory-mapped token files, the built-in corpus, packing, the sample order.
- ``optim``: AdamW with the no-decay rule, warmup + cosine/linear schedule, global-norm clipping.
- ``distributed``: process group, coalesced gradient all-reduce, broadcasts (gloo-safe collectives only).
- ``checkpoint``: FlexCheckpoint save (atomic), resume resolution, the local (no-reshard) loader.
- ``metrics``: metrics.jsonl and loss.png; ``summary``: the start-up table; ``faults``: test fault injection.
"""
