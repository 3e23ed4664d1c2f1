"""The planner keeps a full backward's cost apart from its two halves, learns each backward before it assumes it,
and caps each plan against the reference list of its own backward."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rrfp_ray.plan.planner import Planner, PlannerConfig, default_hints
from rrfp_ray.plan.plans import Plan
from rrfp_ray.plan.scoring import Samples, planned_limits, score
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.memory import limits_for
from rrfp_ray.sim.simulator import layout_for
from rrfp_ray.sim.variability import generate

CAP = Cap.parse("1x")
SHAPE = {"stages": 4, "chunks": 1, "microbatches": 8}
HINTS = ("bfw", "zb-h1", "1f1b", "bf")


def learned(*, forward: float, halves: float, full: float) -> Planner:
    """A planner whose model saw every stage's F, I and W (each half `halves` ms) and full B (`full` ms)."""
    planner = Planner(config=PlannerConfig(hints=HINTS, cap=CAP, simulations=24, samples=1), **SHAPE)
    for vs in range(SHAPE["stages"]):
        for kind, ms in (("F", forward), ("I", halves), ("W", halves), ("B", full)):
            planner.model.add(key=(vs, kind), iteration=0, samples=[(1.0, ms)] * 8)
    planner.planned, planner.last = 0, Plan.identity(microbatches=8, hint="bf", cap=CAP)
    return planner


@pytest.mark.parametrize(("full", "split"), [(12.0, False), (40.0, True)])
def test_each_backward_is_scored_with_its_own_costs(full: float, split: bool):
    planner = learned(forward=10.0, halves=10.0, full=full)
    (mean,) = planner.predicted(iteration=2, features=None)
    predicted = planner.predicted(iteration=2, features=None)
    (unsplit,) = predicted.unsplit
    assert mean.B[0][0] == pytest.approx(10.0) and mean.W[0][0] == pytest.approx(10.0)
    assert unsplit.B[0][0] == pytest.approx(full) and unsplit.W[0][0] == 0.0
    one_f_one_b, zb_h1 = (Plan.identity(microbatches=8, hint=h, cap=CAP) for h in ("1f1b", "zb-h1"))
    assert score(plans=[one_f_one_b], samples=predicted) == score(plans=[one_f_one_b], samples=[unsplit])
    assert score(plans=[zb_h1], samples=predicted) == score(plans=[zb_h1], samples=[mean])
    # a full backward cheaper than its halves together makes the planner pick an unsplit hint, a dearer one a split
    plan = planner.plan(iteration=2, features=None)
    assert make_policy(name=plan.hint, **SHAPE).split is split


def test_samples_pair_each_split_draw_with_a_full_one():
    trace = generate(scenario="multimodal", **SHAPE, seed=1)
    with pytest.raises(ValueError, match="2 split samples but 1 unsplit"):
        Samples([trace, trace], unsplit=[trace])


def test_each_backward_is_learned_before_it_is_assumed():
    """Iteration 0 runs a split backward, iteration 1 (planned before 0's telemetry came) a full one; a planner told
    that a full backward is I + W (the simulated loop's) searches every hint from the start."""
    trace = generate(scenario="multimodal+lognormal", **SHAPE, seed=3)
    config = PlannerConfig(hints=default_hints(chunks=1), cap=CAP, simulations=12, samples=2)
    planner = Planner(config=config, **SHAPE)
    plans = [planner.plan(iteration=k, features=trace.features) for k in (0, 1)]
    assert [make_policy(name=plan.hint, **SHAPE).split for plan in plans] == [True, False]
    assert Planner(config=replace(config, learn_backwards=False), **SHAPE).hints() == config.hints
    assert Planner(config=config, **SHAPE).hints() != config.hints


@pytest.mark.parametrize(("split", "reference"), [(True, "zb-h1"), (False, "1f1b")])
def test_a_plan_is_capped_against_its_own_backwards_reference(split: bool, reference: str):
    trace = generate(scenario="varlen+lognormal", **SHAPE, seed=2)
    own = make_policy(name=reference, **SHAPE)
    expected = limits_for(cap=CAP, reference=own, trace=trace, layout=layout_for(policy=own, trace=trace))
    assert planned_limits(cap=CAP, trace=trace, split=split) == expected
