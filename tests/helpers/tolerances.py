"""Tolerances are data (DESIGN.md rule 6): one table per dtype, one named entry per kind of comparison.

An entry bounds each element: ``|got - want| <= atol + rtol * |want| + of_scale * scale``, where ``scale`` is
the largest ``|want|`` unless the test passes its own (e.g. the sum of the magnitudes of every term of a float
sum); a ``norm`` entry bounds the whole tensor instead: ``||got - want||_F <= rtol * ||want||_F + atol``.
``exact`` (all zero) wherever exactness is possible: bitwise claims are checked with ``assert_bitwise``, not
here. Every loosening says why in its comment, with the error measured where the test that uses it says so.
The dtype is the one the compared computation runs in (fp32 on the CPU, bf16/fp32 on the GPU); ``float64``
is for comparisons between float64 computations. A test that needs a tighter bound adds a tighter entry; an
entry is never loosened to make a test pass.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tol:
    rtol: float = 0.0
    atol: float = 0.0
    of_scale: float = 0.0
    norm: bool = False

    @property
    def exact(self) -> bool:
        return not (self.rtol or self.atol or self.of_scale)


EXACT = Tol()
FP32_ULP = 2.0**-23  # spacing of fp32 numbers in [1, 2)
BF16_ULP = 2.0**-7  # spacing of bf16 numbers in [1, 2): at most 2^-7 of the value

FP32: dict[str, Tol] = {
    "exact": EXACT,
    # ---- fp32 against a float64 oracle, element by element --------------------------------------------------
    # Contractions of <= 64 O(1) terms (MoE routing and experts' weights, the sequence aux loss, mHC, sparse
    # attention out/lse, VHA postmix, HF's MoE block in torch fp32): ~1e-6 relative, 10x headroom.
    "oracle": Tol(rtol=1e-5, atol=1e-5),
    # Compressor: softmax pooling over 2*ratio slots, RMSNorm, RoPE, and the CSA indexer's scores: measured
    # ~1e-6 relative; 2e-5.
    "oracle_compressor": Tol(rtol=2e-5, atol=2e-5),
    # A rotation of |x| ~ 1 with fp32 cos/sin rounded from float64 angles: a few fp32 ulps; 1e-6.
    "oracle_rope": Tol(rtol=1e-6, atol=1e-6),
    # cos/sin of float64 angles rounded once to fp32: half an ulp of a value <= 1 is 6e-8; 1e-7.
    "rope_table": Tol(atol=1e-7),
    # Hadamard transform and the DSA indexer's RoPE of N(0, 1) values: sums of <= 32 fp32 products; 2e-6.
    "rotation": Tol(atol=2e-6),
    # The Hadamard transform keeps the row norm: fp32 norms of rotated rows, a few ulps; 1e-5 relative.
    "norm_preserved": Tol(rtol=1e-5),
    # Clamped SwiGLU with pre-activations of ~|25|: |out| ~ 1e3, so the absolute floor scales to 1e-3.
    "oracle_swiglu_large": Tol(rtol=1e-5, atol=1e-3),
    # Grouped experts / the MoE layer on inputs of scale 4 (clamp active): |out| ~ 1e1..1e2, floor 1e-4.
    "oracle_experts": Tol(rtol=1e-5, atol=1e-4),
    # Fused grouped experts (moe_expert_fusion) vs float64, each tensor relative to its largest entry: blocked fp32
    # GEMM sums (K <= 64 on the CPU, <= 256 in tests/gpu with IEEE fp32 dots) around the SwiGLU in fp32: measured
    # <= 5e-7 on the CPU interpreter; 1e-5. A row in the wrong segment or a clamp off by 1 % misses by >= 1e-3.
    "grouped_experts": Tol(of_scale=1e-5),
    # The tiny model (4 MoE layers, mHC) with moe_expert_fusion on vs off, per tensor, relative Frobenius norm: the
    # experts' fp32 reordering (~1e-7) reaches every gradient; measured <= 1.6e-6, the mHC mixing base / scale
    # gradients (small cancelling sums) up to 5.0e-6; 5e-5. A wrong kernel is O(1).
    "grouped_experts_model": Tol(rtol=5e-5, norm=True),
    # The tiny model with moe_router_logits_fusion on vs off, per tensor, relative Frobenius norm: the logits GEMM's
    # other summation order (~1e-7) reaches every gradient through the routing weights (the same experts are picked);
    # measured <= 2.9e-6 (the mHC mixing bases' small cancelling sums; 2 x 38 tokens); 5e-5, as the experts'. A
    # logits error of 1e-3 relative fails it (test_moe_router_gemm.py).
    "router_logits_model": Tol(rtol=5e-5, norm=True),
    # The reference grouped experts (padded batched GEMMs) vs the per-expert loop they replaced, on segments whose
    # length the loop's CPU GEMM / silu handle with leftover rows (test_moe_grouped_experts.py): the same products
    # summed in another order in those rows only, relative to each tensor's largest entry: measured <= 2.3e-7
    # (3 shapes x 3 seeds); 1e-5. A row given to the wrong expert misses by O(1).
    "grouped_vs_loop": Tol(of_scale=1e-5),
    # Aux-loss-free bias update from a zero bias: fp32(+-gamma) vs float64 gamma, half an ulp (6e-8 rel).
    "bias_step": Tol(rtol=1e-5),
    # The same update on an N(0, 1) bias: fp32(start + gamma) - start loses up to half an ulp of |start| <= ~3
    # (1.2e-7), i.e. ~1e-4 of gamma = 1e-3; 1e-3 relative.
    "bias_step_on_start": Tol(rtol=1e-3),
    # An empty attention row's lse equals the sink: exp/log of one fp32 logit, a few ulps of |sink| <= 2.
    "empty_row_lse": Tol(atol=1e-6),
    "empty_row_lse_rel": Tol(rtol=1e-6),
    # Sinkhorn column sums after the last (column) step: fp32 sums of 4 entries; 1e-5.
    "sinkhorn_col_sums": Tol(atol=1e-5),
    # Row sums after 20 iterations: linear convergence reaches 1e-5 for O(1) logits (the mHC regime) ...
    "sinkhorn_row_sums": Tol(atol=1e-5),
    # ... not for logits of spread ~3 (the float64 oracle has the same residual there): 1e-2.
    "sinkhorn_row_sums_spread": Tol(atol=1e-2),
    # fp32 oracle scores closer than this are treated as ties by the top-k check (score rounding ~1e-6).
    "topk_tie": Tol(atol=1e-4),
    # ---- fp32 against a float64 oracle, relative to the largest entry -----------------------------------------
    # Sparse attention gradients chain two d <= 16 contractions (measured ~1e-7 of the largest entry); VHA
    # postmix gradients (contractions over tokens of <= 8 heads); d_sink vs central differences (FD ~1e-10).
    "oracle_grad": Tol(of_scale=1e-5),
    # The DSA indexer's scores and its q / k / w after RoPE and Hadamard; the hybrid-MLA layer (dense, sparse)
    # vs the float64 dense MLA: fp32 rounding through the whole layer, measured ~1e-6; 2e-5.
    "oracle_layer": Tol(of_scale=2e-5),
    # Triton sparse attention (online softmax in blocks of 16 slots, CSR-ordered dkv sums) vs the float64
    # oracle or the Paddle reference, and the Triton backend inside the tiny model: measured 1e-7..5e-7.
    "triton_sparse_attn": Tol(of_scale=1e-5),
    # The same backend in scripts/gpu_smoke.py's model (yaml init, 4 layers, mHC), per tensor, relative Frobenius
    # norm: the core's reordering error (~1e-7) reaches every gradient; small cancelling sums (the mHC head's and
    # the layers' mixing base / scale / fn, 4..1024 entries) measured up to 8e-5 (seq 16-40, batch 1-2, 4 seeds);
    # 1e-3. A wrong kernel is O(1). The smoke also holds use_fused_mhc to it (one CPU entry per variant; mHC's own
    # model bound, "mhc_fused_model", is 1e-4).
    "model_triton_sparse_attn": Tol(rtol=1e-3, norm=True),
    # The sink gradient (fixed blocked summation order vs float64), relative to the sum of the magnitudes of
    # every term (the natural bound of a float sum with cancellation): measured <= 5.4e-8 (CPU), ~1e-7 (GPU,
    # bf16 or fp32 dO / O: the products are exact in fp32, the sums fp32); a missing or extra term is O(1).
    "sink_grad": Tol(of_scale=1e-5),
    # The fast inverse-RoPE + postmix mode (one-pass Triton kernels) vs the reference and vs float64, relative to
    # the sum of the magnitudes of each result's terms (the scale the tests pass): the same fp32 products summed
    # in Triton's order (K = h for y and d_out, K = tokens x d for d_mix, split-K partials): measured <= 2.3e-7 of
    # that sum vs the reference and <= 3.2e-7 vs float64 (CPU interpreter, 8 shapes; the reference itself is
    # 2.3e-7 off float64); 1e-5. A wrong rotation direction misses by >= 0.7, a token left out of d_mix by 5e-2.
    "inv_rope_postmix_fast": Tol(of_scale=1e-5),
    # The tiny model with that mode on vs the bitwise path, per tensor, relative Frobenius norm: the postmix's
    # reordering (~2e-7) carried through 4 layers, MoE routing and the loss: measured <= 2.4e-6 for every tensor
    # but the mHC gains; 1e-5. The gains (``mhc_*.scale``, ``mhc_head.scale``) are small differences of large
    # sums over tokens, streams and mixing entries (see cp_param_grad_mhc_gain): measured 4.9e-6; 1e-4.
    "model_inv_rope_postmix_fast": Tol(rtol=1e-5, norm=True),
    "model_inv_rope_postmix_fast_mhc_gain": Tol(rtol=1e-4, norm=True),
    # ---- fp32 gradients against central differences of a float64 oracle -----------------------------------
    # Step 1e-6 (truncation ~1e-12, rounding ~1e-10) vs fp32 backward, accumulated rounding ~1e-6 relative.
    "fd_grad": Tol(rtol=1e-4, atol=1e-5),
    # The same relative to the largest entry (mHC: ~1e-6 measured; compressor over 2 x 320 tokens: 5e-7).
    "fd_grad_of_max": Tol(of_scale=1e-4),
    # A difference of two fp32 gradients (the aux-loss part of the router's): cancellation, 10x looser.
    "fd_grad_difference": Tol(rtol=1e-3, atol=1e-5),
    # The aux-loss gradient alone: entries ~1e-3, so the absolute floor is 1e-6.
    "fd_grad_small": Tol(rtol=1e-4, atol=1e-6),
    # ---- fp32 against fp32 computed another way ---------------------------------------------------------------
    # Absorbed latent MQA vs dense MLA: absorption reorders the sums (q_nope W_UK first, W_UV after the
    # softmax); observed ~5e-7 of the output scale.
    "mla_absorbed": Tol(of_scale=1e-5),
    # Parameter gradients of the same: reordered sums over the whole layer; 1e-4 of the largest entry.
    "mla_absorbed_param_grad": Tol(of_scale=1e-4),
    # Fused mHC (use_fused_mhc) vs the Paddle reference, forward outputs and every gradient, relative to the
    # tensor's largest entry: the kernels sum the projection (n*D terms), the collapse, the combine and the
    # parameter gradients (over tokens) in other orders and apply the RMS factor after the projection; measured
    # <= 1e-6 of the largest entry (test_fusion_mhc.py, 4 shapes x 3 seeds); 1e-5 (also the GPU's fp32 bound vs
    # float64, tests/gpu/test_mhc_gpu.py: TF32x3 / bf16x3 products of fp32 accuracy). One Sinkhorn iteration short
    # misses by 1e-3. The gains (`scale` [3] / [1]) are each one sum over tokens and mixing entries of products of
    # both signs, so their value is a small difference of large sums: measured 9.4e-6 of itself; 1e-4.
    "mhc_fused": Tol(of_scale=1e-5),
    "mhc_fused_gain": Tol(of_scale=1e-4),
    # The tiny model (4 layers, 4 streams, 2 x 40 tokens) with use_fused_mhc on vs off, per tensor, relative
    # Frobenius norm: the ops' reordering (~1e-7) reaches every gradient; the mHC base / scale / fn gradients
    # (small cancelling sums) measured up to 1e-5; 1e-4.
    "mhc_fused_model": Tol(rtol=1e-4, norm=True),
    # A sparse phase whose table covers every key vs full causal: the same keys in another slot order.
    "attention_slot_order": Tol(atol=1e-6),
    # The indexer's gathered scores vs the full score matrix: the same products, gathered before the sum.
    "gathered_scores": Tol(atol=1e-6),
    # The indexer KL loss and its gradient vs the float64 oracle on small rows (<= 16 candidates).
    "kl_loss": Tol(atol=1e-6),
    # The KL loss of a whole hybrid-MLA layer (scores through the indexer, probs through the attention).
    "kl_loss_layer": Tol(atol=1e-5),
    # The CSA indexer KL of each CSA layer of the tiny model (test_csa_indexer_loss.py) vs the float64 oracle fed
    # the layer's own q / kv / x (fp32) and picks: fp32 compressors, index scores and attention logits through a
    # log-softmax and a mean over ~40 rows. Measured over 3 seeds x 3 layers (KL 1.2..5.2): the value within
    # 2.5e-7 relative (1e-5), its gradient w.r.t. the student scores within 2.5e-6 of its largest entry (2e-5),
    # indexer parameter gradients vs central differences within 1.8e-6 of the largest entry (2e-5). The planted
    # target errors miss by >= 3e-3 relative (value) and >= 0.13 of the largest entry (gradient).
    "csa_kl_loss": Tol(rtol=1e-5),
    "csa_kl_grad": Tol(of_scale=2e-5),
    "csa_kl_fd": Tol(of_scale=2e-5),
    # Gradients with the loss scale doubled: one extra fp32 multiply by 2 is exact, the sums around it not.
    "loss_scale_linearity": Tol(rtol=1e-6, atol=1e-12),
    # The MoE aux-loss scale enters before several fp32 sums of mixed-sign terms, so entries near 0 cancel:
    # relative to the largest entry (fp32 rounding over ~10 terms is ~1e-6 of it); a wrong scale misses by 2x.
    "loss_scale_of_max": Tol(of_scale=1e-5),
    # Model-level: experts group tokens across the batch and positions, so GEMM row counts (MKL blocking) and
    # fp32 rounding change; a causal leak or a batch mix-up is O(1e-1).
    "model_token_grouping": Tol(atol=1e-5),
    # The model's loss vs a float64 log-softmax of its own logits: one fp32 reduction over 2 x 140 tokens.
    "model_loss": Tol(atol=1e-5),
    # A loss that must not move while only the indexer trains (the frozen backbone's LM loss).
    "frozen_loss": Tol(atol=1e-5),
    # Fused sink gradient in the whole tiny model vs autograd of the reference (d_sink only; the rest is
    # bitwise): the kernel's blocked sum vs autograd's order over 2 x 38 tokens (test_fusion_layer_bitwise.py; at
    # most 2.6e-9, 9e-7 of the largest entry; 2 x 136 tokens: 1e-9).
    "sink_grad_model": Tol(rtol=1e-5, atol=1e-7),
    # Against Hugging Face (torch fp32, other op order): logits of the whole model, the V3.2 attention output.
    # Observed ~1e-6 (logits) and ~1e-7 (output); 1e-4 as the issue set it.
    "hf_parity": Tol(atol=1e-4),
    # ---- context parallelism: CP=2 against CP=1 on the same weights (tests/multi_card_tests) -------------------
    # Logits and the loss are bitwise (CPU fp32; asserted with assert_bitwise). A parameter gradient is the sum
    # over the group of each chunk's share: the same terms as one process, added in another order. Measured
    # ||g_cp - g||_F / ||g||_F <= 3e-6 for every parameter but the mHC gains; 1e-5 (the bound).
    "cp_param_grad": Tol(rtol=1e-5, norm=True),
    # The mHC gains (``mhc_*.scale``, 3 scalars per block) each sum one product per token, stream and mixing
    # entry (b*s*n*n terms) of both signs; their value is a small difference of large sums, so a reordering moves
    # them most: measured up to 1.3e-4 relative (fused tiny model). 1e-3, the only loosened parameter.
    "cp_param_grad_mhc_gain": Tol(rtol=1e-3, norm=True),
    # Auxiliary losses (MoE sequence aux loss, DSA indexer KL): each rank's share of one mean, added over the
    # group in another order than one process: measured 1e-7 relative; 1e-6.
    "cp_aux_loss": Tol(rtol=1e-6),
    # The first training step's loss from a Hugging Face directory vs transformers' loss on that batch: a mean
    # over ~100 tokens of log-softmaxes whose logits differ by ~1e-6; 1e-5 relative as the issue set it.
    "hf_first_step_loss": Tol(rtol=1e-5),
    # AdamW's decoupled weight decay step p * (1 - lr * wd), one fp32 multiply.
    "weight_decay": Tol(rtol=1e-6),
    # The global grad norm (fp32 sum of squares) vs float64; after clipping, the rescaled grads' norm.
    "grad_norm": Tol(rtol=1e-6),
    "clipped_grad_norm": Tol(rtol=1e-5),
    # GPU only (tests/gpu): the fused q RMS norm's fp32 output vs the float64 oracle (or, where the reduction
    # order is not modelled, eager torch), 16 fp32 ulps relative (an fp32 sum of d squares and a 2-ulp
    # rsqrt.approx); dx relative to its largest entry.
    "q_rms_norm_y": Tol(rtol=16 * FP32_ULP, atol=1e-30),
    "q_rms_norm_y_vs_eager": Tol(rtol=16 * FP32_ULP, atol=1e-30),
    "q_rms_norm_dx": Tol(of_scale=1e-5),
    # The kv prologue's gain gradient (registry DERIVED_FUSIONS["kv_norm_rope"].tolerance): a fixed blocked fp32 sum
    # over the rows (the GPU plan; tests/gpu and the GPU plan in the interpreter) vs float64, per column relative to
    # the sum of |term| (``scale``): blocks of <= a few hundred rows each carry ~N ulps; 1e-5 holds it with room.
    # The y / dx of the prologue vs float64: y as the q norm's (16 ulps of the row's largest, plus the rotation's
    # two roundings); dx as the q norm's.
    "kv_prologue_dw": Tol(of_scale=1e-5),
    "qkv_prologue_y": Tol(of_scale=32 * FP32_ULP),
}

BF16: dict[str, Tol] = {
    "exact": EXACT,
    # scripts/gpu_smoke.py on a Paddle GPU build: the tiny model in bf16 autocast, fused vs unfused, on the logits
    # and on all gradients as one vector (relative Frobenius norms). NOT measured (no Paddle GPU build has run it):
    # a kernel that keeps fp32 where the unfused path rounds to bf16 moves each op by ~2^-9, through 4 layers and a
    # top-2 router that can flip a near tie; what the smoke looks for (a wrong device or stream, a kernel that did
    # not run) is O(1). Tighten from the first run's numbers.
    "model_smoke": Tol(rtol=5e-2, norm=True),
    # The fused q RMS norm's bf16 output vs the correctly rounded float64 value: within one bf16 ulp (fp32
    # compute stays far below one bf16 ulp); vs eager torch where the order is not modelled, the same (and
    # 1e-30 for zeros); dx: the output rounding is 2^-9 relative, 1e-2 of the largest entry.
    "q_rms_norm_y": Tol(rtol=BF16_ULP),
    "q_rms_norm_y_vs_eager": Tol(rtol=BF16_ULP, atol=1e-30),
    "q_rms_norm_dx": Tol(of_scale=1e-2),
    # The q/kv prologue's y vs a float64 oracle that rounds the norm's output to bf16 as the op does: the final
    # rounding (half a bf16 ulp) plus, where the fp32 and float64 norms round a pair's intermediates differently, up
    # to sqrt(2) bf16 ulps through the rotation; relative to the row's largest |y| (``scale``): 2 ulps.
    "qkv_prologue_y": Tol(of_scale=2 * BF16_ULP),
    # Fused grouped experts (tests/gpu/test_moe_experts_gpu.py), relative Frobenius norms: vs float64 of the same bf16
    # operands, gate_up, h, d_gate_up and every result rounded to bf16 (2^-9 each), fp32 sums with cancellation in
    # the input and weight gradients; vs the eager torch mirror (its own bf16 roundings, another order). Measured on
    # the H200 at T = 8192 vs an fp32 reference: out 3.4e-3, d_rows / d_weight1 6.4e-3 (torch._grouped_mm: 3.7e-3 /
    # 6.8e-3), so fused vs a mirror can differ by ~9e-3; 2e-2. A row in the wrong segment is O(1e-1).
    "grouped_experts": Tol(rtol=2e-2, norm=True),
    "grouped_experts_vs_eager": Tol(rtol=2e-2, norm=True),
    # Triton sparse attention, bf16, vs an fp32 torch reference (relative Frobenius norms): P is rounded to
    # bf16 before the PV product and out is stored in bf16 (2^-9 each): ~3e-3 norm-wise.
    "sparse_attn_out": Tol(rtol=1e-2, norm=True),
    # lse: logits are exact bf16 products summed in fp32; only the summation order differs.
    "sparse_attn_lse": Tol(atol=2e-3),
    # dq, dkv: dS and P enter the gradient GEMMs in bf16 and the results are stored in bf16.
    "sparse_attn_grad": Tol(rtol=2e-2, norm=True),
    # d_sink: computed from the bf16 out and d_out (delta = rowsum(dO * O)).
    "sparse_attn_d_sink": Tol(rtol=1e-2, norm=True),
    # Fused mHC with bf16 streams (tests/gpu/test_mhc_gpu.py) vs float64 from the same bf16 inputs, for the bf16
    # outputs only (collapsed input, head, combine, streams' gradients): fp32 maths rounded once to bf16 (at most
    # 2^-8 relative; one ulp, 2^-7, allowed) plus the fp32 entry's 1e-5 of the largest entry for the fp32 error
    # underneath. The fp32 outputs of a bf16 run (post, comb, parameter gradients) are fp32 maths on bf16-exact
    # inputs and use the fp32 entries unchanged. The eager torch sequence's post, comb and collapsed input are the
    # same fp32 maths and are held to the same entries. All held on the H200 (2026-12-01), once the bf16x3 tile
    # products were summed per tile in a fresh accumulator (run 3's d fn / comb misses: the tensor cores'
    # accumulator had dropped low bits across 3 x 1024 products, 4e-5 relative bias at K = 16384, bench_mhc.py).
    "mhc_fused": Tol(rtol=BF16_ULP, of_scale=1e-5),
    "mhc_fused_gain": Tol(of_scale=1e-4),
    # Eager torch's combine with bf16 streams vs float64, per element, relative to the test's scale
    # |e| + 2 |post f| + 3 sum_j |comb_jk x_j| (e the exact value): it rounds post and comb to bf16, the product
    # post f, the GEMM (and, with torch's default reduced-precision reduction, possibly its sum once more) and the
    # final sum, each at most u = 2^-8 relative; first order that is u times the scale; 2^-8 (1 + 2^-4).
    "mhc_eager_combine": Tol(of_scale=BF16_ULP / 2 * (1 + 2**-4)),
    # Dense causal mode: head-summed probabilities exp(s - lse) of the warm-up KL target, fp32 from exact bf16
    # products; the lse's error (sparse_attn_lse, 2e-3) becomes a relative error of each term: 1e-2 norm-wise.
    "sparse_attn_probs": Tol(rtol=1e-2, norm=True),
    # The fast inverse-RoPE + postmix mode vs a float64 oracle fed the operands the reference rounds to bf16
    # (M and the rotated O; dY is bf16 already): the one rounding of the result (half a bf16 ulp, 2^-8 relative)
    # plus the fp32 sums' order, relative to the sum of the magnitudes of the terms as in fp32.
    "inv_rope_postmix_fast": Tol(rtol=BF16_ULP / 2, of_scale=1e-5),
}

FP16: dict[str, Tol] = {
    "exact": EXACT,
    # The fast inverse-RoPE + postmix kernels' low-precision path (the bf16 one, run in fp16 in the CPU interpreter,
    # whose bf16 dot is not usable) vs a float64 oracle fed the reference's fp16 operands: half an fp16 ulp
    # (2^-11 relative) for the one rounding of the result, plus the fp32 sums' order (measured <= 6e-8 of the sum
    # of the terms' magnitudes); as bf16.
    "inv_rope_postmix_fast": Tol(rtol=2.0**-11, of_scale=1e-5),
}

FLOAT64: dict[str, Tol] = {
    "exact": EXACT,
    # RoPE frequencies computed in float64 on both sides (powers and a linear ramp): a few float64 ulps.
    "frequencies": Tol(rtol=1e-12),
    # Two float64 oracles that differ by an orthogonal rotation (Hadamard): rounding only.
    "orthogonal_rotation": Tol(of_scale=1e-12, atol=1e-12),
    # A float64 scalar formula computed in another order (softmax scale with YaRN's mscale, the LR schedule).
    "scalar_formula": Tol(rtol=1e-12),
}

TOLERANCES: dict[str, dict[str, Tol]] = {"fp32": FP32, "bf16": BF16, "fp16": FP16, "float64": FLOAT64}


def tolerance(dtype: str, name: str) -> Tol:
    """The entry ``name`` of the ``dtype`` table; an unknown dtype or name raises naming what exists."""
    if dtype not in TOLERANCES:
        raise KeyError(f"no tolerance table for dtype {dtype!r}; tables: {sorted(TOLERANCES)}")
    table = TOLERANCES[dtype]
    if name not in table:
        raise KeyError(f"no {dtype} tolerance named {name!r}; entries: {sorted(table)}")
    return table[name]
