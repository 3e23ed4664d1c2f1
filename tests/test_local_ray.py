"""The embedded Ray start does not depend on what a dead Ray left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = """
import ray
from actors.local_ray import init_ray
owns = init_ray(num_cpus=2)
print("started", owns, int(ray.cluster_resources()["CPU"]))
ray.shutdown()
"""


def test_the_embedded_start_ignores_a_stale_cluster_address_file():
    """A Ray that died without `ray stop` leaves `ray_current_cluster` naming its dead address;
    the old `ray.init(num_cpus=...)` then tried to attach there and refused its own arguments."""
    # Ray's temp dir of this test alone (RAY_TMPDIR), short enough for Ray's socket paths.
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    try:
        (Path(temp) / "ray").mkdir()
        (Path(temp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env |= {"RAY_TMPDIR": temp, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", START], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
        )
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "started True 2" in done.stdout
