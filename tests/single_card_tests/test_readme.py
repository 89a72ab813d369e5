"""The README's config table is generated from the config; it must be current."""

from pathlib import Path

from fleet_ext.docs import render_block, render_fusion_block

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_config_table_is_current():
    assert render_block() in README.read_text(encoding="utf-8"), (
        "README.md's config table is stale: run `python -m fleet_ext.docs README.md`"
    )
    assert render_fusion_block() in README.read_text(encoding="utf-8"), (
        "README.md's fusion table is stale: run `python -m fleet_ext.docs README.md`"
    )


def test_readme_opens_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert block == [
        "pip install -e . && python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 "
        "scripts/pretrain.py --config configs/dsv4_tiny_cpu.yaml",
        'pip install -e ".[test]" && python -m pytest tests -q -n 2 --dist loadfile',
    ]
    assert block[1] in (README.parent / ".ci" / "run").read_text(encoding="utf-8")
