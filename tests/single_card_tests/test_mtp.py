"""Multi-token prediction (``num_nextn_predict_layers``), CPU fp32.

- One MTP depth against a float64 NumPy oracle of everything MTP adds around its transformer layer (whose own
  parity is tested with the layers): the shifted tokens, enorm / hnorm, e_proj + h_proj broadcast over the mHC
  streams, its mHC head, final norm, the shared LM head and the masked cross-entropy of the tokens k + 1 ahead.
  A planted off-by-one shift fails it.
- The returned loss and logits are the LM's (bitwise equal to the model without MTP); the MTP loss joins the
  gradients linearly with ``mtp_loss_scaling_factor``.
- Training on the built-in corpus lowers both losses; FlexCheckpoint saves and resumes the MTP weights
  (``mtp_layers.*``) bitwise; Hugging Face export writes them as the official ``mtp.<k>.*`` (transformers loads
  the directory and ignores them) and import reads them back.
- Bad configs: MTP under context parallelism, a missing trailing ``csa_compress_ratios`` entry.
- Uniform full recompute re-runs each depth as one unit, bitwise equal to no recompute (a depth planted to
  compute differently when re-run must change the gradients; ``block`` leaves the depths alone).
"""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from fleet_ext.config import load_config
from fleet_ext.models import DSv4ForCausalLM
from fleet_ext.models.mtp import shifted
from tests.helpers import oracles
from tests.helpers.asserts import assert_bitwise, assert_close
from tests.helpers.configs import move_constant_inits, tiny_model

MTP = {"num_nextn_predict_layers": 2, "csa_compress_ratios": [0, 4, 128, -1, 0, 4]}


def _model(seed: int = 0, **overrides) -> DSv4ForCausalLM:
    paddle.seed(seed)
    model = DSv4ForCausalLM(load_config(tiny_model(**{**MTP, **overrides})))
    move_constant_inits(model, np.random.default_rng(seed), 0.1)
    return model


def _batch(seq: int = 24, batch: int = 2, seed: int = 1) -> tuple[paddle.Tensor, paddle.Tensor]:
    ids = np.random.default_rng(seed).integers(1, 64, (batch, seq + 1))
    return paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(ids[:, 1:])


def _oracle_depth_loss(model, depth: int, hidden_in, decoder_out, ids, labels, shift) -> float:
    """Float64: the depth's decoder input from its inputs, and its loss from the decoder's output."""
    m = model.mtp_layers[depth - 1]
    p = {k: oracles.f64(v.numpy()) for k, v in m.state_dict().items() if not k.startswith("decoder.")}
    emb = oracles.f64(model.word_embeddings.weight.numpy())
    eps = model.config.model.rms_norm_eps
    ahead = np.concatenate([ids[:, shift:], np.repeat(ids[:, -1:], shift, axis=1)], axis=1)
    token = oracles.rms_norm(emb[ahead], p["enorm.weight"], eps) @ p["e_proj.weight"]
    x = oracles.rms_norm(hidden_in, p["hnorm.weight"], eps) @ p["h_proj.weight"] + token[:, :, None, :]
    head_in = oracles.hc_head(decoder_out, p["mhc_head.fn"], p["mhc_head.base"], p["mhc_head.scale"],
                              model.config.model.mhc_eps, eps)
    logits = oracles.rms_norm(head_in, p["final_layernorm.weight"], eps) @ oracles.f64(
        model.output_layer.weight.numpy())
    target = labels[:, shift:]  # position i predicts labels[i + k]; the last k positions have none
    logits = logits[:, : labels.shape[1] - shift]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    return x, float(nll.mean())


def _capture_decoders(model) -> list[tuple]:
    """(input streams, output streams) of every MTP decoder in the next forward, via forward hooks."""
    seen: list[tuple] = []
    for mtp in model.mtp_layers:
        mtp.decoder.register_forward_post_hook(
            lambda layer, inputs, output: seen.append((inputs[0].numpy(), output.numpy())))
    return seen


