"""Dense causal mode of the Triton sparse-attention family on the CPU (Triton interpreter, fp32).

- Kernels (``causal.causal_attn_fwd`` / ``causal_attn_bwd`` / ``causal_probs`` on torch CPU tensors) against a
  float64 NumPy oracle written here (dsv4_math.md §2.5 / §7 restricted to keys 0..position): out, lse, dq, dkv,
  d_sink and the head-summed probabilities; several sequences, a context-parallel query offset, a partial
  and a second head tile (the dkv pass walks two head blocks), d_qk != d_v, key counts off the block size,
  the dkv pass with one and with several query slices.
- Against the sparse kernels given the full-causal index table: forward (out, lse) and dq byte-identical
  (the same blocks of keys in the same order; CPU interpreter), dkv within the tolerance (another summation
  order: key-major here, CSR there).
- Determinism: two backward runs give byte-identical dq, dkv, d_sink (one and several query slices).
- Key rows past every query's causal bound are never read: NaN there changes no byte of any result.
- ``function.sparse_attention_triton(..., idx=None, q_offset=)`` and ``causal_probs_triton`` (Paddle,
  PyLayer) against the Paddle reference with the full-causal table, forward and autograd, padded widths.
- A planted off-by-one causal bound fails the oracle check (negative control); bad inputs raise ValueError.

Tolerance: fp32 ``triton_sparse_attn`` (tests/helpers/tolerances.py; relative to the largest entry of the
reference), the bound of the sparse kernels (the same loop and the same contractions). Every run counts the
kernels' launches.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest
from helpers import assert_bitwise, assert_close, expect_launches

from fleet_ext import capability

capability.prepare_triton()
torch = pytest.importorskip("torch")

from fleet_ext.ops import launch  # noqa: E402
from fleet_ext.ops.sparse_attn import causal, kernel  # noqa: E402
from fleet_ext.ops.sparse_attn.function import causal_probs_triton, sparse_attention_triton  # noqa: E402
from fleet_ext.ops.sparse_attn.reference import causal_attention_probs, sparse_attention_with_sink  # noqa: E402

NAMES = ("out", "lse", "dq", "dkv", "d_sink")
FWD, DQ, DKV = "_causal_fwd_kernel", "_causal_bwd_dq_kernel", "_causal_bwd_dkv_kernel"
REDUCE = "_causal_dkv_reduce_kernel"


# ------------------------------------------------------------------------------------------------------
# float64 oracle (independent of fleet_ext)
# ------------------------------------------------------------------------------------------------------
def oracle(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset):
    """Flat layout, B = T / seq sequences of N = rows(kv) / B keys; query i of a sequence sees keys
    0 .. q_offset + i. Loss = sum(out * d_out) + sum(lse * d_lse); returns out, lse, dq, dkv, d_sink, probs."""
    q, kv, sink, d_out, d_lse = (np.asarray(a, np.float64) for a in (q, kv, sink, d_out, d_lse))
    num_t, heads, _ = q.shape
    batch = num_t // seq
    n_keys = kv.shape[0] // batch
    out, lse = np.zeros((num_t, heads, d_v)), np.zeros((num_t, heads))
    dq, dkv, d_sink = np.zeros_like(q), np.zeros_like(kv), np.zeros(heads)
    probs = np.zeros((num_t, n_keys))
    for t in range(num_t):
        b, i = divmod(t, seq)
        seen = min(q_offset + i + 1, n_keys)
        k = kv[b * n_keys: b * n_keys + seen]
        logits = scale * q[t] @ k.T  # [H, seen]
        m = np.maximum(logits.max(1), sink)
        e, e_sink = np.exp(logits - m[:, None]), np.exp(sink - m)
        z = e.sum(1) + e_sink
        p, p_sink = e / z[:, None], e_sink / z
        out[t], lse[t] = p @ k[:, :d_v], m + np.log(z)
        probs[t, :seen] = p.sum(0)
        delta = (d_out[t] * out[t]).sum(1) - d_lse[t]
        dl = p * (d_out[t] @ k[:, :d_v].T - delta[:, None])
        dq[t] = scale * dl @ k
        contrib = scale * dl.T @ q[t]
        contrib[:, :d_v] += p.T @ d_out[t]
        dkv[b * n_keys: b * n_keys + seen] += contrib
        d_sink -= p_sink * delta
    return out, lse, dq, dkv, d_sink, probs


def make_case(seed, batch, seq, heads, d_qk, d_v, n_keys):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((batch * seq, heads, d_qk)) * 1.5).astype(np.float32)
    kv = rng.standard_normal((batch * n_keys, d_qk)).astype(np.float32)
    sink = rng.uniform(-1.0, 2.0, heads).astype(np.float32)
    d_out = rng.standard_normal((batch * seq, heads, d_v)).astype(np.float32)
    d_lse = (rng.standard_normal((batch * seq, heads)) * 0.3).astype(np.float32)
    return q, kv, sink, d_out, d_lse


def run_causal(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset, dkv_splits=None):
    """out, lse, dq, dkv, d_sink, probs (NumPy) of the dense causal kernels; asserts that they ran."""
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, kv, sink, d_out, d_lse)]
    with expect_launches(FWD, DQ, DKV, "_causal_probs_kernel"):
        out, lse = causal.causal_attn_fwd(t[0], t[1], t[2], scale, seq, q_offset, d_v=d_v)
        grads = causal.causal_attn_bwd(t[0], t[1], t[2], scale, out, lse, t[3], t[4], seq=seq, q_offset=q_offset,
                                       d_v=d_v, dkv_splits=dkv_splits)
        probs = causal.causal_probs(t[0], t[1], lse, scale, seq, q_offset, d_v=d_v)
    return [x.numpy() for x in (out, lse, *grads, probs)]


# (batch, seq, heads, d_qk, d_v, n_keys, q_offset, dkv_splits)
CASES = {
    "latent_b2_cp_offset": (2, 7, 3, 48, 32, 14, 7, None),  # rank 1 of cp = 2: queries at positions 7..13
    "k_eq_v_multiblock_slices": (1, 21, 16, 32, 32, 40, 19, 3),  # 40 keys: 2.5 blocks of 16; 3 query slices
    "two_head_tiles": (1, 5, 70, 32, 16, 9, 2, 2),  # 70 heads: a full 64-head tile + a masked one
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_float64_oracle(case):
    batch, seq, heads, d_qk, d_v, n_keys, q_offset, splits = CASES[case]
    q, kv, sink, d_out, d_lse = make_case(list(CASES).index(case), batch, seq, heads, d_qk, d_v, n_keys)
    scale = 1.0 / math.sqrt(d_qk)
    used = splits or causal.default_dkv_splits(seq, batch, n_keys, d_qk, 1 << 30, 16)  # interpreter: 16-key blocks
    with expect_launches(REDUCE, exactly=1 if used > 1 else 0):
        got = run_causal(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset, splits)
    ref = oracle(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset)
    for name, g, r in zip((*NAMES, "probs"), got, ref):
        assert_close(g, r, "fp32", "triton_sparse_attn", what=f"{case}: {name}")
    unseen = [b * n_keys + j for b in range(batch) for j in range(q_offset + seq, n_keys)]
    assert np.all(got[3][unseen] == 0.0), "keys past every query's position must get exactly zero gradient"


def test_planted_off_by_one_bound_fails_the_oracle_check():
    """Negative control: queries one position later (they see one more key) must fail the same check."""
    batch, seq, heads, d_qk, d_v, n_keys, q_offset, _ = CASES["latent_b2_cp_offset"]
    q, kv, sink, d_out, d_lse = make_case(0, batch, seq, heads, d_qk, d_v, n_keys)
    scale = 1.0 / math.sqrt(d_qk)
    planted = run_causal(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset - 1)
    ref = oracle(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset)
    for name, g, r in zip(("out", "dq", "dkv"), (planted[0], planted[2], planted[3]), (ref[0], ref[2], ref[3])):
        with pytest.raises(AssertionError):
            assert_close(g, r, "fp32", "triton_sparse_attn", what=f"planted bound: {name}")


def _full_causal_table(batch, seq, n_keys, q_offset):
    """Flat-global [B*S, N] int32 table of the sparse kernels: row b*S + i holds b*N + 0 .. b*N + q_offset + i."""
    keys = np.arange(n_keys)[None, :]
    table = np.where(keys <= q_offset + np.arange(seq)[:, None], keys, -1)
    return np.concatenate([np.where(table >= 0, table + b * n_keys, -1) for b in range(batch)]).astype(np.int32)


def test_forward_and_dq_equal_the_sparse_kernels_on_the_full_causal_table():
    batch, seq, heads, d_qk, d_v, n_keys, q_offset, _ = CASES["latent_b2_cp_offset"]
    q, kv, sink, d_out, d_lse = make_case(4, batch, seq, heads, d_qk, d_v, n_keys)
    scale = 0.2
    dense = run_causal(q, kv, sink, scale, d_v, d_out, d_lse, seq, q_offset)
    t = [torch.from_numpy(a) for a in (q, kv, _full_causal_table(batch, seq, n_keys, q_offset), sink, d_out, d_lse)]
    with expect_launches("_sparse_attn_fwd_kernel", "_bwd_dq_kernel"):
        out, lse = kernel.sparse_attn_fwd(t[0], t[1], t[2], t[3], scale, d_v=d_v)
        sparse = [x.numpy() for x in (out, lse, *kernel.sparse_attn_bwd(t[0], t[1], t[2], t[3], scale, out, lse,
                                                                       t[4], t[5], d_v=d_v))]
    for name, index in (("out", 0), ("lse", 1), ("dq", 2)):
        assert_bitwise(dense[index], sparse[index], f"dense causal vs sparse on the full-causal table: {name}")
    for name, index in (("dkv", 3), ("d_sink", 4)):
        assert_close(dense[index], sparse[index], "fp32", "triton_sparse_attn", what=f"dense vs sparse: {name}")


@pytest.mark.parametrize("splits", [1, 3])
def test_backward_is_bitwise_deterministic(splits):
    q, kv, sink, d_out, d_lse = make_case(11, 2, 9, 5, 48, 32, 9)
    first = run_causal(q, kv, sink, 0.2, 32, d_out, d_lse, 9, 0, splits)
    second = run_causal(q, kv, sink, 0.2, 32, d_out, d_lse, 9, 0, splits)
    for name, a, b in zip((*NAMES, "probs"), first, second):
        assert_bitwise(a, b, f"{name}, two runs, {splits} dkv slices")


def test_keys_past_the_causal_bound_are_never_read():
    batch, seq, heads, d_qk, d_v, n_keys, q_offset = 2, 6, 4, 48, 32, 20, 6  # keys 12..19 are nobody's
    q, kv, sink, d_out, d_lse = make_case(5, batch, seq, heads, d_qk, d_v, n_keys)
    clean = run_causal(q, kv, sink, 0.3, d_v, d_out, d_lse, seq, q_offset, 2)
    poisoned = kv.copy()
    for b in range(batch):
        poisoned[b * n_keys + q_offset + seq:(b + 1) * n_keys] = np.nan
    got = run_causal(q, poisoned, sink, 0.3, d_v, d_out, d_lse, seq, q_offset, 2)
    for name, a, b in zip((*NAMES, "probs"), got, clean):
        assert_bitwise(a, b, f"{name}: NaN keys past the causal bound")


# ------------------------------------------------------------------------------------------------------
# Paddle PyLayer vs the Paddle reference with the full-causal table
# ------------------------------------------------------------------------------------------------------
def _paddle_run(q, kv, sink, scale, d_v, q_offset, w_out, w_lse, fused):
    qt, kvt, st = (paddle.to_tensor(a, stop_gradient=False) for a in (q, kv, sink))
    if fused:
        out, lse = sparse_attention_triton(qt, kvt, None, st, scale, d_v=d_v, q_offset=q_offset)
        probs = causal_probs_triton(qt, kvt, lse, scale, q_offset, kv.shape[1] - 1, d_v=d_v)
    else:
        batch, seq, n_keys = q.shape[0], q.shape[1], kv.shape[1]
        keys = np.arange(n_keys)[None, :]
        table = np.where(keys <= q_offset + np.arange(seq)[:, None], keys, -1).astype(np.int32)
        out, lse = sparse_attention_with_sink(qt, kvt, paddle.to_tensor(np.broadcast_to(table, (batch, seq, n_keys))),
                                              st, scale, d_v=d_v)
        probs = causal_attention_probs(qt, kvt, lse, scale, q_offset, n_keys - 1)
    loss = (out * paddle.to_tensor(w_out)).sum() + (lse * paddle.to_tensor(w_lse)).sum()
    loss.backward()
    return [x.numpy() for x in (out, lse, qt.grad, kvt.grad, st.grad, probs)]


@pytest.mark.parametrize(
    "bsz, seq, heads, dim, d_v, n_keys, q_offset",
    [(2, 5, 3, 48, 32, 10, 5), (1, 6, 2, 40, 24, 6, 0)],
    ids=["latent_b2_offset", "pad_value_and_tail"],  # 24 -> 32 and tail 16: zero-padded for the kernels
)
def test_pylayer_matches_paddle_reference(bsz, seq, heads, dim, d_v, n_keys, q_offset):
    rng = np.random.default_rng(bsz * 100 + dim)
    q = rng.standard_normal((bsz, seq, heads, dim)).astype(np.float32)
    kv = rng.standard_normal((bsz, n_keys, dim)).astype(np.float32)
    sink = rng.uniform(-1.0, 2.0, heads).astype(np.float32)
    w_out = rng.standard_normal((bsz, seq, heads, d_v)).astype(np.float32)
    w_lse = rng.standard_normal((bsz, seq, heads)).astype(np.float32)
    scale = 1.0 / math.sqrt(dim)
    with expect_launches(FWD, DQ, DKV, "_causal_probs_kernel"), expect_launches(
            "_sparse_attn_fwd_kernel", "_row_bound_kernel", exactly=0):
        got = _paddle_run(q, kv, sink, scale, d_v, q_offset, w_out, w_lse, fused=True)
    ref = _paddle_run(q, kv, sink, scale, d_v, q_offset, w_out, w_lse, fused=False)
    for name, g, r in zip((*NAMES, "probs"), got, ref):
        assert_close(g, r, "fp32", "triton_sparse_attn", what=f"pylayer vs reference: {name}")


def test_bad_inputs_raise_naming_the_argument():
    q, kv, sink = torch.zeros(8, 2, 32), torch.zeros(10, 32), torch.zeros(2)
    with pytest.raises(ValueError, match=r"causal_attn_fwd: `q_offset` .* must be in \[0, N - S\] = \[0, 1\]"):
        causal.causal_attn_fwd(q, kv, sink, 0.1, 4, 2)  # 2 sequences of 4 queries, 5 keys each
    with pytest.raises(ValueError, match=r"`seq` \(queries per sequence\) must be >= 1 and divide"):
        causal.causal_attn_fwd(q, kv, sink, 0.1, 3)
    with pytest.raises(ValueError, match=r"`kv` rows \(10\) must be B \* N for the B = 4"):
        causal.causal_attn_fwd(q, kv, sink, 0.1, 2)
    out, lse = causal.causal_attn_fwd(q, kv, sink, 0.1, 4, 1)
    with pytest.raises(ValueError, match=r"`dkv_splits` must be >= 1"):
        causal.causal_attn_bwd(q, kv, sink, 0.1, out, lse, out, seq=4, q_offset=1, dkv_splits=-1)
    with pytest.raises(ValueError, match=r"causal_probs: `n_cols` must be in \[0, N = 5\]"):
        causal.causal_probs(q, kv, lse, 0.1, 4, 1, n_cols=6)
    qp, kvp = paddle.zeros([1, 2, 2, 32]), paddle.zeros([1, 4, 32])
    with pytest.raises(ValueError, match=r"`q_offset` \(1\) belongs to the dense causal mode"):
        sparse_attention_triton(qp, kvp, paddle.zeros([1, 2, 3], dtype="int32"), paddle.zeros([2]), 0.1, q_offset=1)


def test_warp_specialised_dq_is_chosen_only_where_it_runs(monkeypatch):
    """The Gluon dq kernel's dense mode (Hopper only: ``tests/gpu/test_sparse_attn_gpu.py``) is never picked here,
    not even under "auto", and forcing it names why it cannot run."""
    from fleet_ext.ops.sparse_attn import kernel_config

    q, kv, sink, d_out, d_lse = make_case(5, 1, 6, 64, 48, 32, 6)
    monkeypatch.setattr(kernel_config, "DQ_KERNEL", "auto")
    before = launch.LAUNCH_COUNTS["_bwd_dq_ws_kernel"]
    run_causal(q, kv, sink, 0.3, 32, d_out, d_lse, 6, 0)  # asserts the Triton dq kernel ran
    assert launch.LAUNCH_COUNTS["_bwd_dq_ws_kernel"] == before
    monkeypatch.setattr(kernel_config, "DQ_KERNEL", "gluon")
    with pytest.raises(ValueError, match=r"causal_attn_bwd: kernel_config.DQ_KERNEL = 'gluon' cannot run here: "
                                         r"not a Hopper GPU \(sm90\)"):
        run_causal(q, kv, sink, 0.3, 32, d_out, d_lse, 6, 0)
