"""The sequence layout: the seam context parallelism plugs into.

- A layout names this rank's global positions; bad layouts raise naming the field.
- Every position-dependent table (window, compressed, full-causal, visible counts, the DSA top-k table) and
  every RoPE table built for a shard is, byte for byte, the matching row slice of the whole-sequence one:
  they are computed from the layout, not from ``0 .. s-1``.
- The whole layout reproduces positions ``0 .. s-1`` exactly (the hand-written tables in test_index_tables.py
  and every parity test run through it); the model builds one layout per forward and hands it to every
  attention layer (the context-parallel exchange itself: tests/multi_card_tests/test_context_parallel.py).
Integer tables and fp32 cos/sin built from float64 angles: exact equality throughout.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_ext.config import load_config
from fleet_ext.layer_kinds import layer_attention
from fleet_ext.layers import index_tables
from fleet_ext.layers.dsa_indexer import dsa_index_table
from fleet_ext.layers.rope import RotaryTable
from fleet_ext.models import DSv4ForCausalLM
from fleet_ext.parallel.layout import SequenceLayout

TINY = "fleet_ext/configs/dsv4_tiny_cpu.yaml"


def _shards(global_len: int, cp_size: int) -> list[SequenceLayout]:
    return [SequenceLayout.contiguous_shard(global_len, cp_size, rank) for rank in range(cp_size)]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"offset": -1, "local_len": 2, "global_len": 4}, "offset"),
        ({"offset": 3, "local_len": 2, "global_len": 4}, "offset"),
        ({"offset": 0, "local_len": 0, "global_len": 4}, "local_len"),
        ({"offset": 0, "local_len": 4, "global_len": 4, "cp_size": 2, "cp_rank": 2}, "cp_rank"),
        ({"offset": 0, "local_len": 4, "global_len": 4, "chunking": "zigzag"}, "chunking"),
        ({"offset": 0, "local_len": 4.0, "global_len": 4}, "local_len"),
        ({"offset": 2, "local_len": 2, "global_len": 4}, "contiguous chunks"),  # a shard without its CP group size
        ({"offset": 0, "local_len": 2, "global_len": 6, "cp_size": 2}, "contiguous chunks"),
    ],
)
def test_bad_layouts_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SequenceLayout(**kwargs)


def test_contiguous_shards_tile_the_sequence():
    shards = _shards(12, 3)
    assert [list(s.positions()) for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert SequenceLayout.whole(12).is_whole and not shards[1].is_whole
    with pytest.raises(ValueError, match="must divide by cp_size"):
        SequenceLayout.contiguous_shard(10, 3, 0)
    # Equal layouts share cache entries whatever their process group (the group is not part of equality).
    assert SequenceLayout(0, 4, 4, cp_group=object()) == SequenceLayout.whole(4)


@settings(max_examples=40, deadline=None)
@given(
    chunk=st.integers(1, 12), cp_size=st.integers(1, 4), window=st.integers(1, 20), ratio=st.integers(2, 9)
)
def test_shard_tables_are_row_slices_of_the_whole_tables(chunk, cp_size, window, ratio):
    global_len = chunk * cp_size
    whole = SequenceLayout.whole(global_len)
    builders = {
        "window": lambda lay: index_tables.window_index_table(lay, window),
        "compressed": lambda lay: index_tables.all_compressed_index_table(lay, ratio, global_len),
        "full_causal": index_tables.full_causal_index_table,
        "visible": lambda lay: index_tables.compressed_visible_count(lay, ratio),
    }
    for name, build in builders.items():
        full = build(whole).numpy()
        for shard in _shards(global_len, cp_size):
            got = build(shard).numpy()
            want = full[shard.offset : shard.end]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{name} rows of {shard}"


@settings(max_examples=30, deadline=None)
@given(chunk=st.integers(1, 12), cp_size=st.integers(2, 4), window=st.integers(1, 13))
def test_halo_window_table_is_the_row_slice_counted_from_the_halo(chunk, cp_size, window):
    """Under context parallelism a rank's raw keys start ``W - 1`` rows before its chunk (the halo): its window
    table is the whole table's rows with every valid id shifted by that first position (-1 kept)."""
    global_len, width = chunk * cp_size, min(window, chunk * cp_size)
    if width - 1 > chunk:
        return  # the config refuses a halo longer than a chunk
    full = index_tables.window_index_table(SequenceLayout.whole(global_len), width).numpy()
    for shard in _shards(global_len, cp_size):
        first = shard.offset - (width - 1)
        got = index_tables.window_index_table(shard, width, first).numpy()
        want = full[shard.offset : shard.end]
        np.testing.assert_array_equal(np.where(got >= 0, got + first, -1), want, err_msg=str(shard))
        assert got.max() < (width - 1) + chunk  # never past the rank's own last row


