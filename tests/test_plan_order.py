"""A microbatch order (`IterationArgs.order`): slot `s` trains on data microbatch `order[s]`, so a permuted
order changes only the float summation order of the loss and gradients."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from gradients import GradCapture
from torch import nn

from examples.mlp import Regression, mlp
from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.costs import Backward
from rrfp_ray.plan.planner import default_hints
from rrfp_ray.policy.caps import Cap
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_workload
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Message
from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.backend import LocalBackend
from rrfp_ray.train.checkpoint import Checkpointing

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16, "tie_embeddings": False}
RUN = RunConfig(
    model=TINY,
    pipeline={"stages": 2, "chunks": 1, "microbatches": 4, "timeout_s": 30},
    train={"micro_batch_size": 2, "seq_len": 16, "iterations": 1},
)


class RecordingSource:
    """The data source as given, recording each (iteration, index) read."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.reads: list[tuple[int, int]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def microbatch(self, *, iteration: int, index: int):
        self.reads.append((iteration, index))
        return self.inner.microbatch(iteration=iteration, index=index)


def _train(order: tuple[int, ...] | None):
    policy = RUN.pipeline.resolved_policy("bf")
    layout = replace(RUN.pipeline.layout, split=policy.split)
    workload = gpt_workload(RUN)
    source = RecordingSource(workload.data)
    workload = replace(workload, data=source)
    executors = [GradCapture(workload.executor(stage=s, layout=layout)) for s in range(layout.stages)]
    with LocalBackend.over(layout=layout, timeout_s=30) as pipeline:
        report = pipeline.run_iteration(
            iteration=0, policy=policy, cap=Cap.parse("2x"), executors=executors, order=order
        )
    return report, executors, source.reads


