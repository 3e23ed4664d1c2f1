"""Real training through the in-process pipeline: gradients equal the unsplit model's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gradients import GradCapture, gpt_reference

from rrfp_ray.policy.caps import Cap
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_workload
from rrfp_ray.train.backend import LocalBackend
from rrfp_ray.train.partition import partition

TINY = {
    "n_layer": 4,
    "n_embd": 32,
    "n_head": 4,
    "block_size": 16,
    "tie_embeddings": False,
}  # driven without a Trainer: no tie groups


def _run(*, stages: int, chunks: int, microbatches: int = 4) -> RunConfig:
    return RunConfig(
        model=TINY,
        pipeline={"stages": stages, "chunks": chunks, "microbatches": microbatches, "timeout_s": 30},
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 3},
    )


def _pipeline_iterations(run: RunConfig, *, policy_name: str, iterations: int):
    policy = run.pipeline.resolved_policy(policy_name)
    layout = replace(run.pipeline.layout, split=policy.split)
    workload = gpt_workload(run)
    executors = [GradCapture(workload.executor(stage=s, layout=layout)) for s in range(layout.stages)]
    with LocalBackend.over(layout=layout, timeout_s=30) as pipeline:
        reports = [
            pipeline.run_iteration(iteration=i, policy=policy, cap=Cap.parse("2x"), executors=executors)
            for i in range(iterations)
        ]
    return reports, executors


@pytest.mark.parametrize(
    ("policy_name", "stages", "chunks"),
    [("1f1b", 2, 1), ("bf", 2, 1), ("bfw", 2, 1), ("zb-h1", 3, 1), ("interleaved", 2, 2), ("bf", 2, 2), ("bfw", 3, 2)],
)
def test_pipeline_gradients_equal_the_unsplit_model(policy_name, stages, chunks):
    run = _run(stages=stages, chunks=chunks)
    reports, executors = _pipeline_iterations(run, policy_name=policy_name, iterations=1)
    loss, layers = gpt_reference(run)
    parts = partition(n_layers=len(layers), parts=stages * chunks)
    for stage, executor in enumerate(executors):
        expected = [p.grad for c in range(chunks) for i in parts[c * stages + stage] for p in layers[i].parameters()]
        assert len(expected) == len(executor.grads)
        for got, want in zip(executor.grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert reports[0].loss == pytest.approx(loss, rel=1e-5)


def test_losses_agree_between_fixed_and_readiness_policies():
    run = _run(stages=2, chunks=1)
    fixed, _ = _pipeline_iterations(run, policy_name="1f1b", iterations=3)
    ready, _ = _pipeline_iterations(run, policy_name="bf", iterations=3)
    assert [r.loss for r in ready] == pytest.approx([r.loss for r in fixed], rel=1e-5)
