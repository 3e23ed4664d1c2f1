"""Activation bytes learned from the stages' telemetry: per virtual stage against the cost feature or, where a
stage's bytes follow the padded sequence (a decoder over a packed microbatch), against the padded size; what
the planner gates a plan by (the bytes its search scored) and what a trainer's readiness rules gate by."""

from __future__ import annotations

import pytest

from rrfp_ray.observe.telemetry import IterationReport, StageStats
from rrfp_ray.plan.ahead import Seen
from rrfp_ray.plan.costs import CostModel, padded_size
from rrfp_ray.plan.planner import Planner, PlannerConfig, measured_bytes, packed_padded
from rrfp_ray.plan.plans import Plan
from rrfp_ray.plan.scoring import planned_limits
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.bytegate import ByteGate
from rrfp_ray.train.config import PipelineConfig

# per microbatch, its samples' features (images); stage 0 holds the sum, stage 1 the padded sequence
SAMPLES = [[0.0, 3.0], [1.0, 1.0], [4.0, 0.0], [2.0, 2.0], [0.0, 0.0], [5.0, 1.0]]


def _bytes(samples: list[list[float]]) -> list[list[float]]:
    encoder = [100.0 * sum(row) for row in samples]
    decoder = [len(row) * (10.0 + 50.0 * max(row)) for row in samples]
    return [encoder, decoder]


def _report(rows: list[list[float]], *, order: list[int], iteration: int = 0) -> IterationReport:
    """Replica 0's stages reporting per slot the bytes of the data microbatch `order[slot]`."""
    stages = [
        StageStats(
            stage=s, wall_ms=1.0, compute_ms=1.0, blocked_ms=0.0, activation_bytes=[[int(row[j]) for j in order]]
        )
        for s, row in enumerate(rows)
    ]
    return IterationReport(iteration=iteration, policy="1f1b", makespan_ms=1.0, stages=stages, order=order)


def test_measured_bytes_are_indexed_by_data_microbatch() -> None:
    rows = _bytes(SAMPLES)
    order = [5, 4, 3, 2, 1, 0]
    assert measured_bytes(report=_report(rows, order=order), order=order, stages=2, chunks=1) == rows
    report = _report(rows, order=order)
    report.stages[1].activation_bytes = []
    assert measured_bytes(report=report, order=order, stages=2, chunks=1) is None


def test_each_stage_learns_whether_its_bytes_follow_the_sum_or_the_padded_size() -> None:
    model = CostModel()
    features = [sum(row) for row in SAMPLES]
    padded = [padded_size(row) for row in SAMPLES]
    model.observe_bytes(iteration=0, activation_bytes=_bytes(SAMPLES), features=features, padded=padded)
    packed = [[3.0, 0.0, 0.0], [1.0, 1.0, 4.0], [2.0, 2.0, 5.0], [0.0, 1.0, 0.0]]  # other counts, other longest
    expected = _bytes(packed)
    got_features, got_padded = [sum(r) for r in packed], [padded_size(r) for r in packed]
    for block in range(2):
        got = model.activation_bytes(block=block, features=got_features, count=4, padded=got_padded)
        assert got == pytest.approx(expected[block], rel=0.2), f"block {block}"
    # the decoder's bytes do not follow the sum: predicted by it, the packed microbatches come out wrong
    by_sum = model.activation_bytes(block=1, features=got_features, count=4)
    assert by_sum != pytest.approx(expected[1], rel=0.2)


