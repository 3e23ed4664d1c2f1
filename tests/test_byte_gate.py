"""The runtime gates admissions in activation bytes as the simulator does: the stage group builds each stage's
`Memory` once per iteration from the data's bytes (`rrfp_ray.sim.memory.DataBytes`), and every stage's arbiter
holds no more than its limits; without bytes, the cap counts microbatches as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rrfp_ray.policy.agreement import TPProtocol
from rrfp_ray.policy.caps import Cap, Memory
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.schedule.actions import Kind, parse_action
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.memory import DataBytes
from rrfp_ray.sim.replay import replay
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.trace import Trace
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.backend import LocalBackend

P, M = 2, 6


def _trace(weights: list[float]) -> Trace:
    """Stage 1 four times as slow as stage 0: every stage's order is then forced by its needs and the byte gate,
    not by timing (in the simulator, durations moved by up to 40% leave the orders below unchanged)."""
    base = generate(scenario="none", stages=P, microbatches=M, chunks=1, seed=0, t_f=8.0)

    def slow(rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return (rows[0], tuple(4 * x for x in rows[1]))

    rows = tuple(tuple(weights) for _ in range(P))
    return replace(base, F=slow(base.F), B=slow(base.B), W=slow(base.W), activation_bytes=rows)


def _orders(events) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {s: [] for s in range(P)}
    for event in sorted(events, key=lambda e: e.start_ms):
        out[event.stage].append(event.action)
    return out


def _held_peaks(events, *, memory: Memory, stage: int, split: bool) -> tuple[float, float]:
    """The most bytes the stage's ops held from chunk-0 F to B or I (F->B) and to W or B (F->W), replayed from
    the order they started in: an admission counts from its start, a release from its start too (the arbiter
    frees at the end, so this is a lower bound of what the gate saw)."""
    fb = fw = peak_fb = peak_fw = 0.0
    for event in sorted((e for e in events if e.stage == stage), key=lambda e: e.start_ms):
        action = parse_action(event.action, stages=P)
        held = memory.held[action.microbatch]
        if action.kind is Kind.F:
            fb, fw = fb + held, fw + held
            peak_fb, peak_fw = max(peak_fb, fb), max(peak_fw, fw)
        if action.kind in (Kind.B, Kind.I):
            fb -= held
        if action.kind is (Kind.W if split else Kind.B):
            fw -= held
    return peak_fb, peak_fw


@pytest.mark.parametrize(
    ("weights", "name", "cap"),
    [
        ([1, 1, 1, 1, 1, 3], "bf", "1x"),
        ([4, 4, 1, 1, 1, 1], "bfw", "1x"),
        ([1, 1, 1, 1, 1, 3], "bfw", "2x"),
        ([1, 4, 1, 1, 1, 1], "ready-1f1b", "2x"),
    ],
)
def test_the_runtime_gates_in_bytes_as_the_simulator_does(weights: list[float], name: str, cap: str) -> None:
    trace = _trace(weights)
    layout = Layout(stages=P, chunks=1, microbatches=M)
    policy = make_policy(name=name, stages=P, chunks=1, microbatches=M)
    run_layout = policy.layout_over(layout)
    data = DataBytes(rows=trace.activation_bytes)
    memory = data.memories(cap=Cap.parse(cap), policy=policy, layout=run_layout, order=None)
    simulated = simulate(policy=policy, trace=trace, cap=Cap.parse(cap))
    counted = simulate(policy=policy, trace=replace(trace, activation_bytes=None), cap=Cap.parse(cap))
    assert _orders(simulated.events) != _orders(counted.events)  # the gate decides something here
    with LocalBackend.over(layout=layout) as local:
        local.group.set_workload(workload=SyntheticWorkload(trace=trace, payload_elems=4))
        report = local.group.run_iteration(
            iteration=0,
            policy=policy,
            cap=Cap.parse(cap),
            buffer_limit=None,
            tp_protocol=TPProtocol.FIRST,
            data_bytes=data,
        )
    assert _orders(report.events) == _orders(simulated.events)
    for stage, gate in enumerate(memory):
        peak_fb, peak_fw = _held_peaks(report.events, memory=gate, stage=stage, split=run_layout.split)
        assert peak_fb <= gate.limit_fb * (1 + 1e-9), f"stage {stage} held {peak_fb} bytes F->B past {gate.limit_fb}"
        assert peak_fw <= gate.limit_fw * (1 + 1e-9), f"stage {stage} held {peak_fw} bytes F->W past {gate.limit_fw}"
        assert report.stages[stage].peak_bytes == round(simulated.stages[stage].peak_bytes)
        assert report.stages[stage].gate_bytes == list(gate.held)
        limits = [gate.limit_fb, gate.limit_fw]
        assert report.stages[stage].gate_limits == [x if x != float("inf") else None for x in limits]


def test_without_bytes_the_cap_counts_microbatches_as_before() -> None:
    trace = replace(_trace([1, 1, 1, 1, 1, 3]), activation_bytes=None)
    layout = Layout(stages=P, chunks=1, microbatches=M)
    policy = make_policy(name="bf", stages=P, chunks=1, microbatches=M)
    with LocalBackend.over(layout=layout) as local:
        local.group.set_workload(workload=SyntheticWorkload(trace=trace, payload_elems=4))
        report = local.group.run_iteration(
            iteration=0, policy=policy, cap=Cap.parse("1x"), buffer_limit=None, tp_protocol=TPProtocol.FIRST
        )
    assert _orders(report.events) == _orders(simulate(policy=policy, trace=trace, cap=Cap.parse("1x")).events)
    assert [s.peak_bytes for s in report.stages] == [0] * P
    count = DataBytes(rows=_trace([1, 2, 1, 2, 1, 2]).activation_bytes)
    assert count.memories(cap=Cap.parse("3"), policy=policy, layout=layout, order=None) == (None,) * P


def test_bytes_of_the_wrong_shape_are_refused_naming_it() -> None:
    layout = Layout(stages=P, chunks=1, microbatches=M)
    policy = make_policy(name="bf", stages=P, chunks=1, microbatches=M)
    short = DataBytes(rows=((1.0,) * M, (1.0,) * (M - 1)))
    with pytest.raises(ValueError, match=r"expected 2 virtual stages x 6 microbatches, got rows of lengths \[6, 5\]"):
        short.memories(cap=Cap.parse("1x"), policy=policy, layout=layout, order=None)
    limits = DataBytes(rows=((1.0,) * M,) * P, limits=((1.0, 1.0),))
    with pytest.raises(ValueError, match="one .* pair per stage"):
        limits.memories(cap=Cap.parse("1x"), policy=policy, layout=layout, order=None)
    gate = Memory(held=(1.0,) * (M - 1), limit_fb=2.0)
    with pytest.raises(ValueError, match="memory of stage 1: holds 5 microbatches, expected 6"):
        IterationArgs(iteration=0, layout=layout, policy=policy, cap=Cap.parse("1x"), memory=(None, gate))
    with pytest.raises(ValueError, match=r"memory: expected one per stage \(2\), got 1"):
        IterationArgs(iteration=0, layout=layout, policy=policy, cap=Cap.parse("1x"), memory=(gate,))


def test_the_order_moves_each_slots_bytes_with_its_data_microbatch() -> None:
    layout = Layout(stages=P, chunks=1, microbatches=M)
    policy = make_policy(name="bf", stages=P, chunks=1, microbatches=M)
    data = DataBytes(rows=(tuple(range(1, M + 1)),) * P, limits=((10.0, 20.0),) * P)
    order = (5, 4, 3, 2, 1, 0)
    gates = data.memories(cap=Cap.parse("1x"), policy=policy, layout=layout, order=order)
    assert [g.held for g in gates] == [tuple(float(M - i) for i in range(M))] * P
    assert [(g.limit_fb, g.limit_fw) for g in gates] == [(10.0, 20.0)] * P


def test_a_replay_gates_in_bytes_as_the_stages_did() -> None:
    base = generate(scenario="lognormal", stages=P, microbatches=M, chunks=1, seed=2, t_f=8.0)
    trace = replace(base, activation_bytes=((1.0, 1.0, 1.0, 1.0, 1.0, 3.0),) * P)
    layout = Layout(stages=P, chunks=1, microbatches=M)
    policy = make_policy(name="bf", stages=P, chunks=1, microbatches=M)
    cap = Cap.parse("1x")
    report = simulate(policy=policy, trace=trace, cap=cap)  # stands for a measured run
    gates = DataBytes(rows=trace.activation_bytes).memories(cap=cap, policy=policy, layout=layout, order=None)
    counted = replay(report, policy=policy, layout=layout, cap=cap).simulated_ms
    assert counted != pytest.approx(report.makespan_ms, rel=1e-9)  # the bytes decide something here
    for stats, gate in zip(report.stages, gates):
        stats.gate_bytes = list(gate.held)
        stats.gate_limits = [gate.limit_fb, None]
    assert replay(report, policy=policy, layout=layout, cap=cap).simulated_ms == pytest.approx(report.makespan_ms)