@pytest.mark.parametrize("planted_shift", [0, 1])
def test_each_depth_matches_the_float64_oracle(planted_shift):
    """``planted_shift`` 1 feeds the oracle the token one place off (the classic MTP bug): it must fail."""
    model = _model()
    inputs, labels = _batch()
    seen = _capture_decoders(model)
    main_streams = []
    model.layers[-1].register_forward_post_hook(lambda layer, inputs, output: main_streams.append(output.numpy()))
    model.train()
    model(inputs, labels)
    losses = []
    hidden = oracles.f64(main_streams[0])
    for depth, (decoder_in, decoder_out) in enumerate(seen, start=1):
        x, loss = _oracle_depth_loss(model, depth, hidden, oracles.f64(decoder_out), inputs.numpy(), labels.numpy(),
                                     depth + planted_shift)
        if planted_shift:
            assert not np.allclose(x, decoder_in, rtol=1e-4, atol=1e-4)
            return
        assert_close(decoder_in, x, "fp32", "oracle_layer", what=f"depth {depth} decoder input")
        losses.append(loss)
        hidden = oracles.f64(decoder_out)
    assert len(losses) == 2
    assert abs(float(model.mtp_loss) - np.mean(losses)) <= 1e-5 * np.mean(losses), (float(model.mtp_loss), losses)


def test_loss_and_logits_stay_the_lm_ones():
    """MTP changes neither the returned logits nor the returned loss: both bitwise those of the same main weights
    without MTP layers."""
    with_mtp = _model()
    plain = DSv4ForCausalLM(load_config(tiny_model(csa_compress_ratios=MTP["csa_compress_ratios"][:4])))
    plain.set_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp_layers.")})
    inputs, labels = _batch()
    logits_a, loss_a = with_mtp(inputs, labels)
    logits_b, loss_b = plain(inputs, labels)
    assert_bitwise(logits_a, logits_b, "logits")
    assert_bitwise(loss_a, loss_b, "loss")
    assert with_mtp.auxiliary_losses()["mtp_loss"].item() > 0


def test_mtp_loss_enters_the_gradients_linearly_with_its_factor():
    """g(f) = g(0) + f (g(1) - g(0)) for every parameter: the MTP loss is attached at the main loss's gradient
    scale, weighted by ``mtp_loss_scaling_factor`` (and with factor 0 the MTP parameters get none)."""
    grads = {}
    for factor in (0.0, 0.5, 1.0):
        model = _model(mtp_loss_scaling_factor=factor)
        _, loss = model(*_batch())
        loss.backward()
        grads[factor] = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    assert not any(n.startswith("mtp_layers.") and np.any(g) for n, g in grads[0.0].items())
    assert any(n.startswith("mtp_layers.") for n in grads[1.0])
    for name, g in grads[1.0].items():
        base = grads[0.0].get(name, np.zeros_like(g))
        assert_close(grads[0.5][name], base + 0.5 * (g - base), "fp32", "oracle", what=name, scale=np.abs(g).max())


