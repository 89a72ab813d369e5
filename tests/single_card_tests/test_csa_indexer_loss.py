"""The CSA lightning indexer's KL loss (``dsa_indexer_loss_coeff > 0`` with CSA layers).

Checked on every CSA layer of a tiny model against a float64 NumPy oracle (tests/helpers/oracles.py): the loss
value (the target is the main attention's per-head mass at the picked compressed entries, under the sparse
attention's sink-inclusive lse, summed over heads and L1-normalised over the picks; the student the softmax of the
index scores over the same picks; padding rows skipped), its gradient with respect to the student scores, and
central differences of the oracle for entries of every indexer parameter kind. Planted target errors (no L1
normalisation, a per-head softmax over the picks alone) fail that check (negative controls). Then: the KL sends
no gradient into the backbone and leaves the LM loss and logits bitwise unchanged, ``train_indexer_only`` trains
the CSA and -2 indexers only, full recompute replays the picks and logs the value once (bitwise), and a short
training run logs ``indexer_loss`` with its split by layer kind.

Tolerances (tests/helpers/tolerances.py, fp32): ``csa_kl_loss``, ``csa_kl_grad``, ``csa_kl_fd``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from helpers import TINY_HYBRID_MLA, assert_bitwise, assert_close, move_constant_inits, tiny_model
from helpers import oracles as orc

from fleet_ext.layer_kinds import LayerKind, layer_attention
from fleet_ext.layers.csa_indexer import CSAIndexer
from fleet_ext.layers.dsa_indexer import DSAIndexer
from fleet_ext.models import DSv4ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
SEQ, BATCH, COEFF, SCALE = 26, 2, 0.1, 2.0
# Three CSA layers (ratios 4, 4, 8: with top-k 3 the ratio-4 layers choose 3 of up to 6 entries, the ratio-8
# layer keeps all 3 of its entries), a window layer between them; the indexer ropes 8 of its 16 channels.
CSA = tiny_model(csa_compress_ratios=[4, 0, 4, 8], dsa_index_head_dim=16, dsa_index_topk=3, pad_token_id=0)


def _model(overrides: dict | None = None, seed: int = 0) -> DSv4ForCausalLM:
    paddle.seed(seed)
    model = DSv4ForCausalLM({**CSA, **(overrides or {})})
    rng = np.random.default_rng(seed)
    move_constant_inits(model, rng, 0.3)
    for name, param in model.named_parameters():  # O(1) index scores, so the student's softmax is not flat
        if ".indexer." in name and name.endswith(("linear_wq_b.weight", "linear_weights_proj.weight")):
            param.set_value(param.numpy() * 8.0)
    return model


def _ids(seed: int = 3, pad_tail: int = 4) -> paddle.Tensor:
    ids = np.random.default_rng(seed).integers(1, 64, (BATCH, SEQ))
    ids[1, SEQ - pad_tail :] = 0  # padding rows (pad_token_id 0): skipped by the KL
    return paddle.to_tensor(ids)


def _csa_layers(model: DSv4ForCausalLM) -> list[int]:
    m = model.config.model
    return [i for i in range(m.num_hidden_layers) if layer_attention(m, i).kind is LayerKind.CSA]


# --------------------------------------------------------------------------------------------------
# The float64 oracle of one CSA layer's KL, from the inputs its core attention received.
# --------------------------------------------------------------------------------------------------
def _yarn_freq(m) -> np.ndarray:
    return orc.yarn_inv_freq(m.qk_pos_emb_head_dim, m.csa_compress_rotary_base, m.rotary_scaling_factor,
                             m.original_max_position_embeddings, m.beta_fast, m.beta_slow)


def _compressor_params(comp) -> dict[str, np.ndarray]:
    return {"wkv": comp.linear_wkv.weight.numpy().astype(np.float64),
            "wgate": comp.linear_wgate.weight.numpy().astype(np.float64),
            "ape": comp.ape.numpy().astype(np.float64), "norm": comp.norm.weight.numpy().astype(np.float64)}


class LayerOracle:
    """Everything of one CSA layer's KL in float64: the support (the layer's picks), the target's per-head
    probabilities and the student scores as a function of the indexer's parameters (for central differences)."""

    def __init__(self, model: DSv4ForCausalLM, layer: int, inputs: tuple, ids: np.ndarray) -> None:
        m = model.config.model
        core = model.layers[layer].self_attention.core_attention
        query, kv, x, q_latent, layout, _ = inputs
        self.picks = core.indexer(x, q_latent, layout).numpy().astype(np.int64)  # [b, s, k], -1 invalid
        self.x, self.q_latent = x.numpy().astype(np.float64), q_latent.numpy().astype(np.float64)
        self.m, self.ratio, self.freq = m, core.ratio, _yarn_freq(m)
        self.row_mask = ids != m.pad_token_id
        comp = _compressor_params(core.compressor)
        entries = orc.compressor(self.x, comp["wkv"], comp["wgate"], comp["ape"], comp["norm"], core.ratio,
                                 core.compressor.head_dim, True, self.freq, m.rms_norm_eps)
        kv_full = np.concatenate([kv.numpy().astype(np.float64), entries], axis=1)
        width = min(core.window, SEQ)
        window = np.arange(SEQ)[:, None] - width + 1 + np.arange(width)[None, :]  # t-W+1 .. t
        window = np.broadcast_to(np.where(window >= 0, window, -1), (BATCH, SEQ, width))
        table = np.concatenate([window, np.where(self.picks >= 0, self.picks + SEQ, -1)], axis=-1)
        probs = orc.sparse_attention_probs(query.numpy(), kv_full, table, core.attn_sink.numpy(), core.scale)
        self.window_probs, self.probs = probs[..., :SEQ], probs[..., SEQ:]  # [b, h, s, n_comp]
        self.cand = np.zeros((BATCH, SEQ, entries.shape[1]), dtype=bool)
        for b, t, k in zip(*np.nonzero(self.picks >= 0)):
            self.cand[b, t, self.picks[b, t, k]] = True
        ix = core.indexer
        self.params = {**_compressor_params(ix.compressor), "wq": ix.linear_wq_b.weight.numpy().astype(np.float64),
                       "ww": ix.linear_weights_proj.weight.numpy().astype(np.float64)}

    def scores(self) -> np.ndarray:
        p, m = self.params, self.m
        keys = orc.compressor(self.x, p["wkv"], p["wgate"], p["ape"], p["norm"], self.ratio, m.dsa_index_head_dim,
                              True, self.freq, m.rms_norm_eps)
        return orc.csa_indexer_scores(self.x, self.q_latent, p["wq"], p["ww"], keys, m.dsa_index_n_heads,
                                      m.dsa_index_head_dim, self.freq)

    def kl(self, probs: np.ndarray | None = None) -> float:
        return orc.kl_rows(self.probs if probs is None else probs, self.scores(), self.cand, self.row_mask)

    def slot_grad(self, probs: np.ndarray | None = None) -> np.ndarray:
        """d KL / d student [b, s, k] in the layer's slot order (0 on -1 slots)."""
        grad = orc.kl_rows_grad(self.probs if probs is None else probs, self.scores(), self.cand, self.row_mask)
        out = np.take_along_axis(grad, np.clip(self.picks, 0, None), axis=-1)
        return np.where(self.picks >= 0, out, 0.0)


