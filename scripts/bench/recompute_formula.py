"""Activation bytes kept for the backward, as a formula of the config's widths, batch, sequence and dtype.

    python scripts/bench/recompute_formula.py [--config configs/dsv4_flash_gpu.yaml] [--seq 4096] [--batch 1]
                                              [--dtype bf16|fp32] [--set KEY=VALUE ...] [--terms csa]

The formula is a shadow of each module's forward written against storages instead of tensors: every op that
autograd makes save something names the storage it saves (``Trace.save``), new storages get their element
count and dtype, and a cast or a view returns the storage it came from when it does not copy (``Trace.cast``).
A storage counts once, however many ops save it, exactly as ``scripts/bench/recompute_memory.py`` counts
the real forward with ``paddle.autograd.saved_tensors_hooks``; ``tests/single_card_tests/
test_recompute_formula.py`` holds the two equal, byte for byte, on CPU fp32 at several shapes. A recomputed
segment (``Trace.segment``) keeps its tensor inputs and the decisions replayed inside it (the CSA indexer's
picks, the routed experts), nothing else: Paddle's non-reentrant recompute. Fused ops are priced from what
their PyLayers save: the q/kv prologue (input + row statistics), the fused mHC (streams, mix logits, statistics;
the combine's four inputs), the fused experts (counts + gate/up), the fused inverse RoPE + postmix in either
mode (O and M). The storage machinery and the config widths live beside this file in ``recompute_trace.py``.

The MTP depths are priced as their own kind, under their layer index after the backbone's (the projections, the
decoder layer with its selective modules, the depth's mHC head, norm, LM-head input and cross-entropy); under
uniform full recompute each depth is one more recomputed unit (``models.dsv4._mtp_loss``): it keeps its inputs and
replayed decisions, and the shared LM head's input and the loss outside it; ``block`` leaves the depths as they
are. The CSA indexer KL
(``dsa_indexer_loss_coeff > 0``) adds, per CSA layer, the indexer's scoring pass with gradient, the student at the
picks and the KL's own saves, all inside the core attention (recomputed with it), plus the ``loss_mask`` input.

Dtypes: ``fp32`` is the CPU run (every cast to fp32 aliases). ``bf16`` prices the same saved storages as the code
writes them with bf16 weights and activations: tensors it computes in fp32 explicitly stay fp32 (norm
statistics, mHC mixing, router scores, compressor gates, the reference sparse attention's logits and
probabilities, RoPE rotations, the loss), and each ``astype("float32")`` of a bf16 tensor becomes a new fp32
copy. It is a model: it is not checked against a GPU, and Paddle's O1 autocast with fp32 master weights (what
``bf16: true`` runs) would also keep fp32 residual streams and bf16 casts of matmul inputs. Weights and their
casts are not activations and are not counted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # recompute_trace, beside this file

from recompute_trace import BOOL, BYTES, F32, F64, I32, I64, Shapes, T, Trace, promote  # noqa: E402

from fleet_ext.config import load_config, recompute_plan  # noqa: E402
from fleet_ext.layer_kinds import LayerKind, kinds_of, layer_attention  # noqa: E402

MODULES = ("full_attn", "vha_postmix", "core_attn", "mhc", "moe", "moe_act")


# -- norms, RoPE, mHC ---------------------------------------------------------------------------------------------
def rms_normalize(tr: Trace, x: T, rows: int, name: str = "rms") -> T:
    """``ops.q_rms_norm.reference.rms_normalize``: saves x in fp32 and, for ``inv_sqrt``, the row's fp64 square
    root (its gradient) and ``r = 1 / sqrt(mean(x^2) + eps)`` (the reciprocal's)."""
    xf = tr.cast(x, F32)
    tr.save(xf, tr.new(f"{name}.sqrt64", rows, F64), tr.new(f"{name}.r", rows, F32))
    return tr.cast(tr.new(f"{name}.y", x.numel, F32), x.dtype)


def rms_norm(tr: Trace, x: T, rows: int) -> T:
    """``layers.norm.RMSNorm``: the weightless normalisation's saves, then ``gain * normed`` saves normed."""
    xf = tr.cast(x, F32, name=f"{x.name.split('#')[0]}:fp32")
    tr.save(xf, tr.new("norm.sqrt64", rows, F64), tr.new("norm.r", rows, F32), tr.new("norm.normed", x.numel, F32))
    return tr.cast(tr.new("norm.y", x.numel, F32), x.dtype, name="norm.y")


def rope(tr: Trace, sh: Shapes, x: T, width: int, inverse: bool = False) -> T:
    """``ops.rope``: the reference saves the rotated channels in fp32 (x's own storage when x is fp32) and, for
    the inverse, the negated sin table [s, rope/2]; the fused kernel saves nothing (the tables ride on ctx)."""
    if not sh.fusion["rope"]:
        tr.save(tr.cast(x, F32, numel=x.numel // width * sh.rope, name="rope.rotated_channels:fp32"))
        if inverse:
            tr.save(tr.new("rope.neg_sin", sh.s * sh.rope // 2, F32))
    return tr.new("rope.out", x.numel, x.dtype)


def q_rms_norm(tr: Trace, sh: Shapes, q: T) -> T:
    rows = q.numel // sh.d
    if not sh.fusion["q_rms"]:
        return rms_normalize(tr, q, rows, "q_rms")
    tr.save(q, tr.new("q_rms.r", rows, F32))  # the fused PyLayer saves q and r
    return tr.new("q_rms.y", q.numel, q.dtype)


def qkv_prologue(tr: Trace, sh: Shapes, q: T, kv: T) -> tuple[T, T]:
    """q norm + RoPE and kv RMSNorm + RoPE. With both ``dsv4_q_rms_norm_fusion`` and ``apply_rope_fusion`` on,
    ``ops.qkv_prologue``'s PyLayers keep each input and its row statistics r (no normed copy, no rotation);
    otherwise the separate ops' saves."""
    if sh.fusion["q_rms"] and sh.fusion["rope"]:
        tr.save(q, tr.new("q_prologue.r", q.numel // sh.d, F32), kv, tr.new("kv_prologue.r", kv.numel // sh.d, F32))
        return tr.new("q_prologue.y", q.numel, q.dtype), tr.new("kv_prologue.y", kv.numel, kv.dtype)
    q = q_rms_norm(tr, sh, q)
    kv = rms_norm(tr, kv, kv.numel // sh.d)
    return rope(tr, sh, q, sh.d), rope(tr, sh, kv, sh.d)


def sinkhorn(tr: Trace, sh: Shapes) -> T:
    """Softmax, then ``2 * iterations - 1`` normalising divides, each saving its input, denominator and output."""
    cells = sh.tokens * sh.n * sh.n
    tr.save(tr.new("sinkhorn.softmax", cells, F32))
    comb = tr.new("sinkhorn.comb", cells, F32)  # softmax + eps
    for _ in range(2 * sh.iters - 1):
        out = tr.new("sinkhorn.comb", cells, F32)
        tr.save(comb, tr.new("sinkhorn.den", sh.tokens * sh.n, F32), out)
        comb = out
    return comb


def hyper_connection(tr: Trace, sh: Shapes, streams: T) -> tuple[T, T, T]:
    """``layers.mhc.HyperConnection``: (post, comb, collapsed block input)."""
    bs, n = sh.tokens, sh.n
    if sh.fusion["mhc"]:  # ops/mhc/function.py ``_Pre``: the streams, the mix logits [T, (2 + n) n] and r [T]
        tr.save(streams, tr.new("mhc.mix", bs * (2 + n) * n, F32), tr.new("mhc.r", bs, F32))
        post, comb = tr.new("mhc.post", bs * n, F32), tr.new("mhc.comb", bs * n * n, F32)
        return post, comb, tr.new("mhc.collapsed", bs * sh.D, streams.dtype)
    tr.save(rms_normalize(tr, tr.cast(streams, F32, name="mhc.streams:fp32"), bs, "mhc.flat_norm"))
    gates = {}
    for gate in ("pre", "post"):
        tr.save(tr.new(f"mhc.{gate}_w", bs * n, F32), tr.new(f"mhc.{gate}_sigmoid", bs * n, F32))
        gates[gate] = tr.new(f"mhc.{gate}", bs * n, F32)
    tr.save(tr.new("mhc.comb_w", bs * n * n, F32))
    comb = sinkhorn(tr, sh)
    tr.save(gates["pre"], tr.cast(streams, F32, name="mhc.streams:fp32"))  # pre * streams: a second cast
    return gates["post"], comb, tr.cast(tr.new("mhc.collapsed", bs * sh.D, F32), streams.dtype, name="mhc.collapsed")


def hyper_combine(tr: Trace, sh: Shapes, streams: T, block_out: T, post: T, comb: T) -> T:
    if sh.fusion["mhc"]:  # ops/mhc/function.py ``_Combine`` keeps its four inputs as given
        tr.save(streams, block_out, post, comb)
        return tr.new("mhc.streams", streams.numel, streams.dtype)
    tr.save(tr.cast(comb, streams.dtype), streams)
    tr.save(tr.cast(post, streams.dtype), block_out)
    return tr.new("mhc.streams", streams.numel, streams.dtype)


# -- attention ----------------------------------------------------------------------------------------------------
def compressor(tr: Trace, sh: Shapes, att: Any, x: T, width: int) -> T | None:
    """``layers.compressor.Compressor``: roped entries [b, s // ratio, width] (None when there are none)."""
    ratio = att.compress_ratio
    rows = sh.b * (sh.s // ratio)
    if not rows:
        return None
    coff = 2 if att.overlapping_compressor else 1
    tr.save(x)  # linear_wkv and linear_wgate read x
    kv = tr.new("compressor.kv", rows * ratio * coff * width, x.dtype)
    score = tr.new("compressor.score", kv.numel, F32)  # gate in fp32 + ape
    if att.overlapping_compressor:  # previous block's first half, this block's second half: new tensors
        kv = tr.new("compressor.kv_pairs", rows * 2 * ratio * width, kv.dtype)
        score = tr.new("compressor.score_pairs", kv.numel, F32)
    weights = tr.new("compressor.softmax", score.numel, F32)
    tr.save(weights)
    weights = tr.cast(weights, kv.dtype)
    tr.save(kv, weights)
    pooled = rms_norm(tr, tr.new("compressor.pooled", rows * width, promote(kv, weights)), rows)
    return rope(tr, sh, pooled, width)


def sparse_attention(tr: Trace, sh: Shapes, q: T, kv_full: T, width: int) -> T:
    """The sparse attention with sink over ``width`` keys per query: the gather-softmax reference (with the sink
    gradient fusion or not), or the Triton kernel (q, kv, flat ids, out, lse)."""
    bs, h, d = sh.tokens, sh.h, sh.d
    if sh.fusion["backend"] == "triton":
        out = tr.new("attn_core.out", bs * h * d, q.dtype)
        tr.save(q, kv_full, tr.new("attn_core.flat_idx", bs * width, I32), out, tr.new("attn_core.lse", bs * h, F32))
        return out
    tr.save(tr.new("attn_core.gather_idx", bs * width, I32))
    gathered = tr.cast(tr.new("attn_core.gathered_keys", bs * width * d, kv_full.dtype), F32)
    tr.save(tr.cast(q, F32, name="attn_core.q:fp32"), gathered)
    cells = bs * h * width
    tr.save(tr.new("attn_core.valid", cells, BOOL), tr.new("attn_core.exp", cells, F32))
    if not sh.fusion["sink"]:
        tr.save(tr.new("attn_core.exp_sink", bs * h, F32))
    tr.save(tr.new("attn_core.weights", cells, F32), tr.new("attn_core.denom", bs * h, F32),
            tr.new("attn_core.probs", cells, F32))
    out = tr.cast(tr.new("attn_core.out", bs * h * d, F32), q.dtype, name="attn_core.out")
    if sh.fusion["sink"]:  # the sink-gradient PyLayer keeps out and lse
        tr.save(out, tr.new("attn_core.lse", bs * h, F32))
    return out


def indexer_kl(tr: Trace, sh: Shapes, att: Any, x: T, q_latent: T, picks: int) -> None:
    """The CSA indexer KL (``dsa_indexer_loss_coeff > 0``): the indexer's scoring pass now runs with gradient (its
    own compressor at the indexer width, q roped and cast to fp32, fp32 head weights), the student at the picks
    (``gathered_scores``: flat int64 ids, q and the gathered keys, ReLU output, scaled logits, head weights) and
    ``indexer_kl_from_mass`` (valid / positive masks, masked logits and their logsumexp, target and log ratio,
    per-row terms and kept rows, the mean's division) and the auto-scaler's scaled loss. The teacher is no-grad."""
    rows, width, cells = sh.tokens, sh.idx_d, sh.tokens * sh.idx_heads * picks
    compressor(tr, sh, att, x, width)
    q = tr.cast(rope(tr, sh, tr.new("indexer.q", rows * sh.idx_heads * width, q_latent.dtype), width), F32,
                name="indexer.q:fp32")
    tr.save(tr.new("indexer.flat_picks", rows * picks, I64), q, tr.new("indexer.chosen", rows * picks * width, F32))
    tr.save(tr.new("indexer.relu", cells, F32), tr.new("indexer.scaled", cells, F32),
            tr.new("indexer.head_weights", rows * sh.idx_heads, F32))
    tr.save(tr.new("kl.valid", rows * picks, BOOL), tr.new("kl.logits", rows * picks, F32), tr.new("kl.lse", rows, F32))
    tr.save(tr.new("kl.target", rows * picks, F32), tr.new("kl.log_ratio", rows * picks, F32),
            tr.new("kl.positive", rows * picks, BOOL), tr.new("kl.per_row", rows, F32), tr.new("kl.keep", rows, F32))
    tr.save(*(tr.new(f"kl.{name}", 1, F32) for name in ("sum", "rows", "mean", "scaled")))


def core_attention(tr: Trace, sh: Shapes, att: Any, q: T, kv: T, x: T, q_latent: T, loss_mask: T | None = None) -> T:
    """``layers.dsv4_core_attention.CompressedSparseAttention``: kv_full = [kv | entries], keys per query; with the
    indexer KL the layer's ``loss_mask`` is one more input (kept only when the core is recomputed)."""
    if att.kind is LayerKind.FULL_CAUSAL:
        return sparse_attention(tr, sh, q, kv, sh.s)
    width, kv_full = min(att.window, sh.s), kv
    if att.has_compressor:
        entries = compressor(tr, sh, att, x, sh.d)
        kv_full = tr.new("attn_core.kv_full", sh.b * (sh.s + sh.s // att.compress_ratio) * sh.d, kv.dtype)
        if entries is not None and att.has_csa_indexer(sh.dense_csa):
            picks = min(sh.idx_topk, sh.s // att.compress_ratio)
            tr.decide(tr.new("csa_indexer.picks", sh.tokens * picks, I32))
            width += picks
            if sh.kl:
                indexer_kl(tr, sh, att, x, q_latent, picks)
        elif entries is not None:
            width += sh.s // att.compress_ratio
    return sparse_attention(tr, sh, q, kv_full, width)


def inv_rope_postmix(tr: Trace, sh: Shapes, out: T) -> T:
    """Inverse RoPE + VHA postmix ``M @ inv_rope(O)``. The reference saves M (in O's dtype) and the rotated O; the
    fused PyLayers (``ops.inv_rope_postmix``) save O itself and M, cast to O's dtype (bitwise mode) or as it is
    (fast mode), and rebuild the rotation in the backward."""
    mix = tr.new("vha.mix", sh.h * sh.h, F32)
    if sh.fusion["inv_rope_postmix"]:
        tr.save(out, mix if sh.fusion["inv_rope_postmix"] == "fast" else tr.cast(mix, out.dtype))
        return tr.new("vha.out", out.numel, out.dtype)
    rotated = rope(tr, sh, out, sh.d, inverse=True)
    tr.save(tr.cast(mix, out.dtype), rotated)
    return tr.new("vha.out", out.numel, out.dtype)


def attention(tr: Trace, sh: Shapes, att: Any, modules: frozenset, x: T) -> T:
    """``layers.dsv4_attention.DSv4HybridSelfAttention`` on the normalised layer input x [b, s, D]."""
    bs = sh.tokens
    tr.save(x)
    q_latent = rms_norm(tr, tr.new("attn.q_down", bs * sh.q_lora, x.dtype), bs)
    tr.save(q_latent)
    q, kv = qkv_prologue(tr, sh, tr.new("attn.q_up", bs * sh.h * sh.d, x.dtype), tr.new("attn.kv_down", bs * sh.d,
                                                                                          x.dtype))
    # with the indexer KL, ``input_ids != pad_token_id``: a new [b, s] bool, an input of the core
    loss_mask = tr.new("attn.loss_mask", bs, BOOL) if sh.kl and att.has_csa_indexer(sh.dense_csa) else None
    out = tr.segment("core_attn" in modules, lambda *a: core_attention(tr, sh, att, *a), q, kv, x, q_latent,
                     loss_mask)
    if sh.vha:
        out = tr.segment("vha_postmix" in modules, lambda o: inv_rope_postmix(tr, sh, o), out)
    else:
        out = rope(tr, sh, out, sh.d, inverse=True)
    tr.save(out)  # the grouped output projection's input
    o_in = tr.new("attn.o_groups", bs * sh.groups * sh.o_rank, out.dtype)
    tr.save(o_in)
    return tr.new("attn.out", bs * sh.D, o_in.dtype)


# -- MoE ----------------------------------------------------------------------------------------------------------
def swiglu(tr: Trace, sh: Shapes, gate_up: T) -> T:
    """``layers.mlp.clamped_swiglu``: the two halves (copies), their clamps, silu's output, the product."""
    half = gate_up.numel // 2
    gate, up = tr.new("swiglu.gate", half, gate_up.dtype), tr.new("swiglu.up", half, gate_up.dtype)
    if sh.clamp:
        tr.save(gate, up)
        gate, up = tr.new("swiglu.gate_clamped", half, gate.dtype), tr.new("swiglu.up_clamped", half, up.dtype)
    silu = tr.new("swiglu.silu", half, gate.dtype)
    tr.save(gate, silu, up)
    return tr.new("swiglu.h", half, gate.dtype)


def swiglu_mlp(tr: Trace, sh: Shapes, x: T, width: int) -> T:
    """``layers.mlp.SwiGLUMLP`` (shared experts, dense layers)."""
    tr.save(x)
    h = swiglu(tr, sh, tr.new("mlp.fc1", sh.tokens * 2 * width, x.dtype))
    tr.save(h)
    return tr.new("mlp.out", sh.tokens * sh.D, h.dtype)


def router(tr: Trace, sh: Shapes, x: T, hash_routed: bool) -> tuple[T, T]:
    """``layers.moe.TopKRouter`` / ``HashRouter``: (weights [T, k] fp32, indices [T, k] int64)."""
    tokens, E, k = sh.tokens, sh.E, sh.topk_experts
    tr.save(tr.cast(x, F32, name="router.x:fp32"))  # fp32 gate logits
    logits = tr.new("router.logits", tokens * E, F32)
    if sh.scoring == "sqrtsoftplus":
        tr.save(logits)
    scores = tr.new("router.scores", tokens * E, F32)
    tr.save(scores)
    indices = tr.new("router.indices", tokens * k, I64)
    if not hash_routed:
        tr.decide(indices)  # replayed under recompute
    if sh.fusion["router"]:  # the fused top-k / weights op keeps nothing beyond the scores
        _seq_aux(tr, sh, scores, hash_routed)
        return tr.new("router.weights_scaled", tokens * k, F32), indices
    # take_along_axis broadcasts both operands to new tensors and saves those
    tr.save(tr.new("router.scores_b", tokens * E, F32), tr.new("router.indices_b", tokens * k, I64))
    weights = tr.new("router.weights", tokens * k, F32)
    if sh.norm_topk:
        normed = tr.new("router.weights_normed", tokens * k, F32)
        tr.save(weights, tr.new("router.weights_sum", tokens, F32), normed)
    _seq_aux(tr, sh, scores, hash_routed)
    return tr.new("router.weights_scaled", tokens * k, F32), indices


def _seq_aux(tr: Trace, sh: Shapes, scores: T, hash_routed: bool) -> None:
    """The sequence-wise aux loss's saves (top-k routers with ``seq_aux_loss``)."""
    if sh.seq_aux and not hash_routed:
        tokens, E = sh.tokens, sh.E
        tr.save(scores, tr.new("aux.den", tokens, F32), tr.new("aux.probs", tokens * E, F32))
        tr.save(tr.new("aux.f", sh.b * E, F32), tr.new("aux.p_mean", sh.b * E, F32), tr.new("aux.loss", 1, F32))


def experts(tr: Trace, sh: Shapes, x: T, indices: T, weights: T, recompute_act: bool) -> T:
    """``layers.moe.GroupedExperts``: expert-sorted tokens, per-expert clamped SwiGLU, weighted scatter-add."""
    pairs = sh.tokens * sh.topk_experts
    if not sh.fusion["permute"]:  # the reference keeps the sort's int64 maps; the fused gathers keep none
        tr.save(tr.new("experts.token_of", pairs, I64), tr.new("experts.order", pairs, I64))
    x_sorted = tr.new("experts.x_sorted", pairs * sh.D, x.dtype)
    tr.save(x_sorted)
    if sh.fusion["experts"]:  # ops/moe_experts/function.py: the PyLayer keeps the rows per expert and gate+up, and
        h = tr.new("experts.h", pairs * sh.ffn, x.dtype)  # rebuilds h in the backward whatever moe_act says; the
        counts = 2 * sh.E + 1 if sh.fusion["permute"] else sh.E  # fused route's counts: a view of [counts | offsets]
        tr.save(tr.new("experts.counts", counts, I64), tr.new("experts.gate_up", pairs * 2 * sh.ffn, x.dtype))
    else:  # the reference grouped MLP (ops/moe_experts/reference.py): each row's slot in the padded buffer, the
        tr.save(tr.new("experts.slots", pairs, I64))  # SwiGLU's rows rounded up to a multiple of 8
        rows = pairs if pairs * sh.ffn % 8 == 0 else -(-pairs // 8) * 8
        gate_up = tr.new("experts.gate_up", rows * 2 * sh.ffn, x.dtype)
        h = tr.segment(recompute_act, lambda g: swiglu(tr, sh, g), gate_up)
        tr.save(h)
    w_sorted = tr.cast(weights if sh.fusion["permute"] else tr.new("experts.w_sorted", pairs, weights.dtype), F32)
    tr.save(tr.cast(tr.new("experts.y", pairs * sh.D, h.dtype), F32, name="experts.y:fp32"), w_sorted)
    return tr.new("experts.out", sh.tokens * sh.D, x.dtype)


def mlp(tr: Trace, sh: Shapes, x: T, kind: str, modules: frozenset) -> T:
    """Dense SwiGLU (``kind == "dense"``) or the MoE layer with a hash or a top-k router."""
    if kind == "dense":
        return swiglu_mlp(tr, sh, x, sh.dense_F)
    weights, indices = router(tr, sh, x, kind == "hash")
    out = tr.segment("moe" in modules, lambda *a: experts(tr, sh, *a, "moe_act" in modules), x, indices, weights)
    if sh.shared_F:
        swiglu_mlp(tr, sh, x, sh.shared_F)
    return tr.new("moe.out", out.numel, out.dtype)


# -- layers and the model -----------------------------------------------------------------------------------------
def decoder_layer(tr: Trace, sh: Shapes, att: Any, mlp_kind: str, modules: frozenset, streams: T) -> T:
    """``specs.transformer_layer.TransformerLayer`` with mHC: [b, s, n, D] streams in and out."""
    rows, mhc = sh.tokens, "mhc" in modules
    post, comb, collapsed = tr.segment(mhc, lambda x: hyper_connection(tr, sh, x), streams)
    x = rms_norm(tr, collapsed, rows)
    out = tr.segment("full_attn" in modules, lambda y: attention(tr, sh, att, modules, y), x)
    streams = tr.segment(mhc, lambda *a: hyper_combine(tr, sh, *a), streams, out, post, comb)
    post, comb, collapsed = tr.segment(mhc, lambda x: hyper_connection(tr, sh, x), streams)
    out = mlp(tr, sh, rms_norm(tr, collapsed, rows), mlp_kind, modules)
    return tr.segment(mhc, lambda *a: hyper_combine(tr, sh, *a), streams, out, post, comb)


def head(tr: Trace, sh: Shapes, streams: T) -> None:
    """``HyperHead`` collapse, final norm, LM head and the mean cross-entropy (the "other" bucket)."""
    lm_loss(tr, sh, head_input(tr, sh, streams))


def head_input(tr: Trace, sh: Shapes, streams: T) -> T:
    """``HyperHead`` collapse and final norm: the LM head's input (inside an MTP depth's recomputed unit)."""
    rows = sh.tokens
    if sh.fusion["mhc"]:  # ``mhc_head``: the ``_Pre`` PyLayer with n mix logits per token
        tr.save(streams, tr.new("head.mix", rows * sh.n, F32), tr.new("head.r", rows, F32))
        collapsed = tr.new("head.collapsed", rows * sh.D, streams.dtype)
    else:
        tr.save(rms_normalize(tr, tr.cast(streams, F32, name="head.streams:fp32"), rows, "head.flat_norm"))
        tr.save(tr.new("head.mix", rows * sh.n, F32), tr.new("head.sigmoid", rows * sh.n, F32))
        tr.save(tr.new("head.pre", rows * sh.n, F32), tr.cast(streams, F32, name="head.streams:fp32"))
        collapsed = tr.cast(tr.new("head.collapsed", rows * sh.D, F32), streams.dtype, name="head.collapsed")
    return rms_norm(tr, collapsed, rows)


def lm_loss(tr: Trace, sh: Shapes, hidden: T, shifted_labels: bool = False) -> None:
    """The LM head's input and the mean cross-entropy; an MTP depth's also keeps its labels (``shifted`` copies
    rather than the loader's)."""
    rows = sh.tokens
    tr.save(hidden)
    if shifted_labels:
        tr.save(tr.new("loss.labels", rows, I64))
    tr.save(tr.new("loss.softmax", rows * sh.vocab, F32))  # cross_entropy keeps its softmax
    tr.save(tr.new("loss.sum", 1, F32), tr.new("loss.count", 1, F32), tr.new("loss.mean", 1, F32))


def mlp_kind(config: Any, layer: int) -> str:
    moe = config.moe
    return "dense" if layer < moe.first_k_dense_replace else "hash" if layer < moe.moe_n_hash_layers else "topk"


def layer_terms(config: Any, layer: int, batch: int, seq: int, act: str = F32) -> dict[str, T]:
    """The storages decoder layer ``layer`` keeps for the backward (its input streams included)."""
    sh = Shapes.of(config, batch, seq)
    tr = Trace(act)
    plan = recompute_plan(config)
    chunk, modules = plan.chunk_of(layer), plan.modules_of(layer)
    att = layer_attention(config.model, layer)
    streams = T("layer.streams", sh.tokens * sh.n * sh.D, act)
    run = lambda x: decoder_layer(tr, sh, att, mlp_kind(config, layer), modules, x)  # noqa: E731
    if chunk is None:
        run(streams)
    elif chunk[0] == layer:  # full recompute: the chunk keeps its input
        tr.segment(True, run, streams)
    else:
        tr.depth += 1
        run(streams)
    return tr.saved


def mtp_terms(config: Any, depth: int, batch: int, seq: int, act: str = F32) -> dict[str, T]:
    """The storages MTP depth ``depth`` keeps (``models.mtp.MultiTokenPredictionLayer`` and its loss): the embedding
    lookup's shifted ids, ``enorm`` and ``e_proj``'s input, ``hnorm`` over the previous hidden streams and
    ``h_proj``'s input, its decoder layer (layer index ``num_hidden_layers + depth - 1``: its kind, MLP and selective
    modules), its own mHC head and final norm, then the shared LM head's input and the cross-entropy with shifted
    labels. Under uniform full recompute all but the LM head and the loss is one recomputed unit, keeping its inputs
    (the hidden streams and the shifted ids) and its replayed decisions."""
    sh = Shapes.of(config, batch, seq)
    tr, rows, layer = Trace(act), sh.tokens, config.model.num_hidden_layers + depth - 1
    plan = recompute_plan(config)
    full = plan.granularity == "full" and config.recompute.recompute_method == "uniform"
    hidden, ids_ahead = T("mtp.hidden", rows * sh.n * sh.D, act), tr.new("mtp.ids_ahead", rows, I64)

    def run(hidden: T, ids_ahead: T) -> T:
        tr.save(ids_ahead)
        tr.save(rms_norm(tr, tr.new("mtp.embedding", rows * sh.D, act), rows))  # e_proj(enorm(E[ids ahead]))
        tr.save(rms_norm(tr, hidden, rows * sh.n))  # h_proj(hnorm(hidden))
        streams = tr.new("mtp.streams", hidden.numel, act)  # h_proj + e_proj broadcast over the streams
        out = decoder_layer(tr, sh, layer_attention(config.model, layer), mlp_kind(config, layer),
                            plan.modules_of(layer), streams)
        return head_input(tr, sh, out)

    lm_loss(tr, sh, tr.segment(full, run, hidden, ids_ahead), shifted_labels=True)
    # The hidden streams: not recomputed, hnorm saves what the head before already keeps (or, bf16 unfused, only an
    # fp32 copy); recomputed, the unit keeps them unless the main model's head keeps them as they are (fused or fp32).
    if not full or (depth == 1 and (sh.fusion["mhc"] or act == F32)):
        tr.saved.pop(hidden.name, None)
    return tr.saved


def other_terms(config: Any, batch: int, seq: int, act: str = F32) -> dict[str, T]:
    sh = Shapes.of(config, batch, seq)
    tr = Trace(act)
    tr.save(tr.new("embedding.ids", sh.tokens, I64))  # the lookup keeps its ids (negative ones remapped first)
    head(tr, sh, T("head.streams", sh.tokens * sh.n * sh.D, act))
    if sh.mtp:  # the MTP loss (mean over depths x mtp_loss_scaling_factor) held by the auto-scaler
        tr.save(tr.new("mtp.scaled_loss", 1, F32))
    return tr.saved


def nbytes(terms: dict[str, T]) -> int:
    return sum(t.numel * BYTES[t.dtype] for t in terms.values())


def model_bytes(config: Any, batch: int, seq: int, act: str = F32) -> dict[int | None, int]:
    """Bytes kept per decoder layer, per MTP depth (under its layer index, after the backbone's) and under None the
    embedding / head / loss."""
    layers = config.model.num_hidden_layers
    out: dict[int | None, int] = {i: nbytes(layer_terms(config, i, batch, seq, act)) for i in range(layers)}
    for depth in range(1, config.model.num_nextn_predict_layers + 1):
        out[layers + depth - 1] = nbytes(mtp_terms(config, depth, batch, seq, act))
    out[None] = nbytes(other_terms(config, batch, seq, act))
    return out


# -- the tables ---------------------------------------------------------------------------------------------------
FLASH = ROOT / "configs" / "dsv4_flash_gpu.yaml"
PROBE_KINDS = [0, 4, 128, -1]  # one layer of each DSv4 kind, for the per-kind columns
GIB = 2**30


def policies(config: Any) -> dict[str, dict]:
    """The recompute settings the tables compare (the ones this config can take), the config's own included."""
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    usable = [m for m in MODULES if m != "vha_postmix" or config.model.use_vha_attention]
    out: dict[str, dict] = {"none": {"recompute_granularity": None}, "full (1 layer per chunk)": full}
    out.update({f"selective: {m}": {"recompute_granularity": "selective", "recompute_modules": [m]} for m in usable})
    own = config.recompute
    if own.recompute_granularity == "selective":
        names = ", ".join(own.recompute_modules)
        out[f"selective: {names} (this YAML)"] = {"recompute_granularity": "selective",
                                                  "recompute_modules": own.recompute_modules}
    out["selective: all"] = {"recompute_granularity": "selective", "recompute_modules": usable}
    return out


def _load(source: Any, overrides: dict, policy: dict) -> Any:
    clear = {"recompute_method": None, "recompute_num_layers": None, "recompute_modules": None}
    return load_config(source, **{**overrides, **clear, **policy})


def _probe(overrides: dict) -> dict:
    """A model with one top-k MoE decoder layer of each kind (no MTP) at the same widths."""
    return {**overrides, "csa_compress_ratios": PROBE_KINDS, "num_hidden_layers": len(PROBE_KINDS),
            "num_nextn_predict_layers": 0, "moe_n_hash_layers": 0, "first_k_dense_replace": 0}


def kind_table(source: Any, overrides: dict, batch: int, seq: int, act: str) -> tuple[list[str], list[list]]:
    """Rows (policy, bytes per layer of each kind, per MTP depth when there are any, model total) at ``source``'s
    widths: the kinds on a probe model, the MTP depths (mean) and the total on the model as configured."""
    base = load_config(source, **overrides)
    layers, depths = base.model.num_hidden_layers, base.model.num_nextn_predict_layers
    kinds = [k.value for k in kinds_of(load_config(source, **_probe(overrides)).model)]
    rows = []
    for name, policy in policies(base).items():
        per_kind = model_bytes(_load(source, _probe(overrides), policy), batch, seq, act)
        whole = model_bytes(_load(source, overrides, policy), batch, seq, act)
        mtp = [sum(whole[layers + k] for k in range(depths)) // depths] if depths else []
        rows.append([name, *(per_kind[i] for i in range(len(kinds))), *mtp, sum(whole.values())])
    return ["policy", *kinds, *(["MTP depth"] if depths else []), "model"], rows


def print_kind_table(header: list[str], rows: list[list], layers: int, depths: int = 0) -> None:
    none_total = rows[0][-1]
    whole = f"whole model, {layers} layers" + (f" + {depths} MTP depth(s)" if depths else "")
    print("| " + " | ".join([header[0], *(f"{k} (GiB/layer)" for k in header[1:-1]), f"{whole} (GiB)", "vs none"])
          + " |")
    print("|---" * (len(header) + 1) + "|")
    for name, *cells, total in rows:
        print(f"| {name} | " + " | ".join(f"{c / GIB:,.2f}" for c in cells)
              + f" | {total / GIB:,.1f} | {total / none_total:.1%} |")


def print_terms(source: Any, overrides: dict, kind: str, batch: int, seq: int, act: str, top: int) -> None:
    """The largest storages one layer of ``kind`` keeps without recompute (name, dtype, elements, GiB)."""
    config = _load(source, _probe(overrides), {"recompute_granularity": None})
    layer = [k.value for k in kinds_of(config.model)].index(kind)
    terms = sorted(layer_terms(config, layer, batch, seq, act).values(), key=lambda t: -t.numel * BYTES[t.dtype])
    print(f"| storage ({kind}, no recompute) | dtype | elements | GiB |\n|---|---|---|---|")
    for t in terms[:top]:
        print(f"| {t.name.split('#')[0]} | {t.dtype} | {t.numel:,} | {t.numel * BYTES[t.dtype] / GIB:,.3f} |")


def _overrides(pairs: list[str]) -> dict:
    import yaml

    return {key: yaml.safe_load(value) for key, value in (p.split("=", 1) for p in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(FLASH))
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence on this rank")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="activation dtype")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--terms", metavar="KIND", help="list the largest storages of one layer of KIND instead")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    overrides = _overrides(args.set)
    if args.terms:
        print_terms(args.config, overrides, args.terms, args.batch, args.seq, args.dtype, args.top)
        return
    model = load_config(args.config, **overrides).model
    if model.num_nextn_predict_layers or model.dsa_indexer_loss_coeff > 0:
        print(f"priced: {model.num_nextn_predict_layers} MTP depth(s) (each with its layer, head and loss), the CSA "
              f"indexer KL loss (coeff {model.dsa_indexer_loss_coeff:g}) in the CSA layers\n")
    header, rows = kind_table(args.config, overrides, args.batch, args.seq, args.dtype)
    print_kind_table(header, rows, model.num_hidden_layers, model.num_nextn_predict_layers)
    full = next(r for r in rows if r[0].startswith("full"))
    print(f"\nfull recompute keeps {full[-1] / rows[0][-1]:.1%} of the activations of no recompute (goal: <= 10 %)")


if __name__ == "__main__":
    main()
