"""Training data: token file format, built-in corpus, packing, the sample order (deterministic, disjoint,
resumable, identical micro-batches for DP=2 and DP=1 x 2 accumulation) and early errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fleet_ext.config import load_config
from fleet_ext.training import data as D

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("vocab, itemsize", [(256, 1), (50_000, 2), (129_280, 4)])
def test_token_file_round_trip_is_memory_mapped(tmp_path, vocab, itemsize):
    ids = np.random.default_rng(0).integers(0, vocab, 1000)
    path = tmp_path / "t.bin"
    D.write_token_file(path, ids, vocab)
    assert path.stat().st_size == 32 + 1000 * itemsize
    tf = D.read_token_file(path)
    assert isinstance(tf.tokens, np.memmap) and tf.vocab_size == vocab
    np.testing.assert_array_equal(np.asarray(tf.tokens), ids)


def test_token_file_errors_name_the_key_the_file_and_the_fix(tmp_path):
    with pytest.raises(D.DataError, match=r"`train_dataset_path` = '.*missing.bin': the file does not exist.*Fix"):
        D.read_token_file(tmp_path / "missing.bin")
    with pytest.raises(D.DataError, match="is not a file"):
        D.read_token_file(tmp_path)
    (tmp_path / "text.bin").write_bytes(b"hello world, this is not a token file at all")
    with pytest.raises(D.DataError, match=r"not a fleet_ext token file \(magic b'hello wo'"):
        D.read_token_file(tmp_path / "text.bin", key="eval_dataset_path")
    D.write_token_file(tmp_path / "t.bin", np.arange(100), 256)
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-10])
    with pytest.raises(D.DataError, match="truncated or padded: the header says 100 tokens"):
        D.read_token_file(tmp_path / "cut.bin")
    with pytest.raises(D.DataError, match=r"ids must lie in \[0, 256\)"):
        D.write_token_file(tmp_path / "bad.bin", np.array([3, 300]), 256)


def test_builtin_corpus_is_small_public_domain_text_with_sources():
    files = D.builtin_corpus_files()
    tokens = D.builtin_corpus()
    assert 50_000 < len(tokens) < 3_000_000  # "a few MB at most"
    assert int((tokens == D.EOD_ID).sum()) == len(files)  # one end-of-document per file
    sources = (ROOT / "fleet_ext" / "data" / "SOURCES.md").read_text()
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert text.isascii() and len(text) > 2000, path.name
        assert f"`{path.name}`" in sources, f"{path.name} is not listed in SOURCES.md"
    assert D.ByteTokenizer().decode(tokens[:26]) == "The Declaration of Indepen"


def test_packing_gives_shifted_labels():
    seq = D.PackedSequences(np.arange(50, dtype=np.uint16), seq_len=8, name="t")
    assert len(seq) == 6  # (50 - 1) // 8
    inputs, labels = seq.get([0, 5])
    assert inputs.dtype == np.int64 and inputs.shape == (2, 8)
    np.testing.assert_array_equal(inputs[1], np.arange(40, 48))
    np.testing.assert_array_equal(labels[1], np.arange(41, 49))


def test_sample_order_is_disjoint_per_step_and_covers_each_epoch_once():
    order = D.SampleOrder(num_samples=37, micro_batch=2, accumulation=3, world_size=2, seed=7)
    assert order.global_batch == 12
    seen = []
    for step in range(3):  # 36 samples: less than one epoch
        batch = [i for m in range(3) for r in range(2) for i in order.sample_ids(step * 12, m, r)]
        assert len(set(batch)) == 12
        seen += batch
    assert len(set(seen)) == 36
    epoch0 = [order._permutation(0)[k] for k in range(37)]
    assert sorted(epoch0) == list(range(37))
    assert not np.array_equal(order._permutation(0), order._permutation(1))


def test_sample_order_is_deterministic_and_resumable():
    a = D.SampleOrder(100, 4, 1, 2, seed=3)
    b = D.SampleOrder(100, 4, 1, 2, seed=3)
    for consumed in (0, 8, 96, 200, 1208):  # across epoch boundaries, no history needed
        assert a.sample_ids(consumed, 0, 1) == b.sample_ids(consumed, 0, 1)
    assert D.SampleOrder(100, 4, 1, 2, seed=4).sample_ids(0, 0, 0) != a.sample_ids(0, 0, 0)


def test_dp2_and_dp1_with_double_accumulation_read_the_same_micro_batches():
    dp2 = D.SampleOrder(50, micro_batch=3, accumulation=1, world_size=2, seed=1)
    dp1 = D.SampleOrder(50, micro_batch=3, accumulation=2, world_size=1, seed=1)
    assert dp2.global_batch == dp1.global_batch
    for step in range(10):
        c = step * 6
        assert [dp2.sample_ids(c, 0, 0), dp2.sample_ids(c, 0, 1)] == [dp1.sample_ids(c, 0, 0), dp1.sample_ids(c, 1, 0)]


def test_prepare_data_splits_held_out_tail_and_fails_early():
    t = load_config({"max_seq_len": 256, "eval_split_ratio": 0.05}).training
    d = D.prepare_data(t, model_vocab_size=256)
    total = len(D.builtin_corpus())
    assert len(d.train.tokens) + len(d.eval.tokens) == total and len(d.eval.tokens) == int(total * 0.05)
    assert np.shares_memory(d.eval.tokens, D.builtin_corpus())  # a view, not a copy
    with pytest.raises(D.DataError, match=r"vocabulary of 256, larger than the model's `vocab_size` = 64"):
        D.prepare_data(t, model_vocab_size=64)
    long = load_config({"max_seq_len": 4000, "eval_split_ratio": 0.01}).training
    with pytest.raises(D.DataError, match=r"`eval_split_ratio`: the held-out split has \d+ tokens, fewer than one"):
        D.prepare_data(long, model_vocab_size=256)


def test_data_command_builds_a_token_file_the_trainer_reads(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("Call me Ishmael. " * 40)
    out = tmp_path / "a.bin"
    result = subprocess.run(
        [sys.executable, "-m", "fleet_ext.training.data", "--output", str(out), str(src)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    t = load_config({"train_dataset_path": str(out), "max_seq_len": 64, "eval_split_ratio": 0.2}).training
    d = D.prepare_data(t, model_vocab_size=256)
    assert d.source == f"token file {out}" and len(d.train) > 0 and len(d.eval) > 0
    assert D.ByteTokenizer().decode(d.train.get([0])[0][0][:8]) == "Call me "
