"""The public API on the Ray backend: bad input fails before any actor exists, and the
multimodal toy (shapes changing per microbatch) trains over TCP links exactly as it does
on the local backend."""

from __future__ import annotations

import pytest
import toy_vlm
from ray import cloudpickle
from toy_vlm import SPLIT_POINTS, Captions, ToyVLM, text_loss

from actors.backend import RayBackend
from rrfp_ray import Optim, PipelineConfig, Trainer

cloudpickle.register_pickle_by_value(toy_vlm)  # the workers cannot import the tests' own modules


def _nonscalar(logits, targets):
    return logits.sum(dim=-1)


def _arguments(**overrides) -> dict:
    return {
        "model": ToyVLM,
        "split_points": SPLIT_POINTS,
        "loss_fn": text_loss,
        "data": Captions(microbatches=4),
        "val_data": Captions(microbatches=2, stream=1),
        "optimizer": Optim(lr=1e-2, warmup=0, total=10),
        "pipeline": PipelineConfig(stages=2, chunks=2, microbatches=4, policy="bf", timeout_s=60),
        **overrides,
    }


def test_ray_backend_checks_before_any_actor_and_trains_like_the_local_one(ray_session):
    actors = ray_session._private.state.actors  # the GCS actor table (no dashboard needed); ended actors stay in it
    before = len(actors())
    bad = [
        ({"loss_fn": _nonscalar}, "loss_fn _nonscalar must return a scalar tensor"),
        ({"data": Captions(microbatches=3)}, "data.microbatches = 3 differs from the pipeline's microbatches = 4"),
        ({"split_points": ["blocks.2"]}, "split_points cut the model into 2 parts"),
    ]
    for overrides, expected in bad:
        backend = RayBackend()
        with pytest.raises(ValueError, match=expected):
            Trainer(backend=backend, **_arguments(**overrides))
        assert backend.driver is None
    assert len(actors()) == before

    with Trainer(backend=RayBackend(), **_arguments()) as trainer:
        on_ray = [trainer.step().loss for _ in range(2)]
        val_on_ray = trainer.evaluate()
    with Trainer(**_arguments()) as trainer:
        local = [trainer.step().loss for _ in range(2)]
        val_local = trainer.evaluate()
    assert on_ray == pytest.approx(local, rel=1e-5)
    assert val_on_ray == pytest.approx(val_local, rel=1e-5)
    assert on_ray[1] < on_ray[0]
