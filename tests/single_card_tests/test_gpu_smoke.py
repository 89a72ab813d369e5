"""``scripts/gpu_smoke.py``, the first run on a Paddle GPU machine, runs on the CPU too (fp32, Triton interpreter).

The CPU run is the real script end to end (tiny lengths): every fusion of the registry and both Triton backends
against the unfused model, bitwise where the registry claims it, the launch counters and the route. The passing run
narrows the experts to 16 wide (the YAML's are 64) on the script's ``MODEL`` before its ``main`` runs: the interpreted
grouped-experts kernels' time grows with the expert weights (the two variants that run them took 29 of the run's
40 s at 64, 13 s at 16). Planted differences make it fail (the command line as is). The GPU-only parts (bf16 rule,
all gradients as one vector) run here on synthetic results, since no Paddle GPU build exists here.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from fleet_ext.registry import BACKENDS, FUSIONS

pytest.importorskip("triton", reason="the smoke runs the fused kernels (Triton, the `test` extra)")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_smoke.py"
TINY = ["--seq", "16"]  # the whole smoke in ~25 s on 2 CPU cores (experts narrowed, below)


# The script's `main` after narrowing the experts of its model (a fresh process, as the command line would be).
NARROW_EXPERTS = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('gpu_smoke', sys.argv[1])\n"
    "module = sys.modules['gpu_smoke'] = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module.MODEL['moe_intermediate_size'] = 16\n"
    "sys.exit(module.main(sys.argv[2:]))\n"
)


def _smoke(*args: str, narrow_experts: bool = False) -> subprocess.CompletedProcess:
    run = [sys.executable, "-c", NARROW_EXPERTS] if narrow_experts else [sys.executable]
    return subprocess.run([*run, str(SCRIPT), *TINY, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _rows(stdout: str) -> dict[str, list[str]]:
    """The table's rows by variant name: [launches, rule, bitwise, max |diff|, s, result]."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) == 7 and cells[0] != "variant":
            rows[cells[0]] = cells[1:]
    return rows


def _load_script():
    """The script as a module (its functions run in-process here), loaded once."""
    if "gpu_smoke" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_smoke"] = module  # dataclasses look their module up while the class is created
        spec.loader.exec_module(module)
    return sys.modules["gpu_smoke"]


def test_the_smoke_passes_on_the_cpu_with_every_fusion_and_backend():
    result = _smoke(narrow_experts=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "CPU fp32 (Triton interpreter); CPU (Triton interpreter); triton (interpreter);" in result.stdout
    assert "'moe_intermediate_size': 16}" in result.stdout  # the narrowed model is the one that ran
    rows = _rows(result.stdout)
    expected = {"unfused", "unfused (repeat)", "bitwise fusions together", "all fusions + Triton backends",
                *(s for s, f in FUSIONS.items() if f.landed), *(f"{s}=triton" for s in BACKENDS)}
    assert set(rows) == expected, sorted(set(rows) ^ expected)
    assert all(row[-1] == "OK" for row in rows.values()), result.stdout
    assert rows["unfused"][0] == rows["unfused (repeat)"][0] == "0 (0 kernels)"  # unfused: no Triton launch
    for name, row in rows.items():  # bitwise exactly where the registry claims it on CPU fp32
        claimed = name in FUSIONS and FUSIONS[name].bitwise_equal or name in ("unfused", "unfused (repeat)",
                                                                                 "bitwise fusions together")
        assert (row[1] == "bitwise") == claimed, (name, row)
        if row[1] == "bitwise" and name != "unfused":  # the baseline has nothing to be compared with
            assert row[2] == "yes" and row[3] == "0.00e+00", (name, row)
    assert re.search(r"launch routes: \{'interpreter': \d+\} \(OK\)", result.stdout), result.stdout[-2000:]
    assert result.stdout.rstrip().endswith("gpu_smoke: all variants match")


def test_the_smoke_fails_on_planted_differences():
    """Negative control: a bitwise variant, the sink-gradient tolerance and the Triton backend's tolerance each
    catch a planted difference; the script names them and exits 1."""
    planted = ["apply_rope_fusion", "dsa_sink_grad_fusion", "mqa_sparse_attn_backend=triton"]
    result = _smoke(*(a for name in planted for a in ("--only", name, "--plant", name)))
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-3000:]
    rows = _rows(result.stdout)
    assert {name: rows[name][-1] for name in planted} == dict.fromkeys(planted, "FAIL"), result.stdout
    assert rows["unfused"][-1] == "OK" and "gpu_smoke: 3 mismatch(es)" in result.stdout
    assert "FAIL apply_rope_fusion:\n  grad/" in result.stdout and "logits: 4096 of 4096 elements differ" in (
        result.stdout)
    assert "fp32 'model_triton_sparse_attn'" in result.stdout and "fp32 'sink_grad_model'" in result.stdout


def test_an_unknown_variant_exits_2_naming_the_choices():
    result = subprocess.run([sys.executable, str(SCRIPT), "--only", "no_such_fusion"], capture_output=True,
                            text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2 and "unknown variant(s) ['no_such_fusion']" in result.stderr, result.stderr


def test_on_a_paddle_gpu_every_variant_is_held_to_the_bf16_tolerance():
    """No bitwise claim is verified on a Paddle GPU build, so the registry gives every variant the bf16 rule."""
    smoke = _load_script()
    found = smoke.variants("paddle_gpu")
    assert {v.rule for v in found} == {"tolerance bf16 model_smoke"}
    assert "bitwise fusions together" not in {v.name for v in found}


def test_the_gpu_comparison_passes_rounding_and_fails_a_real_difference():
    """The GPU path's comparison (bf16 logits, all gradients as one vector) on synthetic results."""
    smoke = _load_script()
    rng = np.random.default_rng(0)

    def result(noise: float, logits_scale: float = 1.0) -> dict:
        grads = {f"grad/p{i}": paddle.to_tensor((rng.standard_normal(50) * (1 + noise)).astype("float32"))
                 for i in range(3)}
        logits = paddle.to_tensor((base_logits * logits_scale).astype("float32")).astype("bfloat16")
        return {"loss": paddle.to_tensor(np.float32(2.5)), "logits": logits, **grads}

    base_logits = rng.standard_normal((2, 4, 8))
    rng = np.random.default_rng(1)
    base = smoke.Variant("unfused", {}, result={})
    base.result = result(0.0)
    rounding, different = (smoke.Variant(n, {}, rule="tolerance bf16 model_smoke") for n in ("a", "b"))
    rng = np.random.default_rng(1)
    rounding.result = result(2 ** -9)  # one bf16 rounding step on every gradient
    smoke.compare(rounding, base, per_tensor=False)
    assert rounding.problems == [] and rounding.bitwise is False
    rng = np.random.default_rng(1)
    different.result = result(0.0, logits_scale=1.1)
    smoke.compare(different, base, per_tensor=False)
    assert len(different.problems) == 1 and different.problems[0].startswith("logits: ||got - want||")


def test_the_launch_check_catches_a_fused_path_that_did_not_run_and_stray_kernels():
    smoke = _load_script()
    silent = smoke.Variant("apply_rope_fusion", {"apply_rope_fusion": True}, ops={"fleet_ext.ops.rope"})
    smoke.check_launches(silent)
    assert silent.problems == ["no kernel of fleet_ext.ops.rope launched: the fused path did not run"]
    stray = smoke.Variant("unfused", {}, launches={"_rope_kernel": 2})
    smoke.check_launches(stray)
    assert stray.problems == ["kernels of ops that are off were launched: ['_rope_kernel']"]
