"""Hugging Face in and out of training (one process, real Trainer runs on the built-in corpus).

In: ``model_name_or_path`` names a tiny random transformers DeepSeek-V4 / DeepSeek-V3.2 directory; the model
gets that architecture (training keys stay the YAML's) and exactly its weights, and the first step's loss equals
the loss transformers computes on the same batch. Out: ``scripts/export_hf.py`` turns the checkpoint of a short
run into a directory transformers loads with the same logits as the trained fleet_ext model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import paddle
import pytest
from helpers import tolerance

torch = pytest.importorskip("torch", reason="HF interop needs torch (installed by the `test` extra)")
transformers = pytest.importorskip("transformers", reason="HF interop needs transformers==5.23.0 (`test` extra)")

from fleet_ext.config import load_config  # noqa: E402
from fleet_ext.training import cli  # noqa: E402
from fleet_ext.training.hf_interop import export_main, resolve_config  # noqa: E402
from fleet_ext.training.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "configs" / "dsv4_tiny_cpu.yaml"
LOSS_TOL = tolerance("fp32", "hf_first_step_loss").rtol
LOGIT_TOL = tolerance("fp32", "hf_parity").atol
VOCAB = 256  # the built-in corpus is byte tokens
SEQ = 45  # not a multiple of the compression rates (4, 8) or the window
RUN = {"max_steps": 1, "max_seq_len": SEQ, "per_device_train_batch_size": 2, "eval_iters": 0, "warmup_steps": 0,
       "disable_tqdm": True, "learning_rate": 1e-3}
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _perturb(model, generator) -> None:
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # norms, sinks, mHC bases / scales, the indexer's LayerNorm: off their init
                param.add_(0.2 * torch.randn(param.shape, generator=generator))


def _hf_v4():
    config = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        head_dim=16, q_lora_rank=12, num_experts_per_tok=2, n_routed_experts=4, sliding_window=16, o_groups=2,
        o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=3, partial_rotary_factor=0.5,
        initializer_range=0.1, max_position_embeddings=512, layer_types=[SWA, CSA, HCA],
        mlp_layer_types=["hash_moe", "moe", "moe"], scoring_func="sqrtsoftplus", compress_rates={CSA: 4, HCA: 8},
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    _perturb(model, generator)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.tid2eid.copy_(
            torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(VOCAB)])
        )
    return model


def _hf_v32():
    config = transformers.DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=7, initializer_range=0.1,
        max_position_embeddings=512, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    _perturb(model, torch.Generator().manual_seed(1))
    return model


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v32"])
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = _hf_v4() if request.param == "deepseek_v4" else _hf_v32()
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def first_step(hf_dir, tmp_path_factory):
    """A one-step run from the HF directory: (trainer, its run summary, the model's weights before the step)."""
    path, _ = hf_dir
    out = tmp_path_factory.mktemp("run")
    trainer = Trainer(load_config(TINY_YAML, **RUN, model_name_or_path=str(path), output_dir=str(out)))
    before = {k: v.numpy().copy() for k, v in trainer.model.state_dict().items()}
    summary = trainer.train()
    return trainer, summary, before


def _hf_loss(model, trainer) -> float:
    inputs, labels = (torch.from_numpy(np.ascontiguousarray(a))
                      for a in trainer.data.train.get(trainer.order.sample_ids(0, 0, 0)))
    with torch.no_grad():  # labels are aligned with the inputs: transformers' shift_labels
        out = model(input_ids=inputs, labels=labels, shift_labels=labels)
    return float(out.loss)


def test_architecture_comes_from_the_directory_and_training_keys_from_the_yaml(hf_dir, first_step):
    path, hf = hf_dir
    trainer, _, before = first_step
    m, t = trainer.config.model, trainer.config.training
    assert (m.hidden_size, m.num_hidden_layers, m.vocab_size) == (32, 3, VOCAB)
    assert (t.max_seq_len, t.learning_rate, t.model_name_or_path) == (SEQ, 1e-3, str(path))
    if hf.config.model_type == "deepseek_v32":
        assert m.csa_compress_ratios == [-2, -2, -2] and trainer.config.moe.n_group == 4
    else:
        assert m.csa_compress_ratios == [0, 4, 128] and m.hca_compress_ratio == 8
    # Exactly the directory's weights before the first step.
    hf_embed = hf.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(before["word_embeddings.weight"], hf_embed)
    np.testing.assert_array_equal(before["final_layernorm.weight"], hf.model.norm.weight.detach().numpy())


def test_first_step_loss_equals_transformers_loss(hf_dir, first_step):
    _, hf = hf_dir
    trainer, summary, _ = first_step
    want = _hf_loss(hf, trainer)
    got = summary["first_loss"]
    assert abs(got - want) <= LOSS_TOL * abs(want), f"first-step loss {got!r} vs transformers {want!r}"


def test_random_init_misses_the_loss(hf_dir, first_step, tmp_path):
    """Negative control: the same run without model_name_or_path (random weights) is far from transformers' loss."""
    _, hf = hf_dir
    trainer, _, _ = first_step
    config = trainer.config.replace(model_name_or_path=None, output_dir=str(tmp_path))
    fresh = Trainer(config).train()["first_loss"]
    want = _hf_loss(hf, trainer)
    assert abs(fresh - want) > 100 * LOSS_TOL * abs(want), "random weights give the same loss: the test is vacuous"


def _hf_logits(path: Path, ids: np.ndarray, model_type: str) -> np.ndarray:
    cls = transformers.DeepseekV32ForCausalLM if model_type == "deepseek_v32" else transformers.DeepseekV4ForCausalLM
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(torch.from_numpy(ids)).logits.numpy()


def _ours(model, ids: np.ndarray) -> np.ndarray:
    model.eval()
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).numpy()


