"""Independent float64 NumPy oracles for the -2 (hybrid-MLA) layers: dense MLA, the DSA indexer, its top-k +
forced-window table and its KL loss.

Written from ``shared/reference/dsv4_math.md`` §2.8 / §6 / §7 and HF DeepSeek-V3.2's formulas; nothing here imports
or mirrors ``fleet_ext`` (DESIGN.md rule 5). Weights are passed as NumPy arrays in Paddle's ``[in, out]`` layout.
Loops are used where they read closer to the maths than a vectorised trick.
"""

from __future__ import annotations

import math

import numpy as np


def f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def hadamard_matrix(d: int) -> np.ndarray:
    """Sylvester Hadamard H_d / sqrt(d) (symmetric, orthogonal)."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


def rms_norm(x, weight, eps):
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(weight)


def layer_norm(x, weight, bias, eps=1e-6):
    x = f64(x)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * f64(weight) + f64(bias)


def inv_freq_plain(dim, base):
    return np.array([base ** (-(2.0 * i) / dim) for i in range(dim // 2)])


def yarn(dim, base, factor, original, beta_fast, beta_slow, mscale, mscale_all_dim):
    """(inv_freq, cos/sin factor, softmax factor) as HF ``_compute_yarn_parameters`` + ``yarn_apply_mscale``."""

    def corr(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ext = inv_freq_plain(dim, base)
    out = np.empty(dim // 2)
    for i in range(dim // 2):
        keep = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)
        out[i] = ext[i] / factor * (1.0 - keep) + ext[i] * keep

    def m(scale, ms):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    cos_sin = m(factor, mscale) / m(factor, mscale_all_dim) if (mscale and mscale_all_dim) else m(factor, 1.0)
    softmax = m(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return out, cos_sin, softmax


def rope_interleaved(x, pos, inv_freq, factor=1.0):
    """Rotate *all* channels of x [..., s, (h,) d] as complex pairs (2i, 2i+1); pos along axis 1."""
    x = f64(x)
    ang = np.outer(f64(pos), inv_freq)  # [s, d/2]
    if x.ndim == 4:
        ang = ang[:, None, :]
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * ang) * factor
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def rope_leading(x, pos, inv_freq, interleaved=False, factor=1.0):
    """Rotate the leading 2*len(inv_freq) channels ([pe | nope]): rotate-half (i with i + rd/2) or interleaved."""
    x = f64(x).copy()
    half = len(inv_freq)
    ang = np.outer(f64(pos), inv_freq)
    if x.ndim == 4:
        ang = ang[:, None, :]
    pe = x[..., : 2 * half]
    if interleaved:
        z = pe[..., 0::2] + 1j * pe[..., 1::2]
    else:
        z = pe[..., :half] + 1j * pe[..., half:]
    z = z * np.exp(1j * ang) * factor
    if interleaved:
        pe[..., 0::2], pe[..., 1::2] = z.real, z.imag
    else:
        pe[..., :half], pe[..., half:] = z.real, z.imag
    x[..., : 2 * half] = pe
    return x


def mla_dense(x, p, dims, inv_freq, rope_factor, scale, eps, sink=None, allowed=None):
    """Dense causal MLA. Returns (output [b, s, D], per-head probs [b, h, s, s], logits [b, h, s, s]).

    p: dict of weights (Paddle layout). dims: (h, nope, rope, v, kv_lora). ``allowed`` [b, s, s] bool restricts the
    keys (sparse attention); causality always applies. ``sink`` [h] adds a value-less softmax column.
    """
    h, nope, rope, v, lora = dims
    x = f64(x)
    b, s, _ = x.shape
    pos = np.arange(s)
    cq = rms_norm(x @ f64(p["q_down"]), p["q_norm"], eps)
    q = (cq @ f64(p["q_up"])).reshape(b, s, h, nope + rope)
    q_pe = rope_interleaved(q[..., nope:], pos, inv_freq, rope_factor)
    kv_a = x @ f64(p["kv_down"])
    ckv = rms_norm(kv_a[..., :lora], p["kv_norm"], eps)
    k_pe = rope_interleaved(kv_a[..., lora:], pos, inv_freq, rope_factor)
    kv = (ckv @ f64(p["kv_up"])).reshape(b, s, h, nope + v)
    out = np.zeros((b, s, h, v))
    probs = np.zeros((b, h, s, s))
    logits_all = np.full((b, h, s, s), -np.inf)
    for bi in range(b):
        for hi in range(h):
            for t in range(s):
                keys = [j for j in range(t + 1) if allowed is None or allowed[bi, t, j]]
                logits = np.array(
                    [
                        q[bi, t, hi, :nope] @ kv[bi, j, hi, :nope] + q_pe[bi, t, hi] @ k_pe[bi, j]
                        for j in keys
                    ]
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


def indexer_scores(
    x, cq, p, n_heads, head_dim, inv_freq, rope_factor=1.0, interleaved=False, hadamard=True, parts=False
):
    """DSA index scores [b, s, s] (no mask): sum_h w_h ReLU(q_h . k) with w = x W_w / sqrt(H * d).

    ``parts=True`` also returns (q [b, s, H, d], k [b, s, d], w [b, s, H]) after RoPE and Hadamard."""
    x, cq = f64(x), f64(cq)
    b, s, _ = x.shape
    pos = np.arange(s)
    q = (cq @ f64(p["wq_b"])).reshape(b, s, n_heads, head_dim)
    q = rope_leading(q, pos, inv_freq, interleaved, rope_factor)
    k = layer_norm(x @ f64(p["wk"]), p["k_norm_w"], p["k_norm_b"])
    k = rope_leading(k, pos, inv_freq, interleaved, rope_factor)
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
