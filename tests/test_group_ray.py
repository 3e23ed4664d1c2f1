"""One orchestration: the same `StageGroup` code drives the in-process threads and the Ray
actors, so iterations, evaluation, save, load and restart give the same numbers on both."""

from __future__ import annotations

import functools

import pytest
import toy_vlm
from ray import cloudpickle
from toy_vlm import SPLIT_POINTS, Captions, ToyVLM, text_loss

from rrfp_ray import LocalBackend, Optim, PipelineConfig, Trainer
from rrfp_ray.train.checkpoint import Checkpointing, latest

cloudpickle.register_pickle_by_value(toy_vlm)  # the workers cannot import the tests' own modules


def _ray_backend():
    from actors.backend import RayBackend

    return RayBackend()


def _exercise(backend, directory) -> dict:
    """Two steps, a checkpoint, a third step and validation; then a restart, a load of that
    checkpoint and the third step again, validation again."""
    pipeline = PipelineConfig(stages=2, chunks=2, microbatches=4, policy="bf", timeout_s=60)
    with Trainer(
        model=ToyVLM,
        split_points=SPLIT_POINTS,
        loss_fn=text_loss,
        data=Captions(microbatches=4),
        val_data=Captions(microbatches=2, stream=1),
        optimizer=Optim(lr=1e-2, warmup=0, total=10),
        pipeline=pipeline,
        checkpoints=Checkpointing(directory=str(directory), every=0),
        backend=backend,
    ) as trainer:
        losses = [trainer.step().loss for _ in range(2)]
        trainer.save()
        third = trainer.step()
        val = trainer.evaluate()
        trainer.backend.restart()
        manifest = latest(directory=directory, fingerprint=trainer.fingerprint)
        trainer.backend.load(directory=directory, manifest=manifest)
        trainer.iteration = manifest.iteration
        again = trainer.step()
        return {
            "losses": losses,
            "third": third.loss,
            "again": again.loss,
            "val": val,
            "val_after": trainer.evaluate(),
            "stages": sorted(s.stage for s in third.stages),
            "step_counted": all(s.wall_ms >= s.step_ms > 0 for s in third.stages),
        }


@functools.cache
def _local(directory) -> dict:
    return _exercise(LocalBackend(), directory)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_one_group_drives_both_backends_alike(backend, request, tmp_path_factory):
    local = _local(tmp_path_factory.mktemp("local"))
    if backend == "ray":
        request.getfixturevalue("ray_session")
        got = _exercise(_ray_backend(), tmp_path_factory.mktemp("ray"))
    else:
        got = local
    assert got["again"] == pytest.approx(got["third"], rel=1e-6)  # restart + load replays the step
    assert got["val_after"] == pytest.approx(got["val"], rel=1e-6)
    assert got["stages"] == [0, 1] and got["step_counted"]
    for key in ("losses", "third", "val"):
        assert got[key] == pytest.approx(local[key], rel=1e-5), key
