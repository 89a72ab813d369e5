"""Fused inverse RoPE + ungrouped VHA postmix on CUDA (torch tensors, bf16 and fp32), bitwise vs the unfused path.

Run on the GPU benchmark machine (torch + Triton, no Paddle): ``pytest tests/gpu``. Skipped without CUDA.

The fused forward (``kernel.inv_rope_postmix_forward`` with ``torch.matmul`` as the GEMM) is
``M @ O`` plus a narrow GEMM on the inverse-rotated trailing channels; it is bitwise equal to the unfused
``torch.matmul(M, inv_rope(O))`` only while cuBLAS has the column-slice property
``matmul(M, X)[..., a:] == matmul(M, X[..., a:])`` at the split ``split_start`` picks, which is tested
directly first (if it fails for a shape, ``split_start`` must decline that shape on the GPU). The backward
pieces (rebuilt rotation, gradient rotation around torch's own matmul backward) are checked against torch
autograd of the unfused path, and the forward's peak memory against the unfused one (one full-width tensor
less).

The fast mode (``kernel_fast``, ``inv_rope_postmix_mode: fast``) is not bitwise: its y, d_out and d_mix are held
to the ``inv_rope_postmix_fast`` tolerance against float64 NumPy (bf16 and fp32), with a planted-error negative
control, byte-identical run to run at the production shape, and a backward peak below the eager one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_bitwise, assert_close, expect_launches
from helpers import oracles as orc
from helpers.gpu import CUDA_ONLY
from helpers.torch_rope import eager_rope

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernels():
    from fleet_ext.ops.inv_rope_postmix import kernel as postmix_kernel
    from fleet_ext.ops.rope import kernel as rope_kernel

    return postmix_kernel, rope_kernel


def unfused(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``reference.inv_rope_vha_postmix`` in eager torch: ``mix @ inv_rope(out)``."""
    return torch.matmul(mix.to(out.dtype), eager_rope(out, cos, sin, inverse=True))


