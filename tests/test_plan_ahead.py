"""Planning ahead (`rrfp_ray.plan.ahead`): the Trainer plans iteration k+1 while k runs, from k+1's features and the
telemetry of iterations <= k-1, whatever the threads' timing; a late plan runs the last one; a resumed or restarted run
plans as the run it continues; with data parallelism every replica runs one order planned over all replicas' data."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace

import pytest
from torch import nn

from examples.mlp import Regression, mlp
from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.plan.ahead import Lookahead, seen
from rrfp_ray.plan.planner import Planner, PlannerConfig, default_hints
from rrfp_ray.policy.caps import Cap
from rrfp_ray.train.checkpoint import Checkpointing
from rrfp_ray.train.faults import Fault, FaultPlan, FaultyWorkload, Moment

M = 4


@dataclass(frozen=True)
class Featured(Regression):
    """Regression data whose microbatches show a feature that varies over microbatches and iterations."""

    def features(self, *, iteration: int) -> list[float]:
        return [float(1 + (5 * iteration + 3 * m) % 7) for m in range(self.microbatches)]


@dataclass(frozen=True)
class Slow(Featured):
    """Featured data that takes `delay_s` to show its features (as one that reads them from files might)."""

    delay_s: float = 1.0

    def features(self, *, iteration: int) -> list[float]:
        time.sleep(self.delay_s)
        return super().features(iteration=iteration)


class Recording(Featured):
    """Featured data that records each (iteration, index) the stages read."""

    reads: list[tuple[int, int]]

    def microbatch(self, *, iteration: int, index: int):
        self.reads.append((iteration, index))
        return super().microbatch(iteration=iteration, index=index)


def _trainer(
    *, policy: str = "planned", dp: int = 1, data: Regression | None = None, timeout_s: float = 30, **kwargs
) -> Trainer:
    pipeline = PipelineConfig(stages=2, microbatches=M, policy=policy, dp=dp, timeout_s=timeout_s)
    return Trainer(
        model=mlp,
        loss_fn=nn.functional.mse_loss,
        data=Featured(microbatches=dp * M) if data is None else data,
        pipeline=pipeline,
        optimizer=Optim(lr=1e-2, warmup=0, total=10),
        **kwargs,
    )


def _shape() -> dict[str, int]:
    return {"stages": 2, "chunks": 1, "microbatches": M}


def test_each_plan_sees_the_telemetry_of_the_iterations_two_before_it():
    with _trainer() as trainer:
        reports = trainer.fit(6)
        config = trainer.planner.config
        waits = trainer.plan_wait_s
    assert len(waits) == 6 and all(w >= 0 for w in waits)
    # replayed in one thread: observe(k-2), then plan(k), in order; the plans the Trainer ran are these
    replay = Planner(config=config, **_shape())
    source = Featured(microbatches=M)
    plans = []
    for k, report in enumerate(reports):
        if k >= 2:
            replay.observe(report=reports[k - 2], plan=plans[k - 2], features=source.features(iteration=k - 2))
        plans.append(replay.plan(iteration=k, features=source.features(iteration=k)))
        assert (report.order, report.policy) == (list(plans[k].order), plans[k].hint)
    assert any(report.order != list(range(M)) for report in reports)  # the features moved the orders


def test_a_resumed_run_plans_as_the_run_it_resumes(tmp_path):
    directory = tmp_path / "checkpoints"
    with _trainer(checkpoints=Checkpointing(directory=str(directory), every=2)) as trainer:
        orders = [report.order for report in trainer.fit(4)]
    (directory / "manifest-00000004.json").unlink()  # as if the run had crashed before its checkpoint of iteration 4
    with _trainer(checkpoints=Checkpointing(directory=str(directory), resume=True)) as resumed:
        assert resumed.iteration == 2
        assert resumed.planner.planned == 2  # the checkpoint holds the plan made ahead for the iteration it resumes at
        again = [report.order for report in resumed.fit(2)]
    # iteration 2 runs the plan made ahead for it; iteration 3's plan sees the same telemetry (iterations <= 1)
    assert again == orders[2:]
    assert len(set(map(tuple, orders))) > 1


def test_a_restart_drops_the_plan_in_flight_and_replays_the_checkpoints_plans(tmp_path):
    checkpoints = Checkpointing(directory=str(tmp_path / "checkpoints"), every=2, max_restarts=1)
    with _trainer(checkpoints=checkpoints, timeout_s=2.0) as trainer:
        plan = FaultPlan(
            directory=str(tmp_path / "faults"), faults=(Fault(shard=1, iteration=3, moment=Moment.ACTION),)
        )
        trainer.backend.set_workload(workload=FaultyWorkload(inner=trainer.workload, plan=plan))
        reports = trainer.fit(4)  # the fourth step fails in iteration 3, restarts from iteration 2 and reruns it
        assert trainer.restarts == 1
        assert [r.iteration for r in reports] == [0, 1, 2, 2]
        assert reports[3].order == reports[2].order  # the restored planner's plan for iteration 2, not one in flight
        assert math.isnan(trainer.planning_s[-1])  # restored, not planned again
        assert trainer.fit(1)[0].iteration == 3


def test_a_plan_not_ready_in_time_runs_the_last_plan_and_warns_once(caplog):
    with _trainer(data=Slow(microbatches=M)) as trainer:  # each plan outlasts an iteration many times over
        config = PlannerConfig(hints=default_hints(chunks=1), cap=trainer.pipeline.cap, wait_s=1e-3)
        trainer.planner = Planner(config=config, **_shape())
        with caplog.at_level(logging.WARNING, logger="rrfp_ray.plan.ahead"):
            reports = trainer.fit(3)
    assert [r.order for r in reports[1:]] == [reports[0].order] * 2  # the first plan, made before iteration 0
    assert not math.isnan(trainer.planning_s[0]) and all(math.isnan(s) for s in trainer.planning_s[1:])
    assert max(trainer.plan_wait_s[1:]) < 0.5  # bounded: never the search's own time
    warnings = [r for r in caplog.records if "was not ready within" in r.getMessage()]
    assert len(warnings) == 1 and "running the last plan" in warnings[0].getMessage()


def test_the_planner_sees_each_slots_largest_feature_over_the_replicas():
    shown = seen([1.0, 5.0, 2.0, 4.0, 3.0, 0.0], replicas=2, microbatches=3)
    assert (shown.planned, shown.observed) == ([4.0, 5.0, 2.0], [1.0, 5.0, 2.0])
    with pytest.raises(ValueError, match="dp x microbatches = 2 x 4"):
        seen([1.0] * 4, replicas=2, microbatches=4)


def test_two_replicas_planned_train_as_fixed_and_each_reads_its_share_in_the_planned_order():
    """One order for both replicas: replica r's slot s reads its microbatch r x M + order[s]."""
    with _trainer(policy=default_hints(chunks=1)[0], dp=2) as fixed:
        expected = [report.loss for report in fixed.fit(3)]
    with _trainer(dp=2, data=Regression(microbatches=2 * M)) as plain:  # no features, no telemetry yet: identity
        identity = plain.fit(2)
    assert [r.order for r in identity] == [list(range(M))] * 2
    assert [r.loss for r in identity] == pytest.approx(expected[:2], rel=1e-6)
    data = Recording(microbatches=2 * M)
    object.__setattr__(data, "reads", [])
    with _trainer(dp=2, data=data) as trainer:
        data.reads.clear()  # the dry run's
        reports = trainer.fit(3)
    assert [r.loss for r in reports] == pytest.approx(expected, rel=1e-4)  # any order: the same sums
    assert any(r.order != list(range(M)) for r in reports)
    for report in reports:
        reads = [index for iteration, index in data.reads if iteration == report.iteration]
        assert sorted(reads) == sorted(list(range(2 * M)) * 2)  # inputs on stage 0, labels on the last
        for replica in range(2):
            own = [index - replica * M for index in reads if replica * M <= index < (replica + 1) * M]
            assert own[0] == report.order[0]  # slot 0 first: stage 0's first forward
            assert list(dict.fromkeys(own)) == report.order  # stage 0 forwards the slots in order


