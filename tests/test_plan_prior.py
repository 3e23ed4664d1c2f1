"""Planning before any telemetry: scored over which stages follow the feature, microbatches weighed alike, and a
fixed hint still held to its cap on the prior's bytes."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from rrfp_ray.plan.loop import Planning, run
from rrfp_ray.plan.planner import Planner, PlannerConfig, default_hints
from rrfp_ray.plan.plans import Plan
from rrfp_ray.plan.prior import adaptive, following, hypotheses, hypothesised
from rrfp_ray.plan.scoring import Guard, Samples, score
from rrfp_ray.policy.caps import Cap
from rrfp_ray.sim.variability import generate, generate_iterations

CAP = Cap.parse("1x")
SHAPE = {"stages": 4, "chunks": 1, "microbatches": 8}
FEATURES = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]


def planner(**changes) -> Planner:
    config = PlannerConfig(hints=default_hints(chunks=1), cap=CAP, simulations=32, samples=2)
    return Planner(config=replace(config, **changes), **SHAPE)


def test_the_hypotheses_are_all_stages_the_front_half_and_the_back_half():
    assert hypotheses(stages=4) == [frozenset({0, 1, 2, 3}), frozenset({0, 1}), frozenset({2, 3})]
    assert hypotheses(stages=5) == [frozenset(range(5)), frozenset({0, 1, 2}), frozenset({2, 3, 4})]
    assert hypotheses(stages=1) == [frozenset({0})]


def test_a_stage_outside_the_hypothesis_costs_its_mean_and_no_microbatch_weighs_more():
    trace = generate(scenario="varlen", stages=4, chunks=2, microbatches=8, seed=1)
    front = following(trace, stages=frozenset({0, 1}))
    for vs in range(8):
        row, kept = np.array(trace.F[vs]), np.array(front.F[vs])
        assert np.allclose(kept, row if vs % 4 < 2 else row.mean())
    assert front.activation_bytes is None and front.features == trace.features


def test_an_untaught_planner_scores_every_hypothesis_guarded_by_the_prior_bytes():
    fresh = planner()
    predicted = fresh.predicted(iteration=0, features=FEATURES)
    guarded = hypothesised(predicted, basis=None)
    assert len(guarded) == 3 * len(predicted) and guarded.guard.trace.activation_bytes is not None
    assert fresh.model.untaught()
    plan = fresh.plan(iteration=0, features=FEATURES)
    assert plan == planner().plan(iteration=0, features=FEATURES)  # deterministic
    plan.validate(**SHAPE)


def test_a_fixed_hint_past_the_cap_on_the_prior_bytes_scores_inf_though_the_samples_weigh_alike():
    predicted = planner().predicted(iteration=0, features=FEATURES)
    guarded = hypothesised(predicted, basis=None)
    together = (0, 7, 1, 2, 3, 4, 5, 6)  # the two heavy microbatches in flight at once, never so in data order
    fixed, ready = Plan(order=together, hint="zb-h1", cap=CAP), Plan(order=together, hint="bfw", cap=CAP)
    unguarded = Samples(list(guarded), unsplit=list(guarded.unsplit))
    assert all(math.isfinite(x) for x in score(plans=[fixed, ready], samples=unguarded))
    held, gated = score(plans=[fixed, ready], samples=guarded)
    assert held == math.inf and math.isfinite(gated)
    assert Guard(trace=predicted[0]).admits(plan=replace(fixed, order=tuple(range(8))), policy=fixed.validate(**SHAPE))


def test_an_untaught_planner_chooses_among_the_hints_that_adapt_whatever_its_budget():
    assert adaptive(("bfw", "zb-h1", "ready-zb-h1", "1f1b"), **SHAPE) == ("bfw", "ready-zb-h1")
    assert adaptive(("zb-h1", "1f1b"), **SHAPE) == ("zb-h1", "1f1b")  # nothing adapts: the fixed ones as given
    for seed in range(6):  # a large budget reaches every hint; the prediction shows no spread, yet ops jitter
        trace = generate(scenario="multimodal+lognormal", **SHAPE, seed=seed)
        plan = planner(simulations=256).plan(iteration=0, features=trace.features)
        assert not plan.validate(**SHAPE).fixed, (seed, plan.hint)
    fixed = planner(simulations=256, hints=("zb-h1", "1f1b")).plan(iteration=0, features=FEATURES)
    assert fixed.hint in ("zb-h1", "1f1b")


@pytest.mark.parametrize("simulations", [2, 32])
def test_telemetry_or_a_budget_too_small_for_the_hypotheses_plans_as_before(simulations: int):
    traces = generate_iterations(iterations=4, scenario="multimodal+lognormal", **SHAPE, seed=2)
    config = PlannerConfig(hints=default_hints(chunks=1), cap=CAP, simulations=simulations, samples=2)
    done = run(planning=Planning.PLANNED, traces=traces, config=config)
    assert len(done) == 4
    taught = planner()
    plan, report = done[0]
    taught.observe(report=report, plan=plan, features=traces[0].features)
    assert not taught.model.untaught()
    assert len(taught.predicted(iteration=2, features=traces[2].features)) == 2  # noise draws, no hypotheses
