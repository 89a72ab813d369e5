"""Gates (DESIGN.md rule 3): switches that can never run raise at config/build time naming the switch,
the reason and the fix; the resolved table says which backend each switch got and why."""

from __future__ import annotations

import pytest

from fleet_ext import capability
from fleet_ext.capability import Capability
from fleet_ext.config import load_config
from fleet_ext.framework.backend import BackendProvider
from fleet_ext.registry import FUSIONS

TINY = {"num_hidden_layers": 2, "csa_compress_ratios": [0, 128], "moe_n_hash_layers": 0}


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
    assert rows["dsv4_q_rms_norm_fusion"].backend == "reference (pure Paddle)"


def test_cpu_with_triton_and_torch_uses_the_interpreter():
    config = load_config(TINY, apply_rope_fusion=True)
    with capability.override(_cap(gpu=False)):
        table = BackendProvider(config).format_table()
    assert "Triton interpreter (CPU, slow)" in table


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
