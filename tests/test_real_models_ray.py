"""The toy models of tests/real_models.py on the Ray backend (TCP links, one actor per stage): trees of tensors
across boundaries and a tied embedding/head train exactly as on the local backend, whose
gradients the local tests check against the unsplit model."""

from __future__ import annotations

import pytest
import real_models
import torch
from ray import cloudpickle
from real_models import PaddedTokens, dict_model, tied_model, token_loss, token_sum_count, tuple_model

from actors.backend import RayBackend
from rrfp_ray import Optim, PipelineConfig, Trainer

cloudpickle.register_pickle_by_value(real_models)  # the workers cannot import the tests' own modules

CASES = [
    (tuple_model, token_loss, "bfw", 3, 1),
    (dict_model, token_loss, "1f1b", 2, 1),
    (tied_model, token_sum_count, "bf", 2, 2),
]


@pytest.mark.parametrize(
    ("model", "loss_fn", "policy", "stages", "chunks"), CASES, ids=["tuple", "dict", "tied-counted"]
)
def test_ray_trains_trees_ties_and_counted_losses_like_the_local_backend(
    ray_session, model, loss_fn, policy, stages, chunks
):
    def losses(backend):
        pipeline = PipelineConfig(stages=stages, chunks=chunks, microbatches=4, policy=policy, timeout_s=60)
        with Trainer(
            model=model,
            loss_fn=loss_fn,
            data=PaddedTokens(microbatches=4),
            pipeline=pipeline,
            optimizer=Optim(lr=3e-2, warmup=0, total=3),
            backend=backend,
        ) as trainer:
            return [trainer.step().loss for _ in range(3)]

    on_ray = losses(RayBackend())
    assert on_ray == pytest.approx(losses(None), rel=1e-5)
    assert on_ray[-1] < on_ray[0]


def test_ray_exports_the_same_weights_as_the_local_backend(ray_session):
    def export(backend):
        pipeline = PipelineConfig(stages=2, chunks=2, microbatches=4, policy="bfw", timeout_s=60)
        with Trainer(
            model=tied_model,
            loss_fn=token_loss,
            data=PaddedTokens(microbatches=4),
            pipeline=pipeline,
            optimizer=Optim(lr=3e-2, warmup=0, total=3),
            backend=backend,
        ) as trainer:
            trainer.fit(2)
            return trainer.state_dict()

    on_ray, local = export(RayBackend()), export(None)
    assert on_ray.keys() == local.keys()
    for key in local:
        torch.testing.assert_close(on_ray[key], local[key], rtol=1e-5, atol=1e-7)
