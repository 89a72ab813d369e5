"""scripts/pretrain.py as a user runs it (one process): output layout, start-up table, exit codes, and bad
input (malformed YAML, unknown key, missing data, NaN loss) ending with a clear message, a non-zero exit and
the existing checkpoints untouched. Also scripts/loss_compare.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = [sys.executable, str(ROOT / "scripts" / "pretrain.py")]
SMALL = [
    "--max_seq_len",
    "64",
    "--per_device_train_batch_size",
    "2",
    "--per_device_eval_batch_size",
    "2",
    "--warmup_steps",
    "1",
    "--eval_steps",
    "2",
    "--eval_iters",
    "1",
    "--save_steps",
    "2",
    "--disable_tqdm",
    "true",
]


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([*PRETRAIN, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def _snapshot(out: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every file of every checkpoint directory."""
    return {
        str(p.relative_to(out)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for d in sorted(out.glob("checkpoint-*"))
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    """A real 4-step run of the training YAML: checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("cli") / "run"
    result = _run("--config", "configs/dsv4_tiny_cpu.yaml", *SMALL, "--max_steps", "4", "--output_dir", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result


def test_run_writes_metrics_plot_checkpoints_and_a_startup_table(run4):
    out, result = run4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert {"step", "loss", "lr", "tokens_per_sec", "grad_norm", "tokens", "epoch"} <= set(r)
        assert r["tokens_per_sec"] > 0 and r["tokens"] == r["step"] * 2 * 64
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    stdout = result.stdout
    for needle in (
        "fleet_ext pretraining",
        "629.93 K parameters",
        "data 1 x tensor 1 x pipeline 1",
        "micro 2 x accumulation 1 x data 1 = 2 sequences x 64 tokens",
        "built-in public-domain corpus",
        "apply_rope_fusion",
        "reference (pure Paddle)",
        "switch off (default)",
        f"saved {out / 'checkpoint-4'}",
        "done: 4 steps, loss ",
    ):
        assert needle in stdout, needle
    first, last = (float(x) for x in stdout.split("done: 4 steps, loss ")[1].split(",")[0].split(" -> "))
    assert last < first


@pytest.mark.parametrize(
    "case, yaml_text, args, message",
    [
        ("malformed yaml", "max_steps: [1, 2\n", [], "is not valid YAML"),
        ("unknown key in yaml", "max_stepz: 3\n", [], "unknown config key `max_stepz`. Did you mean `max_steps`"),
        (
            "unknown key on the command line",
            None,
            ["--lerning_rate", "0.1"],
            "unknown config key `lerning_rate`. Did you mean `learning_rate`",
        ),
        (
            "missing data file",
            None,
            ["--train_dataset_path", "/nonexistent/tokens.bin"],
            "config key `train_dataset_path` = '/nonexistent/tokens.bin': the file does not exist",
        ),
        (
            "fresh start over checkpoints",
            None,
            ["--resume_from_checkpoint", "null"],
            "already holds checkpoints (checkpoint-2, checkpoint-4) and `resume_from_checkpoint` is null",
        ),
        ("partial checkpoint path", None, ["--resume_from_checkpoint", "PARTIAL"], "is not a complete checkpoint"),
        ("bf16 on a CPU build", None, ["--bf16", "true"], "`bf16` = True cannot run on this machine"),
        (
            "selective recompute without modules",
            None,
            ["--recompute_granularity", "selective"],
            "config key `recompute_modules`",
        ),
        (
            "unknown recompute module",
            None,
            ["--recompute_granularity", "selective", "--recompute_modules", "[core_atn]"],
            "did you mean `core_attn`",
        ),
    ],
)
def test_bad_input_exits_2_with_a_clear_message_and_checkpoints_untouched(
    run4, tmp_path, case, yaml_text, args, message
):
    import paddle

    if case == "bf16 on a CPU build" and paddle.is_compiled_with_cuda():
        pytest.skip("bf16 runs on a GPU build")
    out, _ = run4
    before = _snapshot(out)
    config = "configs/dsv4_tiny_cpu.yaml"
    if yaml_text is not None:
        config = str(tmp_path / "bad.yaml")
        Path(config).write_text(yaml_text)
    if "PARTIAL" in args:
        partial = tmp_path / "checkpoint-9"
        (partial / "model").mkdir(parents=True)  # an interrupted save: no COMPLETE, no trainer state
        args = ["--resume_from_checkpoint", str(partial)]
    result = _run("--config", config, *SMALL, "--max_steps", "6", "--output_dir", str(out), *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "fleet_ext pretrain: error: " in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "fleet_ext pretraining" not in result.stdout
    assert _snapshot(out) == before


def test_nan_loss_stops_with_exit_3_and_leaves_checkpoints_untouched(run4):
    out, _ = run4
    before = _snapshot(out)
    result = _run(
        "--config",
        "configs/dsv4_tiny_cpu.yaml",
        *SMALL,
        "--max_steps",
        "8",
        "--output_dir",
        str(out),
        "--inject_fault",
        "nan_loss@6",
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"resumed from {out / 'checkpoint-4'} at step 4" in result.stdout
    assert "error: non-finite loss (nan) at step 6: training stopped before the optimizer step" in result.stderr
    assert "latest: checkpoint-4" in result.stderr and "Traceback" not in result.stderr
    assert _snapshot(out) == before
    assert not list(out.glob("tmp-*")) and not (out / "checkpoint-6").exists()


def test_loss_compare_prints_the_table_and_asserts_equality(run4, tmp_path):
    out, _ = run4
    script = [sys.executable, str(ROOT / "scripts" / "loss_compare.py")]
    same = subprocess.run(
        [*script, str(out), str(out / "metrics.jsonl"), "--assert-equal"], capture_output=True, text=True, cwd=ROOT
    )
    assert same.returncode == 0, same.stdout + same.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "all steps equal (bitwise)" in same.stdout
    assert same.stdout.count(" yes") == sum("loss" in r for r in records)
    records = [dict(r, loss=r["loss"] * (1 + 1e-7)) if r.get("step") == 3 and "loss" in r else r for r in records]
    other = tmp_path / "metrics.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in records))
    diff = subprocess.run([*script, str(out), str(other), "--assert-equal"], capture_output=True, text=True, cwd=ROOT)
    assert diff.returncode == 1 and "runs differ (bitwise)" in diff.stdout and " NO" in diff.stdout
    tol = subprocess.run(
        [*script, str(out), str(other), "--assert-equal", "--rtol", "1e-6"], capture_output=True, text=True, cwd=ROOT
    )
    assert tol.returncode == 0 and "within rtol 1e-06" in tol.stdout
    # A tolerance given alone is enforced too: exit 1 naming the step and the difference when exceeded.
    tight = subprocess.run([*script, str(out), str(other), "--rtol", "1e-8"], capture_output=True, text=True, cwd=ROOT)
    assert tight.returncode == 1, tight.stdout + tight.stderr
    assert "loss_compare: FAILED (within rtol 1e-08): step 3: loss A " in tight.stderr, tight.stderr
    assert "exceeds rtol 1e-08" in tight.stderr and "step 4" not in tight.stderr
    loose = subprocess.run([*script, str(out), str(other), "--rtol", "1e-6"], capture_output=True, text=True, cwd=ROOT)
    assert loose.returncode == 0 and "all steps equal (within rtol 1e-06)" in loose.stdout, loose.stdout + loose.stderr
    shown = subprocess.run([*script, str(out), str(other)], capture_output=True, text=True, cwd=ROOT)
    assert shown.returncode == 0 and "runs differ (bitwise)" in shown.stdout  # no check asked: the table only


@pytest.mark.parametrize(
    "cap, where",
    [
        ({"triton": False, "torch": True, "gpu": False, "sm": None}, "(CPU): Triton is not installed"),
        ({"triton": True, "torch": True, "gpu": True, "sm": (7, 5)}, "(GPU sm75): GPU compute capability sm75 is"),
    ],
    ids=["no_triton", "sm75"],
)
def test_a_fusion_this_machine_cannot_run_exits_2_before_any_model_is_built(tmp_path, capsys, monkeypatch, cap, where):
    """The capability gate runs with the config checks: exit 2 and the message, no process group, no model."""
    import paddle.distributed as dist

    from fleet_ext import capability
    from fleet_ext.models import DSv4ForCausalLM
    from fleet_ext.training.cli import main

    built = []
    build = DSv4ForCausalLM.__init__
    monkeypatch.setattr(DSv4ForCausalLM, "__init__", lambda self, *a, **k: (built.append(1), build(self, *a, **k))[1])
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "configs" / "dsv4_tiny_cpu.yaml"), *SMALL, "--max_steps", "2", "--output_dir",
            str(out), "--apply_rope_fusion", "true"]
    with capability.override(capability.Capability(**cap)):
        code = main(args)
    printed = capsys.readouterr()
    assert code == 2, printed.out + printed.err
    assert f"fleet_ext pretrain: error: config key `apply_rope_fusion` = True cannot run on this machine {where}" in (
        printed.err
    )
    assert "Fix: install what is missing or set `apply_rope_fusion` off" in printed.err
    assert "Traceback" not in printed.err and "fleet_ext pretraining" not in printed.out
    assert built == [] and not dist.is_initialized() and not out.exists()
    DSv4ForCausalLM(str(ROOT / "configs" / "dsv4_tiny_cpu.yaml"))
    assert built == [1]  # the counter does count a build
