"""Training data: byte-level tokenizer, the token file format, the built-in corpus, packed sequences and
a deterministic, resumable, rank-sharded sample order. NumPy only (no Paddle import).

Token file format (``.bin``, little-endian), memory-mapped when read::

    offset 0   8 bytes  magic b"FXTOKEN1"
    offset 8   uint32   format version (1)
    offset 12  uint32   bytes per token: 1 (uint8), 2 (uint16) or 4 (uint32)
    offset 16  uint64   number of tokens N
    offset 24  uint64   vocabulary size the ids were made for (every id < this)
    offset 32  N tokens

Documents are concatenated with the end-of-document id 0 between them. Make one from text files with
``python -m fleet_ext.training.data --output my.bin a.txt b.txt`` (byte-level ids, vocabulary 256) or from
ids made by any tokenizer with ``--from-npy ids.npy --vocab-size V``.

Packing: sample ``i`` is ``tokens[i*L : i*L + L + 1]`` (L = ``max_seq_len``), inputs its first L ids and
labels its last L. The sample order is a fresh permutation per epoch drawn from ``(seed, epoch)``; the
global batch of a step is the next ``micro_batch * gradient_accumulation_steps * world_size`` samples of
that order, and data-parallel rank ``r`` takes micro-batch ``m`` from slot ``m * world_size + r`` (here
``world_size`` is the data-parallel size: the context-parallel ranks of one data-parallel rank read the same
samples). The position is one integer, ``consumed_samples``, saved in every checkpoint. With this layout DP=2
and DP=1 with twice the accumulation see the same micro-batches.
"""

from __future__ import annotations

import argparse
import functools
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "BUILTIN",
    "EOD_ID",
    "DataError",
    "ByteTokenizer",
    "write_token_file",
    "read_token_file",
    "builtin_corpus",
    "builtin_corpus_files",
    "PackedSequences",
    "SampleOrder",
    "TrainingData",
    "prepare_data",
]

BUILTIN = "builtin"
EOD_ID = 0
MAGIC = b"FXTOKEN1"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}
CORPUS_DIR = Path(__file__).resolve().parents[1] / "data" / "corpus"


class DataError(ValueError):
    """A data path or file that cannot be trained on; the message names the key, the file and the fix."""


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256); id 0 (NUL, absent from text) ends a document."""

    vocab_size = 256
    eod_id = EOD_ID

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != EOD_ID).decode("utf-8", errors="replace")


def _itemsize_for(vocab_size: int) -> int:
    return 1 if vocab_size <= 2**8 else 2 if vocab_size <= 2**16 else 4


def write_token_file(path: str | os.PathLike, tokens: np.ndarray, vocab_size: int) -> None:
    """Write ids (any integer array, every id < ``vocab_size``) in the token file format, atomically."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"write_token_file: tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise DataError(
            f"write_token_file: ids must lie in [0, {vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]"
        )
    itemsize = _itemsize_for(vocab_size)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(_HEADER.pack(MAGIC, VERSION, itemsize, tokens.size, vocab_size))
        fh.write(tokens.astype(_DTYPES[itemsize]).astype(f"<u{itemsize}").tobytes())
    os.replace(tmp, path)


@dataclass(frozen=True)
class TokenFile:
    tokens: np.ndarray  # memory-mapped, read-only
    vocab_size: int