def test_the_gpt_jobs_iteration_line_shows_the_wait_for_the_plan(tmp_path):
    from rrfp_ray.recipes.config import RunConfig
    from rrfp_ray.recipes.gpt_run import PolicyRun
    from rrfp_ray.recipes.gpt_workload import gpt_trainer

    run = RunConfig(
        model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16, "tie_embeddings": False},
        pipeline={"stages": 2, "microbatches": M, "policy": "planned", "timeout_s": 30},
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 2, "varlen": True},
    )
    with gpt_trainer(run) as trainer:
        lines = list(PolicyRun(trainer=trainer, run=run, policy="planned", telemetry=tmp_path / "t.jsonl").iterations())
        waits = trainer.plan_wait_s
    assert len(lines) == 2
    for line, wait in zip(lines, waits, strict=True):
        assert f"plan wait {wait * 1e3:.2f} ms" in line


def test_the_arbiters_gate_by_the_bytes_of_the_iteration_that_runs():
    """A restored plan is gated by the bytes of the data it runs, as the uninterrupted run's was; the last plan
    rerun on a later iteration (its own was late) by counted microbatches, never by another iteration's bytes."""
    source = Featured(microbatches=M)
    config = PlannerConfig(hints=("bfw",), cap=Cap.parse("1x"), wait_s=1e-3)
    uninterrupted = Planner(config=config, **_shape())
    shows = lambda k: seen(source.features(iteration=k), replicas=1, microbatches=M)  # noqa: E731
    first = Lookahead(planner=uninterrupted, shows=shows, timeout_s=30).take(iteration=0)
    assert first.data_bytes is not None  # bytes proportional to the features before any telemetry
    restored = Lookahead(planner=Planner.from_dict(uninterrupted.to_dict()), shows=shows, timeout_s=30)
    again = restored.take(iteration=0)
    assert (again.plan, again.seen, again.data_bytes) == (first.plan, first.seen, first.data_bytes)

    gate = threading.Event()
    slow = Lookahead(
        planner=Planner(config=config, **_shape()), shows=lambda k: gate.wait(30) and shows(k), timeout_s=30
    )
    gate.set()
    ran = slow.take(iteration=0)
    gate.clear()
    slow.ask(iteration=1)
    late = slow.take(iteration=1)  # the plan for 1 waits for its data: the last plan runs
    gate.set()
    assert late.plan == ran.plan and ran.data_bytes is not None and late.data_bytes is None
    slow.close()


