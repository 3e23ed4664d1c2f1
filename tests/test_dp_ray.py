"""Data parallelism on Ray (DP=2 x PP=2, gloo): the replicas' summed gradients equal the
unsplit model's on the global batch, and the run trains as one pipeline over all D x M
microbatches does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from actors.backend import RayBackend
from examples.mlp import Regression, mlp
from rrfp_ray import FactoryOptim, Optim, PipelineConfig, Trainer
from rrfp_ray.train.checkpoint import Checkpointing, latest, load_stage

M = 2
LR = 0.1


def _trainer(*, dp: int, microbatches: int, **kwargs) -> Trainer:
    return Trainer(
        model=mlp,
        loss_fn=nn.functional.mse_loss,
        data=Regression(microbatches=dp * microbatches),
        pipeline=PipelineConfig(stages=2, microbatches=microbatches, policy="bfw", dp=dp, timeout_s=60),
        optimizer=FactoryOptim(factory=lambda params: torch.optim.SGD(params, lr=LR)),
        **kwargs,
    )


def test_dp_2_x_pp_2_on_ray_sums_gradients_and_trains_as_one_pipeline_of_2m(ray_session, tmp_path: Path):
    checkpoints = Checkpointing(directory=str(tmp_path), every=0)
    with _trainer(dp=2, microbatches=M, backend=RayBackend(), checkpoints=checkpoints) as trainer:
        first = trainer.step()
        trainer.save()
        manifest = latest(directory=tmp_path, fingerprint=trainer.fingerprint)
        losses = [first.loss, *(r.loss for r in trainer.fit(3))]
        model = trainer.workload.layers.model()
    assert sorted(manifest.files) == [0, 1]  # replica 0 writes one file per stage
    stepped = {
        k: t for s in range(2) for k, t in load_stage(directory=tmp_path, file=manifest.files[s])["weights"].items()
    }
    data = Regression(microbatches=2 * M)
    batches = [data.microbatch(iteration=0, index=m) for m in range(2 * M)]
    loss = sum(nn.functional.mse_loss(model(x), y) for x, y in batches) / len(batches)
    loss.backward()
    assert first.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    for i, layer in enumerate(model):
        for name, weight in layer.named_parameters():
            stepped_weight = stepped[f"{i}.{name}"]
            torch.testing.assert_close((weight.detach() - stepped_weight) / LR, weight.grad, rtol=1e-3, atol=1e-5)
    assert sorted((s.replica, s.stage) for s in first.stages) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s.reduce_bytes > 0 and s.reduce_ms > 0 for s in first.stages)
    with _trainer(dp=1, microbatches=2 * M) as whole:
        whole_losses = [r.loss for r in whole.fit(4)]
    assert losses == pytest.approx(whole_losses, rel=1e-5)
    assert losses[-1] < losses[0]


def test_zero_1_on_ray_trains_as_zero_0_and_checkpoints_every_replicas_shard(ray_session, tmp_path: Path):
    def trainer(*, zero: int, **kwargs) -> Trainer:
        return Trainer(
            model=mlp,
            loss_fn=nn.functional.mse_loss,
            data=Regression(microbatches=2 * M),
            pipeline=PipelineConfig(stages=2, microbatches=M, policy="bfw", dp=2, zero=zero, timeout_s=60),
            optimizer=Optim(lr=1e-2, warmup=0, total=10),
            **kwargs,
        )

    with trainer(zero=1, backend=RayBackend(), checkpoints=Checkpointing(directory=str(tmp_path), every=2)) as sharded:
        reports = sharded.fit(3)
        manifest = latest(directory=tmp_path, fingerprint=sharded.fingerprint)
    with trainer(zero=0) as plain:
        plain_reports = plain.fit(3)
        want = [[p.detach().clone() for p in e.runner.parameters()] for e in plain.backend.executors]
    assert [r.loss for r in reports] == pytest.approx([r.loss for r in plain_reports], rel=1e-5)
    for stage in range(2):
        total = next(s.optim_bytes for s in plain_reports[-1].stages if (s.replica, s.stage) == (0, stage))
        shards = [s.optim_bytes for s in reports[-1].stages if s.stage == stage]
        assert sum(shards) == total and max(shards) < total
    assert manifest.iteration == 2 and sorted(manifest.files) == [0, 1, 2, 3]  # every replica's shard
    with trainer(zero=1, checkpoints=Checkpointing(directory=str(tmp_path), resume=True)) as resumed:  # in-process
        resumed.fit(1)
        got = [[p.detach().clone() for p in e.runner.parameters()] for e in resumed.backend.executors]
    for got_stage, want_stage in zip(got, want, strict=True):
        for a, b in zip(got_stage, want_stage, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