def test_training_with_mtp_lowers_both_losses_and_resumes_bitwise(tmp_path):
    from fleet_ext.training.trainer import Trainer

    def run(out, **overrides):
        keys = {**MTP, "csa_compress_ratios": [0, 4, 128, 4, 0, 4], "max_seq_len": 64, "per_device_train_batch_size": 4,
                "max_steps": 30, "warmup_steps": 3, "eval_steps": 0, "eval_iters": 1, "save_steps": 15,
                "disable_tqdm": True, "output_dir": str(out), **overrides}
        Trainer(load_config("configs/dsv4_tiny_cpu.yaml", **keys)).train()
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]

    full = run(tmp_path / "full")
    assert {"loss", "mtp_loss"} <= set(full[0]), full[0]
    for key in ("loss", "mtp_loss"):
        first, last = np.mean([r[key] for r in full[:3]]), np.mean([r[key] for r in full[-3:]])
        assert last < first - 0.3, (key, first, last)
    from tests.multi_card_tests.launch_helpers import checkpoint_tensors

    saved = checkpoint_tensors(tmp_path / "full" / "checkpoint-15")
    assert any(k.startswith("mtp_layers.0.decoder.") for k in saved) and "mtp_layers.1.e_proj.weight" in saved
    resumed = run(tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-15"))
    assert [(r["step"], r["loss"], r["mtp_loss"]) for r in resumed] == [
        (r["step"], r["loss"], r["mtp_loss"]) for r in full if r["step"] > 15]


def test_hugging_face_round_trip_keeps_the_mtp_weights(tmp_path):
    """Export writes ``mtp.<k>.*`` in the official release's spelling; transformers loads the directory with the same
    logits (it skips those tensors); import reads every MTP tensor back, and a directory without them builds none."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    model = _model(csa_compress_ratios=[0, 4, 128, 0, 0, 4], moe_n_hash_layers=1)
    model.save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = {"mtp.0.e_proj.weight", "mtp.1.hc_head_fn", "mtp.1.attn.wq_a.weight", "mtp.0.ffn.experts.3.w2.weight"}
    assert want <= set(tensors)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 2
    back = DSv4ForCausalLM.from_pretrained(tmp_path / "hf")
    assert back.config.model.num_nextn_predict_layers == 2
    ours, theirs = model.state_dict(), back.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert_bitwise(theirs[key], ours[key], key)
    ids = np.random.default_rng(2).integers(1, 64, (2, 11))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert_close(model(paddle.to_tensor(ids)).numpy(), hf(torch.tensor(ids)).logits.detach().numpy(), "fp32",
                 "hf_parity")
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, str(tmp_path / "hf" /
                                                                                   "model.safetensors"))
    assert DSv4ForCausalLM.from_pretrained(tmp_path / "hf").mtp_layers is None  # transformers' own saves


@pytest.mark.parametrize("overrides, message", [
    ({"context_parallel_size": 2, "max_seq_len": 64}, "`num_nextn_predict_layers` = 2: MTP under context parallelism"),
    ({"csa_compress_ratios": [0, 4, 128, -1, 0]}, "`csa_compress_ratios`"),
])
def test_bad_mtp_configs_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(tiny_model(**{**MTP, **overrides}))


def test_shifted_tokens():
    ids = paddle.to_tensor([[1, 2, 3, 4]])
    assert shifted(ids, 1).numpy().tolist() == [[2, 3, 4, 4]]
    assert shifted(ids, 2, -100).numpy().tolist() == [[3, 4, -100, -100]]
    with pytest.raises(ValueError, match="depth"):
        shifted(ids, 4)


def test_selective_recompute_reaches_the_mtp_layers_bitwise():
    """MTP layers are numbered after the main ones in the csa_compress_ratios index space, so selective recompute
    covers them; the loss and every gradient stay byte-equal to no recompute."""
    from fleet_ext.config import recompute_plan

    runs = []
    for keys in ({}, {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mhc", "moe"]}):
        model = _model(**keys)
        _, loss = model(*_batch())
        loss.backward()
        runs.append((loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert recompute_plan(model.config).modules.get(5) == frozenset({"core_attn", "mhc", "moe"})
    assert_bitwise(runs[1][0], runs[0][0], "loss")
    assert sorted(runs[0][1]) == sorted(runs[1][1])
    for name, grad in runs[0][1].items():
        assert_bitwise(runs[1][1][name], grad, name)


def _mtp_step(rerun_differs: bool, **keys) -> dict:
    """Loss, MTP loss and every gradient of one step; ``rerun_differs`` plants a depth whose backward re-run (and
    only it) reads its input streams scaled by 1.001."""
    from fleet_ext.models.mtp import MultiTokenPredictionLayer
    from fleet_ext.parallel.recompute import recording

    original = MultiTokenPredictionLayer.forward

    def planted(self, hidden, *args):
        return original(self, hidden if recording() else hidden * 1.001, *args)

    MultiTokenPredictionLayer.forward = planted if rerun_differs else original
    try:
        model = _model(**keys)
        _, loss = model(*_batch())
        loss.backward()
    finally:
        MultiTokenPredictionLayer.forward = original
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss, "mtp_loss": model.mtp_loss, **grads}


@pytest.mark.parametrize("method, rerun_differs", [("uniform", False), ("uniform", True), ("block", True)])
def test_full_recompute_reruns_the_mtp_depths_bitwise(method, rerun_differs):
    """Uniform full recompute runs each MTP depth (projections, decoder layer, its mHC head and norm; not the shared
    LM head nor the loss) as one more recomputed unit, as Megatron-core's MTP layers: loss, MTP loss and every
    gradient byte-equal to no recompute (CPU fp32). Planted: a depth that computes differently when re-run changes
    the gradients under uniform (the depths really re-run) and not under block, which names the first
    ``recompute_num_layers`` layers only (Megatron-core skips MTP there too)."""
    want = _mtp_step(False)
    got = _mtp_step(rerun_differs, recompute_granularity="full", recompute_method=method, recompute_num_layers=2)
    assert sorted(got) == sorted(want) and any(k.startswith("mtp_layers.1.decoder.") for k in want)
    differ = [k for k in want if not np.array_equal(got[k].numpy(), want[k].numpy())]
    if method == "uniform" and rerun_differs:
        assert differ and not {"loss", "mtp_loss"} & set(differ), differ  # only the backward sees the re-run
        assert any(k.startswith("mtp_layers.0.") for k in differ), differ
        return
    for key in want:
        assert_bitwise(got[key], want[key], key)