@pytest.mark.parametrize("topk, window", [(3, 4), (5, 0), (40, 2)])
def test_dsa_topk_table_of_a_shard_is_the_row_slice(topk, window):
    global_len, cp_size = 24, 3
    scores = np.random.default_rng(topk).permutation(2 * global_len * global_len).astype("float32")
    scores = scores.reshape(2, global_len, global_len) / 9.0  # distinct: no ties
    full, k_full = dsa_index_table(paddle.to_tensor(scores), topk, window, SequenceLayout.whole(global_len))
    for shard in _shards(global_len, cp_size):
        part, k_part = dsa_index_table(paddle.to_tensor(scores[:, shard.offset : shard.end]), topk, window, shard)
        assert k_part == k_full
        np.testing.assert_array_equal(part.numpy(), full.numpy()[:, shard.offset : shard.end], err_msg=str(shard))
    with pytest.raises(ValueError, match="must be \\[b, 8, 24\\]"):
        dsa_index_table(paddle.to_tensor(scores), topk, window, _shards(global_len, cp_size)[0])


@pytest.mark.parametrize("layer", [0, 1, 2])  # window (plain RoPE), CSA and HCA (YaRN) tables
def test_rope_of_a_shard_is_the_row_slice(layer):
    config = load_config(TINY)
    table = RotaryTable.for_spec(layer_attention(config.model, layer).rope)
    whole = SequenceLayout.whole(64)
    cos, sin = table.cos_sin(whole.positions())
    assert table.cos_sin(whole.positions())[0] is cos, "tables are cached per range of positions"
    for shard in _shards(64, 4):
        part_cos, part_sin = table.cos_sin(shard.positions())
        assert part_cos.numpy().tobytes() == cos.numpy()[shard.offset : shard.end].tobytes()
        assert part_sin.numpy().tobytes() == sin.numpy()[shard.offset : shard.end].tobytes()
    # Positions from zero: the whole layout's table is the float64 rotation of 0..s-1, rounded once.
    angles = np.arange(64, dtype=np.float64)[:, None] * table.inv_freq[None, :]
    assert cos.numpy().tobytes() == np.cos(angles).astype(np.float32).tobytes()


def _model(**overrides) -> DSv4ForCausalLM:
    paddle.seed(0)
    return DSv4ForCausalLM(load_config(TINY, csa_compress_ratios=[0, 4, 128, -1], **overrides))


def test_the_model_hands_one_layout_to_every_attention_layer():
    model = _model()
    seen = []
    for layer in model.layers:
        original = layer.self_attention.forward

        def record(hidden, *args, _original=original, **kwargs):
            seen.append(kwargs["layout"])
            return _original(hidden, *args, **kwargs)

        layer.self_attention.forward = record
    ids = paddle.randint(1, 200, [2, 37])
    model(ids)
    assert seen == [SequenceLayout.whole(37)] * 4


def test_layers_follow_the_models_layout():
    """A shard layout reaches the layers (they do not rebuild 0..s-1 themselves): without its process group the
    first key exchange refuses it, naming what is missing (the real exchange: tests/multi_card_tests)."""
    model = _model()
    model.sequence_layout = lambda seq: SequenceLayout.contiguous_shard(2 * seq, 2, 1)
    with pytest.raises(ValueError, match="needs a ContextParallelGroup of 2 ranks"):
        model(paddle.randint(1, 200, [1, 32]))
    model = _model()
    model.sequence_layout = lambda seq: SequenceLayout.whole(seq + 1)
    with pytest.raises(ValueError, match="sequence layout gives this rank 17"):
        model(paddle.randint(1, 200, [1, 16]))
