"""rrfp_ray.sim.replay: a measured iteration as a trace, replayed in the simulator."""

from __future__ import annotations

import pytest

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Layout, Message
from rrfp_ray.sim.replay import measured_trace, replay
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate


def flat(rows: tuple[tuple[float, ...], ...]) -> list[float]:
    return [value for row in rows for value in row]


@pytest.mark.parametrize(("name", "chunks"), [("bf", 1), ("bfw", 1), ("1f1b", 1), ("ready-zbv", 2)])
def test_an_iteration_replayed_from_its_own_telemetry_takes_the_same_time(name: str, chunks: int) -> None:
    """The simulator's report stands in for a measured one: its ops' times and its messages' transits
    (latency, or an upper bound where the consumer waited on its own forward) give back its makespan."""
    trace = generate(scenario="multimodal+comm", stages=4, microbatches=8, chunks=chunks, seed=5, comm_ms=3.0)
    policy = make_policy(name=name, stages=4, chunks=chunks, microbatches=8)
    report = simulate(policy=policy, trace=trace, cap=Cap.parse("2x"))
    layout = Layout(stages=4, chunks=chunks, microbatches=8, placement=policy.placement)
    again = replay(report, policy=policy, layout=layout, cap=Cap.parse("2x"))
    assert again.simulated_ms == pytest.approx(report.makespan_ms) and again.ratio == pytest.approx(1.0)
    measured = measured_trace(report, layout=policy.layout_over(layout))
    assert flat(measured.F) == pytest.approx(flat(trace.F))  # op times come back
    for vs in range(1, measured.virtual_stages):
        if layout.is_local(Message(kind=Kind.F, virtual_stage=vs, microbatch=0)):
            assert measured.commF[vs - 1] == (0.0,) * 8  # the V's turn: a hand-off, no latency
            continue
        for m in range(8):
            assert measured.commF[vs - 1][m] >= trace.commF[vs - 1][m] - 1e-9  # never less than the latency


def test_a_report_missing_ops_is_refused_naming_them() -> None:
    trace = generate(scenario="none", stages=2, microbatches=2, chunks=1, seed=0)
    policy = make_policy(name="1f1b", stages=2, chunks=1, microbatches=2)
    report = simulate(policy=policy, trace=trace, cap=Cap())
    cut = IterationReport(iteration=3, policy="1f1b", makespan_ms=1.0, stages=report.stages, events=report.events[1:])
    with pytest.raises(ValueError, match="iteration 3 .*missing"):
        measured_trace(cut, layout=Layout(stages=2, chunks=1, microbatches=2))


def test_the_replay_job_reads_a_telemetry_file_and_finds_its_shape(tmp_path, capsys) -> None:

    import replay as job
    from rrfp_ray.observe.telemetry import append_jsonl

    trace = generate(scenario="lognormal", stages=3, microbatches=6, chunks=1, seed=2)
    policy = make_policy(name="bfw", stages=3, chunks=1, microbatches=6)
    path = tmp_path / "telemetry-bfw.jsonl"
    for iteration in range(3):
        append_jsonl(path=path, report=simulate(policy=policy, trace=trace, cap=Cap.parse("1x"), iteration=iteration))
    rows = job.main([str(path), "--cap", "1x"])
    assert [r["iteration"] for r in rows] == [1, 2]  # the first left out as warm-up
    assert all(r["simulated_ms"] == pytest.approx(r["measured_ms"]) for r in rows)
    assert "bfw: P=3 v=1 M=6, looped placement, cap 1x" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        job.main([str(tmp_path / "none.jsonl")])
    assert "no file" in capsys.readouterr().err
