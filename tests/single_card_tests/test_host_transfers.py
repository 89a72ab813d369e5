"""No host round trips in the step (issue 9 §2): a training forward + backward of the tiny model reads nothing
back from the device outside the MoE layers, and a second forward of the same shape copies nothing to it.

Counted by patching every way out of a tensor (``tests/helpers/transfers.py``: ``numpy``, ``tolist``, ``item``,
``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``__array__``, printing, ...; and the ops whose output
shape depends on the values, which Paddle's GPU kernels size by a device-to-host copy: ``bincount``,
``nonzero``, boolean-mask indexing, ...). Paddle's CPU build has no device, so this stands in for the GPU: on the
CPU none of these reads stalls anything, on a GPU each would.

The models cover every layer kind (window 0, CSA 4 with its lightning indexer and KL, HCA, full causal -1, and
-2 layers under each ``hybrid_mla_attention`` core and phase), routed and hash MoE, mHC, VHA, MTP, recompute,
and the fused Triton paths. The MoE layers are allowed one read each (the issue's limit: the per-expert token counts
for grouped compute, read together with the expert-id range check), recompute and the fused MoE ops included.
Negative controls: a ``.numpy()`` planted in a layer's forward, an ``.item()`` in the backward, a value-shaped op,
or a second read in a MoE layer fails.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import TINY_HYBRID_MLA, expect_launches, tiny_model
from helpers.transfers import HostTransfers

from fleet_ext.layers import index_tables, rope
from fleet_ext.layers.norm import RMSNorm
from fleet_ext.models import DSv4ForCausalLM

MOE_SITES = ("layers/moe.py", "ops/moe_")  # the MoE layer and its kernels' wrappers
SEQ = 40  # longer than the window (8) and several compressed blocks (CSA 4, HCA 8)
EVERY_KIND = {**TINY_HYBRID_MLA, "num_hidden_layers": 5, "csa_compress_ratios": [0, 4, 128, -1, -2],
              "hca_compress_ratio": 8, "use_vha_attention": True}
SPARSE_DSA = {"hybrid_mla_attention": "mqa_dsa", "dsa_indexer_use_sparse_loss": True, "dsa_indexer_loss_coeff": 0.01}
CONFIGS = {
    "every_kind_mla_mha": {"hybrid_mla_attention": "mha"},
    "every_kind_mqa_full_causal": {"hybrid_mla_attention": "mqa_full_causal"},
    "every_kind_dsa_dense_kl": {"hybrid_mla_attention": "mqa_dsa", "dsa_indexer_loss_coeff": 0.01},
    "every_kind_dsa_sparse_kl": SPARSE_DSA,
    "mtp_seq_aux_loss": {**SPARSE_DSA, "num_nextn_predict_layers": 1, "csa_compress_ratios": [0, 4, 128, -1, -2, 0],
                         "moe_router_load_balancing_type": "seq_aux_loss"},
    "full_recompute": {**SPARSE_DSA, "recompute_granularity": "full", "recompute_method": "uniform",
                       "recompute_num_layers": 2},
    "selective_recompute": {**SPARSE_DSA, "recompute_granularity": "selective",
                            "recompute_modules": ["core_attn", "mhc", "moe", "moe_act"]},
}
MOE_FUSED = {**SPARSE_DSA, "moe_permute_fusion": True, "moe_router_fusion": True}
FUSED = {**SPARSE_DSA, "apply_rope_fusion": True, "fuse_inv_rope_into_vha_postmix": True,
         "sparse_attn_global_kv_idx_remap_fusion": True, "dsv4_q_rms_norm_fusion": True,
         "csa_sparse_attn_backend": "triton", "mqa_sparse_attn_backend": "triton"}


def _model(overrides: dict) -> DSv4ForCausalLM:
    paddle.seed(3)
    model = DSv4ForCausalLM(tiny_model(**{**EVERY_KIND, **overrides}))
    model.train()
    return model


def _batch(seed: int = 0, seq: int = SEQ) -> tuple[paddle.Tensor, paddle.Tensor]:
    ids = paddle.to_tensor(np.random.default_rng(seed).integers(0, 64, (2, seq + 1)))
    return ids[:, :-1], ids[:, 1:]


def _step(model: DSv4ForCausalLM, inputs: paddle.Tensor, labels: paddle.Tensor) -> HostTransfers:
    """One training forward + backward with every host transfer counted."""
    model.clear_gradients()
    with HostTransfers() as transfers:
        _, loss = model(inputs, labels=labels)
        loss.backward()
    return transfers


def _is_moe(site: str) -> bool:
    return site.startswith(MOE_SITES)


def assert_no_host_reads_outside_moe(transfers: HostTransfers, what: str) -> None:
    outside = transfers.to_host_where(lambda site: not _is_moe(site))
    assert not outside, f"{what}: device-to-host reads outside the MoE layers:\n{transfers.report()}"


def assert_moe_reads_at_most_one_per_layer(transfers: HostTransfers, model: DSv4ForCausalLM, what: str) -> None:
    moe = sum(transfers.to_host_where(_is_moe).values())
    layers = len(model.moe_layers())
    assert layers > 0, "the model must have MoE layers for this to mean anything"
    assert moe <= layers, f"{what}: {moe} device-to-host reads in {layers} MoE layers (limit one each):\n" + (
        transfers.report()
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_backward_reads_nothing_back_outside_moe(name):
    model = _model(CONFIGS[name])
    for seed in (0, 1):  # the first forward builds the tables; the second re-uses them
        assert_no_host_reads_outside_moe(_step(model, *_batch(seed)), f"{name}, forward {seed + 1}")
    assert any(p.grad is not None for p in model.parameters()), "the backward must have run"


def test_fused_paths_read_nothing_back_outside_moe():
    """Every attention fusion and both Triton sparse-attention backends (the Triton interpreter here)."""
    model = _model(FUSED)
    inputs, labels = _batch(seq=24)  # the interpreted kernels: still past the window, 6 CSA entries for top-5, HCA 3
    with expect_launches("_sparse_attn_fwd_kernel", "_rope_kernel", "_kv_idx_remap_kernel", "_q_rms_norm_fwd_kernel",
                         "_bwd_dq_kernel"):
        transfers = _step(model, inputs, labels)
    assert_no_host_reads_outside_moe(transfers, "fused")


@pytest.mark.parametrize("name", ["every_kind_dsa_sparse_kl", "full_recompute", "selective_recompute", "moe_fused"])
def test_moe_layers_read_the_host_at_most_once_each(name):
    """One read per MoE layer per step (the expert-id range and the rows per expert), also when recompute re-runs
    the layer in the backward (the re-run replays the read) and with the fused router and permute."""
    model = _model(MOE_FUSED if name == "moe_fused" else CONFIGS[name])
    _step(model, *_batch(0))
    assert_moe_reads_at_most_one_per_layer(_step(model, *_batch(1)), model, name)


@pytest.mark.parametrize("name", ["every_kind_dsa_sparse_kl", "mtp_seq_aux_loss", "full_recompute"])
def test_second_forward_copies_nothing_to_the_device(name):
    model = _model(CONFIGS[name])
    _step(model, *_batch(0))
    tables, rope_tables = index_tables.table_cache_builds(), rope.rope_cache_builds()
    second = _step(model, *_batch(1))
    assert not second.to_device, f"{name}: host-to-device copies in the second forward:\n{second.report()}"
    assert index_tables.table_cache_builds() == tables, "the second forward built index tables"
    assert rope.rope_cache_builds() == rope_tables, "the second forward built RoPE tables"


def test_index_tables_are_built_on_the_device_and_shared():
    """The first forward copies no index table to the device (only RoPE's host-computed values go), builds each
    table once for every layer that uses it, and the layers of one RoPE kind share one cos/sin tensor."""
    index_tables.clear_table_cache()
    rope.clear_rope_cache()
    model = _model(CONFIGS["every_kind_dsa_sparse_kl"])
    first = _step(model, *_batch(0))
    copies = {site for (_, site) in first.to_device}
    assert copies and all(site.startswith("layers/rope.py") for site in copies), first.report()
    # Distinct tables: window (shared by the 0 / CSA / HCA layers and the -2 layer's forced window), CSA visible
    # counts, HCA all-compressed, full causal (-1 layer and the -2 layer's indexer): at most one build of each.
    assert 0 < index_tables.table_cache_builds() <= 5, index_tables.table_cache_builds()
    window, full_causal = (model.layers[i].self_attention for i in (0, 3))
    layout = model.sequence_layout(SEQ)
    assert window.rope_table.cos_sin(layout.positions())[0] is full_causal.rope_table.cos_sin(layout.positions())[0]
    builds = rope.rope_cache_builds()
    _step(model, *_batch(1))
    assert rope.rope_cache_builds() == builds


# --------------------------------------------------------------------------------------------------
# Negative controls: the counter sees a planted read, in the forward and in the backward.
# --------------------------------------------------------------------------------------------------
def test_negative_control_numpy_planted_in_a_layer_forward(monkeypatch):
    model = _model(CONFIGS["every_kind_dsa_sparse_kl"])
    forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: (x.numpy(), forward(self, x))[1])
    with pytest.raises(AssertionError, match="numpy"):
        assert_no_host_reads_outside_moe(_step(model, *_batch()), "planted .numpy()")


def test_negative_control_item_planted_in_the_backward():
    model = _model(CONFIGS["every_kind_dsa_sparse_kl"])
    inputs, labels = _batch()
    model.clear_gradients()
    with HostTransfers() as transfers:
        logits, loss = model(inputs, labels=labels)
        logits.register_hook(lambda grad: grad * (1.0 + 0.0 * grad.sum().item()))
        loss.backward()
    with pytest.raises(AssertionError, match="item"):
        assert_no_host_reads_outside_moe(transfers, "planted .item() in the backward")


def test_negative_control_second_read_planted_in_a_moe_layer(monkeypatch):
    """A second read in each MoE layer (here the old ``bincount`` of the routed experts) breaks the per-layer limit."""
    from fleet_ext.layers.moe import GroupedExperts

    model = _model(CONFIGS["every_kind_dsa_sparse_kl"])
    check = GroupedExperts._check  # called from GroupedExperts.forward: the read's site is layers/moe.py
    monkeypatch.setattr(GroupedExperts, "_check",
                        lambda self, x, idx, w: (paddle.bincount(idx.reshape([-1])), check(self, x, idx, w))[1])
    _step(model, *_batch(0))
    with pytest.raises(AssertionError, match="bincount"):
        assert_moe_reads_at_most_one_per_layer(_step(model, *_batch(1)), model, "planted bincount")


def test_negative_control_implicit_read_of_a_value_dependent_shape(monkeypatch):
    """``paddle.nonzero`` sizes its output from the values: a GPU kernel reads them back before allocating."""
    model = _model(CONFIGS["every_kind_dsa_sparse_kl"])
    forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: (paddle.nonzero(x), forward(self, x))[1])
    with pytest.raises(AssertionError, match="nonzero"):
        assert_no_host_reads_outside_moe(_step(model, *_batch()), "planted paddle.nonzero")


def test_model_range_checks_host_ids_before_any_copy():
    """NumPy ids are checked on the host (the model entry for host data); device ids by the embedding lookup,
    with no read back."""
    model = _model(CONFIGS["every_kind_mla_mha"])
    bad = np.full((1, 8), 64, dtype=np.int64)
    with HostTransfers() as transfers, pytest.raises(ValueError, match=r"must lie in \[0, 64\), got \[64, 64\]"):
        model(bad)
    assert not transfers.to_device and not transfers.to_host, transfers.report()
    with pytest.raises(ValueError, match=r"`input_ids` must be an integer array \[batch, seq\]"):
        model(np.zeros(8, dtype=np.int64))
    with pytest.raises(ValueError, match=r"`input_ids` must lie in \[0, 64\), got \[-1, 5\]"):
        model(paddle.to_tensor([[5, -1, 3]]))  # -1 is the CPU lookup's "no padding" id: still refused
    inputs, labels = _batch()
    want = model(inputs, labels=labels)[1]
    got = model(inputs.numpy(), labels=labels.numpy())[1]
    assert got.numpy().tobytes() == want.numpy().tobytes(), "host ids must give the same loss as device ids"


def test_data_loader_range_checks_batches_on_the_host():
    """The loader checks each batch as it cuts it (NumPy): the model does not read device ids back for it."""
    from fleet_ext.training.data import DataError, PackedSequences

    tokens = np.arange(40, dtype=np.uint16)
    assert PackedSequences(tokens, 8, "train", vocab_size=40).get([0, 3])[0].shape == (2, 8)
    want = r"train samples \[3\]: `input_ids` / labels must lie in \[0, 32\).*got \[24, 32\]"
    with pytest.raises(DataError, match=want):
        PackedSequences(tokens, 8, "train", vocab_size=32).get([3])
    assert PackedSequences(tokens, 8, "train").get([3])[0].max() == 31  # no vocabulary given: no check
