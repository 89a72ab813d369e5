"""The Triton sparse-attention backend inside the real layers (Triton interpreter, fp32).

``csa_sparse_attn_backend: triton`` drives the DSv4 window / CSA / HCA / full-causal cores and
``mqa_sparse_attn_backend: triton`` the latent MQA of -2 layers. Not bitwise (online softmax sums in
another order); the documented bound is fp32 ``triton_sparse_attn`` (tests/helpers/tolerances.py), relative
to each tensor's largest entry. The Triton forward and backward kernels must have run (launch counters).
Run-to-run byte identity of the backward is tested at kernel level (test_sparse_attn_triton.py,
test_sparse_attn_dense_causal.py).

The -2 layer's full-causal and warm-up phases under ``mqa_sparse_attn_backend: triton`` run the dense causal
kernels (attention, and the warm-up KL's head-summed probabilities) and build no index table: the table
builders' counter (``index_tables.table_cache_builds``) stays put there, while the reference backend's run
of the same layer moves it (the counter's negative control). Under full recompute those kernels re-run to
the same bytes (the hybrid-MLA CPU model in both dense phases).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from helpers import TINY_HYBRID_MLA, assert_bitwise, assert_close, expect_launches, move_constant_inits, tiny_model

from fleet_ext.layers import index_tables

pytest.importorskip("triton", reason="the Triton backend needs Triton (installed by the `test` extra)")

BASE = tiny_model(hca_compress_ratio=8)  # HCA pools 8 tokens (the entry 128 marks the kind): entries at SEQ 38
HYBRID = {
    **TINY_HYBRID_MLA, "csa_compress_ratios": [0, -2, 128, -2], "hybrid_mla_attention": "mqa_dsa",
    "dsa_indexer_use_sparse_loss": True, "dsa_indexer_loss_coeff": 0.1, "hybrid_mla_rope_type": "rope",
    "add_full_attention_sink_bias": True,
}
SEQ = 38  # past the window (8); CSA 9 entries (top-k picks 3), HCA 4, each with a partial last block (136 tokens
# with HCA at its default 128 gave HCA one entry for 4x the interpreter time)
TRITON_KERNELS = ("_sparse_attn_fwd_kernel", "_bwd_dq_kernel")  # forward, and the backward's dq pass


def _run(overrides: dict) -> dict[str, np.ndarray]:
    from fleet_ext.models import DSv4ForCausalLM

    paddle.seed(0)
    model = DSv4ForCausalLM({**BASE, **overrides})
    rng = np.random.default_rng(0)
    for name, tensor in model.state_dict().items():  # sinks, ape, norms off their constant init
        if tensor.dtype == paddle.float32 and (tensor.ndim == 1 or name.endswith(".ape")):
            tensor.set_value(tensor.numpy() + 0.3 * rng.standard_normal(tensor.shape).astype("float32"))
    ids = paddle.to_tensor(rng.integers(0, 64, (2, SEQ)))
    logits, loss = model(ids, labels=paddle.to_tensor(rng.integers(0, 64, (2, SEQ))))
    loss.backward()
    out = {"logits": logits.numpy()}
    out.update({f"grad:{n}": p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None})
    return out


def _close(reference: dict, fused: dict) -> None:
    assert reference.keys() == fused.keys(), sorted(reference.keys() ^ fused.keys())
    for key, ref in reference.items():
        # mHC's mixing parameters (the layers' and the head's, a few entries each) are small cancelling sums: per
        # element, the core's ~1e-7 reordering error lands at up to ~2e-5 of their largest entry depending on the CPU's
        # BLAS and the shape (the head's 1-entry scale: 1.08e-5 at 38 tokens); held to the model-level entry instead
        # (relative norm, documented for exactly these sums), where a wrong kernel is O(1)
        entry = "model_triton_sparse_attn" if "mhc" in key else "triton_sparse_attn"
        assert_close(fused[key], ref, "fp32", entry, what=key)


@pytest.mark.parametrize(
    "model, switch",
    [({}, "csa_sparse_attn_backend"), (HYBRID, "mqa_sparse_attn_backend")],
    ids=["dsv4_window_csa_hca_full_causal", "hybrid_mla_sparse"],
)
def test_triton_backend_matches_the_reference_in_the_model(model, switch):
    """The DSv4 model's window and HCA slots take the band backward (``band.py``: its kernel launched)."""
    reference = _run(model)
    with expect_launches(*TRITON_KERNELS, *(("_bwd_dkv_band_kernel",) if not model else ())):
        fused = _run({**model, switch: "triton"})
    _close(reference, fused)


