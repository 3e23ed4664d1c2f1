"""Faults in one process: a crash mid-checkpoint, a failed save, a disk error, a long pause
past the link timeout, and a stalled TP rank named with what its neighbours waited for."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from rrfp_ray import InMemoryData, PipelineConfig, Trainer
from rrfp_ray.policy.caps import Cap
from rrfp_ray.runtime.reduce import DPSpec
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.runtime.worker import PipelineError
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.backend import LocalBackend
from rrfp_ray.train.checkpoint import Checkpointing, latest, load_stage
from rrfp_ray.train.faults import Crash, Fault, FaultPlan, FaultyExecutor, FaultyWorkload, Moment

ITERATIONS = 6


def _trainer(directory: Path, *, max_restarts: int = 0, resume: bool = False, **pipeline) -> Trainer:
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(8)]
    return Trainer(
        model=lambda: [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)],
        loss_fn=nn.functional.mse_loss,
        data=InMemoryData(batches=batches, microbatches=4),
        pipeline=PipelineConfig(stages=3, microbatches=4, policy="bf", timeout_s=2.0, **pipeline),
        checkpoints=Checkpointing(directory=str(directory), every=2, max_restarts=max_restarts, resume=resume),
    )


def _with_faults(trainer: Trainer, *faults: Fault, directory: Path) -> FaultPlan:
    plan = FaultPlan(directory=str(directory), faults=faults)
    trainer.backend.set_workload(workload=FaultyWorkload(inner=trainer.workload, plan=plan))
    return plan


def _weights(trainer: Trainer) -> list[torch.Tensor]:
    models = [e.inner if isinstance(e, FaultyExecutor) else e for e in trainer.backend.executors]
    return [p.detach().clone() for e in models for p in e.runner.parameters()]


def test_a_crash_between_two_stage_files_leaves_the_previous_checkpoint_the_newest(tmp_path):
    with _trainer(tmp_path / "ckpt") as trainer:
        plan = _with_faults(trainer, Fault(shard=1, iteration=4, moment=Moment.SAVE), directory=tmp_path / "faults")
        trainer.fit(3)
        with pytest.raises(PipelineError, match=r"checkpoint of iteration 4 failed after 0 restart\(s\).*stage 1"):
            trainer.step()
        assert plan.fired() == list(plan.faults)
        fingerprint = trainer.fingerprint
    assert (tmp_path / "ckpt/iter-00000004/stage-1.pt").is_file()  # written, but no manifest names it
    assert not (tmp_path / "ckpt/manifest-00000004.json").exists()
    manifest = latest(directory=tmp_path / "ckpt", fingerprint=fingerprint)
    assert manifest.iteration == 2
    for file in manifest.files.values():
        load_stage(directory=tmp_path / "ckpt", file=file)
    with _trainer(tmp_path / "ckpt", resume=True) as resumed:
        assert resumed.iteration == 2


def test_a_failed_save_is_retried_after_a_rebuild_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    with _trainer(tmp_path / "clean") as clean:
        clean.fit(ITERATIONS)
        expected = _weights(clean)
    with _trainer(tmp_path / "faulty", max_restarts=1) as trainer:
        _with_faults(trainer, Fault(shard=2, iteration=4, moment=Moment.SAVE), directory=tmp_path / "faults")
        while trainer.iteration < ITERATIONS:
            trainer.step()
        assert trainer.restarts == 1
        assert latest(directory=tmp_path / "faulty", fingerprint=trainer.fingerprint).iteration == ITERATIONS
        for got, want in zip(_weights(trainer), expected, strict=True):
            torch.testing.assert_close(got, want)


def test_a_disk_error_in_every_save_takes_the_restarts_then_is_a_clear_error(tmp_path):
    (tmp_path / "iter-00000004").write_text("a file where the checkpoint's directory goes")
    with _trainer(tmp_path, max_restarts=1) as trainer:
        with pytest.raises(
            PipelineError, match=r"checkpoint of iteration 4 failed after 1 restart\(s\).*iter-00000004"
        ):
            trainer.fit(ITERATIONS)
        assert trainer.restarts == 1
        assert latest(directory=tmp_path, fingerprint=trainer.fingerprint).iteration == 2


def test_a_manifest_that_cannot_be_written_is_a_failed_save(tmp_path):
    (tmp_path / "manifest-00000002.json").mkdir(parents=True)
    with (
        _trainer(tmp_path) as trainer,
        pytest.raises(PipelineError, match=r"manifest of iteration 2 could not be written"),
    ):
        trainer.fit(2)


def test_a_pause_longer_than_the_link_timeout_does_not_break_the_links(tmp_path):
    with _trainer(tmp_path, link_timeout_s=0.3) as trainer:
        trainer.step()
        time.sleep(1.0)  # a user stepping by hand, a long evaluation
        trainer.step()
        assert trainer.restarts == 0


def test_a_stalled_tp_rank_of_a_dp_replica_is_named_with_the_links_and_ops_its_neighbours_wait_for(tmp_path):
    layout = Layout(stages=2, chunks=1, microbatches=2)
    trace = generate(scenario="none", stages=2, microbatches=2, chunks=1, seed=0, t_f=1.0)
    workload = SyntheticWorkload(trace=trace, grad_elems=4)  # gradients for the DP reduction
    plan = FaultPlan(
        directory=str(tmp_path),
        faults=(Fault(shard=6, iteration=0, moment=Moment.ACTION, index=1),),  # replica 1 stage 1 TP rank 0
        crash=Crash.STALL,
        stall_s=7.0,  # past the fabric's wait (its timeout + 5 s, 1 s once a neighbour failed)
    )
    pipeline = PipelineConfig(stages=2, microbatches=2, tp=2, dp=2, policy="bf", timeout_s=1.0)
    with LocalBackend.over(layout=layout, timeout_s=1.0, tp=2, dp=DPSpec(size=2)) as local:
        executors = [
            FaultyExecutor(
                inner=workload.with_tp(rank=i % 2, size=2, all_reduce=torch.clone)
                .with_dp(rank=i // 4)
                .executor(stage=i // 2 % 2, layout=layout),
                plan=plan,
                shard=i,
            )
            for i in range(8)
        ]
        with pytest.raises(PipelineError) as failed:
            local.run_iteration(
                iteration=0, policy=pipeline.resolved_policy("bf"), cap=Cap.parse("inf"), executors=executors
            )
    message = str(failed.value)
    assert "no answer within 1 s of the first failure from replica 1 stage 1 TP rank 0" in message  # the stalled one
    lines = {line.split(" failed during iteration 0: ")[0]: line for line in message.splitlines()}
    assert "(needs gradients 1->0 for microbatch" in lines["replica 1 stage 0 TP rank 0"]  # its pipeline link
    assert (
        "TP agreement of replica 1 stage 1: TP rank 1 waited 1 s for TP rank 0" in lines["replica 1 stage 1 TP rank 1"]
    )
    for rank in (0, 1):  # its DP group: the same stage and TP rank in replica 0
        assert "the DP reduction" in lines[f"replica 0 stage 1 TP rank {rank}"]
