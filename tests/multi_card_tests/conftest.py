"""The uninterrupted DP=2 reference run, launched once and shared by the data-parallel and fault tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_helpers import TEST_OVERRIDES, cli_args, describe, launch

DP_SCRIPT = Path(__file__).with_name("test_dp_training.py")


@pytest.fixture(scope="session")
def dp2_reference(tmp_path_factory):
    """8 steps on 2 ranks (checkpoint every 2): output dir, logs, and each rank's result after training."""
    root = tmp_path_factory.mktemp("dp2_reference")
    out, logs = root / "out", root / "logs"
    result = launch(DP_SCRIPT, ["--output_dir", str(out), *cli_args(TEST_OVERRIDES)], logs)
    assert result.returncode == 0, describe(result, logs)
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]
    return {"out": out, "logs": logs, "ranks": ranks}
