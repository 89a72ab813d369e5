"""The bucketed, in-place gradient all-reduce (``DistEnv.reduce_gradients_``) on 2 gloo ranks equals, bit for bit,
the one-flat-buffer reduction it replaced, at every bucket size, and keeps its presence semantics.

Run by hand (2 CPU ranks)::

    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        tests/multi_card_tests/test_grad_buckets.py --out_dir out/grad_buckets

Launched, each rank builds the same parameters, gives them rank-dependent gradients (some on both ranks, some on
one rank only, one on none), reduces them with the bucketed path at several bucket sizes and with the old flat
path (restated below as the oracle), and writes what it got to ``<out_dir>/rank_<r>.json``. The pytest test
spawns that launch and compares.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import pytest
from launch_helpers import ROOT, describe, launch

HERE = Path(__file__)
SHAPES = [[3], [7, 5], [1], [40], [11], [2, 2], [6, 4]]
ONLY_ON = {1: 0, 2: 1, 5: 0}  # parameter index -> the one rank that gives it a gradient
NEVER = {3}  # no rank gives it a gradient
BUCKETS = [1, 5, 40, 64, 1 << 23]
SCALE = 1.0 / 6.0  # not a power of two: the scaling rounds


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the 2 launched ranks wrote."""
    root = tmp_path_factory.mktemp("grad_buckets")
    out, logs = root / "out", root / "logs"
    result = launch(HERE, ["--out_dir", str(out)], logs, timeout=120)
    assert result.returncode == 0, describe(result, logs)
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]


def test_bucketed_reduction_equals_the_flat_one_bitwise(ranks):
    for rank in ranks:
        oracle = rank["flat"]
        assert oracle["present"] == [i not in NEVER for i in range(len(SHAPES))], oracle["present"]
        for bucket, got in rank["bucketed"].items():
            assert got["present"] == oracle["present"], f"rank {rank['rank']} bucket {bucket}: presence differs"
            assert got["digests"] == oracle["digests"], f"rank {rank['rank']} bucket {bucket}: gradients differ"
            assert all(got["in_place"]), f"rank {rank['rank']} bucket {bucket}: a gradient was replaced, not updated"
    assert ranks[0]["flat"]["digests"] == ranks[1]["flat"]["digests"], "the ranks must end with equal gradients"
    # The oracle's values are not trivially equal to the inputs (the reduction did something).
    assert ranks[0]["flat"]["digests"] != ranks[0]["inputs"], "the reduction left the gradients unchanged"


def test_negative_control_a_one_ulp_scale_change_is_seen(ranks):
    """The launched ranks also reduce with the scale one fp32 ulp off (bucket 5; Paddle's scale op takes an fp32
    factor, so a float64 ulp would not show): the comparison above must see it."""
    rank = ranks[0]
    assert rank["planted"]["present"] == rank["flat"]["present"]
    assert rank["planted"]["digests"] != rank["flat"]["digests"], "a one-ulp scale change went unnoticed"


# --------------------------------------------------------------------------------------------------
# The launched script.
# --------------------------------------------------------------------------------------------------
def _digest(array) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()[:16]


def _params(rank: int):
    """Fresh parameters with this rank's gradients (via a backward, as in training)."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(0)
    params = []
    for shape in SHAPES:
        p = paddle.create_parameter(shape, "float32")
        p.set_value(rng.standard_normal(shape).astype("float32"))
        params.append(p)
    weights = np.random.default_rng(100 + rank)
    terms = []
    for i, p in enumerate(params):
        if i in NEVER or ONLY_ON.get(i, rank) != rank:
            continue
        terms.append((p * paddle.to_tensor(weights.standard_normal(p.shape).astype("float32"))).sum())
    paddle.add_n(terms).backward()
    return params


def _flat_oracle(env, params: list, scale: float) -> None:
    """The reduction this replaces: one flat fp32 copy of every gradient plus presence flags, one all-reduce."""
    import paddle

    sizes = [int(p.size) for p in params]
    bodies = [p.grad.astype("float32").reshape([-1]) if p.grad is not None else paddle.zeros([n], "float32")
              for p, n in zip(params, sizes)]
    flags = [0.0 if p.grad is None else 1.0 for p in params]
    flat = paddle.concat([*bodies, paddle.to_tensor(flags, dtype="float32")])
    env.all_reduce_sum_(flat)
    present = flat[sum(sizes):].tolist()
    flat = flat[: sum(sizes)] * scale
    offset = 0
    with paddle.no_grad():
        for p, n, seen in zip(params, sizes, present):
            body, offset = flat[offset : offset + n], offset + n
            if seen == 0.0:
                continue
            value = body.reshape(p.shape).astype(p.dtype)
            if p.grad is None:
                p._copy_gradient_from(value)
            else:
                paddle.assign(value, output=p.grad)


def _state(params: list, pointers: list | None = None) -> dict:
    out = {"present": [p.grad is not None for p in params],
           "digests": [_digest(p.grad.numpy()) if p.grad is not None else None for p in params]}
    if pointers is not None:  # gradients this rank had before must be updated where they lie
        out["in_place"] = [before is None or p.grad.data_ptr() == before for p, before in zip(params, pointers)]
    return out


def _main(argv: list[str]) -> int:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import numpy as np

    from fleet_ext.parallel.distributed import init_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", type=Path, required=True)
    args = parser.parse_args(argv)
    env = init_distributed()
    params = _params(env.rank)
    result = {"rank": env.rank, "inputs": _state(params)["digests"], "bucketed": {}}
    _flat_oracle(env, params, SCALE)
    result["flat"] = _state(params)
    for bucket in BUCKETS:
        params = _params(env.rank)
        pointers = [p.grad.data_ptr() if p.grad is not None else None for p in params]
        env.reduce_gradients_(params, SCALE, bucket_elements=bucket)
        result["bucketed"][str(bucket)] = _state(params, pointers)
    params = _params(env.rank)
    env.reduce_gradients_(params, float(np.nextafter(np.float32(SCALE), np.float32(1))), bucket_elements=5)
    result["planted"] = _state(params)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank_{env.rank}.json").write_text(json.dumps(result))
    env.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
