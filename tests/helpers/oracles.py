"""Independent float64 NumPy oracles for the DSv4 and hybrid-MLA building blocks, one definition each.

Written from the maths in ``shared/reference/dsv4_math.md`` (§2.3 compressor, §2.4 CSA indexer, §2.5 sparse
attention with sink, §2.6 inverse RoPE, §2.8 / §6 DSA indexer and MLA, §3 mHC, §5 VHA postmix, §7 sink
backward) and HF's ``_compute_yarn_parameters``. Nothing here imports or mirrors ``fleet_ext``: DESIGN.md
rule 5 (an oracle must not share code with what it checks). Everything is float64 and deliberately
loop-heavy where that makes a formula easier to read than a vectorised reshaping trick. Weights are
NumPy arrays in Paddle's ``[in, out]`` layout (``y = x @ w``).
"""

from __future__ import annotations

import math

import numpy as np


def f64(a) -> np.ndarray:
    """``a`` as a float64 array; torch tensors (any device or dtype, bf16 included) are read through fp32."""
    if hasattr(a, "detach") and hasattr(a, "cpu"):  # torch, without importing it
        a = a.detach().float().cpu().numpy()
    return np.asarray(a, dtype=np.float64)


# --------------------------------------------------------------------------------------------------
# Norms.
# --------------------------------------------------------------------------------------------------
def rms_norm(x, weight=None, eps: float = 1e-6) -> np.ndarray:
    x = f64(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * f64(weight)


def layer_norm(x, weight, bias, eps: float = 1e-6) -> np.ndarray:
    x = f64(x)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * f64(weight) + f64(bias)


def hadamard_matrix(d: int) -> np.ndarray:
    """Sylvester Hadamard H_d / sqrt(d) (symmetric, orthogonal)."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


# --------------------------------------------------------------------------------------------------
# RoPE and its frequencies.
# --------------------------------------------------------------------------------------------------
def plain_inv_freq(dim: int, base: float) -> np.ndarray:
    """theta_i = base^(-2i/dim), i = 0 .. dim/2 - 1."""
    return np.array([base ** (-(2.0 * i) / dim) for i in range(dim // 2)], dtype=np.float64)


def yarn_inv_freq(dim, base, factor, original_max_position, beta_fast, beta_slow) -> np.ndarray:
    """HF ``_compute_yarn_parameters`` with truncate=True (frequencies only)."""

    def find_correction_dim(num_rotations):
        return (dim * math.log(original_max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = math.floor(find_correction_dim(beta_fast))
    high = math.ceil(find_correction_dim(beta_slow))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high = high + 0.001
    extrapolated = plain_inv_freq(dim, base)
    interpolated = extrapolated / factor
    out = np.empty(dim // 2)
    for i in range(dim // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation_factor = 1.0 - ramp
        out[i] = interpolated[i] * (1.0 - extrapolation_factor) + extrapolated[i] * extrapolation_factor
    return out


def yarn_parameters(dim, base, factor, original, beta_fast, beta_slow, mscale, mscale_all_dim):
    """(inv_freq, cos/sin factor, softmax factor) as HF ``_compute_yarn_parameters`` + ``yarn_apply_mscale``."""

    def m(scale, ms):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    cos_sin = m(factor, mscale) / m(factor, mscale_all_dim) if (mscale and mscale_all_dim) else m(factor, 1.0)
    softmax = m(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return yarn_inv_freq(dim, base, factor, original, beta_fast, beta_slow), cos_sin, softmax


def rope_angles(positions, inv_freq) -> np.ndarray:
    """[n_pos, dim/2] angles pos * theta_i."""
    return np.outer(f64(positions), f64(inv_freq))


def rope(x, angles, inverse: bool = False, *, factor: float = 1.0, leading: bool = False,
         interleaved: bool = True) -> np.ndarray:
    """Rotate ``2 * angles.shape[-1]`` channels of x as complex pairs.

    The trailing channels (DSv4's ``[nope | pe]``) or, with ``leading``, the leading ones (the DSA indexer's
    ``[pe | nope]``); pairs (2i, 2i+1) when ``interleaved``, else (i, i + half) (rotate-half). ``angles``
    must broadcast against ``x[..., :half]`` (e.g. [s, half] for x [b, s, d], [s, 1, half] for x
    [b, s, h, d]). ``inverse`` multiplies by the conjugate rotation; ``factor`` scales the rotated
    channels (YaRN's cos/sin factor).
    """
    x = f64(x).copy()
    half = np.shape(angles)[-1]
    width = x.shape[-1]
    channels = slice(0, 2 * half) if leading else slice(width - 2 * half, width)
    pe = x[..., channels]
    z = pe[..., 0::2] + 1j * pe[..., 1::2] if interleaved else pe[..., :half] + 1j * pe[..., half:]
    z = z * np.exp((-1j if inverse else 1j) * f64(angles)) * factor
    if interleaved:
        pe[..., 0::2], pe[..., 1::2] = z.real, z.imag
    else:
        pe[..., :half], pe[..., half:] = z.real, z.imag
    x[..., channels] = pe
    return x


def rope_at(x, positions, inv_freq, *, factor: float = 1.0, leading: bool = False,
            interleaved: bool = True) -> np.ndarray:
    """``rope`` of x [b, s, (h,) d] at ``positions`` along axis 1 (one rotation shared by the heads)."""
    angles = rope_angles(positions, inv_freq)
    if np.ndim(x) == 4:
        angles = angles[:, None, :]
    return rope(x, angles, factor=factor, leading=leading, interleaved=interleaved)


# --------------------------------------------------------------------------------------------------
# Compressor (§2.3) and the CSA lightning indexer (§2.4).
# --------------------------------------------------------------------------------------------------
def _softmax_over_slots(scores):
    """Per channel softmax over axis 0 (the slots); -inf slots get weight 0."""
    m = np.max(scores, axis=0, keepdims=True)
    e = np.exp(scores - m)
    return e / e.sum(axis=0, keepdims=True)


def compressor(x, wkv, wgate, ape, norm_weight, ratio, head_dim, overlap, inv_freq, eps=1e-6) -> np.ndarray:
    """Compressed entries [b, s // ratio, head_dim].

    x [b, s, D]; wkv, wgate [D, coff*head_dim]; ape [ratio, coff*head_dim]. Entry i pools tokens
    ratio*i .. ratio*(i+1)-1 (and, with overlap, the previous block through the first half of the
    channels, the current block through the second half, one softmax over the 2*ratio slots per channel).
    Then RMSNorm with weight, then RoPE of the trailing 2*len(inv_freq) channels at position ratio*i.
    """
    x, wkv, wgate, ape = f64(x), f64(wkv), f64(wgate), f64(ape)
    b, s, _ = x.shape
    n = s // ratio
    c, z = x @ wkv, x @ wgate  # [b, s, coff*d]
    d = head_dim
    out = np.zeros((b, n, d))
    for bi in range(b):
        for i in range(n):
            slot_values, slot_scores = [], []
            if overlap:
                if i > 0:  # previous block through the first half (a); block 0 has no previous block
                    for j in range(ratio * (i - 1), ratio * i):
                        slot_values.append(c[bi, j, :d])
                        slot_scores.append(z[bi, j, :d] + ape[j - ratio * (i - 1), :d])
                for j in range(ratio * i, ratio * (i + 1)):  # current block through the second half (b)
                    slot_values.append(c[bi, j, d:])
                    slot_scores.append(z[bi, j, d:] + ape[j - ratio * i, d:])
            else:
                for j in range(ratio * i, ratio * (i + 1)):
                    slot_values.append(c[bi, j])
                    slot_scores.append(z[bi, j] + ape[j - ratio * i])
            weights = _softmax_over_slots(np.stack(slot_scores))
            out[bi, i] = (weights * np.stack(slot_values)).sum(axis=0)
    out = rms_norm(out, norm_weight, eps)
    return rope(out, rope_angles(np.arange(n) * ratio, inv_freq))


def visible_count(seq_len: int, ratio: int) -> np.ndarray:
    """Query t may use compressed entry i iff i < floor((t+1)/ratio)."""
    return np.array([(t + 1) // ratio for t in range(seq_len)], dtype=np.int64)


def csa_indexer_scores(x, q_latent, wq_b, w_weights, keys, n_heads, head_dim, inv_freq) -> np.ndarray:
    """I[b, t, i] = sum_h w[b,t,h] ReLU(q[b,t,h] . k[b,i]) with w = x W_w / sqrt(n_I d_I); q roped at t."""
    x, q_latent, keys = f64(x), f64(q_latent), f64(keys)
    b, s, _ = x.shape
    q = (q_latent @ f64(wq_b)).reshape(b, s, n_heads, head_dim)
    q = rope(q, rope_angles(np.arange(s), inv_freq)[:, None, :])
    w = (x @ f64(w_weights)) / math.sqrt(n_heads * head_dim)  # [b, s, n_I]
    dots = np.einsum("bthd,bid->bthi", q, keys)
    return np.einsum("bth,bthi->bti", w, np.maximum(dots, 0.0))


def masked_scores(scores, ratio) -> np.ndarray:
    """Scores with -inf on the entries a query may not see."""
    s, n = scores.shape[-2], scores.shape[-1]
    hidden = np.arange(n)[None, :] >= visible_count(s, ratio)[:, None]
    return np.where(hidden, -np.inf, f64(scores))


# --------------------------------------------------------------------------------------------------
# Sparse attention with a sink (§2.5, §7).
# --------------------------------------------------------------------------------------------------
def sparse_attention_fwd(q, kv, idx, sink, scale):
    """q [B,S,H,d], kv [B,N,d], idx [B,S,K] (-1 invalid), sink [H] -> (out [B,S,H,d], lse [B,S,H]).

    The sink is an extra softmax column with logit sink_h and value 0; lse includes it.
    """
    q, kv, sink = f64(q), f64(kv), f64(sink)
    bsz, seq, heads, dim = q.shape
    out = np.zeros((bsz, seq, heads, dim))
    lse = np.zeros((bsz, seq, heads))
    for b in range(bsz):
        for t in range(seq):
            keys = [j for j in idx[b, t] if j >= 0]
            for h in range(heads):
                logits = np.array([scale * q[b, t, h] @ kv[b, j] for j in keys] + [sink[h]])
                m = logits.max()
                e = np.exp(logits - m)
                z = e.sum()
                lse[b, t, h] = m + math.log(z)
                p = e / z
                for pj, j in zip(p[:-1], keys):
                    out[b, t, h] += pj * kv[b, j]
    return out, lse


def sparse_attention_bwd(q, kv, idx, sink, scale, d_out, d_lse=None):
    """Analytic backward of ``sparse_attention_fwd`` for the loss sum(out*d_out) + sum(lse*d_lse).

    P_j = exp(l_j - LSE), P_sink = exp(sink - LSE), Delta = rowsum(dO * O);
    dS_j = P_j (dO . v_j - Delta + d_lse); dq = scale sum_j dS_j k_j; dkv_j += scale dS_j q + P_j dO (K = V);
    d_sink = sum P_sink (-Delta + d_lse).
    """
    q, kv, sink, d_out = f64(q), f64(kv), f64(sink), f64(d_out)
    out, lse = sparse_attention_fwd(q, kv, idx, sink, scale)
    d_lse = np.zeros_like(lse) if d_lse is None else f64(d_lse)
    bsz, seq, heads, _ = q.shape
    dq, dkv, dsink = np.zeros_like(q), np.zeros_like(kv), np.zeros_like(sink)
    for b in range(bsz):
        for t in range(seq):
            keys = [j for j in idx[b, t] if j >= 0]
            for h in range(heads):
                delta = d_out[b, t, h] @ out[b, t, h]
                p_sink = math.exp(sink[h] - lse[b, t, h])
                dsink[h] += p_sink * (-delta + d_lse[b, t, h])
                for j in keys:
                    p = math.exp(scale * q[b, t, h] @ kv[b, j] - lse[b, t, h])
                    ds = p * (d_out[b, t, h] @ kv[b, j] - delta + d_lse[b, t, h])
                    dq[b, t, h] += scale * ds * kv[b, j]
                    dkv[b, j] += scale * ds * q[b, t, h] + p * d_out[b, t, h]
    return dq, dkv, dsink


def sink_grad(d_out, out, lse, sink, d_lse=None, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """(d_sink [H], scale [H]) from the given (already rounded) out, lse: §7's sink gradient alone.

    d_sink[h] = sum_{b,t} exp(sink_h - lse) * (d_lse - sum_d dO*O); scale[h] = sum_{b,t} exp(sink_h - lse) *
    (sum_d |dO*O| + |d_lse|), the sum of the magnitudes of every term (the natural bound of a float sum with
    cancellation). ``d_out`` may be None (no output gradient). Tokens go in chunks of ``chunk`` so a
    production-sized GPU tensor is read to the host piece by piece.
    """
    bsz, seq, heads, dim = out.shape
    rows = bsz * seq
    o_all = out.reshape(rows, heads, dim)
    do_all = None if d_out is None else d_out.reshape(rows, heads, dim)
    lse_all, sink64 = f64(lse).reshape(rows, heads), f64(sink)
    extra_all = np.zeros((rows, heads)) if d_lse is None else f64(d_lse).reshape(rows, heads)
    total, scale = np.zeros(heads), np.zeros(heads)
    for t0 in range(0, rows, chunk):
        if do_all is None:
            delta = mag = np.zeros((min(chunk, rows - t0), heads))
        else:
            products = f64(do_all[t0:t0 + chunk]) * f64(o_all[t0:t0 + chunk])
            delta, mag = products.sum(-1), np.abs(products).sum(-1)
        extra = extra_all[t0:t0 + chunk]
        p = np.exp(sink64[None, :] - lse_all[t0:t0 + chunk])
        total += (p * (extra - delta)).sum(0)
        scale += (p * (mag + np.abs(extra))).sum(0)
    return total, scale


# --------------------------------------------------------------------------------------------------
# Hybrid-MLA (-2) layers: dense MLA, the DSA indexer, its top-k + window table and its KL loss (§2.8, §6).
# --------------------------------------------------------------------------------------------------
def mla_dense(x, p, dims, inv_freq, rope_factor, scale, eps, sink=None, allowed=None):
    """Dense causal MLA. Returns (output [b, s, D], per-head probs [b, h, s, s], logits [b, h, s, s]).

    p: dict of weights. dims: (h, nope, rope, v, kv_lora). ``allowed`` [b, s, s] bool restricts the keys
    (sparse attention); causality always applies. ``sink`` [h] adds a value-less softmax column.
    """
    h, nope, rope_dim, v, lora = dims
    x = f64(x)
    b, s, _ = x.shape
    pos = np.arange(s)
    cq = rms_norm(x @ f64(p["q_down"]), p["q_norm"], eps)
    q = (cq @ f64(p["q_up"])).reshape(b, s, h, nope + rope_dim)
    q_pe = rope_at(q[..., nope:], pos, inv_freq, factor=rope_factor)
    kv_a = x @ f64(p["kv_down"])
    ckv = rms_norm(kv_a[..., :lora], p["kv_norm"], eps)
    k_pe = rope_at(kv_a[..., lora:], pos, inv_freq, factor=rope_factor)
    kv = (ckv @ f64(p["kv_up"])).reshape(b, s, h, nope + v)
    out = np.zeros((b, s, h, v))
    probs = np.zeros((b, h, s, s))
    logits_all = np.full((b, h, s, s), -np.inf)
    for bi in range(b):
        for hi in range(h):
            for t in range(s):
                keys = [j for j in range(t + 1) if allowed is None or allowed[bi, t, j]]
                logits = np.array(
                    [q[bi, t, hi, :nope] @ kv[bi, j, hi, :nope] + q_pe[bi, t, hi] @ k_pe[bi, j] for j in keys]
                ) * scale
                extra = [] if sink is None else [float(sink[hi])]
                m = max(list(logits) + extra) if len(keys) or extra else 0.0
                den = np.exp(logits - m).sum() + sum(math.exp(e - m) for e in extra)
                pr = np.exp(logits - m) / den
                for j, pj in zip(keys, pr):
                    probs[bi, hi, t, j] = pj
                    logits_all[bi, hi, t, j] = logits[keys.index(j)]
                    out[bi, t, hi] += pj * kv[bi, j, hi, nope:]
    y = out.reshape(b, s, h * v) @ f64(p["o"])
    return y, probs, logits_all


def dsa_indexer_scores(
    x, cq, p, n_heads, head_dim, inv_freq, rope_factor=1.0, interleaved=False, hadamard=True, parts=False
):
    """DSA index scores [b, s, s] (no mask): sum_h w_h ReLU(q_h . k) with w = x W_w / sqrt(H * d).

    RoPE on the leading channels ([pe | nope]). ``parts=True`` also returns (q [b, s, H, d], k [b, s, d],
    w [b, s, H]) after RoPE and Hadamard."""
    x, cq = f64(x), f64(cq)
    b, s, _ = x.shape
    pos = np.arange(s)
    q = (cq @ f64(p["wq_b"])).reshape(b, s, n_heads, head_dim)
    q = rope_at(q, pos, inv_freq, factor=rope_factor, leading=True, interleaved=interleaved)
    k = layer_norm(x @ f64(p["wk"]), p["k_norm_w"], p["k_norm_b"])
    k = rope_at(k, pos, inv_freq, factor=rope_factor, leading=True, interleaved=interleaved)
    if hadamard:
        hm = hadamard_matrix(head_dim)
        q, k = q @ hm, k @ hm
    w = (x @ f64(p["weights_proj"])) / math.sqrt(n_heads * head_dim)
    scores = np.zeros((b, s, s))
    for bi in range(b):
        for t in range(s):
            for j in range(s):
                dots = q[bi, t] @ k[bi, j]  # [H]
                scores[bi, t, j] = float(np.sum(w[bi, t] * np.maximum(dots, 0.0)))
    return (scores, (q, k, w)) if parts else scores


def topk_window_table(scores, topk, window):
    """Per row: top-k (best first) among j <= t - window (j <= t if window == 0), -1 padded to
    k_top = min(topk, max(0, s - window)); then the window t-W+1..t (-1 before 0)."""
    b, s, _ = scores.shape
    k_top = min(topk, max(0, s - window))
    w_cols = min(window, s) if window else 0
    table = np.full((b, s, k_top + w_cols), -1, dtype=np.int64)
    for bi in range(b):
        for t in range(s):
            cands = [j for j in range(s) if j <= t - window]
            best = sorted(cands, key=lambda j: -scores[bi, t, j])[:k_top]
            table[bi, t, : len(best)] = best
            for c in range(w_cols):
                j = t - w_cols + 1 + c
                table[bi, t, k_top + c] = j if j >= 0 else -1
    return table, k_top


def kl_rows(probs, student_scores, cand, row_mask=None):
    """Mean over kept rows of KL(p || softmax(I)) on each row's candidate set.

    probs [b, h, s, n] per-head attention probabilities; student_scores [b, s, n]; cand [b, s, n] bool.
    """
    b, h, s, n_keys = probs.shape
    total, rows = 0.0, 0
    for bi in range(b):
        for t in range(s):
            keys = [j for j in range(n_keys) if cand[bi, t, j]]
            if not keys or (row_mask is not None and not row_mask[bi, t]):
                continue
            p = np.array([probs[bi, :, t, j].sum() for j in keys])
            if p.sum() <= 0:
                continue
            p = p / p.sum()
            z = np.array([student_scores[bi, t, j] for j in keys])
            logq = z - z.max() - math.log(np.exp(z - z.max()).sum())
            total += float(sum(pi * (math.log(pi) - lq) for pi, lq in zip(p, logq) if pi > 0))
            rows += 1
    return total / max(rows, 1)


def kl_rows_grad(probs, student_scores, cand, row_mask=None) -> np.ndarray:
    """d ``kl_rows`` / d student_scores [b, s, n]: (softmax(I) - p) / rows on each kept row's candidates, else 0
    (dsv4_math.md §6.3; p the head-summed, L1-normalised target, rows the number of kept rows)."""
    b, h, s, n_keys = probs.shape
    grad, rows = np.zeros((b, s, n_keys)), 0
    for bi in range(b):
        for t in range(s):
            keys = [j for j in range(n_keys) if cand[bi, t, j]]
            if not keys or (row_mask is not None and not row_mask[bi, t]):
                continue
            p = np.array([probs[bi, :, t, j].sum() for j in keys])
            if p.sum() <= 0:
                continue
            z = np.array([student_scores[bi, t, j] for j in keys])
            q = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            grad[bi, t, keys] = q - p / p.sum()
            rows += 1
    return grad / max(rows, 1)


def sparse_attention_probs(q, kv, idx, sink, scale) -> np.ndarray:
    """Per-head probabilities [B, H, S, N] of every kv row under ``sparse_attention_fwd``'s softmax (the sink
    in the denominator, the sink's own mass dropped): exp(scale q.kv_j - lse) for j in idx[b, t], else 0."""
    q, kv = f64(q), f64(kv)
    _, lse = sparse_attention_fwd(q, kv, idx, sink, scale)
    bsz, seq, heads, _ = q.shape
    probs = np.zeros((bsz, heads, seq, kv.shape[1]))
    for b in range(bsz):
        for t in range(seq):
            for j in (j for j in idx[b, t] if j >= 0):
                for h in range(heads):
                    probs[b, h, t, j] = math.exp(scale * q[b, t, h] @ kv[b, j] - lse[b, t, h])
    return probs


# --------------------------------------------------------------------------------------------------
# mHC (§3).
# --------------------------------------------------------------------------------------------------
def sinkhorn(logits, iterations: int, eps: float) -> np.ndarray:
    """R <- softmax_row(R) + eps; R <- R / (colsum + eps); (iterations-1) x [row normalise, col normalise]."""
    r = f64(logits)
    e = np.exp(r - r.max(axis=-1, keepdims=True))
    r = e / e.sum(axis=-1, keepdims=True) + eps
    r = r / (r.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iterations - 1):
        r = r / (r.sum(axis=-1, keepdims=True) + eps)
        r = r / (r.sum(axis=-2, keepdims=True) + eps)
    return r


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def hc_pre(streams, fn, base, scale, iterations, hc_eps, norm_eps):
    """streams [b,s,n,D] -> (post [b,s,n], comb [b,s,n,n], block input y [b,s,D])."""
    x = f64(streams)
    b, s, n, dim = x.shape
    flat = x.reshape(b, s, n * dim)
    mix = (flat @ f64(fn).T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    base, scale = f64(base), f64(scale)
    pre = _sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * _sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = sinkhorn((mix[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(b, s, n, n), iterations, hc_eps)
    y = np.einsum("bsi,bsid->bsd", pre, x)
    return post, comb, y


def hc_post(streams, block_out, post, comb) -> np.ndarray:
    """X'_j = post_j f + sum_i comb[i, j] X_i."""
    mixed = np.einsum("bsij,bsid->bsjd", f64(comb), f64(streams))
    return f64(post)[..., :, None] * f64(block_out)[..., None, :] + mixed


def hc_head(streams, fn, base, scale, hc_eps, norm_eps) -> np.ndarray:
    x = f64(streams)
    b, s, n, dim = x.shape
    flat = x.reshape(b, s, n * dim)
    mix = (flat @ f64(fn).T) / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    pre = _sigmoid(mix * f64(scale)[0] + f64(base)) + hc_eps
    return np.einsum("bsi,bsid->bsd", pre, x)


# --------------------------------------------------------------------------------------------------
# VHA postmix (§5).
# --------------------------------------------------------------------------------------------------
def vha_postmix(o, u, v, groups: int = 1) -> np.ndarray:
    """O'[h] = sum_h' M[h, h'] O[h'], M = I + V U^T (block-diagonal over ``groups`` when U, V are [G, h/G, r])."""
    o, u, v = f64(o), f64(u), f64(v)
    heads = o.shape[2]
    if u.ndim == 2:
        u, v = u[None], v[None]
    per = heads // groups
    m = np.zeros((heads, heads))
    for g in range(groups):
        m[g * per : (g + 1) * per, g * per : (g + 1) * per] = np.eye(per) + v[g] @ u[g].T
    return np.einsum("hk,bskd->bshd", m, o)


# --------------------------------------------------------------------------------------------------
# Grouped clamped-SwiGLU experts over expert-sorted rows (DSv4 routed experts, one segment per expert).
# --------------------------------------------------------------------------------------------------
def grouped_swiglu_experts(rows, counts, w1, w2, limit: float, d_out=None):
    """out[r] = (silu(min(g, L)) * clip(u, -L, L)) @ w2[e] with [g | u] = rows[r] @ w1[e], for the ``counts[e]``
    consecutive rows of expert e (L = 0: no clamp); rows past sum(counts) give 0. With ``d_out``: also
    (d_rows, d_w1, d_w2) by hand-derived chain rule (the clamps pass the gradient at their bounds)."""
    x, w1, w2 = f64(rows), f64(w1), f64(w2)
    half = w2.shape[1]
    out, d_x, d_w1, d_w2 = np.zeros((x.shape[0], w2.shape[2])), np.zeros_like(x), np.zeros_like(w1), np.zeros_like(w2)
    start = 0
    for e, n in enumerate(int(c) for c in np.asarray(counts).reshape(-1)):
        seg = slice(start, start + n)
        start += n
        gate_up = x[seg] @ w1[e]
        g, u = gate_up[:, :half], gate_up[:, half:]
        gc, uc = (np.minimum(g, limit), np.clip(u, -limit, limit)) if limit > 0 else (g, u)
        sig = 1.0 / (1.0 + np.exp(-gc))
        h = gc * sig * uc
        out[seg] = h @ w2[e]
        if d_out is None:
            continue
        dy = f64(d_out)[seg]
        d_h = dy @ w2[e].T
        d_g = d_h * uc * sig * (1.0 + gc * (1.0 - sig))
        d_u = d_h * gc * sig
        if limit > 0:
            d_g, d_u = d_g * (g <= limit), d_u * (np.abs(u) <= limit)
        d_gu = np.concatenate([d_g, d_u], axis=1)
        d_x[seg], d_w1[e], d_w2[e] = d_gu @ w1[e].T, x[seg].T @ d_gu, h.T @ dy
    return out if d_out is None else (out, d_x, d_w1, d_w2)


# --------------------------------------------------------------------------------------------------
# Finite differences.
# --------------------------------------------------------------------------------------------------
def central_fd(loss_fn, param: np.ndarray, coords, step: float = 1e-6) -> np.ndarray:
    """d loss / d param[coord] for each flat coordinate in ``coords`` (param is perturbed in place, restored)."""
    flat = param.reshape(-1)
    grads = np.zeros(len(coords))
    for n, k in enumerate(coords):
        keep = flat[k]
        flat[k] = keep + step
        up = loss_fn()
        flat[k] = keep - step
        down = loss_fn()
        flat[k] = keep
        grads[n] = (up - down) / (2 * step)
    return grads
