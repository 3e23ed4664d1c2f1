"""pyproject.toml declares what the code needs: the floors it checks, and a core without the extras."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from actors.collective import RAY_FLOOR
from rrfp_ray.installed import CORE

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _floor(requirement: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.search(r">=([\d.]+)", requirement).group(1).split("."))


def _named(requirements: list[str], name: str) -> str:
    return next(r for r in requirements if re.match(rf"{name}\b(?!-)", r))


def test_the_declared_ray_floor_is_the_one_the_collective_checks():
    assert _floor(_named(PROJECT["dependencies"], "ray")) == RAY_FLOOR


def test_the_pins_ci_installs_meet_every_floor():
    pins = {}
    for line in (ROOT / "requirements-cpu.txt").read_text().splitlines():
        if "==" in line:
            name, version = line.split("==")
            pins[name.split("[")[0]] = tuple(int(part) for part in version.split(".")[:2])
    for name in ("torch", "ray"):
        assert pins[name] >= _floor(_named(PROJECT["dependencies"], name))[:2], name


def test_the_core_leaves_plots_and_progress_bars_to_the_extras():
    core = " ".join(PROJECT["dependencies"])
    assert "matplotlib" not in core and "tqdm" not in core
    extras = PROJECT["optional-dependencies"]
    assert any(r.startswith("matplotlib") for r in extras["plots"])
    assert {"matplotlib", "tqdm"} <= {re.split(r"[<>=\[]", r)[0] for r in extras["jobs"]}
    # the CPU install path CI uses installs the extras too
    pinned = (ROOT / "requirements-cpu.txt").read_text()
    assert "matplotlib" in pinned and "tqdm" in pinned


def test_the_library_imports_without_the_extras():
    """Importing the public API (both backends) loads neither matplotlib nor tqdm."""
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = sys.modules['tqdm'] = None\n"  # any import of them fails
        "from rrfp_ray import Trainer, PipelineConfig, LocalBackend\n"
        "from actors.backend import RayBackend\n"
        "import rrfp_ray.observe.diagram\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_older_ray_is_refused_at_import_naming_the_floor():
    code = "import ray\nray.__version__ = '2.55.1'\nimport actors.collective\n"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert "actors.collective needs ray >= 2.56, found 2.55.1" in done.stderr


def test_the_core_packages_the_jobs_check_for_are_the_declared_ones():
    declared = [re.split(r"[<>=\[ ]", requirement)[0] for requirement in PROJECT["dependencies"]]
    assert list(CORE) == declared


@pytest.mark.parametrize("job", ["train_gpt.py", "train_vlm.py"])
def test_a_job_run_by_a_python_without_the_core_packages_says_so_and_exits_2(job):
    """As under `ray job submit` on a head started outside the virtualenv: `-S` leaves site-packages out."""
    done = subprocess.run(
        [sys.executable, "-S", f"jobs/{job}", "--iterations", "1"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"{job}: error: this Python ({sys.executable}) lacks torch, ray, pydantic, numpy")
    assert "Traceback" not in done.stderr and ". .venv/bin/activate" in done.stderr