def read_token_file(path: str | os.PathLike, key: str = "train_dataset_path") -> TokenFile:
    """Memory-map a token file after checking its header; errors name ``key``, the file and the fix."""
    path = Path(path)
    fix = "make one with `python -m fleet_ext.training.data --output FILE.bin TEXT_FILES...`"
    if not path.exists():
        raise DataError(f"config key `{key}` = '{path}': the file does not exist. Fix: point it at a token file; {fix}")
    if not path.is_file():
        raise DataError(f"config key `{key}` = '{path}' is not a file. Fix: point it at a token file; {fix}")
    size = path.stat().st_size
    if size < _HEADER.size:
        raise DataError(f"config key `{key}` = '{path}': {size} bytes is too short for a token file header. Fix: {fix}")
    with open(path, "rb") as fh:
        magic, version, itemsize, count, vocab = _HEADER.unpack(fh.read(_HEADER.size))
    if magic != MAGIC:
        raise DataError(
            f"config key `{key}` = '{path}' is not a fleet_ext token file (magic {magic!r}, expected {MAGIC!r}). "
            f"Fix: {fix}"
        )
    if version != VERSION or itemsize not in _DTYPES:
        raise DataError(
            f"config key `{key}` = '{path}': unsupported token file version {version} / {itemsize} bytes per token "
            f"(supported: version {VERSION}, 1/2/4 bytes). Fix: {fix}"
        )
    if size != _HEADER.size + count * itemsize:
        raise DataError(
            f"config key `{key}` = '{path}' is truncated or padded: the header says {count} tokens of {itemsize} "
            f"bytes ({_HEADER.size + count * itemsize} bytes in all), the file has {size} bytes. Fix: rewrite it"
        )
    tokens = np.memmap(path, dtype=f"<u{itemsize}", mode="r", offset=_HEADER.size, shape=(count,))
    return TokenFile(tokens=tokens, vocab_size=int(vocab))


def builtin_corpus_files() -> list[Path]:
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise DataError(
            f"the built-in corpus is missing: no *.txt under {CORPUS_DIR}. Fix: reinstall fleet_ext "
            "(pip install -e .) or set `train_dataset_path` to a token file"
        )
    return files


@functools.lru_cache(maxsize=1)
def builtin_corpus() -> np.ndarray:
    """The shipped public-domain texts as byte ids, documents joined by the end-of-document id."""
    tok = ByteTokenizer()
    parts = []
    for path in builtin_corpus_files():
        parts.append(tok.encode(path.read_text(encoding="utf-8")))
        parts.append(np.array([EOD_ID], dtype=np.uint8))
    out = np.concatenate(parts)
    out.setflags(write=False)
    return out


class PackedSequences:
    """Fixed-length training sequences cut from one token stream (sample i = tokens[i*L : i*L + L + 1]).

    With ``vocab_size`` every batch is range-checked here, on the host, as it is cut: the model does not read its
    device inputs back to check them (a device-to-host round trip per forward).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str, vocab_size: int | None = None) -> None:
        self.tokens, self.seq_len, self.name, self.vocab_size = tokens, seq_len, name, vocab_size
        self.num_samples = max((len(tokens) - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self.num_samples

    def get(self, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels), each [len(indices), seq_len] int64."""
        rows = np.stack(
            [np.asarray(self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1]) for i in indices]
        )
        rows = rows.astype(np.int64)
        if self.vocab_size is not None and rows.size:
            low, high = int(rows.min()), int(rows.max())
            if low < 0 or high >= self.vocab_size:
                raise DataError(
                    f"{self.name} samples {list(indices)}: `input_ids` / labels must lie in [0, {self.vocab_size}) "
                    f"(the model's `vocab_size`), got [{low}, {high}]. Fix: re-tokenize the data for this vocabulary "
                    "or raise vocab_size"
                )
        return rows[:, :-1], rows[:, 1:]


class SampleOrder:
    """Which samples each rank reads at each micro-step: deterministic, epoch-shuffled, resumable."""

    def __init__(self, num_samples: int, micro_batch: int, accumulation: int, world_size: int, seed: int) -> None:
        if num_samples <= 0:
            raise DataError("SampleOrder: the dataset has no samples")
        self.num_samples = num_samples
        self.micro_batch = micro_batch
        self.accumulation = accumulation
        self.world_size = world_size
        self.seed = seed

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs, the object lives for the run
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def sample_ids(self, consumed_samples: int, micro_step: int, rank: int) -> list[int]:
        """Samples of micro-batch ``micro_step`` on ``rank`` for the step that starts at ``consumed_samples``."""
        start = consumed_samples + (micro_step * self.world_size + rank) * self.micro_batch
        out = []
        for k in range(start, start + self.micro_batch):
            epoch, pos = divmod(k, self.num_samples)
            out.append(int(self._permutation(epoch)[pos]))
        return out

    def epoch(self, consumed_samples: int) -> float:
        return consumed_samples / self.num_samples