def _planted_probs(oracle: LayerOracle, planted: str) -> np.ndarray:
    """Target probabilities with a planted error (``kl_rows`` sums them over heads and L1-normalises)."""
    if planted == "per_head_softmax_over_picks":  # each head normalised over the picks alone: window and sink
        mass = oracle.probs.sum(axis=-1, keepdims=True)  # left out of the lse, so every head weighs the same
        return np.where(mass > 0, oracle.probs / np.where(mass > 0, mass, 1.0), 0.0)
    raise ValueError(planted)


def _unnormalised_kl(oracle: LayerOracle) -> float:
    """The KL with the head-summed target not L1-normalised over the picks (a planted error)."""
    scores, total, rows = oracle.scores(), 0.0, 0
    for b, t in zip(*np.nonzero(oracle.cand.any(-1) & oracle.row_mask)):
        keys = np.nonzero(oracle.cand[b, t])[0]
        p = oracle.probs[b, :, t][:, keys].sum(axis=0)  # [k]: the picks' head-summed mass
        z = scores[b, t, keys]
        log_q = z - z.max() - np.log(np.exp(z - z.max()).sum())
        total += float((p * (np.log(p) - log_q)).sum())
        rows += 1
    return total / rows


def _run(model: DSv4ForCausalLM, ids: paddle.Tensor, monkeypatch) -> tuple[dict, dict, paddle.Tensor]:
    """One training forward/backward; the inputs of every CSA core and the gradient of every student."""
    inputs, student_grads = {}, {}
    original = CSAIndexer.gathered_scores

    def spy(self, *args):
        out, key = original(self, *args), id(self)
        out.register_hook(lambda g: student_grads.__setitem__(key, g.numpy().copy()))
        return out

    monkeypatch.setattr(CSAIndexer, "gathered_scores", spy)
    hooks = [model.layers[i].self_attention.core_attention.register_forward_pre_hook(
        lambda layer, args, i=i: inputs.__setitem__(i, args)) for i in _csa_layers(model)]
    model.train()
    model.set_aux_loss_backward_scale(SCALE)
    _, loss = model(ids, labels=ids)
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {i: student_grads[id(model.layers[i].self_attention.core_attention.indexer)] for i in inputs}
    return inputs, grads, loss


