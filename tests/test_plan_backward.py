"""The planner keeps a full backward's cost apart from its two halves, and each backward's forwards apart, learns
each backward before it assumes it, and caps each plan against the reference list of its own backward."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest

from rrfp_ray.plan.costs import Backward
from rrfp_ray.plan.planner import Planner, PlannerConfig, default_hints
from rrfp_ray.plan.plans import Plan
from rrfp_ray.plan.scoring import Samples, planned_limits, score
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.sim.memory import limits_for
from rrfp_ray.sim.simulator import layout_for, simulate
from rrfp_ray.sim.trace import Trace
from rrfp_ray.sim.variability import generate

CAP = Cap.parse("1x")
SHAPE = {"stages": 4, "chunks": 1, "microbatches": 8}
HINTS = ("bfw", "zb-h1", "1f1b", "bf")


def learned(*, forward: float, halves: float, full: float, split_forward: float | None = None) -> Planner:
    """A planner whose model saw every stage's F (`forward` ms) and full B (`full` ms) in an iteration with a full
    backward, and its F (`split_forward`, else `forward`), I and W (each half `halves` ms) in one with a split."""
    planner = Planner(config=PlannerConfig(hints=HINTS, cap=CAP, simulations=24, samples=1), **SHAPE)
    seen = {
        Backward.FULL: (("F", forward), ("B", full)),
        Backward.SPLIT: (("F", forward if split_forward is None else split_forward), ("I", halves), ("W", halves)),
    }
    for family, kinds in seen.items():
        for vs in range(SHAPE["stages"]):
            for kind, ms in kinds:
                planner.model.models[family].add(key=(vs, kind), iteration=0, samples=[(1.0, ms)] * 8)
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


def test_each_backward_is_scored_with_the_forwards_measured_beside_it():
    """Split halves a little cheaper than a full backward, but forwards that ran slower beside them: a planner that
    kept one forward cost for both would pick a split hint."""
    planner = learned(forward=10.0, halves=5.0, full=12.0, split_forward=16.0)
    predicted = planner.predicted(iteration=2, features=None)
    ((split,), (unsplit,)) = predicted, predicted.unsplit
    assert split.F[0][0] == pytest.approx(16.0) and unsplit.F[0][0] == pytest.approx(10.0)
    assert not make_policy(name=planner.plan(iteration=2, features=None).hint, **SHAPE).split
    ties = learned(forward=10.0, halves=5.0, full=12.0)  # the same forwards beside either: the halves win
    assert make_policy(name=ties.plan(iteration=2, features=None).hint, **SHAPE).split


def _ran(hint: str, *, trace: Trace, planner: Planner, iteration: int) -> None:
    """`planner` observes `trace` simulated under `hint` in the identity order."""
    plan = Plan.identity(microbatches=8, hint=hint, cap=CAP)
    report = simulate(policy=plan.validate(**SHAPE), trace=trace, cap=CAP, iteration=iteration)
    planner.observe(report=report, plan=plan, features=trace.features)


@pytest.mark.parametrize("first", ["1f1b", "zb-h1"])
def test_an_iteration_teaches_only_its_own_backwards_costs_and_the_other_is_predicted_from_it(first: str):
    trace = generate(scenario="multimodal", **SHAPE, seed=4)
    planner = Planner(config=PlannerConfig(hints=HINTS, cap=CAP, samples=1), **SHAPE)
    _ran(first, trace=trace, planner=planner, iteration=0)
    ran = Backward.of(split=make_policy(name=first, **SHAPE).split)
    assert planner.model.observed(ran) and not planner.model.observed(ran.other)
    assert not any(planner.model.models[ran.other].observations.values())
    fit = functools.partial(planner.model.kind_fit, block=1, features=trace.features)
    # the family not run: forwards as measured beside the other, a full B as the halves together, each half B / 2
    assert fit(kind=Kind.F, family=ran.other) == fit(kind=Kind.F, family=ran)
    if ran is Backward.FULL:
        assert fit(kind=Kind.I, family=ran.other).slope == pytest.approx(fit(kind=Kind.B, family=ran).slope / 2)
    else:
        halves = fit(kind=Kind.I, family=ran).intercept + fit(kind=Kind.W, family=ran).intercept
        assert fit(kind=Kind.B, family=ran.other).intercept == pytest.approx(halves)
    # the other family run on forwards twice as slow: its forwards learn that, the first family's stay
    before = fit(kind=Kind.F, family=ran)
    slow = replace(trace, F=[[2 * f for f in row] for row in trace.F])
    _ran("zb-h1" if first == "1f1b" else "1f1b", trace=slow, planner=planner, iteration=1)
    assert fit(kind=Kind.F, family=ran) == before
    ratio = fit(kind=Kind.F, family=ran.other).predict(1.0) / fit(kind=Kind.F, family=ran).predict(1.0)
    assert ratio == pytest.approx(2.0, rel=0.05)
    state = planner.to_dict()
    assert Planner.from_dict(json.loads(json.dumps(state))).to_dict() == state


def test_a_family_not_run_for_a_while_follows_the_load_the_other_family_sees_since():
    """A full-backward iteration at forwards of 10 ms, a split one at 16, then full ones at 20 (the stages slowed):
    the split family, not run since, is predicted slowed alike, its measured ratio to the full family kept."""
    trace = generate(scenario="multimodal", **SHAPE, seed=5)
    planner = Planner(config=PlannerConfig(hints=HINTS, cap=CAP, samples=1), **SHAPE)

    def at(forward_ms: float) -> Trace:
        return replace(trace, F=[[forward_ms] * 8 for _ in range(4)], features=None)

    _ran("1f1b", trace=at(10.0), planner=planner, iteration=0)
    _ran("zb-h1", trace=at(16.0), planner=planner, iteration=1)
    fit = functools.partial(planner.model.kind_fit, block=2, features=None)
    halves = fit(kind=Kind.W, family=Backward.SPLIT).predict(1.0)
    assert fit(kind=Kind.F, family=Backward.SPLIT).predict(1.0) == pytest.approx(16.0)
    for k in range(2, 2 + 2):
        _ran("1f1b", trace=at(20.0), planner=planner, iteration=k)
    assert fit(kind=Kind.F, family=Backward.FULL).predict(1.0) == pytest.approx(20.0)
    assert fit(kind=Kind.F, family=Backward.SPLIT).predict(1.0) == pytest.approx(32.0)
    assert fit(kind=Kind.W, family=Backward.SPLIT).predict(1.0) == pytest.approx(2 * halves)
    assert Planner.from_dict(json.loads(json.dumps(planner.to_dict()))).model.kind_fit(
        block=2, kind=Kind.F, family=Backward.SPLIT, features=None
    ).predict(1.0) == pytest.approx(32.0)


def test_a_saved_planner_whose_costs_do_not_tell_the_families_apart_learns_them_afresh():
    planner = learned(forward=10.0, halves=5.0, full=12.0)
    state = planner.to_dict()
    state["model"] = {"window": 4, "restart": True, "observations": [[0, "F", [[0, 1.0, 10.0]]]]}
    restored = Planner.from_dict(state)
    assert not any(restored.model.observed(family) for family in Backward) and restored.model.window == 4