def test_a_permuted_order_reads_the_permuted_microbatches_and_trains_alike():
    order = (2, 0, 3, 1)
    base, base_executors, base_reads = _train(None)
    permuted, executors, reads = _train(order)
    # stage 0 reads each microbatch's inputs and the last stage its labels: each index twice, in slot order
    assert sorted(base_reads) == sorted(reads) == sorted([(0, m) for m in range(4)] * 2)
    # the first read is stage 0's first forward (slot 0): the last stage forwards slot 0 only after it
    assert (base_reads[0], reads[0]) == ((0, 0), (0, order[0]))
    assert (base.order, permuted.order) == (None, list(order))  # the telemetry names each slot's data microbatch
    assert IterationReport.from_json(permuted.to_json()).order == list(order)
    assert permuted.loss == pytest.approx(base.loss, rel=1e-5)
    for got_executor, want_executor in zip(executors, base_executors):
        assert len(got_executor.grads) == len(want_executor.grads)
        for got, want in zip(got_executor.grads, want_executor.grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _fit(policy: str) -> tuple[Trainer, list[float]]:
    pipeline = PipelineConfig(stages=2, microbatches=4, policy=policy, timeout_s=30)
    trainer = Trainer(model=mlp, loss_fn=nn.functional.mse_loss, data=Regression(microbatches=4), pipeline=pipeline,
                      optimizer=Optim(lr=1e-2, warmup=0, total=10))  # fmt: skip
    with trainer:
        return trainer, [report.loss for report in trainer.fit(4)]


def test_planned_trains_like_its_first_hint_and_plans_every_iteration():
    trainer, planned = _fit("planned")
    _, fixed = _fit(default_hints(chunks=1)[0])
    assert all(math.isfinite(loss) for loss in planned)
    assert planned == pytest.approx(fixed, rel=1e-4)  # any order and hint: the same microbatches, the same steps
    assert len(trainer.planning_s) == 4
    model = trainer.planner_state()["model"]
    assert any(model[family.value]["observations"] for family in Backward)  # it observed the telemetry


def test_the_planner_state_travels_with_the_checkpoint(tmp_path):
    pipeline = PipelineConfig(stages=2, microbatches=4, policy="planned", timeout_s=30)
    args = {"model": mlp, "loss_fn": nn.functional.mse_loss, "data": Regression(microbatches=4), "pipeline": pipeline}
    with Trainer(**args, checkpoints=Checkpointing(directory=str(tmp_path), every=2)) as trainer:
        trainer.fit(2)
        saved = trainer.planner.to_dict()
    with Trainer(**args, checkpoints=Checkpointing(directory=str(tmp_path), resume=True)) as resumed:
        assert resumed.iteration == 2
        assert resumed.planner is not None and resumed.planner.to_dict() == saved


def _injected(*, stages: int, microbatches: int, heavy: int, ms: float, latency_ms: float = 0.0) -> Trace:
    """A trace whose only times are data microbatch `heavy`'s forward on stage 0 and its activation's latency
    into stage 1, with features that show it."""
    zeros = [[0.0] * microbatches for _ in range(stages)]
    forward = [[ms if (s, m) == (0, heavy) else 0.0 for m in range(microbatches)] for s in range(stages)]
    late = [[latency_ms if (s, m) == (0, heavy) else 0.0 for m in range(microbatches)] for s in range(stages - 1)]
    features = [5.0 if m == heavy else 1.0 for m in range(microbatches)]
    rows = {"F": forward, "B": zeros, "W": zeros, "commF": late, "commB": zeros[1:]}
    return Trace(stages=stages, microbatches=microbatches, chunks=1, features=features, **rows)


def test_injected_delays_follow_the_data_microbatch_a_slot_holds():
    order, heavy = (2, 0, 3, 1), 2
    policy = RUN.pipeline.resolved_policy("1f1b")
    layout = replace(RUN.pipeline.layout, split=policy.split)
    trace = _injected(stages=2, microbatches=4, heavy=heavy, ms=300.0, latency_ms=200.0)
    workload = replace(gpt_workload(RUN), injected=(trace,))
    executors = [workload.executor(stage=s, layout=layout) for s in range(layout.stages)]
    with LocalBackend.over(layout=layout, timeout_s=30) as pipeline:
        report = pipeline.run_iteration(
            iteration=0, policy=policy, cap=Cap.parse("2x"), executors=executors, order=order, latency=workload.latency
        )
    forwards = {e.action: e for e in report.events if "F" in e.action}  # "1F3": stage 1's forward of slot 3
    slowest = max((a for a in forwards if a[0] == "0"), key=lambda a: forwards[a].end_ms - forwards[a].start_ms)
    slot = order.index(heavy)
    assert slowest == f"0F{slot}" and forwards[slowest].end_ms - forwards[slowest].start_ms >= 300.0
    assert forwards[f"1F{slot}"].start_ms >= 300.0 + 200.0 - 50.0  # the stages' clocks start within a few ms


def test_each_iteration_s_messages_wait_its_own_injected_trace():
    traces = [_injected(stages=2, microbatches=4, heavy=m, ms=0.0, latency_ms=100.0 * (m + 1)) for m in (1, 3)]
    late = [Message(kind=Kind.F, virtual_stage=1, microbatch=m) for m in (1, 3)]  # stage 0's activations, sent on
    for workload in (replace(gpt_workload(RUN), injected=tuple(traces)), SyntheticWorkload(trace=traces[0],
                     iterations=tuple(traces))):  # fmt: skip
        waits = [[workload.latency(m, iteration=k) for m in late] for k in range(3)]
        assert waits == [[200.0, 0.0], [0.0, 400.0], [200.0, 0.0]]  # iteration 2 cycles to 0's


def test_each_iteration_sleeps_its_own_injected_trace_and_shows_the_planner_its_features():
    pipeline = PipelineConfig(stages=2, microbatches=4, policy="planned", timeout_s=30)
    traces = [_injected(stages=2, microbatches=4, heavy=m, ms=150.0 * (m == 3)) for m in (1, 3)]
    trainer = Trainer(model=mlp, loss_fn=nn.functional.mse_loss, data=Regression(microbatches=4), pipeline=pipeline,
                      injected=traces)  # fmt: skip
    with trainer:
        reports = trainer.fit(3)
        shown = [trainer.planning.shown(k).planned for k in (0, 1, 2)]
    assert shown == [[1.0, 5.0, 1.0, 1.0], [1.0, 1.0, 1.0, 5.0], [1.0, 5.0, 1.0, 1.0]]  # iteration 2 cycles to 0's
    for report in reports:  # iteration 1 alone sleeps, in the slot that holds data microbatch 3
        slot = report.order.index(3)
        [heavy] = [e for e in report.events if e.action == f"0F{slot}"]
        assert (heavy.end_ms - heavy.start_ms >= 150.0) == (report.iteration == 1)
