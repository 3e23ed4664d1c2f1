"""cpw: bfw plus priority inheritance for the W that frees a held admission."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_policy import Driven
from test_simulator import bf_choice, builds, readiness, traces

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.policy.arbiter import Arbiter
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.pickers import BFPicker, CPWPicker, hint_indexes, picker_for
from rrfp_ray.policy.policy import Policy, Rule, make_policy
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.schedule.actions import Action, Kind, parse_action
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.schedule.slots import slots_of
from rrfp_ray.sim.simulator import layout_for, simulate
from rrfp_ray.sim.trace import Trace
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.backend import LocalBackend


def acts(text: str) -> list[Action]:
    return [parse_action(word, stages=4) for word in text.split()]  # picker tests: P = 4, so 4F1 is chunk 1


PICKER_LAYOUT = Layout(stages=4, chunks=2, microbatches=4, split=True)


def cpw() -> Driven:
    return Driven(CPWPicker(slots=slots_of(PICKER_LAYOUT)), layout=PICKER_LAYOUT)


def bfw() -> Driven:
    return Driven(BFPicker(slots=slots_of(PICKER_LAYOUT), with_w=True), layout=PICKER_LAYOUT)


def feed(picker: Driven, steps: list[tuple[str, bool]]) -> list[Action | None]:
    """Add the actions of each step (space-separated, may be empty), then pick once with its admit flag."""
    picked = []
    for text, admit in steps:
        for action in acts(text):
            picker.add(action)
        picked.append(picker.pick(admit=admit))
    return picked


# --- resolution --------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 2])
def test_cpw_resolves_to_bfws_layout_and_caps(chunks: int) -> None:
    cpw = make_policy(name="cpw", stages=4, chunks=chunks, microbatches=8)
    bfw = make_policy(name="bfw", stages=4, chunks=chunks, microbatches=8)
    assert (cpw.name, cpw.rule, cpw.split, cpw.fixed) == ("cpw", Rule.CPW, True, False)
    assert cpw.order == bfw.order  # same reference list, so the same caps at any multiple
    assert isinstance(
        picker_for(
            policy=cpw,
            index=hint_indexes(
                policy=cpw,
                layout=layout_for(
                    policy=cpw, trace=generate(scenario="none", stages=4, microbatches=8, chunks=chunks, seed=0)
                ),
            )[0],
        ),
        CPWPicker,
    )


def test_unknown_policy_error_lists_cpw() -> None:
    with pytest.raises(ValueError, match="unknown policy.*cpw"):
        make_policy(name="cp-w", stages=2, chunks=1, microbatches=4)


# --- the picker --------------------------------------------------------------------------

# A stage at caps F->B 2 and F->W 2: it admits 0F0 and 0F1, then is held; 0B0 brings the F->B
# count back to 1, a level at which it admitted before, so only the F->W cap (0W0 pending) holds
# 0F2, and 0W0 goes ahead of the ready 0B1.
HELD_BY_W = [("0F0 0F1", True), ("", True), ("0I0", False), ("0W0 0I1 0F2", False), ("", True)]


def test_cpw_runs_the_w_that_frees_a_held_admission_first() -> None:
    assert feed(cpw(), HELD_BY_W) == acts("0F0 0F1 0I0 0W0 0F2")
    assert feed(bfw(), HELD_BY_W[:4]) == acts("0F0 0F1 0I0 0I1")


def test_cpw_keeps_bfw_order_when_the_f_to_b_cap_may_be_the_one() -> None:
    """At caps F->B 1: 0F1 brings the F->B count to 1, a level it never admitted at, so the held
    0F2 may wait on the F->B cap, which no W can free: BFW's choice, the backward, stands."""
    steps = [("0F0", True), ("0I0", False), ("0W0 0F1", True), ("0I1 0F2", False)]
    assert feed(cpw(), steps) == feed(bfw(), steps) == acts("0F0 0I0 0F1 0I1")


def test_cpw_lets_a_later_chunk_forward_go_first() -> None:
    steps = [*HELD_BY_W[:3], ("0W0 4F1 0F2", False)]
    assert feed(cpw(), steps)[-1] == parse_action(stages=4, text="4F1")


