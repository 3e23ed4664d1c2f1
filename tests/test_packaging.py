"""The built wheel (not the editable install) holds every subpackage, and each imports."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def packages() -> list[str]:
    found = []
    for top in ("rrfp_ray", "actors", "benchmarks"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            found.append(".".join(init.parent.relative_to(ROOT).parts))
    return found


def test_the_wheel_holds_and_imports_every_subpackage(tmp_path: Path):
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
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("rrfp_ray-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    names = packages()
    assert {"rrfp_ray.schedule", "rrfp_ray.train", "actors", "benchmarks"} <= set(names)
    code = (
        "import importlib, sys; names = sys.argv[1:]; "
        "files = [importlib.import_module(n).__file__ for n in names]; "
        f"outside = [f for f in files if not f.startswith({str(site)!r})]; assert not outside, outside"
    )
    subprocess.run([sys.executable, "-c", code, *names], cwd=tmp_path, env={"PYTHONPATH": str(site)}, check=True)