# -- the -2 layer's dense phases: the dense causal kernels, no index table ------------------------------------
DENSE_KERNELS = ("_causal_fwd_kernel", "_causal_bwd_dq_kernel", "_causal_bwd_dkv_kernel")
TABLE_KERNELS = ("_sparse_attn_fwd_kernel", "_bwd_dq_kernel", "_row_bound_kernel")
MLA_LAYER = {**TINY_HYBRID_MLA, "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "q_lora_rank": 16,
             "v_head_dim": 16, "qk_pos_emb_head_dim": 8, "csa_compress_ratios": [-2], "num_hidden_layers": 1,
             "csa_window_size": 4, "o_groups": 2, "o_lora_rank": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 16, "moe_n_hash_layers": 0, "dsa_index_n_heads": 4,
             "hybrid_mla_rope_type": "rope", "add_full_attention_sink_bias": True, "init_method_std": 0.2}
PHASES = {"full_causal": {"hybrid_mla_attention": "mqa_full_causal"},
          "warmup": {"hybrid_mla_attention": "mqa_dsa", "dsa_indexer_use_sparse_loss": False,
                     "dsa_indexer_loss_coeff": 0.5}}


def _dense_phase_layer_run(phase: str, backend: str) -> tuple[dict[str, np.ndarray], int]:
    """The -2 layer (seed 0, batch 2, 11 tokens) in ``phase``: output, input gradient, every parameter gradient
    and the indexer KL; and how many index tables were built during the forward and backward."""
    from fleet_ext.config import load_config
    from fleet_ext.layers.mla import MLASelfAttention
    from fleet_ext.specs.backend import BackendProvider

    config = load_config({**MLA_LAYER, **PHASES[phase], "mqa_sparse_attn_backend": backend})
    paddle.seed(0)
    layer = MLASelfAttention(config, 0, BackendProvider(config).attention_ops)
    move_constant_inits(layer, np.random.default_rng(1), 0.3)
    x = paddle.to_tensor(np.random.default_rng(2).standard_normal((2, 11, 32)).astype("float32"), stop_gradient=False)
    index_tables.clear_table_cache()
    out = layer(x)
    (out * paddle.to_tensor(np.linspace(-1.0, 1.0, out.size, dtype="float32").reshape(out.shape))).sum().backward()
    builds = index_tables.table_cache_builds()
    got = {"out": out.numpy(), "grad:x": x.grad.numpy()}
    got.update({f"grad:{n}": p.grad.numpy() for n, p in layer.named_parameters() if p.grad is not None})
    if phase == "warmup":
        got["indexer_kl"] = np.asarray(float(layer.indexer_loss))
    return got, builds


@pytest.mark.parametrize("phase", list(PHASES))
def test_dense_phases_run_the_dense_causal_kernels_without_a_table(phase):
    reference, reference_builds = _dense_phase_layer_run(phase, "unfused")
    assert reference_builds >= 1, "negative control: the reference backend's table must show in the counter"
    kernels = (*DENSE_KERNELS, "_causal_probs_kernel") if phase == "warmup" else DENSE_KERNELS
    with expect_launches(*kernels), expect_launches(*TABLE_KERNELS, exactly=0):
        fused, fused_builds = _dense_phase_layer_run(phase, "triton")
    assert fused_builds == 0, f"the Triton backend built {fused_builds} index table(s) in the {phase} phase"
    if phase == "warmup":
        assert float(reference["indexer_kl"]) > 1e-3 and any(".indexer." in k for k in fused)
    _close(reference, fused)


