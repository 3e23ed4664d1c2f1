"""Memory in bytes: caps as multiples of the reference list's peak bytes on the same data, admissions
gated in bytes, and plans that never go past the cap."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rrfp_ray.plan.loop import Planning, run
from rrfp_ray.plan.planner import PlannerConfig, default_hints
from rrfp_ray.plan.scoring import planned_limits, reference_for
from rrfp_ray.policy.arbiter import peak_bytes
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.sim.memory import limits_for
from rrfp_ray.sim.simulator import layout_for, simulate
from rrfp_ray.sim.variability import generate, generate_iterations

SHAPE = {"stages": 4, "chunks": 1, "microbatches": 12}
POLICIES = ("1f1b", "zb-h1", "gpipe", "bf", "bfw", "cpw", "ready-1f1b", "ready-zb-h1")


@pytest.mark.parametrize("cap", ["1x", "2x", "inf", "3"])
@pytest.mark.parametrize("name", POLICIES)
def test_equal_bytes_per_microbatch_run_as_the_count(name: str, cap: str):
    trace = generate(scenario="lognormal", **SHAPE, seed=1)
    weighed = replace(trace, activation_bytes=[[5e6] * 12 for _ in range(4)])
    policy = make_policy(name=name, **SHAPE)
    counted = simulate(policy=policy, trace=trace, cap=Cap.parse(cap)).makespan_ms
    assert simulate(policy=policy, trace=weighed, cap=Cap.parse(cap)).makespan_ms == pytest.approx(counted, rel=1e-12)


def test_the_reference_of_bf_is_1f1b_and_of_bfw_zb_h1():
    trace = generate(scenario="varlen", **SHAPE, seed=2)
    cap = Cap.parse("1x")
    for rule, reference in (("bf", "1f1b"), ("bfw", "zb-h1"), ("cpw", "zb-h1")):
        policy, own = make_policy(name=rule, **SHAPE), make_policy(name=reference, **SHAPE)
        layout = layout_for(policy=policy, trace=trace)
        assert limits_for(cap=cap, reference=policy, trace=trace, layout=layout) == limits_for(
            cap=cap, reference=own, trace=trace, layout=layout
        )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["bf", "bfw", "cpw", "ready-zb-h1"])
def test_readiness_never_holds_more_bytes_than_its_reference_at_1x(name: str, seed: int):
    trace = generate(scenario="varlen+lognormal", **SHAPE, seed=seed)
    policy = make_policy(name=name, **SHAPE)
    report = simulate(policy=policy, trace=trace, cap=Cap.parse("1x"))
    release = (Kind.W,) if policy.split else (Kind.B,)
    for stage, stats in enumerate(report.stages):
        reference = peak_bytes(
            policy.order[stage], held=[r[stage] for r in zip(*trace.activation_bytes)], release=release
        )
        assert 0 < stats.peak_bytes <= reference + 1


@pytest.mark.parametrize("planning", [Planning.PLANNED, Planning.PLANNED_FIXED, Planning.ORACLE])
def test_plans_never_go_past_the_cap(planning: Planning):
    traces = generate_iterations(iterations=4, scenario="varlen+lognormal", **SHAPE, seed=3)
    config = PlannerConfig(hints=default_hints(chunks=1), cap=Cap.parse("1x"), simulations=10, samples=2)
    for trace, (plan, report) in zip(traces, run(planning=planning, traces=traces, config=config)):
        split = make_policy(name=plan.hint, **SHAPE).split
        for stats, (fb, fw) in zip(report.stages, planned_limits(cap=plan.cap, trace=trace, split=split)):
            assert stats.peak_bytes <= (fw if split else fb) * (1 + 1e-9) + 1, plan


@pytest.mark.parametrize("stages", [4, 8])
def test_every_default_hint_holds_no_more_microbatches_than_the_reference_of_the_cap(stages: int):
    """Without bytes in the trace the arbiter caps a list at a multiple of its own peak in microbatches, so a hint
    whose list holds more than the reference's (zb-h1 split, 1f1b full) would run with more memory than `Kx` says."""
    shape = {"stages": stages, "chunks": 1, "microbatches": 4 * stages}
    ones = [1.0] * shape["microbatches"]
    for name in default_hints(chunks=1):
        policy = make_policy(name=name, **shape)
        reference = reference_for(split=policy.split, **shape)
        for release in ((Kind.I, Kind.B), (Kind.W,) if policy.split else (Kind.B,)):
            for stage in range(stages):
                own, allowed = (peak_bytes(p.order[stage], held=ones, release=release) for p in (policy, reference))
                assert own <= allowed, (name, stage, release)


@pytest.mark.parametrize("planning", [Planning.PLANNED, Planning.ORACLE])
def test_a_packing_plan_holds_no_more_bytes_than_zb_h1_on_the_batch_as_given(planning: Planning):
    traces = generate_iterations(iterations=4, scenario="varlen+lognormal", **SHAPE, seed=5, docs=3)
    config = PlannerConfig(hints=default_hints(chunks=1), cap=Cap.parse("1x"), simulations=10, samples=2)
    zb = make_policy(name="zb-h1", **SHAPE)
    for trace, (plan, report) in zip(traces, run(planning=planning, traces=traces, config=config)):
        assert plan.packing is not None
        fixed = simulate(policy=zb, trace=trace, cap=Cap.parse("1x"))
        for stats, reference in zip(report.stages, fixed.stages):
            assert stats.peak_bytes <= reference.peak_bytes + 1, plan
