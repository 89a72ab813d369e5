"""Context parallelism, measured: bytes each rank sends per layer (counted and by formula) and activations saved.

Two modes::

    # On paper: the formula at DeepSeek-V4-Flash shapes (configs/dsv4_flash_gpu.yaml), s = 65,536, cp 4 and 8
    python scripts/bench/context_parallel.py formula

    # Counted, under a launch of cp processes (1, 2, 4): per-layer bytes sent by rank 0 in the forward against
    # the formula, and the bytes autograd saves for the backward on rank 0 (saved_tensors_hooks)
    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        scripts/bench/context_parallel.py measure --seq 512

What a rank sends in the forward (``e`` bytes per activation, ``b`` sequences, chunk ``c = S / cp`` tokens, K = V
width ``d``, window ``W``, compression rate ``r``, CSA indexer width ``d_I``; interior rank, i.e. every rank but
the last, which has no next rank to feed):

- window, CSA, HCA layers: the window halo, ``(W - 1) d b e`` to the next rank;
- CSA adds the compressor halo (the previous block's projected first half: ``r d`` kv values of ``e`` bytes and
  ``r d`` fp32 scores, and the same for the indexer's compressor at ``d_I``) and the all-gather of its compressed
  entries and indexer keys, ``(cp - 1) (c / r) (d + d_I) b e``; HCA the all-gather of its entries at ``d``;
- full-causal ``-1`` layers: the all-gather of K = V, ``(cp - 1) c d b e``; ``-2`` layers the latent key
  ``(cp - 1) c (L + r_pe) b e`` and the DSA indexer keys (fp32);
- the loss: every rank's per-token losses and kept flags (fp32), ``2 (cp - 1) c b 4``; MoE sequence aux loss and
  the KL's kept-row count: a few numbers per layer.
PaddleFleet instead all-gathers the raw KV of CSA / HCA layers, at least ``(cp - 1) c d b e`` per layer.
The backward sends the matching gradients back (the halo's, and a reduce-scatter of each gathered tensor's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fleet_ext.layer_kinds import LayerKind, layer_attention  # noqa: E402


def layer_forward_bytes(model, layer: int, seq: int, cp: int, batch: int = 1, e: int = 2, csa_dense: bool = False
                        ) -> int:
    """Bytes an interior rank sends in the forward of ``layer`` (see the module docstring)."""
    if cp == 1:
        return 0
    a = layer_attention(model, layer)
    c, d, d_i = seq // cp, model.v_head_dim, model.dsa_index_head_dim
    if a.kind is LayerKind.FULL_CAUSAL:
        return (cp - 1) * c * d * batch * e
    if a.kind is LayerKind.HYBRID_MLA:
        latent = model.hybrid_mla_kv_lora_rank + model.hybrid_mla_qk_rope_head_dim
        indexer = model.dsa_index_head_dim * 4 if model.hybrid_mla_attention == "mqa_dsa" else 0
        return (cp - 1) * c * (latent * e + indexer) * batch
    total = (min(a.window, seq) - 1) * d * batch * e
    if a.kind is LayerKind.CSA:
        widths = [d] if csa_dense else [d, d_i]
        total += sum(a.compress_ratio * w * (e + 4) * batch for w in widths)  # compressor halos: kv + fp32 score
        total += sum((cp - 1) * (c // a.compress_ratio) * w * batch * e for w in widths)
    elif a.kind is LayerKind.HCA:
        total += (cp - 1) * (c // a.compress_ratio) * d * batch * e
    return total


def raw_kv_gather_bytes(model, seq: int, cp: int, batch: int = 1, e: int = 2) -> int:
    """What all-gathering the raw KV (PaddleFleet's CSA / HCA route) sends per layer, at the least."""
    return (cp - 1) * (seq // cp) * model.v_head_dim * batch * e


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def formula_table(seq: int = 65536, cps: tuple[int, ...] = (4, 8)) -> str:
    from fleet_ext.config import load_config

    model = load_config(ROOT / "configs" / "dsv4_flash_gpu.yaml").model
    kinds = {}
    for i in range(model.num_hidden_layers):
        kinds.setdefault(layer_attention(model, i).kind, i)
    rows = [f"DeepSeek-V4-Flash widths, s = {seq:,}, batch 1, bf16 activations: MiB sent per interior rank per "
            "layer in the forward (the backward sends the matching gradients)", "",
            "| cp | layer kind | halo + gathers (this design) | all-gather of the raw KV (at least) | ratio |",
            "|---|---|---|---|---|"]
    for cp in cps:
        for kind, layer in kinds.items():
            ours = layer_forward_bytes(model, layer, seq, cp)
            raw = raw_kv_gather_bytes(model, seq, cp)
            rows.append(f"| {cp} | {kind.value} | {_mib(ours)} | {_mib(raw)} | {ours / raw:.3f} |")
        whole = sum(layer_forward_bytes(model, i, seq, cp) for i in range(model.num_hidden_layers))
        raw = raw_kv_gather_bytes(model, seq, cp) * model.num_hidden_layers
        layers = f"all {model.num_hidden_layers} layers"
        rows.append(f"| {cp} | {layers} | {_mib(whole)} | {_mib(raw)} | {whole / raw:.3f} |")
    return "\n".join(rows)


def measure(seq: int, batch: int) -> str:
    """Counted per-layer bytes (rank 0, forward) against the formula, and saved activation bytes on rank 0."""
    import numpy as np
    import paddle

    from fleet_ext.config import load_config
    from fleet_ext.models import DSv4ForCausalLM
    from fleet_ext.parallel.cp_collectives import COMM_BYTES
    from fleet_ext.parallel.distributed import ParallelTopology, init_distributed

    env = init_distributed()
    cp = env.world_size
    overrides = {"context_parallel_size": cp, "max_seq_len": seq, "hca_compress_ratio": 16,
                 "csa_compress_ratios": [0, 4, 128, -1], "moe_router_load_balancing_type": "seq_aux_loss"}
    config = load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml", **overrides)
    topology = ParallelTopology.build(env, cp)
    paddle.seed(0)
    model = DSv4ForCausalLM(config)
    model.use_context_parallel(topology.cp_group)
    per_layer: dict[int, int] = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda *_: COMM_BYTES.clear())
        layer.register_forward_post_hook(lambda *_, i=i: per_layer.__setitem__(i, sum(COMM_BYTES.values())))
    ids = np.random.default_rng(0).integers(1, config.model.vocab_size, (batch, seq + 1))
    c = seq // cp
    mine = slice(topology.cp_rank * c, (topology.cp_rank + 1) * c)
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, paddle.Tensor) and not t.persistable and t._is_initialized():
            seen[t.data_ptr()] = int(t.size) * t.element_size()
        return t

    with paddle.autograd.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(paddle.to_tensor(ids[:, :-1][:, mine]), labels=paddle.to_tensor(ids[:, 1:][:, mine]))
    loss.backward()
    lines = [f"cp {cp}, s {seq}, batch {batch}, tiny widths (D {config.model.hidden_size}, d "
             f"{config.model.v_head_dim}), fp32: rank 0 saved {sum(seen.values()):,} bytes for the backward"]
    for i in range(config.model.num_hidden_layers):
        kind = layer_attention(config.model, i).kind.value
        moe = 0 if i < config.moe.moe_n_hash_layers else batch * config.moe.n_routed_experts * 4 * (cp - 1) // cp
        want = layer_forward_bytes(config.model, i, seq, cp, batch, e=4) + (moe if cp > 1 else 0)
        lines.append(f"  layer {i} ({kind}): counted {per_layer.get(i, 0):,} B sent, formula {want:,} B")
    return "\n".join(lines) if env.rank == 0 else ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("formula", "measure"))
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    print(formula_table() if args.mode == "formula" else measure(args.seq, args.batch), flush=True)


if __name__ == "__main__":
    main()