def test_cpw_frees_with_a_chunk_0_w_only() -> None:
    steps = [*HELD_BY_W[:3], ("4W0 0I1 0F2", False)]
    assert feed(cpw(), steps)[-1] == parse_action(stages=4, text="0I1")
    steps = [*HELD_BY_W[:3], ("4W0 0W1 0I1 0F2", False)]
    assert feed(cpw(), steps)[-1] == parse_action(stages=4, text="0W1")


def test_cpw_is_bfw_when_the_cap_never_binds() -> None:
    policy = make_policy(name="cpw", stages=4, chunks=2, microbatches=8)
    bfw = make_policy(name="bfw", stages=4, chunks=2, microbatches=8)
    trace = generate(scenario="multimodal+comm", stages=4, microbatches=8, chunks=2, seed=3)
    a, b = (simulate(policy=p, trace=trace, cap=Cap.parse("inf")) for p in (policy, bfw))
    assert [(e.action, e.start_ms) for e in a.events] == [(e.action, e.start_ms) for e in b.events]


# --- invariants on random traces ---------------------------------------------------------


def check_cpw_run(report: IterationReport, *, policy: Policy, trace: Trace, cap: Cap) -> None:
    """Every action once, with its duration, after its needs, one at a time per stage; admissions
    within both caps; never idle while an action is eligible; and each choice the one cpw's rule
    makes, rebuilt from the events (unbounded receive buffers)."""
    layout = layout_for(policy=policy, trace=trace)
    ops = {}
    for event in report.events:
        action = parse_action(event.action, stages=layout.stages)
        assert action not in ops, f"{action} ran twice"
        assert event.end_ms - event.start_ms == pytest.approx(trace.duration(action))
        ops[action] = event
    assert set(ops) == {a for s in range(layout.stages) for a in layout.actions(stage=s)}
    ready = readiness(ops, layout=layout, trace=trace)
    for stage in range(layout.stages):
        arbiter = Arbiter(layout=layout, stage=stage, policy=policy, cap=cap)
        timeline = sorted((a for a in ops if a.stage == stage), key=lambda a: ops[a].start_ms)
        admitted_at = -1
        for k, action in enumerate(timeline):
            start, free = ops[action].start_ms, ops[timeline[k - 1]].end_ms if k else 0.0
            assert start >= max(free, ready[action]), f"{action} started before its stage was free or it was ready"
            done, pending = timeline[:k], timeline[k:]
            admitted = sum(a.kind is Kind.F and a.chunk == 0 for a in done)
            held_fb = admitted - sum(a.kind.backward and a.chunk == 0 for a in done)
            held_fw = admitted - sum(a.kind is Kind.W and a.chunk == 0 for a in done)
            room = held_fb < arbiter.cap_fb and held_fw < arbiter.cap_fw
            if room:
                admitted_at = max(admitted_at, held_fb)
            admission = [a for a in pending if a.kind is Kind.F and a.chunk == 0]
            allowed = [a for a in pending if room or a not in admission]
            assert not [a for a in allowed if ready[a] < start and start > free], f"{stage}: idle before {action}"
            eligible = [a for a in allowed if ready[a] <= start]
            assert action in eligible, f"{action} ran while not eligible"
            held = not room and any(ready[a] <= start for a in admission)
            expected = cpw_choice(eligible, done=done, held=held, free_w=held_fb <= admitted_at)
            assert action == expected, f"ran {action} at {start}, cpw ranks {expected} first"
        assert report.stages[stage].peak_inflight <= arbiter.cap_fw


def cpw_choice(eligible: list[Action], *, done: list[Action], held: bool, free_w: bool) -> Action:
    later = any(a.kind is Kind.F and a.chunk > 0 for a in eligible)
    freeing = sorted((a for a in eligible if a.kind is Kind.W and a.chunk == 0), key=lambda a: a.microbatch)
    if held and free_w and not later and freeing:
        return freeing[0]
    return bf_choice(eligible, done=done)


