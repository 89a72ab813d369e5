"""Gates (DESIGN.md rule 3): switches that can never run raise at config/build time naming the switch,
the reason and the fix; the resolved table says which backend each switch got and why."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import DEFAULT_WIDTHS_2L

from fleet_ext import capability
from fleet_ext.capability import Capability
from fleet_ext.config import load_config
from fleet_ext.registry import DERIVED_FUSIONS, FUSIONS, NO, PLATFORMS, UNTESTED, YES, Claim, Fusion, check_capability
from fleet_ext.specs.backend import BackendProvider

ROOT = Path(__file__).resolve().parents[2]

TINY = DEFAULT_WIDTHS_2L


def _cap(triton=True, torch=True, gpu=True, sm=(9, 0)) -> Capability:
    return Capability(triton=triton, torch=torch, gpu=gpu, sm=sm if gpu else None)


@pytest.mark.parametrize(
    "cap, pattern",
    [
        (_cap(triton=False), r"`apply_rope_fusion` = True cannot run on this machine.*Triton is not installed"),
        (_cap(gpu=False, torch=False), r"CPU\).*the Triton interpreter needs torch"),
        (_cap(sm=(7, 5)), r"GPU sm75\).*below sm80"),
    ],
    ids=["no_triton", "cpu_without_torch", "sm75"],
)
def test_switch_that_cannot_run_here_raises_at_build(cap, pattern):
    config = load_config(TINY, apply_rope_fusion=True)
    with capability.override(cap), pytest.raises(ValueError, match=pattern):
        BackendProvider(config)


@pytest.mark.parametrize("sm", [(8, 0), (9, 0), (10, 0)], ids=["sm80", "sm90", "sm100"])
def test_supported_gpus_resolve_to_triton(sm):
    config = load_config(TINY, apply_rope_fusion=True)
    with capability.override(_cap(sm=sm)):
        rows = {r.switch: r for r in BackendProvider(config).resolved}
    assert rows["apply_rope_fusion"].backend == f"Triton sm{sm[0]}{sm[1]}"
    assert "bitwise equal" in rows["apply_rope_fusion"].reason
    # The qualified claim: verified on CPU fp32 and on the GPU against torch, not on a Paddle GPU build.
    assert "CPU fp32: yes, GPU (torch): yes, Paddle GPU: untested" in rows["apply_rope_fusion"].reason
    reason = rows["apply_rope_fusion"].reason
    assert "CP-safe: yes (CPU fp32); recompute-safe: yes (CPU fp32); here: Paddle GPU" in reason
    assert rows["dsv4_q_rms_norm_fusion"].backend == "reference (pure Paddle)"


@pytest.mark.parametrize("sm", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_sparse_backend_row_names_the_hopper_forward(sm):
    """The start-up table says where the sparse-attention forward runs: the warp-specialised Gluon kernel on sm90
    only (``kernel_config.ws_forward_fits``), the Triton kernel elsewhere."""
    config = load_config(TINY, csa_sparse_attn_backend="triton", mqa_sparse_attn_backend="triton")
    with capability.override(_cap(sm=sm)):
        rows = {r.switch: r for r in BackendProvider(config).resolved}
    for switch in ("csa_sparse_attn_backend", "mqa_sparse_attn_backend"):
        assert rows[switch].backend.startswith(f"Triton sm{sm[0]}{sm[1]}")
        assert ("warp-specialised Gluon" in rows[switch].backend) == (sm == (9, 0))


@pytest.mark.parametrize("sm", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
def test_expert_row_names_the_hopper_kernels(sm):
    """The start-up table says where the experts' warp-specialised Gluon kernels run: sm90 only
    (``moe_experts.kernel.hopper_dtype``), the Triton kernels elsewhere."""
    config = load_config(TINY, moe_expert_fusion=True)
    with capability.override(_cap(sm=sm)):
        rows = {r.switch: r for r in BackendProvider(config).resolved}
    assert rows["moe_expert_fusion"].backend.startswith(f"Triton sm{sm[0]}{sm[1]}")
    assert ("warp-specialised Gluon gate+up and weight gradient" in rows["moe_expert_fusion"].backend) == (sm == (9, 0))


def test_a_derived_fusion_withheld_on_gpus_keeps_the_composition_there(monkeypatch):
    """A derived fusion whose GPU test failed (``gpu_withheld``, planted here on kv_norm_rope: none is withheld
    today) gives a GPU the two separate ops, with the reason, and the CPU the kernel."""
    import dataclasses

    config = load_config(TINY, apply_rope_fusion=True, dsv4_q_rms_norm_fusion=True)
    assert not any(f.gpu_withheld for f in DERIVED_FUSIONS.values())
    with capability.override(_cap(sm=(9, 0))):
        rows = {r.switch: r for r in BackendProvider(config).resolved}
    assert rows["kv_norm_rope"].value is True and rows["kv_norm_rope"].backend == "Triton sm90"
    withheld = dataclasses.replace(DERIVED_FUSIONS["kv_norm_rope"], gpu_withheld="its GPU test failed (planted)")
    monkeypatch.setitem(DERIVED_FUSIONS, "kv_norm_rope", withheld)
    with capability.override(_cap(sm=(9, 0))):
        rows = {r.switch: r for r in BackendProvider(config).resolved}
    assert rows["kv_norm_rope"].value is False and rows["kv_norm_rope"].backend == "the separate ops, as resolved above"
    assert "GPU test failed (planted)" in rows["kv_norm_rope"].reason
    assert rows["q_norm_rope"].value is True and rows["q_norm_rope"].backend == "Triton sm90"
    with capability.override(_cap(gpu=False)):
        rows = {r.switch: r for r in BackendProvider(config).resolved}
    assert rows["kv_norm_rope"].value is True and rows["kv_norm_rope"].backend == "Triton interpreter (CPU, slow)"


def test_cpu_with_triton_and_torch_uses_the_interpreter():
    config = load_config(TINY, apply_rope_fusion=True)
    with capability.override(_cap(gpu=False)):
        table = BackendProvider(config).format_table()
    assert "Triton interpreter (CPU, slow)" in table
    assert "here: CPU fp32" in table and "'untested' = no test yet" in table.splitlines()[-1]


def test_switches_off_never_touch_triton():
    with capability.override(_cap(triton=False, torch=False, gpu=False)):
        rows = BackendProvider(load_config(TINY)).resolved
    assert all(r.backend.startswith(("reference", "unused")) for r in rows), rows


def test_registry_entries_are_complete():
    config_switches = set(load_config(TINY).fusion.__dataclass_fields__)
    assert set(FUSIONS) <= config_switches
    for fusion in FUSIONS.values():
        assert fusion.bitwise_equal or fusion.tolerance or not fusion.landed, fusion.switch
        if fusion.landed:
            assert callable(fusion.load("reference"))


# -- the gate without a model: the same check the pretraining start-up runs (exit 2) --------------------------


def test_check_capability_is_the_providers_gate_and_names_every_switch():
    config = load_config(TINY, apply_rope_fusion=True, dsv4_q_rms_norm_fusion=True, csa_sparse_attn_backend="triton")
    with capability.override(_cap(sm=(7, 5))), pytest.raises(ValueError) as from_provider:
        BackendProvider(config)
    with pytest.raises(ValueError) as direct:
        check_capability(config, _cap(sm=(7, 5)))
    assert str(direct.value) == str(from_provider.value)
    assert str(direct.value).startswith(
        "config keys `apply_rope_fusion` = True, `dsv4_q_rms_norm_fusion` = True, `csa_sparse_attn_backend` = "
        "'triton' cannot run on this machine (GPU sm75): GPU compute capability sm75 is below sm80"
    ), direct.value
    check_capability(config, _cap(sm=(8, 0)))  # runs there: no error
    check_capability(load_config(TINY), _cap(triton=False, torch=False, gpu=False))  # nothing on: no error


# -- claims are data, and every claim that names tests names tests that exist ---------------------------------


def _test_functions(path: Path) -> set[str]:
    """Names of the test functions (module level or in a test class) defined in a test file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = list(tree.body) + [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
    return {n.name for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _claim_problems(name: str, claim: Claim) -> list[str]:
    """Why the tests a claim names do not earn it: a missing file or function, or a test of the wrong platform."""
    problems = []
    platform = name.split("/", 1)[1] if name.startswith("bitwise/") else None
    where = PLATFORMS[platform][2] if platform else None
    for test in claim.tests:
        file, _, function = test.partition("::")
        path = ROOT / file
        if not path.is_file():
            problems.append(f"{name}: {file} does not exist")
        elif function not in _test_functions(path):
            problems.append(f"{name}: {file} defines no test function {function}")
        if where is not None and not file.startswith(where):
            problems.append(f"{name}: {test} is not a {PLATFORMS[platform][0]} test (those live in {where})")
    return problems


def _all_claims():
    fusions = [*FUSIONS.values(), *DERIVED_FUSIONS.values()]  # the derived ones (no switch of their own) too
    return [(f"{f.switch} {name}", name, claim) for f in fusions for name, claim in f.claims()]


@pytest.mark.parametrize("label, name, claim", _all_claims(), ids=[c[0] for c in _all_claims()])
def test_every_claim_is_earned_by_tests_that_exist(label, name, claim):
    assert claim.verdict in (YES, NO, UNTESTED), label
    if claim.verdict == YES:
        assert claim.tests, f"{label}: a 'yes' claim names the test that earns it"
    assert _claim_problems(name, claim) == [], label


def test_claims_default_to_untested_and_the_check_catches_a_claim_without_its_test():
    bare = Fusion(switch="some_switch", summary="", fused="", reference="")  # a new entry claims nothing
    assert [c.verdict for _, c in bare.claims()] == [UNTESTED] * 5 and not bare.bitwise_equal
    with pytest.raises(ValueError, match="must name the test that earns it"):
        Claim(YES)
    with pytest.raises(ValueError, match="expected 'tests/<dir>/<file>.py::<test function>'"):
        Claim(YES, ("tests/single_card_tests/test_fusion_rope.py",))
    planted = {  # each names a test that does not earn it: the check above must say so
        "bitwise/cpu_fp32": Claim(YES, ("tests/single_card_tests/test_fusion_rope.py::test_no_such_function",)),
        "cp_safe": Claim(YES, ("tests/multi_card_tests/test_no_such_file.py::test_cp",)),
        "bitwise/gpu": Claim(YES, ("tests/single_card_tests/test_fusion_rope.py::"
                                   "test_forward_and_backward_are_bitwise_equal_to_the_reference",)),
    }
    found = {name: _claim_problems(name, claim) for name, claim in planted.items()}
    assert "defines no test function test_no_such_function" in found["bitwise/cpu_fp32"][0]
    assert "test_no_such_file.py does not exist" in found["cp_safe"][0]
    assert "is not a GPU (torch) test (those live in tests/gpu/)" in found["bitwise/gpu"][0]