def _check(layer: int, got_kl: float, got_grad: np.ndarray, want_kl: float, want_grad: np.ndarray) -> None:
    assert_close(got_kl, want_kl, "fp32", "csa_kl_loss", what=f"layer {layer} KL")
    assert_close(got_grad, COEFF * SCALE * want_grad, "fp32", "csa_kl_grad", what=f"layer {layer} d student")


@pytest.fixture(scope="module")
def checked(request):
    """The model after one training step's backward, with each CSA layer's oracle (shared by the tests below)."""
    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    model = _model({"dsa_indexer_loss_coeff": COEFF})
    ids = _ids()
    inputs, grads, _ = _run(model, ids, mp)
    oracles = {i: LayerOracle(model, i, inputs[i], ids.numpy()) for i in inputs}
    return model, grads, oracles


def test_kl_and_its_student_gradient_match_the_float64_oracle_on_every_csa_layer(checked):
    model, grads, oracles = checked
    assert sorted(oracles) == _csa_layers(model) == [0, 2, 3]
    for i, oracle in oracles.items():
        got = float(model.layers[i].self_attention.indexer_loss)
        want = oracle.kl()
        assert want > 1e-3, f"layer {i}: the KL is ~0, the comparison would be vacuous"
        assert (oracle.picks < 0).any() and not oracle.row_mask.all(), "the -1 slots and padding rows must occur"
        _check(i, got, grads[i], want, oracle.slot_grad())
    assert sorted(model.indexer_losses()) == [0, 2, 3]


