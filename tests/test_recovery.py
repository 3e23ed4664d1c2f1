"""A lost stage: the Trainer rebuilds the pipeline from the last checkpoint and ends where
an uninterrupted run ends."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from rrfp_ray import InMemoryData, PipelineConfig, Trainer
from rrfp_ray.runtime.worker import PipelineError
from rrfp_ray.train.checkpoint import Checkpointing, latest

ITERATIONS = 6


class _CrashOnce:
    """Wraps a stage's executor; raises in its `at`-th action, as a crashed stage would."""

    def __init__(self, inner, *, at: int) -> None:
        self.inner, self.left = inner, at

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, **kwargs):
        self.left -= 1
        if self.left == 0:
            raise RuntimeError("injected crash")
        return self.inner.run(**kwargs)


def _trainer(tmp_path, *, max_restarts: int, policy: str = "bf") -> Trainer:
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(8)]
    return Trainer(
        model=lambda: [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)],
        loss_fn=nn.functional.mse_loss,
        data=InMemoryData(batches=batches, microbatches=4),
        pipeline=PipelineConfig(stages=3, microbatches=4, policy=policy, timeout_s=2.0),
        checkpoints=Checkpointing(directory=str(tmp_path), every=2, max_restarts=max_restarts),
    )


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for e in trainer.backend.executors for p in e.runner.parameters()]


@pytest.mark.parametrize("crash_at", [3, 17, 40])
def test_a_crashed_stage_is_rebuilt_and_the_run_ends_where_an_uninterrupted_one_does(tmp_path, crash_at, caplog):
    caplog.set_level(logging.INFO, logger="rrfp_ray")
    with _trainer(tmp_path / "clean", max_restarts=0) as clean:
        clean_losses = [r.loss for r in clean.fit(ITERATIONS)]
        expected = _weights(clean)
    with _trainer(tmp_path / "crash", max_restarts=2) as trainer:
        executors = trainer.backend.executors
        executors[1] = _CrashOnce(executors[1], at=crash_at)
        trainer.backend.executors = executors
        losses = {}
        while trainer.iteration < ITERATIONS:
            iteration = trainer.iteration
            losses[iteration] = trainer.step().loss
        assert trainer.restarts == 1
        logged = [r.getMessage() for r in caplog.records]
        assert any("restart 1 of 2" in m for m in logged) and any("restarting" in m for m in logged)
        assert any("checkpoint of iteration" in m for m in logged)
        for got, want in zip(_weights(trainer), expected):
            torch.testing.assert_close(got, want)
    assert [losses[i] for i in range(ITERATIONS)] == pytest.approx(clean_losses)


def test_restarts_are_bounded(tmp_path):
    with _trainer(tmp_path, max_restarts=0) as trainer:
        executors = trainer.backend.executors
        executors[2] = _CrashOnce(executors[2], at=5)
        trainer.backend.executors = executors
        with pytest.raises(PipelineError, match="after 0 restart"):
            trainer.step()


def test_resume_continues_from_the_newest_checkpoint(tmp_path):
    with _trainer(tmp_path, max_restarts=0) as first:
        first.fit(4)
        expected_next = first.step().loss
    assert latest(directory=tmp_path, fingerprint=first.fingerprint).iteration == 4
    resumed = Trainer(
        model=lambda: [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)],
        loss_fn=nn.functional.mse_loss,
        data=first.workload.data,
        pipeline=first.pipeline,
        checkpoints=Checkpointing(directory=str(tmp_path), every=0, resume=True),
    )
    with resumed:
        assert resumed.iteration == 4
        assert resumed.step().loss == pytest.approx(expected_next)


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="resume: no manifest"):
        Trainer(
            model=[nn.Linear(8, 2), nn.Linear(2, 2)],
            loss_fn=nn.functional.mse_loss,
            data=InMemoryData(batches=[(torch.randn(4, 8), torch.randn(4, 2))], microbatches=2),
            pipeline=PipelineConfig(stages=2, microbatches=2),
            checkpoints=Checkpointing(directory=str(tmp_path), resume=True),
        )


def test_resume_with_another_model_shape_is_an_error(tmp_path):
    with _trainer(tmp_path, max_restarts=0) as first:
        first.fit(2)
    with pytest.raises(ValueError, match=r"another model: parameter 0.weight is \[16, 8\] there, \[4, 8\] in this"):
        Trainer(
            model=[nn.Linear(8, 4), nn.Linear(4, 2), nn.Linear(2, 2)],
            loss_fn=nn.functional.mse_loss,
            data=first.workload.data,
            pipeline=first.pipeline,
            checkpoints=Checkpointing(directory=str(tmp_path), resume=True),
        )


def test_a_restart_says_so_in_the_log_and_in_the_telemetry(tmp_path, caplog):
    caplog.set_level("INFO", logger="rrfp_ray.train.api")
    with _trainer(tmp_path, max_restarts=2) as trainer:
        executors = trainer.backend.executors
        executors[1] = _CrashOnce(
            executors[1], at=17
        )  # stage 1's first op of iteration 2: the in-process wait names it
        trainer.backend.executors = executors
        reports = [trainer.step() for _ in range(4)]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restart ")]
    assert lines == [
        "restart 1 of 2: stage 1 failed in iteration 2; "
        f"restoring checkpoint {tmp_path}/manifest-00000002.json (iteration 2)"
    ]
    assert [(r.iteration, r.restart) for r in reports] == [(0, 0), (1, 0), (2, 1), (3, 0)]
    assert reports[2].to_json()["restart"] == 1
