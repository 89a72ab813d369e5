"""Fused grouped experts on CUDA (torch tensors, bf16 and fp32): vs the float64 oracle, vs an eager torch mirror.

Run on the H200 through the device tool (torch + Triton, no Paddle): ``python -m pytest -q tests/gpu``.
Skipped without CUDA.

- **vs float64** (``helpers.oracles.grouped_swiglu_experts`` on the same operand values): fp32 within
  ``grouped_experts`` (1e-5 of each tensor's largest entry; IEEE fp32 dots); bf16 within the bf16
  ``grouped_experts`` entry (relative Frobenius norm: gate_up, h and the results are rounded to bf16).
- **vs eager torch** (per-expert ``matmul`` loop with the clamped SwiGLU in the operands' dtype, autograd for
  the backward): fp32 within ``grouped_experts``, bf16 within ``grouped_experts_vs_eager``.
- Both launch settings (small groups: many experts; large groups), odd widths (masked tiles), empty experts,
  one expert taking every row, rows past ``sum(counts)`` (zeros), and run-to-run byte identity of every result
  (the weight gradients are fixed-order sums, no atomics).
- The oracle test checks which load path and grid kind ran (``kernel_tiles.PATH_COUNTS``): the defaults' (TMA
  descriptors: every shape here is 16-byte aligned); a second test runs the pointer path, one program per tile,
  persistent and flattened persistent grids on the same tiles and asks for byte-identical results (bf16: all
  four; fp32: pointer per tile vs TMA flattened).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise, assert_close, expect_launches
from helpers import oracles as orc
from helpers.gpu import CUDA_ONLY

from fleet_ext import capability

capability.prepare_triton()  # a no-op on a GPU; keeps a CPU collection of this file from mis-building kernels

pytestmark = CUDA_ONLY
DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LIMIT = 7.0


@pytest.fixture(scope="module")
def kernels():
    from fleet_ext.ops.moe_experts import kernel, kernel_bwd  # imported only where they will run

    return kernel, kernel_bwd


ROLE_KERNELS = {"gate_up": "_grouped_gate_up", "down": "_grouped_rows_mm", "d_gate_up": "_grouped_d_gate_up",
                "d_rows": "_grouped_rows_mm", "d_weight": "_grouped_d_weight"}


def paths_ran(run, *args) -> tuple:
    """The (kernel, load path, grid kind) of every launch of ``run(*args)``."""
    from fleet_ext.ops.moe_experts import kernel_tiles

    kernel_tiles.PATH_COUNTS.clear()
    result = run(*args)
    return result, set(kernel_tiles.PATH_COUNTS)


def expected_paths(kernel, n_rows: int, experts: int, dtype: torch.dtype, ws_gate_up: bool,
                   ws_d_weight: list[bool]) -> set:
    """What ``kernel.TUNE`` asks for (every test shape here is 16-byte aligned: TMA wherever it is asked for), the
    gate+up and the weight gradients on the warp-specialised kernels (TMA, persistent) where they run."""
    from fleet_ext.ops.moe_experts import kernel_tiles

    name = str(dtype).rsplit(".", 1)[-1]
    skip = {"gate_up"} if ws_gate_up else set()
    skip |= {"d_weight"} if all(ws_d_weight) else set()
    paths = {(ROLE_KERNELS[role], "tma" if cfg.tma else "pointer", kernel_tiles.GRID_KINDS[cfg.persistent])
             for role in ROLE_KERNELS if role not in skip
             for cfg in [kernel.launch_config(role, n_rows, experts, name)]}
    paths |= {(WS_GATE_UP, "tma", "persistent")} if ws_gate_up else set()
    return paths | ({(WS_D_WEIGHT, "tma", "persistent")} if any(ws_d_weight) else set())


WS_GATE_UP, WS_D_WEIGHT = "_gate_up_ws_kernel", "_d_weight_ws_kernel"


def ws_d_weight_runs(kernels, dtype: str, case: str) -> list[bool]:
    """Which of the two weight gradients (d_weight1: M = D, d_weight2: M = I) take the warp-specialised kernel (bf16,
    M a multiple of its tile rows, small groups: not ``large_groups``)."""
    _, dim, inter, _ = CASES[case]
    return [dtype == "bf16" and case != "large_groups" and m % kernels[1].WS_D_WEIGHT["BM"] == 0
            for m in (dim, inter)]


CASES = {  # name: (counts, D, I, pad rows)
    "small_groups": ([37, 0, 90, 5, 64, 128, 1, 0, 77, 50, 3, 200, 0, 16, 41, 9], 256, 128, 0),
    "large_groups": ([700, 0, 1100, 513], 256, 128, 0),
    "odd_widths": ([33, 0, 70, 9, 120], 200, 72, 0),
    "one_expert_takes_all": ([0, 0, 300, 0], 128, 64, 0),
    "rows_past_the_counts": ([40, 0, 25], 128, 64, 19),
}


def make(case: str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    counts, dim, inter, pad = CASES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n, experts = sum(counts) + pad, len(counts)
    x = (2.0 * torch.randn(n, dim, generator=gen, device=DEVICE)).to(dtype)
    # fp32: gate_up ~ N(0, 5^2), the clamp at 7 active on ~16 % of the entries. bf16: ~ N(0, 2^2) (a bf16 gate_up
    # within one ulp of the bound can round to the other side and switch its gradient on or off, an O(1) change
    # the float64 oracle does not make; the clamp's code is the same for both dtypes).
    scale = 2.5 if dtype == torch.float32 else 1.0
    w1 = (torch.randn(experts, dim, 2 * inter, generator=gen, device=DEVICE) * scale / dim**0.5).to(dtype)
    w2 = (torch.randn(experts, inter, dim, generator=gen, device=DEVICE) / inter**0.5).to(dtype)
    g = torch.randn(n, dim, generator=gen, device=DEVICE).to(dtype)
    return x, torch.tensor(counts, dtype=torch.int64, device=DEVICE), w1, w2, g


def fused(kernels, x, counts, w1, w2, g) -> dict[str, torch.Tensor]:
    kernel, kernel_bwd = kernels
    out, gate_up, _ = kernel.experts_forward(x, counts, w1, w2, LIMIT)
    d_x, d_w1, d_w2 = kernel_bwd.experts_backward(g, x, counts, w1, w2, gate_up, LIMIT)
    return {"out": out, "d_rows": d_x, "d_weight1": d_w1, "d_weight2": d_w2}


def eager(x, counts, w1, w2, g) -> dict[str, torch.Tensor]:
    """The reference's op sequence in eager torch: one matmul pair per expert, SwiGLU in the operands' dtype."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w1, w2)]
    xs, w1s, w2s = leaves
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        gate, up = (xs[start:start + n] @ w1s[e]).chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)
        outs.append(h @ w2s[e])
        start += n
    outs.append(xs[start:] * 0)  # rows past the counts: zeros
    out = torch.cat(outs)
    d_x, d_w1, d_w2 = torch.autograd.grad(out, leaves, g)
    return {"out": out.detach(), "d_rows": d_x, "d_weight1": d_w1, "d_weight2": d_w2}


