"""jobs/train_gpt.py on its own embedded Ray: resuming from a checkpoint one of whose stage
files carries code (its digest in the manifest updated to match) ends the job with exit 2 and
one line naming the file, no traceback; the code does not run."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    *("--stages", "2", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16"),
    *("--seq-len", "16", "--micro-batch-size", "2", "--microbatches", "2", "--val-every", "0"),
    *("--checkpoint-every", "2", "--no-compare", "--policy", "bf", "--scenario", "none"),
]


class _Payload:
    """Unpickling this would create `path`: the code a tampered checkpoint could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _train_gpt(*flags: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "train_gpt.py"), *TINY, "--out", str(out), *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow
def test_resuming_from_a_checkpoint_carrying_code_exits_2_with_one_line(tmp_path):
    first = _train_gpt("--iterations", "2", out=tmp_path)
    assert first.returncode == 0, first.stderr
    checkpoints = tmp_path / "checkpoints"
    manifest_path = checkpoints / "manifest-00000002.json"
    manifest = json.loads(manifest_path.read_text())
    stage_file = checkpoints / manifest["files"]["1"]["path"]
    planted = tmp_path / "planted-by-the-checkpoint"
    torch.save({"w": torch.zeros(1), "x": _Payload(planted)}, stage_file)
    manifest["files"]["1"]["sha256"] = hashlib.sha256(stage_file.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))

    resumed = _train_gpt("--iterations", "4", "--resume", out=tmp_path)
    assert resumed.returncode == 2, resumed.stderr
    assert "Traceback" not in resumed.stderr
    errors = [line for line in resumed.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        (
            f"train_gpt.py: error: stage 1 failed during checkpoint load: checkpoint file {stage_file} holds objects "
            "other than tensors and plain data (io.open), so it was refused unread; load only checkpoints this "
            "project wrote"
        )
    ], resumed.stderr
    assert not planted.exists()


def test_placement_that_times_out_arrives_as_itself_not_as_a_dead_driver(ray_session):
    """An error of ours in the driver actor's start reaches the caller with its kind and its message."""
    from actors.backend import RayBackend
    from actors.placement import PlacementError
    from rrfp_ray.errors import ExitCode
    from rrfp_ray.runtime.synthetic import SyntheticWorkload
    from rrfp_ray.sim.variability import generate
    from rrfp_ray.train.config import PipelineConfig

    ray = ray_session
    blocker = ray.util.placement_group([{"CPU": 1}] * int(ray.available_resources()["CPU"]))  # every free CPU
    ray.get(blocker.ready(), timeout=60)
    config = PipelineConfig(stages=2, microbatches=4, timeout_s=30)
    trace = generate(scenario="none", stages=2, microbatches=4, chunks=1, seed=0, t_f=1.0)
    backend = RayBackend(placement_timeout_s=1)
    try:
        with pytest.raises(PlacementError, match=r"^placement timed out after 1 s waiting for 2 x \{CPU: 1\}") as error:
            backend.start(pipeline=config, workload=SyntheticWorkload(trace=trace, payload_elems=16))
        assert error.value.exit_code is ExitCode.RUN_FAILED
        assert "Traceback" not in str(error.value) and "\n" not in str(error.value)
    finally:
        backend.close()
        ray.util.remove_placement_group(blocker)
