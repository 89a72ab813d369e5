"""The house rules DESIGN.md states, checked on the source: floors import only downward, no file over 600
lines, no function over 80 lines.

Floors, top to bottom: entry points (demo, docs) → training → models → specs → layers → parallel → ops →
framework → config, registry, capability, layer_kinds. A module may import its own floor or any floor below
it; ``ops`` additionally imports neither ``layers`` nor ``framework`` (kernels stay usable without the layer
stack). Every import is read from the syntax tree, function-level (lazy) imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fleet_ext"

FLOORS = {
    "config": 0, "registry": 0, "capability": 0, "layer_kinds": 0, "__init__": 0,
    "framework": 1,
    "ops": 2,
    "parallel": 3,
    "layers": 4,
    "specs": 5,
    "models": 6,
    "training": 7,
    "demo": 8, "docs": 8,
}
FORBIDDEN = {"ops": {"layers", "framework"}}  # beyond the order: ops stays free of the layer stack
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def _floor_name(module: str) -> str:
    """'fleet_ext.layers.moe' -> 'layers'; 'fleet_ext' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported fleet_ext module) for every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}" if base == "fleet_ext" else base) for alias in node.names]
    return [(line, name) for line, name in found if name == "fleet_ext" or name.startswith("fleet_ext.")]


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def upward_imports(paths: list[Path]) -> list[str]:
    """Every import that points to a higher floor (or to a forbidden one), as 'file:line: a -> b'."""
    problems = []
    for path in paths:
        own = _floor_name(_module_of(path))
        if own not in FLOORS:
            problems.append(f"{path.relative_to(ROOT)}: module is on no floor (add it to FLOORS)")
            continue
        for line, target in _imports(path):
            other = _floor_name(target)
            if other not in FLOORS:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {target}, which is on no floor")
            elif FLOORS[other] > FLOORS[own] or other in FORBIDDEN.get(own, ()):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {own} -> {other} ({target})")
    return problems


def test_every_import_points_down():
    problems = upward_imports(_sources())
    assert not problems, "imports that point up a floor:\n" + "\n".join(problems)


def test_the_import_check_catches_an_upward_import(tmp_path):
    """Test the test: a layer module importing the composition floor, an op importing a layer, and a lazy
    (function-level) upward import are each reported."""
    fake = PACKAGE / "layers" / "_planted_for_test.py"
    fake_op = PACKAGE / "ops" / "_planted_for_test.py"
    try:
        fake.write_text("def f():\n    from fleet_ext.specs.backend import BackendProvider\n    return 1\n")
        fake_op.write_text("from fleet_ext.framework.layer import FleetLayer\n")
        problems = upward_imports([fake, fake_op])
    finally:
        fake.unlink()
        fake_op.unlink()
    assert len(problems) == 2, problems
    assert "layers -> specs" in problems[0] and "ops -> framework" in problems[1]


def _long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    return out


def test_no_file_over_600_lines():
    sizes = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in _sources()}
    long = [f"{path.relative_to(ROOT)}: {n}" for path, n in sizes.items() if n > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_80_lines():
    long = [entry for path in _sources() for entry in _long_functions(path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("floor", sorted({k for k in FLOORS if k not in ("__init__", "demo", "docs")}))
def test_every_floor_exists(floor):
    """The table names real places (a renamed floor must not silently stop being checked)."""
    assert (PACKAGE / floor).is_dir() or (PACKAGE / f"{floor}.py").is_file(), floor