@pytest.mark.parametrize("name, coords", [("wq", 6), ("ww", 6), ("wkv", 6), ("wgate", 4), ("ape", 4), ("norm", 4)])
def test_indexer_parameter_gradients_match_central_differences(checked, name, coords):
    """Every indexer parameter kind: fp32 autograd of the model vs central differences of the float64 KL."""
    model, _, oracles = checked
    attr = {"wq": "linear_wq_b.weight", "ww": "linear_weights_proj.weight", "wkv": "compressor.linear_wkv.weight",
            "wgate": "compressor.linear_wgate.weight", "ape": "compressor.ape", "norm": "compressor.norm.weight"}
    params = dict(model.named_parameters())
    rng = np.random.default_rng(5)
    for i, oracle in oracles.items():
        grad = params[f"layers.{i}.self_attention.core_attention.indexer.{attr[name]}"].grad.numpy().reshape(-1)
        picked = rng.choice(grad.size, size=min(coords, grad.size), replace=False)
        top = int(np.argmax(np.abs(grad)))  # and the largest entry, so the check is not vacuous
        picked = np.unique(np.append(picked, top))
        fd = orc.central_fd(oracle.kl, oracle.params[name], picked)
        assert np.abs(fd).max() > 1e-4, f"layer {i} {name}: the sampled gradient is ~0"
        assert_close(grad[picked] / (COEFF * SCALE), fd, "fp32", "csa_kl_fd", what=f"layer {i} d KL / d {name}",
                     scale=np.abs(grad).max() / (COEFF * SCALE))


@pytest.mark.parametrize("planted", ["unnormalised", "per_head_softmax_over_picks"])
def test_planted_target_errors_fail_the_oracle_check(checked, planted):
    """Negative control: the same comparison against a target with a planted error must fail on some layer."""
    model, grads, oracles = checked
    failures = 0
    for i, oracle in oracles.items():
        got = float(model.layers[i].self_attention.indexer_loss)
        if planted == "unnormalised":
            want_kl, want_grad = _unnormalised_kl(oracle), oracle.slot_grad()
        else:
            probs = _planted_probs(oracle, planted)
            want_kl, want_grad = oracle.kl(probs), oracle.slot_grad(probs)
        try:
            _check(i, got, grads[i], want_kl, want_grad)
        except AssertionError:
            failures += 1
    assert failures == len(oracles), f"{planted}: only {failures} of {len(oracles)} layers caught the planted error"


# --------------------------------------------------------------------------------------------------
# Gradient isolation and the unchanged LM path.
# --------------------------------------------------------------------------------------------------
def _step(overrides: dict, scale: float = 1.0) -> dict:
    model = _model(overrides)
    model.train()
    model.set_aux_loss_backward_scale(scale)
    ids = _ids()
    logits, loss = model(ids, labels=ids)
    loss.backward()
    return {"logits": logits.numpy(), "loss": loss.numpy(), "model": model,
            "grads": {n: None if p.grad is None else p.grad.numpy().copy() for n, p in model.named_parameters()}}


def test_the_kl_sends_no_gradient_into_the_backbone_and_leaves_the_lm_path_bitwise():
    off, on = _step({}), _step({"dsa_indexer_loss_coeff": COEFF})
    assert_bitwise(on["logits"], off["logits"], "logits")
    assert_bitwise(on["loss"], off["loss"], "LM loss")
    indexer = [n for n in off["grads"] if ".indexer." in n]
    assert len(indexer) == 3 * 6
    for name, grad in off["grads"].items():
        if name in indexer:
            assert grad is None or not grad.any(), f"{name}: the LM loss reached the indexer"
            assert np.abs(on["grads"][name]).max() > 0, f"{name}: the KL did not reach the indexer"
        elif grad is not None:
            assert_bitwise(on["grads"][name], grad, name)
        else:
            assert on["grads"][name] is None, f"{name}: a gradient appeared with the KL"
    assert off["model"].indexer_losses() == {}
    model = on["model"]
    model.eval()
    ids = _ids()
    assert_bitwise(model(ids).numpy(), off["logits"], "eval logits")
    assert model.indexer_losses() == {}, "no KL outside training"
    model.train()
    with paddle.no_grad():
        model(ids)
    assert model.indexer_losses() == {}, "no KL without gradients"