def test_the_plan_that_ran_and_the_one_made_ahead_are_shown_without_waiting():
    """`ran` is the plan `take` gave last; `ahead(iteration=k)` the plan asked for k once it is made, never a plan
    still being made or one asked for another iteration."""
    source = Featured(microbatches=M)
    gate = threading.Event()
    shows = lambda k: gate.wait(30) and seen(source.features(iteration=k), replicas=1, microbatches=M)  # noqa: E731
    planner = Planner(config=PlannerConfig(hints=("bfw",), cap=Cap.parse("1x")), **_shape())
    lookahead = Lookahead(planner=planner, shows=shows, timeout_s=30)
    assert lookahead.ran is None and lookahead.ahead(iteration=0) is None
    gate.set()
    taken = lookahead.take(iteration=0)
    assert lookahead.ran is taken and taken.iteration == 0
    gate.clear()
    lookahead.ask(iteration=1)
    assert lookahead.ahead(iteration=1) is None  # still waiting for its data
    gate.set()
    assert lookahead.settle(timeout_s=30)
    made = lookahead.ahead(iteration=1)
    assert made is not None and made.iteration == 1 and made.data_bytes is not None
    assert lookahead.ahead(iteration=2) is None and lookahead.ran is taken
    assert lookahead.take(iteration=1) == replace(made, wait_s=lookahead.ran.wait_s)
    lookahead.close()
