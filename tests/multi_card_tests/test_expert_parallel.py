"""Expert parallelism over real ``paddle.distributed.launch`` ranks (gloo, 2 processes): EP=2 against EP=1.

Run by hand::

    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        tests/multi_card_tests/test_expert_parallel.py --output_dir DIR

Launched, every rank builds each case's MoE layer (same seed, same weights everywhere), computes the data-parallel
reference itself (both ranks' tokens through the unsharded layer in this process, the expert gradients of the two
ranks summed: what DP=2 with EP=1 all-reduces), then its own tokens through its expert shard under EP=2, and
writes bitwise flags and bytes exchanged to ``<output_dir>/rank_<r>.json``; the tests read them. Also: dispatch ->
combine is the identity when the experts are (random and skewed routings, a rank that receives no row), and a
planted wrong expert offset must break the parity (negative control).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

D, E, K, I_FFN, VOCAB, BATCH, SEQ, EP = 16, 8, 3, 6, 40, 2, 12, 2
BASE = dict(hidden_size=D, vocab_size=VOCAB, num_hidden_layers=4, csa_compress_ratios=[0] * 4, n_routed_experts=E,
            num_experts_per_tok=K, moe_intermediate_size=I_FFN, n_shared_experts=1, moe_n_hash_layers=1,
            init_method_std=0.5)
CASES = {  # name: (layer number: 0 is hash-routed, config overrides, dispatcher)
    "topk_alltoall": (1, {}, "alltoall"),
    "topk_allgather": (1, {}, "allgather"),
    "hash_alltoall": (0, {}, "alltoall"),
    "hash_allgather": (0, {}, "allgather"),
    "seq_aux_bias_alltoall": (1, {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.01,
                                  "moe_router_enable_expert_bias": True}, "alltoall"),
    "planted_offset_bug": (1, {}, "alltoall"),
}
NEGATIVE_CONTROLS = ("planted_offset_bug",)


# -- the launched side ---------------------------------------------------------------------------------------
def _inputs(rank: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed + 101 * rank)
    x = rng.standard_normal((BATCH, SEQ, D)).astype("float32")
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int64")
    dy = rng.standard_normal((BATCH, SEQ, D)).astype("float32")
    return x, ids, dy


def _run(layer, x, ids, dy) -> tuple:
    """Forward and backward of ``sum(layer(x) * dy)``: (output, input gradient, {param name: gradient})."""
    import paddle

    xt = paddle.to_tensor(x, stop_gradient=False)
    out = layer(xt, paddle.to_tensor(ids))
    (out * paddle.to_tensor(dy)).sum().backward()
    grads = {n: p.grad.numpy().copy() for n, p in layer.named_parameters() if p.grad is not None}
    for p in layer.parameters():
        p.clear_gradient(False)  # None again: the next run starts from no gradient
    return out.numpy(), xt.grad.numpy(), grads


def _layer_case(name: str, rank: int) -> dict:
    import paddle

    from fleet_ext.config import load_config
    from fleet_ext.layers.moe import MoELayer
    from fleet_ext.parallel.cp_collectives import COMM_BYTES
    from fleet_ext.parallel.expert_parallel import build_expert_groups

    number, overrides, dispatcher = CASES[name]
    cfg = load_config({**BASE, **overrides})
    paddle.seed(7)
    ref = MoELayer(cfg, number)
    state = {k: v.numpy().copy() for k, v in ref.state_dict().items()}
    ref.train()
    per_rank = [_run(ref, *_inputs(r, 3)) for r in range(EP)]
    want_out, want_dx, want_grads = per_rank[rank]
    summed = {n: per_rank[0][2][n] + per_rank[1][2][n] for n in want_grads if "experts.weight" in n
              and "shared" not in n}
    epg = build_expert_groups(rank, EP, "gloo", EP, dispatcher)
    layer = MoELayer(cfg, number)
    layer.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    layer.train()
    layer.experts.shard(epg)
    local = epg.local_experts(E)
    if name == "planted_offset_bug":  # the other rank's experts under this rank's ids
        other = range((1 - rank) * len(local), (2 - rank) * len(local))
        for w in ("weight1", "weight2"):
            getattr(layer.experts, w).set_value(state[f"experts.{w}"][other.start : other.stop])
    before = dict(COMM_BYTES)
    out, dx, grads = _run(layer, *_inputs(rank, 3))
    checks = {"out": out.tobytes() == want_out.tobytes(), "dx": dx.tobytes() == want_dx.tobytes()}
    for n, g in grads.items():
        want = summed[n][local.start : local.stop] if n in summed else want_grads[n]
        checks[n] = g.shape == want.shape and g.tobytes() == want.tobytes()
    checks["same_params_with_grads"] = sorted(grads) == sorted(want_grads)
    sent = {k: v - before.get(k, 0) for k, v in COMM_BYTES.items() if v != before.get(k, 0)}
    x, ids, _ = _inputs(rank, 3)
    with paddle.no_grad():  # this rank's routing (the reference's weights): token slots whose expert lives elsewhere
        _, indices = ref.router(paddle.to_tensor(x), paddle.to_tensor(ids))
    remote = int((indices.numpy() // (E // EP) != rank).sum())
    return {"bitwise": checks, "bytes_sent": sent, "remote_slots": remote}


def _identity_case(routing: str, dispatcher: str, rank: int) -> dict:
    """dispatch -> combine with identity experts gives back every row (bytewise)."""
    import paddle

    from fleet_ext.ops.moe_permute import reference
    from fleet_ext.parallel.expert_parallel import (
        build_expert_groups,
        combine_rows,
        dispatch_rows,
        gather_counts,
        layout_of,
    )

    rng = np.random.default_rng(11 + rank)
    tokens = 9 + 4 * rank  # ranks hold different numbers of tokens
    x = paddle.to_tensor(rng.standard_normal((tokens, D)).astype("float32"))
    if routing == "random":
        idx = np.stack([rng.permutation(E)[:K] for _ in range(tokens)])
    elif routing == "skewed":  # every row goes to rank 0's experts (rank 1 receives nothing), experts 1 and 3 empty
        idx = np.stack([[0, 2, 0][: K - 1] + [2 - 2 * (t % 2)] for t in range(tokens)])
        idx[:, 0] = 0
    else:
        raise ValueError(routing)
    indices = paddle.to_tensor(idx.astype("int64"))
    epg = build_expert_groups(rank, EP, "gloo", EP, dispatcher)
    rows, _ = reference.permute(x, indices, E)
    counts = paddle.bincount(indices.reshape([-1]), minlength=E).astype("int64")
    layout = layout_of(gather_counts(counts, epg).numpy(), K, epg)  # the layer's path (MoELayer._read_host)
    back = combine_rows(dispatch_rows(rows, x, indices, layout, epg), layout, epg)
    return {"identity": back.numpy().tobytes() == rows.numpy().tobytes(), "received": sum(layout.recv),
            "own_counts": layout.counts[epg.rank].tolist() == counts.tolist()}


def _worker(output_dir: Path) -> None:
    import paddle.distributed as dist

    dist.init_parallel_env()
    rank = dist.get_rank()
    result = {name: _layer_case(name, rank) for name in CASES}
    for routing in ("random", "skewed"):
        for dispatcher in ("alltoall", "allgather"):
            result[f"identity_{routing}_{dispatcher}"] = _identity_case(routing, dispatcher, rank)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"rank_{rank}.json").write_text(json.dumps(result, indent=1))


# -- the pytest side ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from launch_helpers import describe, launch

    out = tmp_path_factory.mktemp("ep_layer")
    result = launch(Path(__file__), ["--output_dir", str(out / "json")], out / "logs", timeout=300)
    assert result.returncode == 0, describe(result, out / "logs")
    return [json.loads((out / "json" / f"rank_{r}.json").read_text()) for r in range(EP)]


@pytest.mark.parametrize("case", [c for c in CASES if c not in NEGATIVE_CONTROLS])
def test_moe_layer_ep2_is_bitwise_dp2(launched, case):
    """Output, input gradient, dense gradients (this rank's share) and expert-shard gradients (both ranks' partials
    summed: EP=2 after its dispatch backward = DP=2's all-reduce), byte for byte, on both ranks (CPU fp32)."""
    for rank, result in enumerate(launched):
        bad = [k for k, ok in result[case]["bitwise"].items() if not ok]
        assert not bad, (rank, case, bad)
        assert "experts.weight1" in result[case]["bitwise"]


@pytest.mark.parametrize("case", ["topk_alltoall", "hash_alltoall"])
def test_all_to_all_bytes_match_the_formula(launched, case):
    """One row of D fp32 values per token slot that crosses ranks: rank r sends its own remote slots in the dispatch
    and in the combine's backward, and the other rank's slots routed to r's experts in the combine and in the
    dispatch's backward: 2 x (R_r + R_other) x D x 4 bytes per layer step (R: slots whose expert is remote)."""
    remote = [result[case]["remote_slots"] for result in launched]
    assert min(remote) > 0
    for rank, result in enumerate(launched):
        want = 2 * (remote[rank] + remote[1 - rank]) * D * 4
        assert result[case]["bytes_sent"]["ep_all_to_all"] == want, (rank, result[case]["bytes_sent"], remote)


def test_dispatchers_give_the_same_bits(launched):
    """alltoall and allgather both match the same reference bytewise, so they equal each other; they move
    different amounts (allgather sends every token to every member)."""
    for result in launched:
        for routing in ("topk", "hash"):
            a, g = result[f"{routing}_alltoall"], result[f"{routing}_allgather"]
            assert all(a["bitwise"].values()) and all(g["bitwise"].values())
            assert "ep_all_gather" in g["bytes_sent"] and "ep_all_gather" not in a["bytes_sent"]


@pytest.mark.parametrize("routing", ["random", "skewed"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_dispatch_then_combine_is_the_identity(launched, routing, dispatcher):
    for result in launched:
        assert result[f"identity_{routing}_{dispatcher}"]["identity"]
        assert result[f"identity_{routing}_{dispatcher}"]["own_counts"]  # the gathered table, in member order
    if routing == "skewed":
        assert launched[1][f"identity_{routing}_{dispatcher}"]["received"] == 0


def test_planted_expert_offset_breaks_parity(launched):
    """Negative control: a shard holding the other rank's experts must not pass."""
    for result in launched:
        checks = result["planted_offset_bug"]["bitwise"]
        assert not checks["out"] and not checks["dx"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=Path, required=True)
    _worker(parser.parse_args().output_dir)