def test_a_plans_bytes_are_those_its_search_scored() -> None:
    config = PlannerConfig(hints=("bf",), cap=Cap.parse("1x"), learn_backwards=False)
    planner = Planner(config=config, stages=2, chunks=1, microbatches=6)
    features = [sum(row) for row in SAMPLES]
    padded = [padded_size(row) for row in SAMPLES]
    planner.observe(
        report=_report(_bytes(SAMPLES), order=list(range(6))),
        plan=Plan.identity(microbatches=6, hint="bf", cap=config.cap),
        features=features,
        activation_bytes=_bytes(SAMPLES),
        padded=padded,
    )
    order = (5, 0, 1, 2, 3, 4)
    plan = Plan(order=order, hint="bf", cap=config.cap)
    gate = planner.data_bytes(plan=plan, features=features, samples=SAMPLES)
    rows = planner.predicted_bytes(features=features, padded=padded)
    assert [list(r) for r in gate.rows] == rows
    trace = Trace(
        stages=2,
        microbatches=6,
        chunks=1,
        F=[[1.0] * 6] * 2,
        B=[[1.0] * 6] * 2,
        W=[[0.0] * 6] * 2,
        commF=[[0.0] * 6],
        commB=[[0.0] * 6],
        activation_bytes=rows,
    )
    assert gate.limits == planned_limits(cap=config.cap, trace=trace, split=False)  # the data's own order
    packing = ((0, 5), (1, 2, 3), (4,), (6, 7), (8, 9), (10, 11))
    packed = planner.data_bytes(
        plan=Plan(order=order, hint="bf", cap=config.cap, packing=packing), features=features, samples=SAMPLES
    )
    assert packed.limits == gate.limits  # the cap is that of the batch as given, whatever the packing
    assert [list(r) for r in packed.rows] == planner.predicted_bytes(
        features=[sum([x for row in SAMPLES for x in row][i] for i in g) for g in packing],
        padded=packed_padded(samples=SAMPLES, packing=packing),
    )


def test_readiness_rules_gate_on_learned_bytes_fixed_schedules_never() -> None:
    pipeline = PipelineConfig(stages=2, microbatches=6, policy="bf", cap="1x")
    shown = Seen(planned=[sum(r) for r in SAMPLES], observed=[sum(r) for r in SAMPLES], samples=SAMPLES)
    gate = ByteGate(shows=lambda iteration: shown, pipeline=lambda: pipeline)
    bf, one = (make_policy(name=n, stages=2, chunks=1, microbatches=6) for n in ("bf", "1f1b"))
    assert gate.data_bytes(iteration=0, policy=bf, cap=pipeline.cap) is None  # nothing measured yet: count
    gate.observe(report=_report(_bytes(SAMPLES), order=list(range(6))), packing=None)
    learned = gate.data_bytes(iteration=1, policy=bf, cap=pipeline.cap)
    for row, expected in zip(learned.rows, _bytes(SAMPLES)):
        assert list(row) == pytest.approx(expected, rel=1e-6)
    assert learned.limits is None  # the rule's own list on these bytes, as the simulator takes it
    assert gate.data_bytes(iteration=1, policy=one, cap=pipeline.cap) is None
    assert gate.data_bytes(iteration=1, policy=bf, cap=Cap.parse("4")) is None
    pipeline = pipeline.model_copy(update={"shape": pipeline.shape.model_copy(update={"layer_split": (1, 3)})})
    assert gate.data_bytes(iteration=2, policy=bf, cap=pipeline.cap) is None  # layers moved: learned afresh


def test_stages_that_hold_nothing_for_some_microbatches_still_learn_their_driver() -> None:
    """Text-only microbatches hold no encoder bytes: the choice between the fits must not blow up on them."""
    samples = [[0.0, 0.0], [0.0, 3.0], [0.0, 0.0], [5.0, 2.0], [0.0, 0.0], [1.0, 0.0], [8.0, 5.0], [0.0, 0.0]]
    rows = _bytes(samples)
    model = CostModel()
    features, padded = [sum(r) for r in samples], [padded_size(r) for r in samples]
    model.observe_bytes(iteration=0, activation_bytes=rows, features=features, padded=padded)
    query = [[13.0, 0.0], [6.0, 6.0], [0.0, 0.0]]
    expected = _bytes(query)
    got_features, got_padded = [sum(r) for r in query], [padded_size(r) for r in query]
    for block in range(2):
        got = model.activation_bytes(block=block, features=got_features, count=3, padded=got_padded)
        assert got == pytest.approx(expected[block], rel=0.1, abs=30.0), f"block {block}"