@pytest.mark.parametrize("phase", list(PHASES))
def test_dense_phases_with_the_triton_backend_are_bitwise_under_full_recompute(phase):
    """The dense causal kernels re-run under full recompute give the bytes of the run without it (the model of
    configs/dsv4_hybrid_mla_cpu.yaml, -2 layers in ``phase``; loss, auxiliary losses, every parameter gradient)."""
    from fleet_ext.config import load_config
    from fleet_ext.models import DSv4ForCausalLM

    def step(recompute: dict) -> dict:
        paddle.seed(11)
        overrides = {"dsa_indexer_use_sparse_loss": False}
        if phase == "full_causal":
            overrides.update(hybrid_mla_attention="mqa_full_causal", dsa_indexer_loss_coeff=0.0)
        model = DSv4ForCausalLM(load_config("configs/dsv4_hybrid_mla_cpu.yaml", mqa_sparse_attn_backend="triton",
                                            **overrides, **recompute))
        model.train()
        rng = np.random.default_rng(5)
        move_constant_inits(model, rng, 0.2)
        ids = paddle.to_tensor(rng.integers(1, model.config.model.vocab_size, size=(2, 25)).astype("int64"))
        _, loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        out = {"loss": loss.numpy(), **{k: v.numpy() for k, v in model.auxiliary_losses().items()}}
        out.update({n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None})
        return out

    want = step({})
    with expect_launches(*DENSE_KERNELS, min=2):  # the forward kernel runs again in the backward
        got = step({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3})
    assert sorted(got) == sorted(want)
    if phase == "warmup":
        assert want["indexer_loss"].item() > 0, "the indexer KL must be on"
    for key in want:
        assert_bitwise(got[key], want[key], f"{phase}, full recompute: {key}")


@pytest.mark.parametrize("choice", ["auto", "float24", "bfloat16"])
def test_dkv_contribution_dtype_reaches_the_backward(monkeypatch, choice):
    """``sparse_attn_dkv_contribution_dtype`` (auto when unset) reaches every backward call of the triton backend (the
    spy records what ``sparse_attn_bwd`` is given). On fp32 inputs, as here, auto and bfloat16 keep fp32
    contributions (kernel.partial_storage); float24 is tested against the float64 oracle in
    test_sparse_attn_triton.py, the rounded kinds against the fp32 reference on the GPU
    (tests/gpu/test_sparse_attn_gpu.py::test_rounded_partials)."""
    from fleet_ext.ops.sparse_attn import kernel

    seen = []
    real = kernel.sparse_attn_bwd

    def spy(*args, **kwargs):
        seen.append(kwargs.get("partial_dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "sparse_attn_bwd", spy)
    overrides = {} if choice == "auto" else {"sparse_attn_dkv_contribution_dtype": choice}
    _run({"csa_sparse_attn_backend": "triton", **overrides})
    assert seen and set(seen) == {choice}, seen


@pytest.mark.parametrize("global_len, cp_size, cp_rank", [(38, 1, 0), (12, 1, 0), (40, 2, 0), (40, 2, 1), (48, 4, 3)])
def test_hca_slot_bands_describe_the_index_table(global_len, cp_size, cp_rank):
    """``CompressedSparseAttention.slot_bands``: every slot a band names holds its key or -1 in the table the layer
    builds (the contract of ``band.py``), and the bands hold every valid slot (no CSR slots left), with and without a
    context-parallel halo; window-only, CSA and full-causal layers name none (they keep the CSR path)."""
    from fleet_ext.layer_kinds import LayerKind
    from fleet_ext.models import DSv4ForCausalLM
    from fleet_ext.parallel.layout import SequenceLayout

    model = DSv4ForCausalLM(BASE)
    local = global_len // cp_size
    layout = SequenceLayout(offset=cp_rank * local, local_len=local, global_len=global_len, cp_size=cp_size,
                            cp_rank=cp_rank)
    named = set()
    for layer in model.layers:
        core = layer.self_attention.core_attention
        bands = core.slot_bands(layout)
        is_hca = core.compressor is not None and core.indexer is None and core.kind is not LayerKind.FULL_CAUSAL
        assert bool(bands) == is_hca, (core.kind, bands)
        if not bands:
            continue
        table = core.index_table(paddle.zeros([1, local, 4]), None, layout)[0].numpy()
        held = np.zeros_like(table, dtype=bool)
        for band in bands:
            i = np.arange(local)[:, None]
            j = np.arange(band.slot0, band.slot0 + band.n_slots)[None, :]
            part = table[:, band.slot0:band.slot0 + band.n_slots]
            assert np.all((part == -1) | (part == band.step * i + band.base + j)), band
            held[:, band.slot0:band.slot0 + band.n_slots] = part >= 0
        assert np.array_equal(held, table >= 0)
        named.add(core.kind)
    assert named, "no HCA layer in the model"
