"""Check that a refactor changed no bit: dump logits, loss and every parameter gradient of a set of tiny
models with one source tree, dump again with another, compare byte for byte.

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before python scripts/compare_model_outputs.py dump /tmp/before.npz --root /tmp/before
    python scripts/compare_model_outputs.py dump /tmp/after.npz
    python scripts/compare_model_outputs.py compare /tmp/before.npz /tmp/after.npz   # exit 1 on any difference

Both dumps must come from the same machine: CPU BLAS code paths round differently (an SSE-only MKL run
differs from the default AVX2 one in most gradients), so bytes are only comparable on one machine.
The cases cover every attention kind (window, CSA, HCA, full-causal, -2 in all three modes), VHA, the
indexer KL, and the Triton fusions (interpreter on CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

_HYBRID = "configs/dsv4_hybrid_mla_cpu.yaml"
_TINY = "fleet_ext/configs/dsv4_tiny_cpu.yaml"
CASES: dict[str, tuple[str, dict, int]] = {
    "kinds": (_TINY, {"csa_compress_ratios": [0, 4, 128, -1]}, 150),
    "vha_dense_csa": (_TINY, {"use_vha_attention": True, "csa_dense_mode": True}, 131),
    "mla_dsa_sparse": (_HYBRID, {"dsa_indexer_use_sparse_loss": True}, 97),
    "mla_dsa_warmup": (_HYBRID, {}, 64),
    "mla_mha": (_HYBRID, {"hybrid_mla_attention": "mha", "dsa_indexer_loss_coeff": 0.0, "train_indexer_only": False,
                          "dsa_indexer_use_sparse_loss": False}, 70),
    "fused": (_TINY, {"apply_rope_fusion": True, "dsv4_q_rms_norm_fusion": True, "csa_sparse_attn_backend": "triton",
                      "sparse_attn_global_kv_idx_remap_fusion": True}, 40),
}


def dump(out: Path, root: Path) -> None:
    """Run every case (seeded) forward and backward; save logits, loss and gradients to ``out``."""
    import paddle

    from fleet_ext.config import load_config
    from fleet_ext.models import DSv4ForCausalLM

    arrays: dict[str, np.ndarray] = {}
    for name, (source, overrides, seq) in CASES.items():
        config = load_config(root / source, **overrides)
        paddle.seed(7)
        model = DSv4ForCausalLM(config)
        model.train()
        ids = np.random.default_rng(3).integers(1, config.model.vocab_size, size=(2, seq + 1))
        ids = paddle.to_tensor(ids.astype("int64"))
        logits, loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        arrays[f"{name}/logits"], arrays[f"{name}/loss"] = logits.numpy(), loss.numpy()
        for param_name, param in model.named_parameters():
            if param.grad is not None:
                arrays[f"{name}/grad/{param_name}"] = param.grad.numpy()
        print(f"{name}: loss {float(loss):.6f}", file=sys.stderr)
    np.savez(out, **arrays)


def compare(before: Path, after: Path) -> int:
    """0 when both dumps hold the same arrays with the same bytes, else 1 (listing what differs)."""
    a, b = np.load(before), np.load(after)
    missing = sorted(set(a.files) ^ set(b.files))
    differ = [k for k in sorted(set(a.files) & set(b.files)) if a[k].tobytes() != b[k].tobytes()]
    for key in differ[:20]:
        print(f"differs: {key} (max |diff| {np.abs(a[key].astype(np.float64) - b[key]).max():.3e})")
    for key in missing[:20]:
        print(f"in one dump only: {key}")
    same = len(set(a.files) & set(b.files)) - len(differ)
    print(f"{same} arrays byte-identical, {len(differ)} differ, {len(missing)} in one dump only")
    return 1 if differ or missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="tree holding the YAMLs")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "dump":
        dump(args.out, args.root)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
