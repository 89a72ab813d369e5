"""Issue #4's end-to-end bar: the fusion switches set from a training YAML give byte-equal losses.

The tiny CPU model (VHA postmix on, so every fusion has a path to take) is trained for a few steps by
``scripts/pretrain.py`` with all switches off and with the four bitwise switches on (Triton interpreter);
``scripts/loss_compare.py --assert-equal`` then requires every step's loss to be identical. The sink-grad
fusion, which is deterministic but not bitwise, is held to its documented tolerance (``--rtol``, which
``loss_compare.py`` enforces); the same check is shown to fail on a loss planted just beyond that tolerance
and to pass on one within it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleet_ext.training.metrics import read_metrics

pytest.importorskip("triton", reason="fused kernels need Triton (installed by the `test` extra)")

ROOT = Path(__file__).resolve().parents[2]
BITWISE_SWITCHES = {
    "apply_rope_fusion": True,
    "fuse_inv_rope_into_vha_postmix": True,
    "sparse_attn_global_kv_idx_remap_fusion": True,
    "dsv4_q_rms_norm_fusion": True,
}
# Every kernel those switches launch (the inverse-RoPE + postmix op writes its trailing channels with its own; the q
# norm and RoPE switches together run the q/kv prologue kernels, the q norm's statistics launch staying on the CPU).
BITWISE_KERNELS = {"_rope_kernel", "_write_trailing_kernel", "_kv_idx_remap_kernel", "_q_rms_norm_fwd_kernel",
                   "_norm_rope_fwd_kernel", "_norm_rope_bwd_kernel"}
SINK_GRAD_CHECK = ("--rtol", "1e-5")  # the sink-grad fusion's documented relative tolerance on the loss
SINK_GRAD_RTOL = float(SINK_GRAD_CHECK[1])
# 40 tokens past a window of 16; top-k 4 of 10 CSA entries, HCA pooling 8 tokens (5 entries): every kind runs its
# compressed path with real picks, and 2 x 40 tokens take the sink gradient's two launches (partials over blocks of
# 64 tokens in the interpreter, then their reduce); 136 tokens with the YAML's window 32 took twice the time.
SHORT_RUN = ["--max_steps", "3", "--warmup_steps", "1", "--max_seq_len", "40", "--per_device_train_batch_size", "2",
             "--csa_window_size", "16", "--dsa_index_topk", "4", "--hca_compress_ratio", "8",
             "--eval_steps", "0", "--save_steps", "0", "--disable_tqdm", "true"]


def _yaml(tmp_path: Path, name: str, switches: dict) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "dsv4_tiny_cpu.yaml").read_text())
    config.update({"use_vha_attention": True, "output_dir": str(tmp_path / name), **switches})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _assert_kernels_ran(tmp_path: Path, kernels: set[str]) -> None:
    """The fused run's metrics name every expected kernel with launches (the trainer writes its launch
    counters at the end of a run); the unfused run launched no Triton kernel at all."""
    launches = [r["kernel_launches"] for r in read_metrics(tmp_path / "runs" / "B") if "kernel_launches" in r]
    assert len(launches) == 1 and all(launches[0].get(name, 0) > 0 for name in kernels), (kernels, launches)
    assert not any("kernel_launches" in r for r in read_metrics(tmp_path / "runs" / "A"))


def _compare(tmp_path: Path, switches: dict, *check: str) -> subprocess.CompletedProcess:
    off, on = _yaml(tmp_path, "off", {}), _yaml(tmp_path, "on", switches)
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "loss_compare.py"), str(off), str(on), *check,
         "--workdir", str(tmp_path / "runs"), *SHORT_RUN],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )


def test_bitwise_switches_from_yaml_give_byte_equal_losses(tmp_path):
    result = _compare(tmp_path, BITWISE_SWITCHES, "--assert-equal")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all steps equal (bitwise)" in result.stdout and "     3 " in result.stdout, result.stdout[-2000:]
    on_table = result.stdout.split("runs/B", 1)[1]
    for switch in BITWISE_SWITCHES:  # the second run really resolved every switch to its Triton kernel
        assert any(line.startswith(switch) and "Triton interpreter" in line for line in on_table.splitlines()), switch
    _assert_kernels_ran(tmp_path, BITWISE_KERNELS)


def _compare_files(a: Path, b: Path, *check: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "loss_compare.py"), str(a), str(b), *check],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _plant(source: Path, target: Path, step: int, rel: float) -> Path:
    """Copy a metrics file with the loss of ``step`` moved to relative difference ``rel`` from the original."""
    records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    assert any(r.get("step") == step and "loss" in r for r in records), f"{source} has no loss at step {step}"
    for record in records:
        if record.get("step") == step and "loss" in record:
            record["loss"] = record["loss"] / (1.0 - rel)  # |new - old| / max(|new|, |old|) == rel
    target.write_text("".join(json.dumps(r) + "\n" for r in records))
    return target


def _assert_check_catches_a_planted_difference(a: Path, tmp_path: Path, step: int) -> None:
    """The sink-grad check fails on a loss 1.5x its tolerance away, naming the step; passes at 0.5x."""
    beyond = _compare_files(a, _plant(a, tmp_path / "beyond.jsonl", step, 1.5 * SINK_GRAD_RTOL), *SINK_GRAD_CHECK)
    assert beyond.returncode == 1, beyond.stdout + beyond.stderr
    assert f"step {step}: loss A " in beyond.stderr and "relative 1.5e-05 exceeds rtol 1e-05" in beyond.stderr, (
        beyond.stderr
    )
    assert "runs differ (within rtol 1e-05)" in beyond.stdout
    within = _compare_files(a, _plant(a, tmp_path / "within.jsonl", step, 0.5 * SINK_GRAD_RTOL), *SINK_GRAD_CHECK)
    assert within.returncode == 0, within.stdout + within.stderr
    assert "all steps equal (within rtol 1e-05)" in within.stdout and " NO" not in within.stdout


def test_the_sink_grad_check_fails_on_a_planted_difference(tmp_path):
    """Test of the test (fast, no training): the sink-grad check below can fail."""
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"step": s, "loss": x, "lr": 1e-3}) + "\n"
                         for s, x in enumerate([5.56, 5.12, 4.87], start=1)))
    _assert_check_catches_a_planted_difference(a, tmp_path, step=2)
    far = _compare_files(a, _plant(a, tmp_path / "far.jsonl", 3, 0.44), *SINK_GRAD_CHECK)
    assert far.returncode == 1 and "step 3: " in far.stderr, far.stdout + far.stderr  # runs 44 % apart fail


def test_sink_grad_switch_from_yaml_stays_within_tolerance(tmp_path):
    result = _compare(tmp_path, {"dsa_sink_grad_fusion": True}, *SINK_GRAD_CHECK)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all steps equal (within rtol 1e-05)" in result.stdout and "     3 " in result.stdout, result.stdout[-2000:]
    on_table = result.stdout.split("runs/B", 1)[1]
    assert any(line.startswith("dsa_sink_grad_fusion") and "Triton interpreter" in line
               for line in on_table.splitlines()), on_table[-3000:]
    _assert_kernels_ran(tmp_path, {"_sink_grad_partial_kernel", "_sink_grad_reduce_kernel"})
    # The same comparison on this run's own losses fails when one is planted just beyond the tolerance.
    _assert_check_catches_a_planted_difference(tmp_path / "runs" / "A" / "metrics.jsonl", tmp_path, step=2)