def _problem(b, s, h, d, rope_dim, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    positions = torch.arange(s, dtype=torch.float64)[:, None] + 11
    inv_freq = 1.0 / (160000.0 ** (torch.arange(rope_dim // 2, dtype=torch.float64) / (rope_dim // 2)))
    angles = positions * inv_freq
    rank = max(1, h // 4)
    u = 0.1 * torch.randn(h, rank, generator=g)
    v = 0.1 * torch.randn(h, rank, generator=g)  # VHA's V off its zero init
    return {
        "out": torch.randn(b, s, h, d, generator=g).to(dtype).to(DEVICE),
        "cos": torch.cos(angles).float().to(DEVICE),
        "sin": torch.sin(angles).float().to(DEVICE),
        "mix": (torch.eye(h) + v @ u.T).to(DEVICE),
        "grad": torch.randn(b, s, h, d, generator=g).to(dtype).to(DEVICE),
    }


SHAPES = [  # (b, s, h, d, rope_dim)
    (1, 16384, 64, 512, 64),  # production: 64K context / CP 4
    (1, 1024, 64, 512, 64),
    (2, 512, 64, 512, 64),
    (1, 1000, 64, 512, 2),  # pe = 2: split at 504
    (2, 136, 4, 16, 8),  # the tiny CPU model's geometry
    (2, 37, 3, 24, 8),  # odd head count
    (2, 37, 3, 24, 2),
    (1, 100, 8, 64, 16),
    (1, 256, 128, 128, 64),
    (1, 333, 16, 256, 64),
]


@pytest.mark.parametrize("b,s,h,d,rope_dim", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cublas_column_slice_property_at_the_split(kernels, dtype, b, s, h, d, rope_dim):
    postmix_kernel, _ = kernels
    start = postmix_kernel.split_start(d, rope_dim)
    assert start is not None
    p = _problem(b, s, h, d, rope_dim, dtype)
    mix, x = p["mix"].to(dtype), p["out"]
    full = torch.matmul(mix, x)
    assert_bitwise(torch.matmul(mix, x[..., start:].contiguous()), full[..., start:], "split-N GEMM")
    y = x.clone()
    y[..., start:] = torch.flip(y[..., start:], dims=[-1])
    assert_bitwise(torch.matmul(mix, y)[..., :start], full[..., :start], "column independence")


@pytest.mark.parametrize("b,s,h,d,rope_dim", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_forward_is_bitwise_equal_to_the_unfused_path(kernels, dtype, b, s, h, d, rope_dim):
    postmix_kernel, _ = kernels
    p = _problem(b, s, h, d, rope_dim, dtype)
    saved = p["out"].clone()
    got = postmix_kernel.inv_rope_postmix_forward(p["out"], p["cos"], p["sin"], p["mix"].to(dtype), torch.matmul)
    assert_bitwise(got, unfused(p["out"], p["cos"], p["sin"], p["mix"]), "forward")
    assert_bitwise(p["out"], saved, "attention output untouched")


@pytest.mark.parametrize("b,s,h,d,rope_dim", [(1, 16384, 64, 512, 64), (2, 37, 3, 24, 8), (2, 136, 4, 16, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_pieces_are_bitwise_equal_to_autograd_of_the_unfused_path(kernels, dtype, b, s, h, d, rope_dim):
    """Rebuilt rotation + the matmul backward on it + the gradient rotation == autograd of the unfused path."""
    _, rope_kernel = kernels
    p = _problem(b, s, h, d, rope_dim, dtype)
    out = p["out"].clone().requires_grad_(True)
    mix = p["mix"].clone().requires_grad_(True)
    want_out, want_mix = torch.autograd.grad(unfused(out, p["cos"], p["sin"], mix), [out, mix], p["grad"])
    rotated = rope_kernel.rope(p["out"], p["cos"], p["sin"], inverse=True)
    assert_bitwise(rotated, eager_rope(p["out"], p["cos"], p["sin"], inverse=True), "rebuilt rotation")
    mix_leaf = p["mix"].clone().requires_grad_(True)
    rotated.requires_grad_(True)
    d_mix, d_rotated = torch.autograd.grad(torch.matmul(mix_leaf.to(dtype), rotated), [mix_leaf, rotated], p["grad"])
    assert_bitwise(d_mix, want_mix, "d_mix")
    assert_bitwise(rope_kernel.rope_grad(d_rotated, p["cos"], p["sin"], inverse=True), want_out, "d_out")
    assert float(d_mix.abs().max()) > 0


def test_forward_peak_memory_is_one_full_width_tensor_lower(kernels):
    """Production shape, bf16: the unfused forward holds inv_rope(O) and the result, the fused one the result
    and one pe-wide buffer."""
    postmix_kernel, _ = kernels
    p = _problem(1, 16384, 64, 512, 64, torch.bfloat16)
    mix = p["mix"].to(torch.bfloat16)
    full_width = p["out"].numel() * p["out"].element_size()

    def peak(fn) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        del result
        return torch.cuda.max_memory_allocated() - base

    unfused_peak = peak(lambda: torch.matmul(mix, eager_rope(p["out"], p["cos"], p["sin"], inverse=True)))
    fused_peak = peak(lambda: postmix_kernel.inv_rope_postmix_forward(p["out"], p["cos"], p["sin"], mix, torch.matmul))
    # unfused: inv_rope(O) + result = 2 N; fused: result + one pe-wide buffer = 1.125 N (rd / d = 1/8)
    assert fused_peak <= unfused_peak - 0.8 * full_width, (fused_peak / full_width, unfused_peak / full_width)
    assert fused_peak <= 1.2 * full_width, fused_peak / full_width


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_trailing_kernel(kernels, dtype):
    postmix_kernel, _ = kernels
    dst = torch.randn(2, 37, 3, 24, device=DEVICE).to(dtype)
    src = torch.randn(2, 37, 3, 8, device=DEVICE).to(dtype)
    want = dst.clone()
    want[..., 16:] = src
    assert_bitwise(postmix_kernel.write_trailing_(dst, src), want, "write_trailing_")


# -- the fast mode (inv_rope_postmix_mode: fast): one-pass kernels, within tolerance, deterministic ---------------

FAST_SHAPES = [  # (b, s, h, d, rope_dim)
    (1, 16384, 64, 512, 64),  # production: y and d_out checked on 256 sampled tokens, d_mix over all of them
    (2, 512, 64, 512, 64),
    (1, 1000, 64, 512, 2),
    (1, 256, 128, 128, 64),
    (1, 333, 16, 256, 64),
    (2, 136, 4, 16, 8),
    (2, 37, 3, 24, 8),
]
FAST_KERNELS = ("_postmix_fast_fwd_kernel", "_postmix_fast_bwd_kernel", "_postmix_fast_reduce_kernel")


@pytest.fixture(scope="module")
def fast_kernel():
    from fleet_ext.ops.inv_rope_postmix import kernel_fast

    return kernel_fast


def _angles(s: int, rope_dim: int) -> np.ndarray:
    """The float64 angles ``_problem`` builds its fp32 cos/sin from."""
    positions = np.arange(s, dtype=np.float64)[:, None] + 11
    return positions * (1.0 / (160000.0 ** (np.arange(rope_dim // 2, dtype=np.float64) / (rope_dim // 2))))


def _pair_sum(a: np.ndarray, rope_dim: int) -> np.ndarray:
    """|a| with each pe pair's two entries replaced by their sum (what a rotation can mix into one channel)."""
    a = np.abs(a)
    pe = a[..., a.shape[-1] - rope_dim:]
    both = pe[..., 0::2] + pe[..., 1::2]
    pe[..., 0::2], pe[..., 1::2] = both, both
    return a


def _host64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def _fast_oracle(p: dict, rows: np.ndarray, dtype: torch.dtype, rope_dim: int) -> dict:
    """float64 NumPy (value, sum of the magnitudes of its terms) of y and d_out on ``rows`` (flattened b*s tokens)
    and of d_mix over every token, fed the operands the reference rounds: M and inv_rope(O) in ``dtype``."""
    b, s, h, d = p["out"].shape
    m = _host64(p["mix"].to(dtype))
    rotated = eager_rope(p["out"], p["cos"], p["sin"], inverse=True).reshape(b * s, h, d)  # the reference's operand
    out_flat, grad_flat = p["out"].reshape(b * s, h, d), p["grad"].reshape(b * s, h, d)
    angles = _angles(s, rope_dim)[rows % s][:, None, :]
    index = torch.from_numpy(rows).to(p["out"].device)
    xr, o, g = _host64(rotated[index]), _host64(out_flat[index]), _host64(grad_flat[index])
    result = {
        "y": (np.matmul(m, xr), np.matmul(np.abs(m), _pair_sum(o, rope_dim))),
        "d_out": (orc.rope(np.matmul(m.T, g), angles), _pair_sum(np.matmul(np.abs(m).T, np.abs(g)), rope_dim)),
    }
    d_mix, scale = np.zeros((h, h)), np.zeros((h, h))
    for t0 in range(0, b * s, 1024):  # all tokens, in chunks: [h, t*d] x [t*d, h] in float64
        gc = _host64(grad_flat[t0:t0 + 1024]).transpose(1, 0, 2).reshape(h, -1)
        xc = _host64(rotated[t0:t0 + 1024]).transpose(1, 0, 2).reshape(h, -1)
        d_mix += gc @ xc.T
        scale += np.abs(gc) @ np.abs(xc).T
    result["d_mix"] = (d_mix, scale)
    return result


def _rows(b: int, s: int) -> np.ndarray:
    total = b * s
    return np.arange(total) if total <= 4096 else np.sort(np.random.default_rng(1).choice(total, 256, replace=False))


@pytest.mark.parametrize("b,s,h,d,rope_dim", FAST_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_mode_within_tolerance_of_the_float64_oracle(fast_kernel, dtype, b, s, h, d, rope_dim):
    """y, d_out, d_mix of the one-pass kernels vs float64 NumPy (bf16: half an ulp of the value for the result's one
    rounding, plus the fp32 sums' order relative to the sum of the terms' magnitudes; fp32: the latter)."""
    p = _problem(b, s, h, d, rope_dim, dtype)
    saved = p["out"].clone()
    with expect_launches(*FAST_KERNELS, exactly=1):
        y = fast_kernel.forward(p["out"], p["cos"], p["sin"], p["mix"])
        d_out, d_mix = fast_kernel.backward(p["out"], p["cos"], p["sin"], p["mix"], p["grad"])
    assert_bitwise(p["out"], saved, "attention output untouched")
    assert y.dtype == d_out.dtype == dtype and d_mix.dtype == torch.float32
    rows = _rows(b, s)
    want = _fast_oracle(p, rows, dtype, rope_dim)
    index = torch.from_numpy(rows).to(DEVICE)
    got = {"y": y.reshape(b * s, h, d)[index], "d_out": d_out.reshape(b * s, h, d)[index], "d_mix": d_mix}
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    for key, (value, scale) in want.items():
        entry = name if key != "d_mix" else "fp32"  # d_mix is fp32 (M's dtype) whatever O's dtype
        assert_close(got[key], value, entry, "inv_rope_postmix_fast", what=key, scale=scale)
    assert float(d_mix.abs().max()) > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_mode_tolerance_catches_a_planted_error(fast_kernel, dtype):
    """Negative control: the same check fails against the oracle of the forward (not inverse) rotation."""
    b, s, h, d, rope_dim = 2, 136, 4, 16, 8
    p = _problem(b, s, h, d, rope_dim, dtype)
    with expect_launches("_postmix_fast_fwd_kernel", exactly=1):
        y = fast_kernel.forward(p["out"], p["cos"], p["sin"], p["mix"]).reshape(b * s, h, d)
    wrong = {**p, "cos": p["cos"], "sin": -p["sin"]}  # the inverse of the inverse rotation
    value, scale = _fast_oracle(wrong, np.arange(b * s), dtype, rope_dim)["y"]
    with pytest.raises(AssertionError, match="inv_rope_postmix_fast"):
        assert_close(y, value, "bf16" if dtype == torch.bfloat16 else "fp32", "inv_rope_postmix_fast", scale=scale)


def test_fast_backward_is_byte_identical_run_to_run(fast_kernel):
    """Production shape, bf16: d_mix (split-K partials + a fixed-order reduction, no atomics), d_out and the
    forward give the same bytes on every run."""
    p = _problem(1, 16384, 64, 512, 64, torch.bfloat16)
    with expect_launches(*FAST_KERNELS, exactly=3):
        runs = [(fast_kernel.forward(p["out"], p["cos"], p["sin"], p["mix"]),
                 *fast_kernel.backward(p["out"], p["cos"], p["sin"], p["mix"], p["grad"])) for _ in range(3)]
    for later in runs[1:]:
        for name, a, b in zip(("y", "d_out", "d_mix"), runs[0], later):
            assert_bitwise(b, a, f"{name}, run to run")


def test_fast_backward_peak_memory_is_below_eager(fast_kernel):
    """Production shape, bf16: the fast backward holds d_out and the small partials; the eager backward of the
    unfused path (graph built beforehand) holds the rotated gradient and d_out on top."""
    p = _problem(1, 16384, 64, 512, 64, torch.bfloat16)
    full_width = p["out"].numel() * p["out"].element_size()
    out_leaf, mix_leaf = p["out"].clone().requires_grad_(True), p["mix"].clone().requires_grad_(True)
    y = unfused(out_leaf, p["cos"], p["sin"], mix_leaf)

    def peak(fn) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        del result
        return torch.cuda.max_memory_allocated() - base

    eager = peak(lambda: torch.autograd.grad(y, [out_leaf, mix_leaf], p["grad"], retain_graph=True))
    with expect_launches("_postmix_fast_bwd_kernel", exactly=1):
        fast = peak(lambda: fast_kernel.backward(p["out"], p["cos"], p["sin"], p["mix"], p["grad"]))
    assert fast <= 1.1 * full_width, fast / full_width  # d_out plus the fp32 [splits, h, h] partials (<= 64 MiB)
    assert fast <= eager, (fast / full_width, eager / full_width)
