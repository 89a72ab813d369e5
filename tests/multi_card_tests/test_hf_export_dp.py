"""``scripts/export_hf.py`` on a checkpoint written by 2 data-parallel ranks (the shared DP=2 reference run):
the exported model holds exactly the checkpoint's tensors and transformers reproduces its logits."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from helpers import tolerance
from launch_helpers import ROOT, assert_same_tensors, checkpoint_tensors

torch = pytest.importorskip("torch", reason="HF interop needs torch (installed by the `test` extra)")
transformers = pytest.importorskip("transformers", reason="HF interop needs transformers==5.23.0 (`test` extra)")


def test_export_of_a_dp2_checkpoint_loads_into_transformers(dp2_reference, tmp_path):
    import paddle

    from fleet_ext.training.hf_interop import export_checkpoint

    checkpoint = dp2_reference["out"] / "checkpoint-8"
    assert len(list((checkpoint / "model").glob("*.distcp"))) == 2, "the checkpoint must come from 2 ranks"
    model = export_checkpoint(checkpoint, tmp_path / "hf")
    ours = {k: v.numpy() for k, v in model.state_dict().items()}
    assert_same_tensors(ours, checkpoint_tensors(checkpoint), "exported model vs the DP=2 checkpoint")
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = np.random.default_rng(0).integers(0, 256, size=(2, 150))
    with torch.no_grad():
        expected = hf.eval()(torch.from_numpy(ids)).logits.numpy()
    model.eval()
    with paddle.no_grad():
        got = model(paddle.to_tensor(ids)).numpy()
    diff = np.abs(got - expected).max()
    assert diff <= tolerance("fp32", "hf_parity").atol, f"max |logit diff| {diff:.3e}"


def test_export_script_command_line(dp2_reference, tmp_path):
    """The script as a user runs it: exit 0 and the written directory named; exit 2 on a non-checkpoint."""
    script = [sys.executable, str(ROOT / "scripts" / "export_hf.py")]
    ok = subprocess.run([*script, str(dp2_reference["out"] / "checkpoint-2"), str(tmp_path / "hf")],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "transformers deepseek_v4" in ok.stdout and (tmp_path / "hf" / "model.safetensors").is_file()
    bad = subprocess.run([*script, str(tmp_path), str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "not a complete training checkpoint" in bad.stderr
