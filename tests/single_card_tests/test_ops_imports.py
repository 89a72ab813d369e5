"""Kernel modules and the launch adapter import without Paddle (and without torch).

The GPU benchmark machine has torch and Triton but no Paddle (DESIGN.md, Platforms), so ``fleet_ext``,
``fleet_ext.ops.launch`` and every ``fleet_ext/ops/*/kernel*.py`` must import with Paddle unimportable,
and must not pull a framework in as a side effect (e.g. by asking the machine for its GPU at import:
``capability.detect()`` imports Paddle, or torch when Paddle is missing). The kernel modules are found by
globbing, so a new ``kernel_*.py`` is covered without editing this test.

Each check runs in a fresh interpreter where ``sys.modules["paddle"] = None`` is set before anything
else: any ``import paddle`` (or of a submodule) raises ``ImportError`` there, and
``importlib.util.find_spec("paddle")`` answers None, as on a machine without Paddle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "fleet_ext" / "ops"
KERNEL_MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts) for path in OPS.glob("*/kernel*.py")
)
MODULES = ["fleet_ext", "fleet_ext.ops.launch", *KERNEL_MODULES]

# Imports the modules given on the command line one by one and reports, per module, the import error (if
# any) and the frameworks that became loaded while importing it.
_PROBE = r"""
import sys
sys.modules["paddle"] = None  # Paddle is unimportable from here on
import importlib, json

FRAMEWORKS = ("paddle", "torch")


def loaded():
    return sorted({m.split(".")[0] for m, mod in sys.modules.items()
                   if mod is not None and m.split(".")[0] in FRAMEWORKS})


report = []
for name in sys.argv[1:]:
    before = set(loaded())
    try:
        importlib.import_module(name)
        error = None
    except Exception as exc:  # report every module, not just the first failure
        error = f"{type(exc).__name__}: {exc}"
    report.append({"module": name, "error": error, "pulled_in": sorted(set(loaded()) - before)})
print(json.dumps({"report": report, "paddle_entry": repr(sys.modules.get("paddle", "absent")),
                  "paddle_submodules": sorted(m for m in sys.modules if m.startswith("paddle."))}))
"""


def _probe(modules: list[str]) -> dict:
    run = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, f"the probe itself failed:\n{run.stderr}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_glob_finds_every_kernel_module():
    """The split kernel modules are all discovered (a guard against a glob that silently matches nothing)."""
    assert {"fleet_ext.ops.sparse_attn.kernel", "fleet_ext.ops.sparse_attn.kernel_fwd",
            "fleet_ext.ops.sparse_attn.kernel_bwd", "fleet_ext.ops.q_rms_norm.kernel",
            "fleet_ext.ops.q_rms_norm.kernel_fwd", "fleet_ext.ops.q_rms_norm.kernel_bwd",
            "fleet_ext.ops.rope.kernel", "fleet_ext.ops.kv_idx_remap.kernel", "fleet_ext.ops.sink_grad.kernel",
            "fleet_ext.ops.inv_rope_postmix.kernel"} <= set(KERNEL_MODULES)


def test_kernel_modules_and_launch_import_without_paddle_or_torch():
    result = _probe(MODULES)
    failures = [f"{r['module']}: {r['error']}" for r in result["report"] if r["error"]]
    assert not failures, "modules that need Paddle (or fail) at import:\n" + "\n".join(failures)
    pulled = [f"{r['module']} imported {', '.join(r['pulled_in'])}" for r in result["report"] if r["pulled_in"]]
    assert not pulled, "modules that import a framework at import time:\n" + "\n".join(pulled)
    # Paddle stayed out: the sentinel is untouched and no paddle.* module was loaded behind it.
    assert result["paddle_entry"] == "None" and result["paddle_submodules"] == []


@pytest.mark.parametrize("planted", ["import paddle", "from fleet_ext import capability\ncapability.detect()"])
def test_the_probe_catches_a_kernel_module_that_imports_a_framework(tmp_path, planted):
    """Test of the test: a kernel module that imports Paddle, or asks the machine at import, is reported."""
    package = tmp_path / "planted_ops"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kernel_planted.py").write_text(f"import triton\n{planted}\n")
    run = subprocess.run([sys.executable, "-c", _PROBE, "planted_ops.kernel_planted"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert run.returncode == 0, run.stderr
    (entry,) = json.loads(run.stdout.strip().splitlines()[-1])["report"]
    assert entry["error"] or entry["pulled_in"], entry

