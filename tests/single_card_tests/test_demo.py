"""The README's first command: the built-in demo trains the embedded tiny model and the loss drops."""

import subprocess
import sys


def test_demo_trains_and_reports_a_lower_loss():
    result = subprocess.run(
        [sys.executable, "-m", "fleet_ext.demo", "--steps", "12"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reference (pure Paddle)" in result.stdout, "the fusion table must be printed"
    summary = [line for line in result.stdout.splitlines() if line.startswith("loss ")]
    assert summary, result.stdout
    first, last = (float(x) for x in summary[-1].split()[1:4:2])
    assert last < first - 0.5, summary[-1]


def test_demo_model_is_the_training_yaml_model():
    """The packaged demo YAML (shipped in the wheel) and configs/dsv4_tiny_cpu.yaml describe one model."""
    from pathlib import Path

    from fleet_ext.config import load_config
    from fleet_ext.demo import DEFAULT_CONFIG

    training = load_config(Path(__file__).resolve().parents[2] / "configs" / "dsv4_tiny_cpu.yaml")
    demo = load_config(DEFAULT_CONFIG)
    assert (demo.model, demo.moe) == (training.model, training.moe)