def test_export_of_the_trained_checkpoint_round_trips(hf_dir, first_step, tmp_path):
    """The checkpoint of the run from the HF directory exports to the same format, with the trained weights."""
    _, hf = hf_dir
    trainer, summary, before = first_step
    assert summary["checkpoint"] and Path(summary["checkpoint"]).name == "checkpoint-1"
    assert export_main([summary["checkpoint"], str(tmp_path)]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == hf.config.model_type
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(2, 51))
    after = trainer.model.state_dict()["word_embeddings.weight"].numpy()
    assert np.abs(after - before["word_embeddings.weight"]).max() > 1e-5, "the step must have moved the weights"
    diff = np.abs(_ours(trainer.model, ids) - _hf_logits(tmp_path, ids, hf.config.model_type)).max()
    assert diff <= LOGIT_TOL, f"max |logit diff| after export {diff:.3e}"


def test_export_of_a_tiny_training_run(tmp_path):
    """scripts/export_hf.py on checkpoint-2 of the tiny YAML (DeepSeek-V4 layers, mHC, hash routing)."""
    run = {**RUN, "max_steps": 2, "max_seq_len": 64}
    trainer = Trainer(load_config(TINY_YAML, **run, output_dir=str(tmp_path / "run")))
    summary = trainer.train()
    out = tmp_path / "hf"
    assert export_main([summary["checkpoint"], str(out)]) == 0
    ids = np.random.default_rng(6).integers(0, VOCAB, size=(2, 150))  # > 128: the HCA layer has an entry
    expected = _hf_logits(out, ids, "deepseek_v4")
    assert np.abs(expected).max() > 0.5
    diff = np.abs(_ours(trainer.model, ids) - expected).max()
    assert diff <= LOGIT_TOL, f"max |logit diff| {diff:.3e}"


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    assert export_main([str(tmp_path), str(tmp_path / "hf")]) == 2
    assert "not a complete training checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_yaml_keys_the_directory_sets_are_replaced_with_a_warning(hf_dir, caplog):
    path, _ = hf_dir
    config = load_config(TINY_YAML, model_name_or_path=str(path), dsa_indexer_loss_coeff=0.0, seed=5)
    with caplog.at_level(logging.WARNING, logger="fleet_ext.training.hf_interop"):
        resolved = resolve_config(config)
    assert "hidden_size: 64 -> 32" in caplog.text and resolved.training.seed == 5
    assert resolve_config(resolved).to_dict() == resolved.to_dict(), "resolving twice changes nothing"
    assert resolve_config(load_config(TINY_YAML)).to_dict() == load_config(TINY_YAML).to_dict()


def test_a_missing_directory_exits_2_before_training(tmp_path, capsys):
    code = cli.main(["--config", str(TINY_YAML), "--model_name_or_path", str(tmp_path / "nope"),
                     "--output_dir", str(tmp_path / "run")])
    assert code == cli.EXIT_BAD_INPUT
    assert "config key `model_name_or_path`" in capsys.readouterr().err and not (tmp_path / "run").exists()
