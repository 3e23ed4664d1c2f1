"""Packing samples into microbatches of balanced cost, and traces that record their samples."""

from __future__ import annotations

import json
import random

import pytest

from rrfp_ray.plan.loop import Planning, run
from rrfp_ray.plan.packing import light_ends, loads, pack, packing_shares, spread
from rrfp_ray.plan.planner import PlannerConfig, default_hints
from rrfp_ray.plan.plans import Plan
from rrfp_ray.plan.search import budgets
from rrfp_ray.policy.caps import Cap
from rrfp_ray.sim.trace import Trace, iterations_from_json, iterations_to_json
from rrfp_ray.sim.variability import generate, generate_iterations

SHAPE = {"stages": 4, "chunks": 1, "microbatches": 8}


@pytest.mark.parametrize("seed", range(5))
def test_pack_places_every_sample_once_and_narrows_the_spread(seed: int):
    rng = random.Random(seed)
    costs = [rng.lognormvariate(6, 0.8) for _ in range(32)]
    packing = pack(costs=costs, bins=8)
    assert sorted(i for group in packing for i in group) == list(range(32))
    assert all(packing)
    before = [sum(costs[4 * m : 4 * m + 4]) for m in range(8)]
    after = loads(costs=costs, packing=packing)
    assert sum(after) == pytest.approx(sum(costs))
    assert spread(after) <= spread(before)
    assert max(after) <= sum(costs) / 8 + max(costs)  # LPT's bound, kept by the moves and swaps
    assert pack(costs=costs, bins=8) == packing


@pytest.mark.parametrize("seed", range(5))
def test_pack_with_light_ends_makes_its_light_bins_lighter_than_the_others(seed: int):
    rng = random.Random(seed)
    costs = [rng.lognormvariate(6, 0.8) for _ in range(64)]
    shares = light_ends(bins=16, light=4, weight=0.7)
    assert sum(shares) == pytest.approx(1.0) and shares[:4] == [0.7 / 16] * 4
    packing = pack(costs=costs, bins=16, shares=shares)
    assert sorted(i for group in packing for i in group) == list(range(64)) and all(packing)
    after = loads(costs=costs, packing=packing)
    assert max(after[:4]) < min(after[4:])
    for load, share in zip(after, shares):  # each bin near its aim: within the largest sample
        assert abs(load - share * sum(costs)) <= max(costs)


def test_a_plan_tries_the_balanced_packing_first_then_light_ends_within_its_budget():
    assert packing_shares(blocks=4, microbatches=16)[0] is None
    assert packing_shares(blocks=4, microbatches=16)[1] == light_ends(bins=16, light=4, weight=0.7)
    assert light_ends(bins=4, light=8, weight=0.5)[:2] == [0.5 / 4] * 2  # at most half the bins are light
    assert budgets(simulations=32, samples=2, count=2) == [24, 8]
    assert budgets(simulations=6, samples=2, count=2) == [6]  # a quarter cannot score one plan: one search
    assert budgets(simulations=32, samples=2, count=1) == [32]


def test_pack_of_equal_costs_is_even_and_refuses_too_few_samples():
    assert loads(costs=[1.0] * 12, packing=pack(costs=[1.0] * 12, bins=4)) == [3.0] * 4
    with pytest.raises(ValueError, match="cannot pack 3 samples into 4"):
        pack(costs=[1.0, 2.0, 3.0], bins=4)


def test_varlen_records_its_documents_and_repacks_them():
    trace = generate(scenario="varlen", **SHAPE, seed=1, docs=4)
    assert [len(row) for row in trace.samples] == [4] * 8
    assert [sum(row) for row in trace.samples] == pytest.approx(trace.features)
    flat = [x for row in trace.samples for x in row]
    packing = pack(costs=flat, bins=8)
    packed = trace.repacked(packing)
    assert packed.features == pytest.approx(loads(costs=flat, packing=packing))
    assert spread(packed.features) < spread(trace.features)
    for m in range(8):  # every op of a microbatch scales with its tokens
        ratio = packed.features[m] / trace.features[m]
        assert packed.F[2][m] == pytest.approx(trace.F[2][m] * ratio)
        assert packed.activation_bytes[0][m] == pytest.approx(trace.activation_bytes[0][m] * ratio)
    assert iterations_from_json(json.loads(json.dumps(iterations_to_json([packed, trace])))) == (packed, trace)
    assert generate(scenario="varlen", **SHAPE, seed=1).samples is None  # one document per microbatch


def test_samples_must_add_up_to_the_features():
    trace = generate(scenario="varlen", **SHAPE, seed=1, docs=2)
    data = trace.to_json()
    data["samples"][0][0] += 5
    with pytest.raises(ValueError, match="must sum, per microbatch"):
        Trace.from_json(data)
    with pytest.raises(ValueError, match="place each of the 16 samples"):
        trace.repacked([[0]] * 8)


def test_planned_packs_before_it_orders_and_the_plan_round_trips():
    traces = generate_iterations(iterations=3, scenario="varlen+lognormal", **SHAPE, seed=2, docs=3)
    config = PlannerConfig(hints=default_hints(chunks=1), cap=Cap.parse("1x"), simulations=8, samples=2)
    for trace, (plan, report) in zip(traces, run(planning=Planning.PLANNED, traces=traces, config=config)):
        assert plan.packing is not None
        packed = trace.repacked(plan.packing)
        assert spread(packed.features) <= spread(trace.features)
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
        assert report.makespan_ms > 0
