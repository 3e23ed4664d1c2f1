"""`planned` beside fixed schedules on the synthetic workload (`jobs/bench_runtime.py --policies ...,planned`): a
slot sleeps the durations of the data microbatch its iteration's order puts there, from that iteration's own trace,
and the summary compares planned with the best fixed schedule of each seed (in-process; the Ray run is the
benchmark's)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest

from benchmarks.runtime_planned import summarize
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.synthetic import SleepExecutor
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.variability import generate


def _forward_ms(executor: SleepExecutor, *, slot: int) -> float:
    began = time.perf_counter()
    executor.run(
        action=Action(virtual_stage=0, kind=Kind.F, microbatch=slot, stage=0, chunk=0), iteration=0, payload=None
    )
    return (time.perf_counter() - began) * 1e3


def test_a_slot_sleeps_its_data_microbatch_of_its_iterations_trace():
    quick = generate(scenario="none", stages=2, microbatches=2, chunks=1, seed=0, t_f=1.0)
    slow = replace(quick, F=tuple(tuple(60.0 if m == 1 else f for m, f in enumerate(row)) for row in quick.F))
    layout = Layout(stages=2, chunks=1, microbatches=2)
    executor = SleepExecutor(trace=quick, layout=layout, payload_elems=1, iterations=(quick, slow))
    policy = make_policy(name="1f1b", stages=2, chunks=1, microbatches=2)

    def begin(iteration: int, order: tuple[int, ...] | None) -> None:
        executor.begin(
            args=IterationArgs(iteration=iteration, layout=layout, policy=policy, cap=Cap.parse("1x"), order=order)
        )

    begin(3, (1, 0))  # iteration 3 replays trace 3 % 2 = 1 (slow), whose data microbatch 1 is slow: slot 0 runs it
    assert _forward_ms(executor, slot=0) >= 60.0  # a sleep lasts at least its duration, whatever the load
    begin(5, None)  # trace 1 again, in the data's own order: slot 1 runs the slow microbatch
    assert _forward_ms(executor, slot=1) >= 60.0


def test_the_summary_compares_planned_with_each_seeds_best_fixed_schedule_and_sums_the_plan_waits():
    def seed(one: float, zb: float, planned: float) -> dict:
        return {
            "1f1b": {"iteration_ms": [500.0, one, one]},
            "zb-h1": {"iteration_ms": [500.0, zb, zb]},
            "planned": {
                "iteration_ms": [500.0, planned, planned],
                "plan_wait_ms": [20.0, 0.5, 1.5],
                "planning_ms": [20.0, 10.0, math.nan],
            },
        }

    summary = summarize([seed(110.0, 100.0, 80.0), seed(90.0, 100.0, 100.0)], fixed=("1f1b", "zb-h1"))
    assert summary["best_fixed_per_seed"] == ["zb-h1", "1f1b"]
    ratio = summary["planned_over_best_fixed"]
    assert ratio["per_seed"] == pytest.approx([1.25, 0.9])
    assert ratio["geomean"] == pytest.approx(math.sqrt(1.25 * 0.9))
    assert (ratio["lowest"], ratio["highest"]) == pytest.approx((0.9, 1.25))
    assert summary["plan_wait_fraction"] == pytest.approx(4.0 / 360.0)  # the first iteration of each left out
    assert summary["first_plan_wait_ms"] == [20.0, 20.0]
    assert summary["late_plans"] == 2