@dataclass
class TrainingData:
    train: PackedSequences
    eval: PackedSequences | None
    vocab_size: int
    source: str

    def describe(self) -> str:
        held = f"{len(self.eval.tokens):,} held-out tokens ({len(self.eval)} sequences)" if self.eval else "no held-out"
        return f"{self.source}: {len(self.train.tokens):,} training tokens ({len(self.train)} sequences), {held}"


def _stream(path: str, key: str) -> tuple[np.ndarray, int, str]:
    if path == BUILTIN:
        tokens = builtin_corpus()
        return tokens, ByteTokenizer.vocab_size, f"built-in public-domain corpus ({len(builtin_corpus_files())} files)"
    tf = read_token_file(path, key)
    return tf.tokens, tf.vocab_size, f"token file {path}"


def prepare_data(training, model_vocab_size: int) -> TrainingData:
    """Open and check the training (and held-out) tokens of a ``TrainingConfig``; raise ``DataError`` early."""
    seq = training.max_seq_len
    tokens, vocab, source = _stream(training.train_dataset_path, "train_dataset_path")
    if vocab > model_vocab_size:
        raise DataError(
            f"config key `train_dataset_path` = '{training.train_dataset_path}' holds ids for a vocabulary of {vocab}, "
            f"larger than the model's `vocab_size` = {model_vocab_size}. Fix: raise vocab_size or re-tokenize"
        )
    eval_tokens = None
    if training.eval_dataset_path is not None:
        eval_tokens, eval_vocab, _ = _stream(training.eval_dataset_path, "eval_dataset_path")
        if eval_vocab > model_vocab_size:
            raise DataError(
                f"config key `eval_dataset_path` = '{training.eval_dataset_path}' holds ids for a vocabulary of "
                f"{eval_vocab} > `vocab_size` = {model_vocab_size}. Fix: re-tokenize it"
            )
    elif training.eval_split_ratio > 0:
        held = int(len(tokens) * training.eval_split_ratio)
        tokens, eval_tokens = tokens[: len(tokens) - held], tokens[len(tokens) - held :]
    train = PackedSequences(tokens, seq, "train", model_vocab_size)
    if len(train) == 0:
        raise DataError(
            f"config key `train_dataset_path` = '{training.train_dataset_path}': {len(tokens)} training tokens are "
            f"fewer than one sequence of max_seq_len + 1 = {seq + 1}. Fix: lower max_seq_len or add data"
        )
    held_out = None
    if training.eval_iters > 0:
        held_out = PackedSequences(eval_tokens if eval_tokens is not None else tokens[:0], seq, "eval",
                                   model_vocab_size)
        if len(held_out) == 0:
            key = "eval_dataset_path" if training.eval_dataset_path is not None else "eval_split_ratio"
            raise DataError(
                f"config key `{key}`: the held-out split has {len(held_out.tokens)} tokens, fewer than one sequence "
                f"of max_seq_len + 1 = {seq + 1}. Fix: hold out more, lower max_seq_len, or set eval_iters: 0"
            )
    return TrainingData(train=train, eval=held_out, vocab_size=vocab, source=source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fleet_ext.training.data",
        description="Write a fleet_ext token file (memory-mapped at training).",
    )
    parser.add_argument("--output", required=True, help="token file to write, e.g. data/my_corpus.bin")
    parser.add_argument("texts", nargs="*", help="UTF-8 text files, one document each (byte-level ids)")
    parser.add_argument("--from-npy", help="a 1-D .npy array of ids made by another tokenizer")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of --from-npy ids")
    args = parser.parse_args(argv)
    if bool(args.texts) == bool(args.from_npy):
        parser.error("give either text files or --from-npy")
    if args.from_npy:
        if not args.vocab_size:
            parser.error("--from-npy needs --vocab-size")
        tokens, vocab = np.load(args.from_npy, mmap_mode="r"), args.vocab_size
    else:
        tok = ByteTokenizer()
        parts = []
        for name in args.texts:
            parts += [tok.encode(Path(name).read_text(encoding="utf-8")), np.array([EOD_ID], dtype=np.uint8)]
        tokens, vocab = np.concatenate(parts), tok.vocab_size
    write_token_file(args.output, tokens, vocab)
    print(f"wrote {args.output}: {len(tokens):,} tokens, vocabulary {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
