"""The simulator's model of the DP reduction (`rrfp_ray.sim.reduction`) in closed form: a bucket
that goes after the iteration's last op is fully exposed, one whose chunk finished early is hidden."""

from __future__ import annotations

import pytest

from rrfp_ray.observe.telemetry import dp_summary
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.reduction import ReduceModel, with_reduction
from rrfp_ray.sim.simulator import layout_for, simulate
from rrfp_ray.sim.variability import generate

T_F = 20.0  # ms; a full backward takes 2 x T_F (scenario none)


def _run(*, policy: str, chunks: int = 1, model: ReduceModel):
    trace = generate(scenario="none", stages=2, microbatches=4, chunks=chunks, seed=0, t_f=T_F)
    chosen = make_policy(name=policy, stages=2, chunks=chunks, microbatches=4)
    report = simulate(policy=chosen, trace=trace, cap=Cap(multiple=2.0))
    return report, with_reduction(report, layout=layout_for(policy=chosen, trace=trace), model=model)


def test_one_bucket_after_the_last_op_is_fully_exposed_and_an_early_chunk_hides_its_own():
    model = ReduceModel(chunk_bytes=1000, bucket_bytes=1000, bytes_per_ms=100.0, latency_ms=2.0)  # 12 ms a bucket
    plain, reduced = _run(policy="1f1b", model=model)
    assert reduced.makespan_ms == plain.makespan_ms  # the reduction never delays an op
    first, last = sorted(reduced.stages, key=lambda s: s.stage)
    assert first.last_op_ms == reduced.makespan_ms  # stage 0's backward of the last microbatch ends the iteration
    assert first.reduce_ms == pytest.approx(12.0) and first.reduce_bytes == 1000
    assert first.reduce_exposed_ms == pytest.approx(12.0)  # all of it after the last op
    assert first.reduce_end_ms == pytest.approx(reduced.makespan_ms + 12.0)
    assert last.last_op_ms == pytest.approx(
        reduced.makespan_ms - 2 * T_F
    )  # its last backward ends one backward earlier
    assert last.reduce_exposed_ms == 0.0  # 12 ms of reduction inside the 40 ms stage 0 still works
    assert dp_summary([reduced])["dp_exposed_fraction"] == pytest.approx(0.5)  # the median of 1 and 0


def test_without_overlap_every_bucket_waits_for_the_last_op_of_every_stage():
    model = ReduceModel(
        chunk_bytes=2500, bucket_bytes=1000, bytes_per_ms=100.0, latency_ms=1.0, overlap=False, layers=5
    )
    _, reduced = _run(policy="1f1b", model=model)
    for stats in reduced.stages:
        assert stats.reduce_ms == pytest.approx(25.0 + 3 * 1.0)  # buckets of 1000, 1000 and 500 bytes
        assert stats.reduce_exposed_ms == pytest.approx(stats.reduce_ms)
    assert dp_summary([reduced])["dp_exposed_fraction"] == pytest.approx(1.0)


def test_with_two_chunks_the_chunk_that_finishes_first_reduces_under_the_other_ones_backwards():
    model = ReduceModel(chunk_bytes=1000, bucket_bytes=1000, bytes_per_ms=100.0)  # 10 ms a chunk
    _, reduced = _run(policy="interleaved", chunks=2, model=model)
    first = next(s for s in reduced.stages if s.stage == 0)
    assert first.last_op_ms == reduced.makespan_ms and first.reduce_ms == pytest.approx(20.0)
    assert first.reduce_exposed_ms == pytest.approx(10.0)  # chunk 1's bucket was done before chunk 0's last backward


def test_a_bad_model_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match="bytes_per_ms"):
        ReduceModel(chunk_bytes=1, bucket_bytes=1, bytes_per_ms=0.0)


def test_buckets_released_through_the_last_backward_leave_only_the_last_one_exposed():
    whole = ReduceModel(chunk_bytes=2000, bucket_bytes=1000, bytes_per_ms=100.0)  # one 2000-byte tensor: one bucket
    layered = ReduceModel(chunk_bytes=2000, bucket_bytes=1000, bytes_per_ms=100.0, layers=2)  # two buckets of 10 ms
    assert layered.buckets() == [(1, 1000), (2, 1000)]
    _, at_end = _run(policy="1f1b", model=whole)
    _, through = _run(policy="1f1b", model=layered)
    first_at_end = next(s for s in at_end.stages if s.stage == 0)
    first = next(s for s in through.stages if s.stage == 0)
    assert first_at_end.reduce_exposed_ms == pytest.approx(20.0)  # all of it after the last backward
    # the last backward (40 ms) finalizes the first layer halfway: its bucket is done before the op ends
    assert first.reduce_ms == pytest.approx(20.0) and first.reduce_exposed_ms == pytest.approx(10.0)