def oracle(x, counts, w1, w2, g) -> dict:
    out, d_x, d_w1, d_w2 = orc.grouped_swiglu_experts(x, counts.cpu().numpy(), w1, w2, LIMIT, d_out=g)
    return {"out": out, "d_rows": d_x, "d_weight1": d_w1, "d_weight2": d_w2}


def _check(got: dict, want: dict, dtype: str, name: str, what: str) -> None:
    for key in want:
        assert_close(got[key], want[key], dtype, name, what=f"{what}: {key}")


class _no_tf32:
    """fp32 eager matmuls in full fp32 (the fused kernel's fp32 dots are IEEE fp32)."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_and_gradients_vs_the_float64_oracle(kernels, case, dtype):
    x, counts, w1, w2, g = make(case, DTYPES[dtype])
    ws = kernels[0].use_ws_gate_up(x, w1)  # bf16, D a multiple of 64, small groups (the defaults' choice)
    assert ws == (dtype == "bf16" and case in ("small_groups", "one_expert_takes_all", "rows_past_the_counts"))
    ws_dw = ws_d_weight_runs(kernels, dtype, case)
    with expect_launches(WS_GATE_UP if ws else "_grouped_gate_up", "_grouped_d_gate_up", exactly=1), \
            expect_launches("_grouped_rows_mm", exactly=2), expect_launches(WS_D_WEIGHT, exactly=sum(ws_dw)), \
            expect_launches("_grouped_d_weight", exactly=2 - sum(ws_dw)):
        got, ran = paths_ran(fused, kernels, x, counts, w1, w2, g)
    assert ran == expected_paths(kernels[0], x.shape[0], len(counts), x.dtype, ws, ws_dw)
    want = oracle(x, counts, w1, w2, g)
    _check(got, want, dtype, "grouped_experts", f"{case} {dtype} vs float64")
    pad = CASES[case][3]
    if pad:
        assert not got["out"][-pad:].any() and not got["d_rows"][-pad:].any()


@pytest.mark.parametrize("case", ["small_groups", "large_groups", "odd_widths"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_and_gradients_vs_the_eager_torch_mirror(kernels, case, dtype):
    x, counts, w1, w2, g = make(case, DTYPES[dtype], seed=1)
    got = fused(kernels, x, counts, w1, w2, g)
    name = "grouped_experts" if dtype == "fp32" else "grouped_experts_vs_eager"
    with _no_tf32():
        want = eager(x, counts, w1, w2, g)
    _check(got, want, dtype, name, f"{case} {dtype} vs eager torch")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_result_is_byte_identical_run_to_run(kernels, dtype):
    x, counts, w1, w2, g = make("small_groups", DTYPES[dtype], seed=2)
    first = fused(kernels, x, counts, w1, w2, g)
    for _ in range(2):
        again = fused(kernels, x, counts, w1, w2, g)
        for key in first:
            assert_bitwise(again[key], first[key], f"{dtype} again: {key}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_load_paths_and_grid_kinds_give_the_same_bytes(kernels, dtype, monkeypatch, case="rows_past_the_counts"):
    """The defaults' tiles with pointer or TMA-descriptor loads, one program per tile or a persistent grid (the
    tile loop flattened into the K loop or not): byte-identical results, each on the path asked for (the Triton
    gate+up here; the warp-specialised one is compared with it below)."""
    kernel = kernels[0]
    monkeypatch.setattr(kernel, "GATE_UP_KERNEL", "triton")
    monkeypatch.setattr(kernels[1], "D_WEIGHT_KERNEL", "triton")
    x, counts, w1, w2, g = make(case, DTYPES[dtype], seed=3)
    first = fused(kernels, x, counts, w1, w2, g)
    variants = [(False, 0), (True, 0), (True, 1), (True, 2)] if dtype == "bf16" else [(False, 0), (True, 2)]
    for tma, persistent in variants:
        with kernel.launch_overrides(tma=tma, persistent=persistent):
            got, ran = paths_ran(fused, kernels, x, counts, w1, w2, g)
        assert {r[1:] for r in ran} == {("tma" if tma else "pointer", ("per tile", "persistent",
                                                                      "persistent flattened")[persistent])}
        for key in first:
            assert_bitwise(got[key], first[key], f"{case} {dtype} tma={tma} persistent={persistent}: {key}")


def test_planted_difference_fails_the_bf16_check(kernels):
    """Negative control: one row moved across a segment boundary fails the check the tests above pass."""
    x, counts, w1, w2, g = make("small_groups", torch.bfloat16)
    want = oracle(x, counts, w1, w2, g)
    shifted = counts.clone()
    shifted[0] -= 1
    shifted[2] += 1  # expert 1 is empty: the row lands in expert 2
    got = fused(kernels, x, shifted, w1, w2, g)
    with pytest.raises(AssertionError):
        _check(got, want, "bf16", "grouped_experts", "planted")


WS_FORMS = {"ping_pong": {}, "cooperative": {"COOP": True}}  # the cooperative form: two warpgroups on one tile


def _ws_form(kernel, monkeypatch, form: str) -> None:
    cfg = {**kernel.WS_GATE_UP, **WS_FORMS[form]}
    if form == "cooperative" and not kernel.WS_GATE_UP["COOP"]:
        cfg["BM"] *= 2  # each warpgroup keeps the default's rows
    monkeypatch.setattr(kernel, "WS_GATE_UP", cfg)


@pytest.mark.parametrize("form", list(WS_FORMS))
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][1] % 64 == 0])
def test_warp_specialised_gate_up_equals_the_triton_kernel_bitwise(kernels, case, form, monkeypatch):
    """bf16: the Gluon gate+up (``kernel_gate_up_ws.py``) gives the Triton kernel's gate_up and h byte for byte
    (the same K steps in the same order, the same epilogue) on every segment pattern, run to run too."""
    kernel = kernels[0]
    x, counts, w1, _, _ = make(case, torch.bfloat16, seed=4)
    monkeypatch.setattr(kernel, "GATE_UP_KERNEL", "triton")
    want = kernel.gate_up(x, counts, w1, LIMIT)
    monkeypatch.setattr(kernel, "GATE_UP_KERNEL", "gluon")
    _ws_form(kernel, monkeypatch, form)
    for attempt in range(2):
        with expect_launches(WS_GATE_UP, exactly=1):
            got = kernel.gate_up(x, counts, w1, LIMIT)
        for name, a, b in zip(("gate_up", "h"), got, want):
            assert_bitwise(a, b, f"{case} {form} run {attempt}: {name}")


def test_warp_specialised_gate_up_check_fails_on_a_planted_difference(kernels, monkeypatch):
    """Negative control: one row moved across a segment boundary makes the bitwise check above fail."""
    kernel = kernels[0]
    x, counts, w1, _, _ = make("small_groups", torch.bfloat16, seed=4)
    monkeypatch.setattr(kernel, "GATE_UP_KERNEL", "triton")
    want = kernel.gate_up(x, counts, w1, LIMIT)
    monkeypatch.setattr(kernel, "GATE_UP_KERNEL", "gluon")
    shifted = counts.clone()
    shifted[0] -= 1
    shifted[2] += 1
    with pytest.raises(AssertionError):
        assert_bitwise(kernel.gate_up(x, shifted, w1, LIMIT)[0], want[0], "planted")


def test_forcing_the_warp_specialised_gate_up_where_it_cannot_run_names_why(kernels, monkeypatch):
    kernel = kernels[0]
    x, counts, w1, _, _ = make("small_groups", torch.float32)
    monkeypatch.setattr(kernel, "GATE_UP_KERNEL", "gluon")
    with pytest.raises(ValueError, match="GATE_UP_KERNEL = 'gluon' cannot run here: dtype float32"):
        kernel.gate_up(x, counts, w1, LIMIT)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][1] % 128 == 0])
def test_warp_specialised_weight_gradient_equals_the_triton_kernel_bitwise(kernels, case, monkeypatch):
    """bf16: the Gluon weight gradient (``kernel_d_weight_ws.py``) gives the Triton kernel's ``a_e^T b_e`` byte for
    byte (rows summed in the same order, BK a step; empty experts and rows past the counts included), run to run."""
    kernel_bwd = kernels[1]
    x, counts, _, _, g = make(case, torch.bfloat16, seed=5)
    b = torch.cat([g, g[:, :64]], dim=1)  # NN = D + 64: a partial last column tile
    want = torch.full((len(counts), x.shape[1], b.shape[1]), 3.0, device=DEVICE, dtype=torch.bfloat16)
    monkeypatch.setattr(kernel_bwd, "D_WEIGHT_KERNEL", "triton")
    kernel_bwd.weight_grad(x, b, counts, want)
    monkeypatch.setattr(kernel_bwd, "D_WEIGHT_KERNEL", "gluon")
    for attempt in range(2):
        got = torch.full_like(want, 5.0)
        with expect_launches(WS_D_WEIGHT, exactly=1):
            kernel_bwd.weight_grad(x, b, counts, got)
        assert_bitwise(got, want, f"{case} run {attempt}: a^T b")
    shifted = counts.clone()  # negative control: one row moved across a segment boundary
    first = int(torch.nonzero(counts)[0])
    shifted[first] -= 1
    shifted[first + 1 if first + 1 < len(counts) else first - 1] += 1
    kernel_bwd.weight_grad(x, b, shifted, got)
    with pytest.raises(AssertionError):
        assert_bitwise(got, want, "planted")