@st.composite
def cases(draw) -> tuple[Policy, Trace, Cap]:
    stages = draw(st.integers(1, 6))
    chunks = draw(st.integers(1, 3))
    counts = [m for m in range(1, 3 * stages + 1) if builds("cpw", stages=stages, chunks=chunks, microbatches=m)]
    microbatches = draw(st.sampled_from(counts))
    policy = make_policy(name="cpw", stages=stages, chunks=chunks, microbatches=microbatches)
    # The checker models the cap in microbatches; a trace with activation bytes is gated in bytes instead
    # (tests/test_simulator.py checks that gate), so the bytes are dropped here.
    trace = dataclasses.replace(
        draw(traces(stages=stages, microbatches=microbatches, chunks=chunks)), activation_bytes=None
    )
    return policy, trace, Cap.parse(draw(st.sampled_from(("1x", "1.5x", "2x", "inf", "1", "2", "3"))))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_cpw_completes_and_keeps_every_invariant(case: tuple[Policy, Trace, Cap]) -> None:
    policy, trace, cap = case
    check_cpw_run(simulate(policy=policy, trace=trace, cap=cap), policy=policy, trace=trace, cap=cap)


def test_the_rule_fires_on_the_suite_and_the_check_sees_it() -> None:
    """On this trace cpw and bfw differ, so the checks above are not checking bfw twice."""
    policy = make_policy(name="cpw", stages=8, chunks=1, microbatches=32)
    bfw = make_policy(name="bfw", stages=8, chunks=1, microbatches=32)
    trace = generate(scenario="multimodal", stages=8, microbatches=32, chunks=1, seed=2)
    report = simulate(policy=policy, trace=trace, cap=Cap.parse("2x"))
    check_cpw_run(report, policy=policy, trace=trace, cap=Cap.parse("2x"))
    other = simulate(policy=bfw, trace=trace, cap=Cap.parse("2x"))
    assert [e.action for e in report.events] != [e.action for e in other.events]
    with pytest.raises(AssertionError, match="ranks"):
        check_cpw_run(other, policy=policy, trace=trace, cap=Cap.parse("2x"))


# --- against bfw on the multimodal scenario (docs/policy_past_bf.md) ----------------------


def makespans(name: str, *, cap: str, seeds: range) -> list[float]:
    policy = make_policy(name=name, stages=8, chunks=1, microbatches=32)
    return [
        simulate(
            policy=policy,
            trace=generate(scenario="multimodal", stages=8, microbatches=32, chunks=1, seed=s),
            cap=Cap.parse(cap),
        ).makespan_ms
        for s in seeds
    ]


def test_cpw_is_never_slower_than_bfw_on_multimodal_at_the_1x_cap() -> None:
    cpw, bfw = makespans("cpw", cap="1x", seeds=range(10)), makespans("bfw", cap="1x", seeds=range(10))
    assert all(c <= b for c, b in zip(cpw, bfw))
    assert statistics.mean(cpw) < statistics.mean(bfw)


def test_cpw_is_faster_than_bfw_on_multimodal_at_2x_on_average_not_on_every_seed() -> None:
    """Measured: slower on seeds 1 and 9 (by 0.9% and 1.8%), faster on 2, 3 and 6, equal elsewhere."""
    cpw, bfw = makespans("cpw", cap="2x", seeds=range(10)), makespans("bfw", cap="2x", seeds=range(10))
    assert statistics.mean(cpw) < statistics.mean(bfw)
    assert sum(c > b for c, b in zip(cpw, bfw)) <= 2


# --- the runtime runs it unchanged --------------------------------------------------------


def test_the_runtime_runs_cpw() -> None:
    P, M = 4, 8
    policy = make_policy(name="cpw", stages=P, chunks=1, microbatches=M)
    layout = Layout(stages=P, chunks=1, microbatches=M, split=True)
    workload = SyntheticWorkload(
        trace=generate(scenario="multimodal", stages=P, microbatches=M, chunks=1, seed=1, t_f=1.0), payload_elems=16
    )
    pipeline = LocalBackend.over(layout=layout, timeout_s=20)
    try:
        report = pipeline.run_iteration(
            iteration=0,
            policy=policy,
            cap=Cap.parse("1x"),
            executors=[workload.executor(stage=s, layout=layout) for s in range(P)],
            latency=workload.latency,
        )
    finally:
        pipeline.close()
    assert sorted(e.action for e in report.events) == sorted(str(a) for s in range(P) for a in layout.actions(stage=s))
    for stage in range(P):
        arbiter = Arbiter(layout=layout, stage=stage, policy=policy, cap=Cap.parse("1x"))
        assert report.stages[stage].peak_inflight <= arbiter.cap_fw