def test_the_kl_gradient_scales_with_the_main_loss_backward_scale():
    one, two = _step({"dsa_indexer_loss_coeff": COEFF}), _step({"dsa_indexer_loss_coeff": COEFF}, scale=2.0)
    for name, grad in one["grads"].items():
        if ".indexer." in name:
            assert_close(two["grads"][name], 2 * grad, "fp32", "loss_scale_linearity", what=name)


def test_full_recompute_replays_the_picks_and_logs_the_kl_once():
    """Bitwise: logits, loss, every gradient and the logged KL, with and without full recompute."""
    coeff = {"dsa_indexer_loss_coeff": COEFF}
    want = _step(coeff)
    got = _step({**coeff, "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2})
    for key in ("logits", "loss"):
        assert_bitwise(got[key], want[key], key)
    for name, grad in want["grads"].items():
        assert (grad is None) == (got["grads"][name] is None), name
        if grad is not None:
            assert_bitwise(got["grads"][name], grad, name)
    losses = got["model"].indexer_losses()
    assert sorted(losses) == [0, 2, 3]
    for i, value in want["model"].indexer_losses().items():
        assert_bitwise(losses[i].numpy(), value.numpy(), f"layer {i} logged KL")


# --------------------------------------------------------------------------------------------------
# Indexer warm-up and the metrics.
# --------------------------------------------------------------------------------------------------
MIXED = {**TINY_HYBRID_MLA, "csa_compress_ratios": [4, -2, 0, 4], "hybrid_mla_attention": "mqa_dsa"}


def test_train_indexer_only_trains_the_csa_and_dsa_indexers_only():
    model = _model({**MIXED, "train_indexer_only": True, "dsa_indexer_loss_coeff": 1.0})
    assert model.indexer_layers() == {"csa": [0, 3], "mla": [1]}
    trainable = model.freeze_for_indexer_warmup()
    indexers = {prefix for prefix, sub in model.named_sublayers() if isinstance(sub, (CSAIndexer, DSAIndexer))}
    assert len(indexers) == 3 and all(any(n.startswith(p + ".") for p in indexers) for n in trainable)
    ids = _ids()
    _, loss = model(ids, labels=ids)
    loss.backward()
    seen = 0
    for name, param in model.named_parameters():
        if any(name.startswith(p + ".") for p in indexers):
            seen += 1
            assert not param.stop_gradient and np.abs(param.grad.numpy()).max() > 0, name
        else:
            assert param.stop_gradient and param.grad is None, f"frozen {name} got a gradient"
    assert seen == len(trainable) == 2 * 6 + 5
    assert sorted(model.indexer_losses()) == [0, 1, 3]
    by_kind = model.indexer_losses_by_kind()
    assert sorted(by_kind["csa"]) == [0, 3] and sorted(by_kind["mla"]) == [1]


def test_a_training_run_logs_the_indexer_loss_per_layer_kind(tmp_path):
    from fleet_ext.config import load_config
    from fleet_ext.training.trainer import Trainer

    keys = {**MIXED, "dsa_indexer_loss_coeff": 0.01, "dsa_indexer_use_sparse_loss": True, "max_seq_len": 64,
            "per_device_train_batch_size": 2, "max_steps": 3, "warmup_steps": 1, "eval_steps": 0, "eval_iters": 1,
            "save_steps": 0, "logging_steps": 1, "disable_tqdm": True, "output_dir": str(tmp_path)}
    Trainer(load_config(ROOT / "configs" / "dsv4_tiny_cpu.yaml", **keys)).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(rows) == 3
    for row in rows:
        assert {"indexer_loss", "indexer_loss_csa", "indexer_loss_mla"} <= set(row), row
        assert row["indexer_loss_csa"] > 0 and row["indexer_loss_mla"] > 0, row
        # The overall value is the mean over the three layers: two CSA, one -2.
        mean = (2 * row["indexer_loss_csa"] + row["indexer_loss_mla"]) / 3
        assert abs(row["indexer_loss"] - mean) <= 1e-6 * mean, row
