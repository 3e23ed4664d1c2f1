"""On Ray: a stage killed at a random point of a GPT run is rebuilt from the last
checkpoint and the run ends with the parameters of an uninterrupted run (in this process: the
same computation, no actors to start); a kill during a checkpoint write leaves the previous
checkpoint loadable; no actor is left behind."""

from __future__ import annotations

import random
import re
import threading
from pathlib import Path

import pytest
import ray
import torch

from actors.backend import RayBackend
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer
from rrfp_ray.train.backend import LocalBackend
from rrfp_ray.train.checkpoint import latest, load_stage

ITERATIONS = 6


def _run(directory: Path, *, max_restarts: int) -> RunConfig:
    return RunConfig(
        model={"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16},
        pipeline={"stages": 3, "microbatches": 4, "policy": "bf", "timeout_s": 30},
        variability={"scenario": "lognormal", "t_f": 20.0},  # iterations of ~0.4 s: room to kill inside one
        train={
            "iterations": ITERATIONS,
            "micro_batch_size": 2,
            "seq_len": 16,
            "val_every": 0,
            "checkpoint_dir": str(directory),
            "checkpoint_every": 2,
            "max_restarts": max_restarts,
        },
    )


def _final_states(trainer) -> list[dict]:
    trainer.save()
    manifest = latest(directory=Path(trainer.checkpoints.directory), fingerprint=trainer.fingerprint)
    assert manifest.iteration == ITERATIONS
    return [
        load_stage(directory=Path(trainer.checkpoints.directory), file=f) for _, f in sorted(manifest.files.items())
    ]


def _live_actors() -> int:
    return sum(1 for a in ray._private.state.actors().values() if a["State"] != "DEAD")


def test_a_killed_stage_is_rebuilt_and_the_run_matches_an_uninterrupted_one(ray_session, tmp_path, caplog):
    caplog.set_level("INFO", logger="rrfp_ray.train.api")
    before = _live_actors()
    with gpt_trainer(_run(tmp_path / "clean", max_restarts=0), backend=LocalBackend()) as clean:
        clean.fit(ITERATIONS)
        expected = _final_states(clean)
    rng = random.Random(1)
    with gpt_trainer(_run(tmp_path / "killed", max_restarts=2), backend=RayBackend()) as trainer:
        stages = ray.get(trainer.backend.driver.stage_actors.remote())
        victim, at = rng.randrange(len(stages)), rng.randrange(1, ITERATIONS)
        _, pid = ray.get(stages[victim].process.remote())
        trainer.fit(at)
        threading.Timer(rng.uniform(0.02, 0.25), ray.kill, args=(stages[victim],)).start()
        while trainer.iteration < ITERATIONS:
            trainer.step()
        assert trainer.restarts == 1, f"stage {victim} was killed but no restart happened"
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restart ")]
        said = re.fullmatch(
            rf"restart 1 of 2: stage {victim} \(pid {pid}\) died in iteration (\d+); restoring "
            rf"(checkpoint {tmp_path}/killed/manifest-\d{{8}}\.json \(iteration \d+\)|no checkpoint yet: .*)",
            line,
        )
        assert said and int(said.group(1)) >= at, line
        got = _final_states(trainer)
    for want_stage, got_stage in zip(expected, got):
        assert want_stage["weights"].keys() == got_stage["weights"].keys()
        for name, want in want_stage["weights"].items():
            torch.testing.assert_close(got_stage["weights"][name], want, msg=f"parameter {name}")
    assert _live_actors() == before


# a kill mid-write and a rebuild on Ray (in-process: a crash between two stage files, tests/test_faults.py):
# `make test-slow`
@pytest.mark.slow
def test_a_kill_during_a_checkpoint_write_keeps_the_previous_checkpoint(ray_session, tmp_path):
    before = _live_actors()
    with gpt_trainer(_run(tmp_path, max_restarts=0), backend=RayBackend()) as trainer:
        trainer.fit(2)  # commits the checkpoint of iteration 2
        stages = ray.get(trainer.backend.driver.stage_actors.remote())
        saving = trainer.backend.driver.save.remote(directory=str(tmp_path), iteration=3)
        ray.kill(stages[1])
        with pytest.raises(ray.exceptions.RayError):
            ray.get(saving)
        manifest = latest(directory=tmp_path, fingerprint=trainer.fingerprint)
        assert manifest.iteration == 2
        for file in manifest.files.values():
            load_stage(directory=tmp_path, file=file)
    assert _live_actors() == before


@pytest.mark.slow  # a kill and a rebuild of 6 actors (the in-process twin: tests/test_dp.py): `make test-slow`
def test_a_killed_actor_in_replica_1_rebuilds_the_whole_dp_zero_group(ray_session, tmp_path):
    def run(directory: Path, *, max_restarts: int) -> RunConfig:
        config = _run(directory, max_restarts=max_restarts)
        pipeline = config.pipeline.replaced(stages=2, dp=2, zero=1)
        return config.model_copy(update={"pipeline": pipeline})

    with gpt_trainer(run(tmp_path / "clean", max_restarts=0), backend=LocalBackend()) as clean:
        clean.fit(ITERATIONS)
        expected = _final_states(clean)
    rng = random.Random(2)
    with gpt_trainer(run(tmp_path / "killed", max_restarts=2), backend=RayBackend()) as trainer:
        stages = ray.get(trainer.backend.driver.stage_actors.remote())
        victim, at = 2 + rng.randrange(2), rng.randrange(1, ITERATIONS)  # actors 2, 3: replica 1's stages
        trainer.fit(at)
        threading.Timer(rng.uniform(0.02, 0.25), ray.kill, args=(stages[victim],)).start()
        while trainer.iteration < ITERATIONS:
            trainer.step()
        assert trainer.restarts == 1, f"actor {victim} (replica 1) was killed but no restart happened"
        got = _final_states(trainer)
    assert len(got) == len(expected) == 4  # ZeRO-1: every replica's stage writes its shard
    for want_stage, got_stage in zip(expected, got):
        for name, want in want_stage["weights"].items():  # replica 0's files alone hold weights
            torch.testing.assert_close(got_stage["weights"][name], want, msg=f"parameter {name}")
        assert want_stage["optimizer"].keys() == got_stage["optimizer"].keys()
        for name, want in want_stage["optimizer"].items():  # this replica's shard of the moments
            for field, tensor in want.items():
                torch.testing.assert_close(got_stage["optimizer"][name][field], tensor, msg=f"state {name} {field}")
