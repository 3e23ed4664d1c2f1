"""The built wheel (not the editable install) holds every subpackage of rrfp_ray and actors and
nothing else, each imports, and its console scripts name functions that exist."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def packages() -> list[str]:
    found = []
    for top in ("rrfp_ray", "actors"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            found.append(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_the_wheel_holds_and_imports_every_subpackage(tmp_path: Path):
    source = tmp_path / "source"  # a copy of the tracked files: no build/ left from an earlier wheel
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("rrfp_ray-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    names = packages()
    assert {"rrfp_ray.schedule", "rrfp_ray.train", "rrfp_ray.recipes", "actors"} <= set(names)
    tops = {name.split("/")[0] for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"rrfp_ray", "actors"}  # no top-level benchmarks or jobs in users' site-packages
    (entry_points,) = site.glob("rrfp_ray-*.dist-info/entry_points.txt")
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in entry_points.read_text()
    code = (
        "import importlib, sys; names = sys.argv[1:]; "
        "files = [importlib.import_module(n).__file__ for n in names]; "
        f"outside = [f for f in files if not f.startswith({str(site)!r})]; assert not outside, outside"
    )
    subprocess.run([sys.executable, "-c", code, *names], cwd=tmp_path, env={"PYTHONPATH": str(site)}, check=True)


SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize(("name", "target"), sorted(SCRIPTS.items()))
def test_every_console_script_runs_its_job_with_the_same_flags(name: str, target: str, capsys, monkeypatch):
    module_name, function = target.split(":")
    module = importlib.import_module(module_name)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        getattr(module, function)()
    assert exit_info.value.code == 0
    job = {"rrfp-train": "train_gpt", "rrfp-simulate": "simulate"}[name]
    assert importlib.import_module(job).main is module.main  # jobs/<job>.py runs the very same function
    assert "--stages" in capsys.readouterr().out
