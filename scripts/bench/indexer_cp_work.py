"""Context parallelism: DSA indexer scoring work per rank, with and without the dual-chunk rebalance (a formula).

    python scripts/bench/indexer_cp_work.py                 # s = 65,536, cp 2, 4, 8 (markdown table)
    python scripts/bench/indexer_cp_work.py --seq 131072 --cp 16

Work = index-score entries one rank computes for one sequence's top-k in one -2 layer (queries x keys scored;
each entry costs ``heads x (2 head_dim + 2)`` flops), from ``fleet_ext.layers.mqa_latent_attention.
indexer_work_per_rank``, the formula ``tests/multi_card_tests/test_context_parallel.py`` holds equal to the
counted entries at CP 2. "all keys" is what every rank scored before the causal scoring (its chunk against the
whole sequence). Bytes: what a rank sends its mirror per -2 layer in ``dualchunk_p2p`` (the late half-chunk's
fp32 indexer queries q and weights w, then the int32 picks it made for the mirror's late half).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fleet_ext.layers.mqa_latent_attention import indexer_work_per_rank  # noqa: E402

GI = 2**30


def _gi(entries: int) -> str:
    return f"{entries / GI:.4g}"


def rows(seq: int, cps: list[int], heads: int, head_dim: int, topk: int, window: int) -> list[str]:
    """Markdown rows, one per context-parallel size."""
    k_top = min(topk, max(0, seq - window))
    out = []
    for cp in cps:
        chunk = seq // cp
        contiguous = indexer_work_per_rank(seq, cp, "contiguous")
        dual = indexer_work_per_rank(seq, cp, "dualchunk_p2p")
        mirror_bytes = (chunk - chunk // 2) * (heads * (head_dim + 1) + k_top) * 4
        out.append(
            f"| {cp} | {chunk:,} | {_gi(chunk * seq)} | {' / '.join(_gi(n) for n in contiguous)} | "
            f"{max(contiguous) / min(contiguous):.0f}x | {' / '.join(sorted({_gi(n) for n in dual}))} | "
            f"{max(dual) / max(contiguous):.3f} | {mirror_bytes / 2**20:,.1f} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--heads", type=int, default=64, help="dsa_index_n_heads")
    parser.add_argument("--head-dim", type=int, default=128, help="dsa_index_head_dim")
    parser.add_argument("--topk", type=int, default=2048, help="dsa_index_topk")
    parser.add_argument("--window", type=int, default=128, help="csa_window_size (forced window)")
    args = parser.parse_args()
    print(f"s = {args.seq:,}, batch 1, one -2 layer; entries in Gi (2^30); indexer {args.heads} heads x "
          f"{args.head_dim}, top-k {args.topk}, window {args.window}\n")
    print("| cp | chunk | all keys (before), every rank | contiguous, rank 0 / 1 / ... | last / first | "
          "dualchunk_p2p, every rank | dualchunk max / contiguous max | sent to the mirror (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows(args.seq, args.cp, args.heads, args.head_dim, args.topk, args.window)))


if __name__ == "__main__":
    main()
