"""The Chrome/Perfetto trace: one compute event per op, blocked gaps, stage metadata, iterations in a row."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rrfp_ray.observe.perfetto import BLOCKED, COMPUTE, RECV, SEND, blocked_spans, chrome_trace, write_trace
from rrfp_ray.observe.telemetry import IterationReport, OpEvent, StageStats, merge_stage_reports, stage_stats
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.schedule.actions import action_kind
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate

CASES = (("bf", 1), ("bfw", 1), ("1f1b", 1), ("interleaved", 2))


def report_for(*, name: str, chunks: int, seed: int = 0, iteration: int = 0) -> IterationReport:
    trace = generate(scenario="multimodal", stages=4, microbatches=8, chunks=chunks, seed=seed)
    policy = make_policy(name=name, stages=4, chunks=chunks, microbatches=8)
    return simulate(policy=policy, trace=trace, cap=Cap.parse("2x"), iteration=iteration)


def complete(trace: dict, *, tid: int) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]


@pytest.fixture(scope="module", params=CASES, ids=[name for name, _ in CASES])
def report(request) -> IterationReport:
    name, chunks = request.param
    return report_for(name=name, chunks=chunks)


def test_written_trace_parses_and_has_one_compute_event_per_op(report, tmp_path):
    path = write_trace(tmp_path / "trace.json", [report])
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    compute = complete(trace, tid=COMPUTE)
    assert len(compute) == len(report.events)
    assert Counter((e["pid"], e["name"]) for e in compute) == Counter((e.stage, e.action) for e in report.events)
    by_name = {(e["pid"], e["name"]): e for e in compute}
    for event in report.events:
        traced = by_name[(event.stage, event.action)]
        assert traced["ts"] == pytest.approx(event.start_ms * 1e3)
        assert traced["dur"] == pytest.approx((event.end_ms - event.start_ms) * 1e3)
        assert traced["cat"] == action_kind(event.action).value
        assert traced["args"]["waited_ms"] == pytest.approx(event.start_ms - event.ready_ms)
        assert traced["args"]["overtook"] == event.overtook
        assert traced["args"]["hint_pos"] == event.hint_pos


def test_compute_and_blocked_fill_each_stage_wall(report):
    trace = chrome_trace([report])
    for stats in report.stages:
        busy = sum(e["dur"] for e in complete(trace, tid=COMPUTE) if e["pid"] == stats.stage)
        idle = sum(e["dur"] for e in complete(trace, tid=BLOCKED) if e["pid"] == stats.stage)
        assert busy + idle == pytest.approx(stats.wall_ms * 1e3, rel=0.02)
        assert idle == pytest.approx(stats.blocked_ms * 1e3, rel=0.02, abs=1.0)


def test_metadata_names_every_stage_and_only_the_tracks_with_data(report):
    trace = chrome_trace([report])
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {s.stage: f"stage {s.stage}" for s in report.stages}
    tracks = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {"compute", "blocked"} <= tracks
    assert not tracks & {"send", "recv"}
    assert not complete(trace, tid=SEND) + complete(trace, tid=RECV)


def test_iterations_follow_one_another_by_makespan():
    first, second = report_for(name="bf", chunks=1, seed=1), report_for(name="bf", chunks=1, seed=2, iteration=1)
    trace = chrome_trace([first, second])
    compute = complete(trace, tid=COMPUTE)
    assert len(compute) == len(first.events) + len(second.events)
    later = [e for e in compute if e["args"]["iteration"] == 1]
    assert min(e["ts"] for e in later) == pytest.approx(first.makespan_ms * 1e3)
    end = max(e["ts"] + e["dur"] for e in complete(trace, tid=BLOCKED) + compute)
    assert end == pytest.approx((first.makespan_ms + second.makespan_ms) * 1e3)


def runtime_report(*, iteration: int, started_at: float) -> IterationReport:
    """Two stages as the runtime reports them: stage 1 starts 5 ms after stage 0, on its own clock."""
    events0 = [OpEvent(stage=0, action="0F0", start_ms=1.0, end_ms=3.0, ready_ms=0.0, hint_pos=0, overtook=False)]
    events1 = [OpEvent(stage=1, action="1F0", start_ms=2.0, end_ms=6.0, ready_ms=1.0, hint_pos=0, overtook=True)]
    results = []
    for stage, events, shift, wall in ((0, events0, 0.0, 10.0), (1, events1, 0.005, 8.0)):
        stats = stage_stats(stage=stage, events=events, wall_ms=wall)
        stats.started_at = started_at + shift
        results.append((events, stats))
    return merge_stage_reports(iteration=iteration, policy="bf", results=results)


def test_runtime_reports_use_each_stage_window_and_the_real_start_times():
    first, second = runtime_report(iteration=0, started_at=1000.0), runtime_report(iteration=1, started_at=1000.5)
    assert blocked_spans(first, stage=1) == [pytest.approx((5.0, 7.0)), pytest.approx((11.0, 13.0))]
    trace = chrome_trace([first, second])
    stage1 = sorted((e["ts"], e["dur"]) for e in complete(trace, tid=BLOCKED) if e["pid"] == 1)
    expected = [(5e3, 2e3), (11e3, 2e3), (505e3, 2e3), (511e3, 2e3)]
    assert stage1 == [pytest.approx(span) for span in expected]


def test_send_and_recv_tracks_appear_only_with_their_spans():
    report = report_for(name="bf", chunks=1)
    sends = [[OpEvent(stage=0, action="0F0", start_ms=20.0, end_ms=21.0, ready_ms=20.0, hint_pos=-1, overtook=False)]]
    trace = chrome_trace([report], send_events=sends)
    sent = complete(trace, tid=SEND)
    assert [(e["pid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in sent] == [(0, "0F0", "send", 20e3, 1e3)]
    tracks = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert (0, "send") in tracks
    assert not {name for _, name in tracks} & {"recv"}
    assert (1, "send") not in tracks


def test_bad_input_names_the_argument():
    report = report_for(name="bf", chunks=1)
    with pytest.raises(ValueError, match="reports"):
        chrome_trace([])
    with pytest.raises(ValueError, match="recv_events"):
        chrome_trace([report], recv_events=[[], []])
    stray = IterationReport(
        iteration=3,
        policy="bf",
        makespan_ms=5.0,
        stages=[StageStats(stage=0, wall_ms=5.0, compute_ms=1.0, blocked_ms=4.0)],
        events=[OpEvent(stage=1, action="1F0", start_ms=0.0, end_ms=1.0, ready_ms=0.0, hint_pos=0, overtook=False)],
    )
    with pytest.raises(ValueError, match=r"stages \[1\]"):
        chrome_trace([stray])
