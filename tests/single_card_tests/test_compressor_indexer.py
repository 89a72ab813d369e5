"""DSv4 compressor (HCA / CSA-overlap) and CSA lightning indexer vs float64 oracles (dsv4_math.md §2.3, §2.4).

Every parameter is overwritten with non-trivial random values (ape and the norm weight start at 0 / 1, which
would hide a wrong slot or channel alignment) and copied to the oracle.
Tolerances (tests/helpers/tolerances.py, fp32): the layer vs the float64 oracle on O(1) values over
contractions of <= 32 terms, then RMSNorm (~1e-6 relative): ``oracle_compressor``. Gradients: fp32 autograd
vs central differences of the float64 oracle (step 1e-6, truncation ~1e-12, rounding ~1e-10); fp32
accumulation over 2 x 320 tokens measured at ~5e-7 of the largest gradient entry: ``fd_grad_of_max``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from helpers import assert_close, tiny_model, tolerance
from helpers import oracles as orc

from fleet_ext.config import load_config
from fleet_ext.layer_kinds import LayerAttention, layer_attention
from fleet_ext.layers.compressor import Compressor
from fleet_ext.layers.csa_indexer import CSAIndexer
from fleet_ext.ops.rope.reference import apply_partial_rope
from fleet_ext.parallel.layout import SequenceLayout

whole = SequenceLayout.whole

HEAD_DIM, ROPE_DIM, HIDDEN = 16, 8, 32


def make_config(**overrides):
    base = tiny_model(hidden_size=HIDDEN, num_hidden_layers=3, v_head_dim=HEAD_DIM, qk_pos_emb_head_dim=ROPE_DIM,
                      csa_compress_ratios=[0, 4, 128], dsa_index_n_heads=4, dsa_index_head_dim=16,
                      init_method_std=0.02)
    return load_config({**base, **overrides}).model


def kind_for(cfg, entry: int) -> LayerAttention:
    """The layer-kind table's answer for a layer whose csa_compress_ratios entry is ``entry``."""
    return layer_attention(SimpleNamespace(**{**vars(cfg), "csa_compress_ratios": [entry]}), 0)


def compress(comp: Compressor, x: paddle.Tensor) -> paddle.Tensor:
    return comp(x, whole(x.shape[1]))


def yarn_freq(cfg):
    return orc.yarn_inv_freq(cfg.qk_pos_emb_head_dim, cfg.csa_compress_rotary_base, cfg.rotary_scaling_factor,
                             cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow)


def randomize_compressor(comp: Compressor, rng) -> dict:
    """Overwrite every compressor parameter with O(1) random values; return float64 copies for the oracle."""
    d_in, d_out = comp.linear_wkv.weight.shape
    values = {
        "wkv": rng.standard_normal((d_in, d_out)) * 0.4,
        "wgate": rng.standard_normal((d_in, d_out)) * 0.4,
        "ape": rng.standard_normal(comp.ape.shape) * 1.5,
        "norm": rng.uniform(0.5, 2.0, comp.norm.weight.shape),
    }
    comp.linear_wkv.weight.set_value(values["wkv"].astype("float32"))
    comp.linear_wgate.weight.set_value(values["wgate"].astype("float32"))
    comp.ape.set_value(values["ape"].astype("float32"))
    comp.norm.weight.set_value(values["norm"].astype("float32"))
    return {k: v.astype("float32").astype(np.float64) for k, v in values.items()}


def oracle_compress(comp: Compressor, params: dict, x: np.ndarray, cfg, overlap: bool) -> np.ndarray:
    return orc.compressor(x, params["wkv"], params["wgate"], params["ape"], params["norm"], comp.ratio, comp.head_dim,
                          overlap, yarn_freq(cfg), cfg.rms_norm_eps)


