"""The tree's layering: `rrfp_ray/` never imports ray or the Ray shells, and a lower layer
never imports a higher one (read from the source, function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[1] / "rrfp_ray"
ACTORS = LIBRARY.parent / "actors"
# A layer may import its own modules and those of strictly lower rank.
RANKS = {
    "schedule": 0,
    "models": 0,
    "observe": 1,
    "policy": 1,
    "sim": 2,
    "plan": 3,
    "runtime": 4,
    "train": 5,
    "recipes": 6,
}
TOP = max(RANKS.values()) + 1  # rrfp_ray/__init__.py and rrfp_ray/cli.py: the public surface


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "rrfp_ray" else None


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules() -> list[Path]:
    return sorted(LIBRARY.rglob("*.py"))


def test_every_library_module_is_in_a_known_layer():
    layers = {path.relative_to(LIBRARY).parts[0] for path in modules() if len(path.relative_to(LIBRARY).parts) > 1}
    assert layers == set(RANKS)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(LIBRARY)))
def test_no_module_imports_ray_or_the_ray_shells(path: Path):
    bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in ("ray", "actors", "jobs", "benchmarks"))
    assert not bad, f"{path.relative_to(LIBRARY)} imports {bad}"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(LIBRARY)))
def test_no_module_imports_a_higher_layer(path: Path):
    parts = path.relative_to(LIBRARY).parts
    own = parts[0] if len(parts) > 1 else None
    rank = RANKS[own] if own else TOP
    upward = sorted(
        module
        for module in imported_modules(path)
        if (layer := layer_of(module)) in RANKS and layer != own and RANKS[layer] >= rank
    )
    assert not upward, f"{path.relative_to(LIBRARY)} (layer {own}) imports {upward}"


@pytest.mark.parametrize("path", sorted(ACTORS.rglob("*.py")), ids=lambda p: str(p.relative_to(ACTORS)))
def test_no_installed_module_imports_the_jobs_or_their_benchmarks(path: Path):
    """The wheel holds rrfp_ray and actors only: neither may import what stays in jobs/."""
    bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in ("jobs", "benchmarks"))
    assert not bad, f"actors/{path.relative_to(ACTORS)} imports {bad}"


def test_the_checker_sees_an_upward_import(tmp_path: Path):
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from rrfp_ray.train.api import Trainer\n")
    assert "rrfp_ray.train.api" in imported_modules(module)
    assert layer_of("rrfp_ray.train.api") == "train"


def test_no_library_module_is_over_400_lines():
    long = {str(p.relative_to(LIBRARY)): n for p in modules() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_the_error_base_imports_nothing_of_the_project():
    """rrfp_ray/errors.py is what every layer's errors derive from, so it sits below them all."""
    imported = imported_modules(LIBRARY / "errors.py")
    assert not sorted(m for m in imported if m.split(".")[0] in ("rrfp_ray", "actors", "jobs", "benchmarks"))
