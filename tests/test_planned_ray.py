"""`planned` on the Ray backend: the driver plans each iteration ahead while the stage actors run the one before, and
the GPT on variable-length text, its samples packed and its microbatches ordered, trains as it does on the local
backend, in the packings and orders the reports record."""

from __future__ import annotations

import math

import pytest

from actors.backend import RayBackend
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16, "tie_embeddings": False}


def _run() -> RunConfig:
    return RunConfig(
        model=TINY,
        pipeline={
            "stages": 2,
            "microbatches": 4,
            "policy": "planned",
            "arrange": "both",
            "timeout_s": 60,
            "backend": "tcp",
        },
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 3, "varlen": True},
    )


@pytest.mark.slow
def test_planned_on_ray_trains_as_on_the_local_backend(ray_session):
    with gpt_trainer(_run(), backend=RayBackend()) as trainer:
        on_ray = trainer.fit(3)
        waits = trainer.plan_wait_s
    with gpt_trainer(_run()) as trainer:
        local = [report.loss for report in trainer.fit(3)]
    losses = [report.loss for report in on_ray]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses == pytest.approx(local, rel=1e-4)  # any packing and order: the same samples, the same steps
    assert losses[-1] < losses[0]
    for report in on_ray:
        assert sorted(report.order) == list(range(4))
        assert sorted(i for group in report.packing for i in group) == list(range(8))
    assert any(report.order != list(range(4)) for report in on_ray)  # what the varlen text shows moved the orders
    assert len(waits) == 3 and all(w >= 0 for w in waits)