# --------------------------------------------------------------------------------------------------
# Compressor forward.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ratio,seq,overlap",
    [(128, 320, False), (4, 10, True), (8, 20, True), (4, 4, True)],
    ids=["hca128_2.5blocks", "csa4_2.5blocks", "csa8_2.5blocks", "csa4_one_block"],
)
def test_compressor_matches_oracle(ratio, seq, overlap):
    cfg = make_config()
    paddle.seed(0)
    comp = Compressor(cfg, kind_for(cfg, ratio), HEAD_DIM, apply_partial_rope)
    assert comp.overlap is overlap
    coff = 2 if overlap else 1
    assert list(comp.ape.shape) == [ratio, coff * HEAD_DIM]
    assert list(comp.linear_wkv.weight.shape) == [HIDDEN, coff * HEAD_DIM]
    rng = np.random.default_rng(ratio)
    params = randomize_compressor(comp, rng)
    x = rng.standard_normal((2, seq, HIDDEN)).astype("float32")
    got = compress(comp, paddle.to_tensor(x)).numpy()
    assert got.shape == (2, seq // ratio, HEAD_DIM), got.shape
    want = oracle_compress(comp, params, x, cfg, overlap)
    assert_close(got, want, "fp32", "oracle_compressor")
    # The tail (seq % ratio tokens) must be dropped: changing it changes nothing.
    x2 = x.copy()
    x2[:, (seq // ratio) * ratio :] += 5.0
    leaked = compress(comp, paddle.to_tensor(x2)).numpy()
    np.testing.assert_array_equal(leaked, got, err_msg="tail tokens leaked into entries")
    # Conversely the ape must matter (a zero or ignored ape would pass the comparison above only by luck).
    params_no_ape = dict(params, ape=np.zeros_like(params["ape"]))
    assert np.abs(oracle_compress(comp, params_no_ape, x, cfg, overlap) - want).max() > 1e-2


def test_hca_rate_comes_from_hca_compress_ratio():
    """The entry 128 marks an HCA layer; it pools `hca_compress_ratio` tokens per entry, without overlap."""
    cfg = make_config(hca_compress_ratio=16)
    attention = kind_for(cfg, 128)
    assert (attention.kind.value, attention.compress_ratio, attention.overlapping_compressor) == ("hca", 16, False)
    paddle.seed(0)
    comp = Compressor(cfg, attention, HEAD_DIM, apply_partial_rope)
    rng = np.random.default_rng(16)
    params = randomize_compressor(comp, rng)
    x = rng.standard_normal((3, 37, HIDDEN)).astype("float32")
    got = compress(comp, paddle.to_tensor(x)).numpy()
    assert got.shape == (3, 37 // 16, HEAD_DIM), got.shape
    assert_close(got, oracle_compress(comp, params, x, cfg, overlap=False), "fp32", "oracle_compressor")


def test_compressor_overlap_uses_previous_block_first_half():
    """CSA entry i (i >= 1) depends on block i-1 only through the first half of the channels; entry 0 does not."""
    cfg = make_config()
    comp = Compressor(cfg, kind_for(cfg, 4), HEAD_DIM, apply_partial_rope)
    rng = np.random.default_rng(7)
    randomize_compressor(comp, rng)
    x = rng.standard_normal((1, 12, HIDDEN)).astype("float32")
    base = compress(comp, paddle.to_tensor(x)).numpy()
    x2 = x.copy()
    x2[:, 4:8] += 1.0  # block 1
    moved = compress(comp, paddle.to_tensor(x2)).numpy()
    np.testing.assert_array_equal(moved[:, 0], base[:, 0], err_msg="entry 0 must not see block 1")
    assert np.abs(moved[:, 1] - base[:, 1]).max() > 1e-3 and np.abs(moved[:, 2] - base[:, 2]).max() > 1e-3, (
        "entries 1 (own block) and 2 (previous block via overlap) must both change"
    )


def test_compressor_shorter_than_one_block():
    comp = Compressor(make_config(), kind_for(make_config(), 128), HEAD_DIM, apply_partial_rope)
    out = compress(comp, paddle.to_tensor(np.ones((2, 100, HIDDEN), dtype="float32")))
    assert list(out.shape) == [2, 0, HEAD_DIM]


@pytest.mark.parametrize("ratio,seq", [(4, 10), (128, 320)], ids=["csa4", "hca128"])
def test_compressor_gradients_vs_finite_differences(ratio, seq):
    cfg = make_config()
    comp = Compressor(cfg, kind_for(cfg, ratio), HEAD_DIM, apply_partial_rope)
    rng = np.random.default_rng(100 + ratio)
    params = randomize_compressor(comp, rng)
    x = rng.standard_normal((2, seq, HIDDEN)).astype("float32")
    g = rng.standard_normal((2, seq // ratio, HEAD_DIM))

    out = compress(comp, paddle.to_tensor(x))
    (out * paddle.to_tensor(g.astype("float32"))).sum().backward()
    grad_ape = comp.ape.grad.numpy().reshape(-1)
    grad_wgate = comp.linear_wgate.weight.grad.numpy().reshape(-1)

    def loss():
        return float((oracle_compress(comp, params, x, cfg, overlap=ratio < 128) * g).sum())

    for name, grad, n_coords in (("ape", grad_ape, 128), ("wgate", grad_wgate, 64)):
        coords = rng.choice(grad.size, size=min(n_coords, grad.size), replace=False)
        fd = orc.central_fd(loss, params[name], coords)
        scale = np.abs(fd).max()
        assert scale > 1e-3, f"{name}: the sampled gradient is ~0, the check would be vacuous"
        assert_close(grad[coords], fd, "fp32", "fd_grad_of_max", what=f"d loss / d {name}")


# --------------------------------------------------------------------------------------------------
# Indexer.
# --------------------------------------------------------------------------------------------------
def build_indexer(seed=0, **cfg_overrides):
    cfg = make_config(**cfg_overrides)
    paddle.seed(seed)
    idxr = CSAIndexer(cfg, kind_for(cfg, 4), apply_partial_rope)
    rng = np.random.default_rng(seed)
    params = randomize_compressor(idxr.compressor, rng)
    wq = rng.standard_normal(idxr.linear_wq_b.weight.shape).astype("float32") * 0.3
    ww = rng.standard_normal(idxr.linear_weights_proj.weight.shape).astype("float32") * 0.3
    idxr.linear_wq_b.weight.set_value(wq)
    idxr.linear_weights_proj.weight.set_value(ww)
    params.update(wq=wq.astype(np.float64), ww=ww.astype(np.float64))
    return cfg, idxr, params, rng


def oracle_scores(cfg, idxr, params, x, q_latent):
    keys = oracle_compress(idxr.compressor, params, x, cfg, overlap=True)
    return orc.csa_indexer_scores(x, q_latent, params["wq"], params["ww"], keys, cfg.dsa_index_n_heads,
                              cfg.dsa_index_head_dim, yarn_freq(cfg))


def test_indexer_scores_match_oracle():
    cfg, idxr, params, rng = build_indexer()
    x = rng.standard_normal((2, 20, HIDDEN)).astype("float32")
    ql = rng.standard_normal((2, 20, cfg.q_lora_rank)).astype("float32")
    got = idxr.scores(paddle.to_tensor(x), paddle.to_tensor(ql), whole(x.shape[1])).numpy()
    want = oracle_scores(cfg, idxr, params, x, ql)
    assert got.shape == (2, 20, 5)
    assert (want > 0).any() and (want < 0).any(), "head weights of both signs must be exercised"
    assert_close(got, want, "fp32", "oracle_compressor")


@pytest.mark.parametrize("seq,topk", [(20, 3), (18, 8), (23, 1)])
def test_indexer_topk_sets_match_oracle(seq, topk):
    cfg, idxr, params, rng = build_indexer(seed=seq, dsa_index_topk=topk)
    x = rng.standard_normal((2, seq, HIDDEN)).astype("float32")
    ql = rng.standard_normal((2, seq, cfg.q_lora_rank)).astype("float32")
    ids = idxr(paddle.to_tensor(x), paddle.to_tensor(ql), whole(x.shape[1]))
    assert ids.dtype == paddle.int32, ids.dtype
    ids = ids.numpy()
    n_comp = seq // 4
    width = min(topk, n_comp)
    assert ids.shape == (2, seq, width), ids.shape
    scores = oracle_scores(cfg, idxr, params, x, ql)
    visible = orc.visible_count(seq, 4)
    tie_tol = tolerance("fp32", "topk_tie").atol  # closer oracle scores are treated as ties
    exact_rows = rows_with_invalid = rows_mask_matters = 0
    for b in range(2):
        for t in range(seq):
            row, vis = ids[b, t], int(visible[t])
            n_valid = min(width, vis)
            picked = row[row >= 0]
            assert np.all(row[row < 0] == -1), f"b={b} t={t}: invalid picks must be -1, got {row}"
            assert len(picked) == n_valid, f"b={b} t={t}: want {n_valid} valid picks of {vis} visible, got {row}"
            assert len(set(picked.tolist())) == n_valid, f"b={b} t={t}: duplicate picks {row}"
            assert np.all(picked < vis), f"b={b} t={t}: picked a not-yet-visible entry: {row} (visible {vis})"
            rows_with_invalid += int(n_valid < width)
            if n_valid == 0:
                continue
            vis_scores = scores[b, t, :vis]
            order = np.argsort(-vis_scores, kind="stable")
            chosen_min = scores[b, t, picked].min()
            if vis > n_valid:
                rows_mask_matters += int(scores[b, t, vis:].max(initial=-np.inf) > chosen_min)
                not_chosen = np.setdiff1d(np.arange(vis), picked)
                assert chosen_min >= vis_scores[not_chosen].max() - tie_tol, (
                    f"b={b} t={t}: picked {picked} but a better visible entry exists; scores {vis_scores}"
                )
                if vis_scores[order[n_valid - 1]] - vis_scores[order[n_valid]] > tie_tol:
                    assert set(picked.tolist()) == set(order[:n_valid].tolist()), f"b={b} t={t}: {row}"
                    exact_rows += 1
            else:
                assert set(picked.tolist()) == set(range(vis)), f"b={b} t={t}: must pick every visible entry: {row}"
                exact_rows += 1
    assert rows_with_invalid > 0, "no row exercised the -1 padding"
    assert exact_rows >= seq, f"only {exact_rows} rows compared exactly (too many ties)"
    if width < n_comp:
        assert rows_mask_matters > 0, "no row where a hidden entry outscored the picks: the mask is not exercised"


def test_indexer_inputs_are_detached():
    cfg, idxr, _, rng = build_indexer(seed=3)
    x = paddle.to_tensor(rng.standard_normal((1, 12, HIDDEN)).astype("float32"), stop_gradient=False)
    ql = paddle.to_tensor(rng.standard_normal((1, 12, cfg.q_lora_rank)).astype("float32"), stop_gradient=False)
    # Control: the score path itself is differentiable w.r.t. both inputs, so "no gradient" below is meaningful.
    idxr.scores(x, ql, whole(x.shape[1])).sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0
    assert ql.grad is not None and float(ql.grad.abs().sum()) > 0
    x.clear_gradient()
    ql.clear_gradient()
    idxr.clear_gradients()
    ids = idxr(x, ql, whole(x.shape[1]))
    assert ids.stop_gradient, "the top-k ids must carry no autograd graph"
    assert not x.stop_gradient and not ql.stop_gradient, "forward must not flip the caller's tensors"
    # Use the ids downstream next to a differentiable path through x: x gets exactly the direct gradient.
    gathered = paddle.take_along_axis(x, paddle.clip(ids, min=0).astype("int64")[..., :1].expand([1, 12, HIDDEN]), 1)
    (gathered.sum() + (x * 2.0).sum()).backward()
    assert ql.grad is None or float(ql.grad.abs().sum()) == 0.0, "gradient reached q_latent through the indexer"
    for name, p in idxr.named_parameters():
        assert p.grad is None or float(p.grad.abs().sum()) == 0.0, f"indexer forward built a graph into {name}"
