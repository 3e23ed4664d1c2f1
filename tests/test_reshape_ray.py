"""On Ray: a checkpoint written by 2 stage actors resumes onto 3, and `Trainer.reshape` moves the running
actors to a new split; both train what the uninterrupted in-process run trains (tests/test_reshape.py
is the in-process twin)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.backend import RayBackend
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer
from rrfp_ray.train.backend import LocalBackend

ITERATIONS = 4


def _run(directory: Path, *, stages: int, resume: bool = False) -> RunConfig:
    return RunConfig(
        model={"n_layer": 4, "n_embd": 32, "n_head": 4, "block_size": 16},
        pipeline={"stages": stages, "microbatches": 4, "policy": "1f1b", "timeout_s": 60},
        train={
            "iterations": ITERATIONS,
            "warmup": 1,
            "micro_batch_size": 2,
            "seq_len": 16,
            "val_every": 0,
            "checkpoint_dir": str(directory),
            "checkpoint_every": 2,
            "resume": resume,
        },
    )


@pytest.mark.slow  # two pipelines of stage actors: `make test-slow`
def test_resume_from_2_stages_onto_3_then_reshape_on_ray(ray_session, tmp_path):
    with gpt_trainer(_run(tmp_path / "clean", stages=2), backend=LocalBackend()) as clean:
        expected = [r.loss for r in clean.fit(ITERATIONS)]
    with gpt_trainer(_run(tmp_path / "ray", stages=2), backend=RayBackend()) as first:
        losses = [r.loss for r in first.fit(2)]
    with gpt_trainer(_run(tmp_path / "ray", stages=3, resume=True), backend=RayBackend()) as resumed:
        assert resumed.iteration == 2
        assert resumed.resumed.startswith("resuming iteration 2 of a P=2 T=1 D=1 v=1 M=4 split 3,3 checkpoint onto P=3")
        losses.append(resumed.step().loss)
        assert resumed.reshape(layer_split=(1, 1, 4)) > 0
        losses.append(resumed.step().loss)
    assert losses == pytest.approx(expected, rel=1e-4)
