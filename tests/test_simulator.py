"""The simulator: closed forms at constant durations, invariants on random traces, BF's bound, buffers."""

from __future__ import annotations

import math
import pickle
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rrfp_ray.observe.telemetry import IterationReport, OpEvent, stage_stats
from rrfp_ray.policy.arbiter import Arbiter
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy, make_policy
from rrfp_ray.schedule.actions import Action, Kind, parse_action
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.bounds import bf_bound, bounds
from rrfp_ray.sim.memory import memories
from rrfp_ray.sim.simulator import Case, DeadlockError, TransportModel, layout_for, simulate, simulate_many
from rrfp_ray.sim.trace import Trace
from rrfp_ray.sim.variability import SCENARIOS, generate

T_F = 20.0  # generate's defaults then give B + W = 2 t_f, and B = W = t_f under the split
T_B = 2 * T_F
LIST_POLICIES_V1 = ("gpipe", "1f1b", "zb-h1", "ready-gpipe", "ready-1f1b", "ready-zb-h1")
LIST_POLICIES_V = ("interleaved", "ready-interleaved")
RULES = ("bf", "bfw")
CAPS = ("1x", "2x", "inf", "1.5x", "1", "2", "3")
MIXES = ("multimodal+comm", "straggler+imbalance", "lognormal+comm")


def constant(*, stages: int, microbatches: int, chunks: int = 1) -> Trace:
    return generate(scenario="none", stages=stages, microbatches=microbatches, chunks=chunks, seed=0, t_f=T_F)


def run(name: str, *, stages: int, microbatches: int, chunks: int = 1, cap: str = "1x") -> IterationReport:
    policy = make_policy(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
    trace = constant(stages=stages, microbatches=microbatches, chunks=chunks)
    return simulate(policy=policy, trace=trace, cap=Cap.parse(cap))


def builds(name: str, *, stages: int, chunks: int, microbatches: int) -> bool:
    try:
        make_policy(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
    except ValueError:
        return False
    return True


# --- closed forms at constant durations --------------------------------------------------


@pytest.mark.parametrize("stages", range(1, 7))
def test_gpipe_and_1f1b_makespan_and_bubble(stages: int) -> None:
    P = stages
    for name, first in (("gpipe", 1), ("1f1b", P)):
        for M in range(first, 3 * P + 1):
            report = run(name, stages=P, microbatches=M)
            assert report.makespan_ms == pytest.approx((M + P - 1) * (T_F + T_B)), (name, M)
            assert report.bubble == pytest.approx((P - 1) / (M + P - 1)), (name, M)


def interleaved_makespan(*, stages: int, chunks: int, microbatches: int) -> float:
    """PyTorch's interleaved order at constant durations; every chunk's F costs t_f, its B t_b.

    M >= P: the last stage cannot start before (P-1) t_f, has v M (t_f + t_b) of work, and its
    last backward still crosses P-1 stages: (v M + P - 1)(t_f + t_b). That is the stage-window
    lower bound, so the order is optimal there (checked below).
    M < P: the M microbatches of chunk c have left a stage before the first comes back on chunk
    c+1 (P > M steps later), so chunks never compete; the last virtual stage runs F, B per
    microbatch from (V-1) t_f on, then the last B crosses V-1 virtual stages, V = v P:
    (V + M - 1)(t_f + t_b).
    Together: (v max(M, P) + min(M, P) - 1)(t_f + t_b), bubble 1 - v M / (v max(M, P) + min(M, P) - 1),
    which for M >= P is (P - 1) / (v M + P - 1): 1F1B's (P - 1) / (M + P - 1) divided by about v.
    """
    P, v, M = stages, chunks, microbatches
    return (v * max(M, P) + min(M, P) - 1) * (T_F + T_B)


@pytest.mark.parametrize("stages", range(1, 7))
@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_makespan_and_bubble(stages: int, chunks: int) -> None:
    P, v = stages, chunks
    tested = 0
    for M in range(1, 3 * P + 1):
        if not builds("interleaved", stages=P, chunks=v, microbatches=M):
            continue
        tested += 1
        report = run("interleaved", stages=P, chunks=v, microbatches=M)
        expected = interleaved_makespan(stages=P, chunks=v, microbatches=M)
        assert report.makespan_ms == pytest.approx(expected), M
        assert report.bubble == pytest.approx(1 - v * M * (T_F + T_B) / expected), M
        if M >= P:
            assert report.bubble == pytest.approx((P - 1) / (v * M + P - 1)), M
            trace = constant(stages=P, microbatches=M, chunks=v)
            assert report.makespan_ms == pytest.approx(bounds(trace=trace, split=False).best_ms), M
    assert tested >= 3


@pytest.mark.parametrize("stages", range(1, 7))
def test_zb_h1_makespan(stages: int) -> None:
    P = stages
    for M in range(P, 3 * P + 1):
        if not builds("zb-h1", stages=P, chunks=1, microbatches=M):
            continue
        report = run("zb-h1", stages=P, microbatches=M)
        assert report.makespan_ms == pytest.approx(M * (T_F + T_B) + (P - 1) * T_F), M
        assert report.bubble == pytest.approx((P - 1) / (3 * M + P - 1)), M


@pytest.mark.parametrize("stages,microbatches", [(1, 3), (4, 4), (4, 16), (6, 13)])
def test_peak_inflight_1f1b_holds_p_minus_s_and_gpipe_m(stages: int, microbatches: int) -> None:
    one_f_one_b = run("1f1b", stages=stages, microbatches=microbatches)
    gpipe = run("gpipe", stages=stages, microbatches=microbatches)
    assert [s.peak_inflight for s in one_f_one_b.stages] == [stages - s for s in range(stages)]
    assert [s.peak_inflight for s in gpipe.stages] == [microbatches] * stages
    assert one_f_one_b.peak_inflight == stages and gpipe.peak_inflight == microbatches


def test_ready_policies_respect_the_cap_in_peak_inflight() -> None:
    for cap, expected in (("1x", 4), ("2x", 8), ("3", 3)):
        assert run("bf", stages=4, microbatches=16, cap=cap).peak_inflight == expected


# --- invariants, checked from the events ------------------------------------------------


def check_run(
    report: IterationReport, *, policy: Policy, trace: Trace, cap: Cap, buffer_limit: int | None = None
) -> None:
    """Everything a run must satisfy, derived from its events and the trace alone.

    Readiness of an op = the end of its local need and the arrival (sender's end + latency) of
    its delivery. With unbounded buffers this is also when the simulator made it ready, and:
    fixed policies start each list op as soon as the stage is free and the op is ready; other
    policies never idle while an op is eligible (ready, and if it is an admission, the stage
    is under its caps), and start the op their rule ranks first among the eligible ones.
    """
    layout = layout_for(policy=policy, trace=trace)
    ops: dict[Action, OpEvent] = {}
    for event in report.events:
        action = parse_action(event.action, stages=layout.stages, placement=layout.placement)
        assert action not in ops, f"{action} ran twice"
        assert action.stage == event.stage
        assert event.end_ms - event.start_ms == pytest.approx(trace.duration(action))
        ops[action] = event
    for stage in range(layout.stages):
        assert {a for a in ops if a.stage == stage} == set(layout.actions(stage=stage)), f"stage {stage} incomplete"
    ready = readiness(ops, layout=layout, trace=trace)
    for action, event in ops.items():
        assert event.start_ms >= ready[action], f"{action} started at {event.start_ms} before ready at {ready[action]}"
        if buffer_limit is None:
            assert event.ready_ms == ready[action], action
    assert report.makespan_ms == max(e.end_ms for e in report.events)
    assert report.makespan_ms >= bounds(trace=trace, split=layout.split).best_ms * (1 - 1e-12)
    compute = sum(e.end_ms - e.start_ms for e in report.events)
    assert report.bubble == pytest.approx(1 - compute / (layout.stages * report.makespan_ms))
    for stage in range(layout.stages):
        timeline = sorted((a for a in ops if a.stage == stage), key=lambda a: ops[a].start_ms)
        for before, after in zip(timeline, timeline[1:]):
            assert ops[after].start_ms >= ops[before].end_ms, f"{before} and {after} overlap"
        if buffer_limit is not None:
            assert report.stages[stage].peak_buffered <= buffer_limit
            continue
        memory = memories(cap=cap, policy=policy, trace=trace, layout=layout, limits=None)[stage]
        arbiter = Arbiter(layout=layout, stage=stage, policy=policy, cap=cap, memory=memory)
        if memory is not None and cap.multiple >= 1:  # the reference holds every microbatch: one always fits
            limit = memory.limit_fw if math.isfinite(memory.limit_fw) else memory.limit_fb
            assert report.stages[stage].peak_bytes <= limit * (1 + 1e-9) + 1, f"stage {stage} past its byte cap"
        if policy.fixed:
            check_fixed(timeline, ops=ops, ready=ready, order=policy.order[stage])
        else:
            check_greedy(timeline, ops=ops, ready=ready, policy=policy, arbiter=arbiter)


def readiness(ops: dict[Action, OpEvent], *, layout: Layout, trace: Trace) -> dict[Action, float]:
    arrival = {}
    for action, event in ops.items():
        message = layout.sends(action)
        if message is not None:
            arrival[message] = event.end_ms + trace.latency(message)
    ready = {}
    for action in ops:
        local, message = layout.local_need(action), layout.message_need(action)
        times = [0.0]
        if local is not None:
            times.append(ops[local].end_ms)
        if message is not None:
            times.append(arrival[message])
        ready[action] = max(times)
    return ready


def check_fixed(timeline: list[Action], *, ops: dict, ready: dict, order: list[Action]) -> None:
    assert timeline == order, "a fixed policy must run exactly its list"
    free = 0.0
    for action in timeline:
        assert ops[action].start_ms == max(free, ready[action]), f"{action} started late"
        free = ops[action].end_ms


def admits(action: Action) -> bool:
    return action.kind is Kind.F and action.chunk == 0


def check_greedy(timeline: list[Action], *, ops: dict, ready: dict, policy: Policy, arbiter: Arbiter) -> None:
    split = arbiter.layout.split
    for k, action in enumerate(timeline):
        start = ops[action].start_ms
        free = ops[timeline[k - 1]].end_ms if k else 0.0
        done, pending = timeline[:k], timeline[k:]
        held_fb = sum(admits(a) for a in done) - sum(a.kind.backward and a.chunk == 0 for a in done)
        release = Kind.W if split else Kind.B
        held_fw = sum(admits(a) for a in done) - sum(a.kind is release and a.chunk == 0 for a in done)
        room = held_fb < arbiter.cap_fb and held_fw < arbiter.cap_fw
        if arbiter.memory is None:
            allowed = [a for a in pending if room or not admits(a)]
            idle_eligible = [a for a in allowed if ready[a] < start and start > free]
            eligible = [a for a in allowed if ready[a] <= start]
        else:
            fits = byte_room(done, arbiter=arbiter, release=release)
            idle_eligible = [
                a
                for a in pending
                if ready[a] < start
                and start > free
                and fits(a, pending=pending, ready=ready, at=max(ready[a], free), rule=policy.rule is not None)
            ]
            eligible = [
                a
                for a in pending
                if ready[a] <= start and fits(a, pending=pending, ready=ready, at=start, rule=policy.rule is not None)
            ]
        assert not idle_eligible, f"idle on [{free}, {start}) while {idle_eligible[0]} was eligible"
        assert action in eligible, f"{action} ran while not eligible (cap {arbiter.cap_fb}/{arbiter.cap_fw})"
        expected = bf_choice(eligible, done=done) if policy.rule else list_choice(eligible, arbiter=arbiter)
        assert action == expected, f"ran {action} at {start}, the policy ranks {expected} first"


def byte_room(done: list[Action], *, arbiter: Arbiter, release: Kind):
    """Whether an action may start, by bytes: any non-admission; an admission only as the first the
    picker ranks among those ready, and when its bytes fit (or the stage holds none)."""
    memory = arbiter.memory
    held = [a.microbatch for a in done if admits(a)]
    freed_fb = [a.microbatch for a in done if a.kind.backward and a.chunk == 0]
    freed_fw = [a.microbatch for a in done if a.kind is release and a.chunk == 0]
    bytes_fb = sum(memory.held[m] for m in held) - sum(memory.held[m] for m in freed_fb)
    bytes_fw = sum(memory.held[m] for m in held) - sum(memory.held[m] for m in freed_fw)
    empty_fb, empty_fw = len(held) == len(freed_fb), len(held) == len(freed_fw)

    def fits(action: Action, *, pending: list[Action], ready: dict, at: float, rule: bool) -> bool:
        if not admits(action):
            return True
        rank = (lambda a: a.microbatch) if rule else arbiter.hint_position
        head = min((a for a in pending if admits(a) and ready[a] <= at), key=rank)
        weight = memory.held[action.microbatch]
        return head == action and (
            (empty_fb or bytes_fb + weight <= memory.limit_fb * (1 + 1e-9))
            and (empty_fw or bytes_fw + weight <= memory.limit_fw * (1 + 1e-9))
        )

    return fits


def list_choice(eligible: list[Action], *, arbiter: Arbiter) -> Action:
    return min(eligible, key=arbiter.hint_position)


def bf_choice(eligible: list[Action], *, done: list[Action]) -> Action:
    """The paper's BF (see rrfp_ray.policy.pickers): B turn after an F (or at the start), W only when idle."""
    backwards = sorted((a for a in eligible if a.kind.backward), key=lambda a: (-a.chunk, a.microbatch))
    later = sorted((a for a in eligible if a.kind is Kind.F and a.chunk > 0), key=lambda a: (a.chunk, a.microbatch))
    admissions = sorted((a for a in eligible if admits(a)), key=lambda a: a.microbatch)
    weights = sorted((a for a in eligible if a.kind is Kind.W), key=lambda a: (a.microbatch, -a.chunk))
    last = [a.kind for a in done if a.kind is not Kind.W][-1:]
    backward_turn = last in ([], [Kind.F])
    order = [*backwards, *later, *admissions] if backward_turn else [*later, *admissions, *backwards]
    return (order or weights)[0]


@st.composite
def traces(draw, *, stages: int, microbatches: int, chunks: int, comm: bool = True) -> Trace:
    seed = draw(st.integers(0, 2**16))
    if draw(st.booleans()):
        scenarios = SCENARIOS + MIXES if comm else ("none", "lognormal", "straggler", "imbalance", "multimodal")
        scenario = draw(st.sampled_from(scenarios))
        return generate(scenario=scenario, stages=stages, microbatches=microbatches, chunks=chunks, seed=seed)
    return integer_trace(stages=stages, microbatches=microbatches, chunks=chunks, seed=seed, comm=comm)


def integer_trace(*, stages: int, microbatches: int, chunks: int, seed: int, comm: bool) -> Trace:
    """Small integer durations: many ties, the cases where event order matters."""
    rng = random.Random(seed)
    V = stages * chunks

    def rows(count: int, low: int, high: int) -> list[list[float]]:
        return [[float(rng.randint(low, high)) for _ in range(microbatches)] for _ in range(count)]

    return Trace(
        stages=stages,
        microbatches=microbatches,
        chunks=chunks,
        F=rows(V, 1, 3),
        B=rows(V, 1, 4),
        W=rows(V, 0, 2),
        commF=rows(V - 1, 0, 2 if comm else 0),
        commB=rows(V - 1, 0, 2 if comm else 0),
    )


@st.composite
def cases(draw, *, names: tuple[str, ...] | None = None) -> tuple[Policy, Trace, Cap]:
    stages = draw(st.integers(1, 8))
    chunks = draw(st.integers(1, 3))
    choices = names or ((LIST_POLICIES_V1 if chunks == 1 else LIST_POLICIES_V) + RULES)
    usable = [n for n in choices if builds(n, stages=stages, chunks=chunks, microbatches=2 * stages)]
    name = draw(st.sampled_from(usable))
    counts = [m for m in range(1, max(stages, 12) + 1) if builds(name, stages=stages, chunks=chunks, microbatches=m)]
    microbatches = draw(st.sampled_from(counts))
    policy = make_policy(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
    trace = draw(traces(stages=stages, microbatches=microbatches, chunks=chunks))
    return policy, trace, Cap.parse(draw(st.sampled_from(CAPS)))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_every_run_completes_and_keeps_every_invariant(case: tuple[Policy, Trace, Cap]) -> None:
    policy, trace, cap = case
    report = simulate(policy=policy, trace=trace, cap=cap)
    check_run(report, policy=policy, trace=trace, cap=cap)


def test_the_checker_catches_an_idle_stage() -> None:
    """check_run is strict: the same events under a policy that should not have idled fail it."""
    trace = generate(scenario="lognormal", stages=4, microbatches=8, chunks=1, seed=3)
    fixed = make_policy(name="1f1b", stages=4, chunks=1, microbatches=8)
    report = simulate(policy=fixed, trace=trace, cap=Cap.parse("2x"))
    check_run(report, policy=fixed, trace=trace, cap=Cap.parse("2x"))
    ready = make_policy(name="ready-1f1b", stages=4, chunks=1, microbatches=8)
    with pytest.raises(AssertionError, match="idle|ranks"):
        check_run(report, policy=ready, trace=trace, cap=Cap.parse("2x"))


# --- the paper's bound on BF (v = 1) ----------------------------------------------------


def flat_trace(*, F: list[list[float]], B: list[list[float]]) -> Trace:
    """One chunk, no W, no communication."""
    P, M = len(F), len(F[0])
    zeros = [[0.0] * M for _ in range(P)]
    return Trace(stages=P, microbatches=M, chunks=1, F=F, B=B, W=zeros, commF=zeros[: P - 1], commB=zeros[: P - 1])


def bf_makespan(trace: Trace, *, cap: str) -> float:
    policy = make_policy(name="bf", stages=trace.stages, chunks=1, microbatches=trace.microbatches)
    return simulate(policy=policy, trace=trace, cap=Cap.parse(cap)).makespan_ms


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_bf_bound_holds_without_a_cap(data: st.DataObject) -> None:
    stages = data.draw(st.integers(1, 8))
    microbatches = data.draw(st.integers(stages, 3 * stages))
    trace = data.draw(traces(stages=stages, microbatches=microbatches, chunks=1, comm=False))
    assert bf_makespan(trace, cap="inf") <= bf_bound(trace=trace) * (1 + 1e-12)


@pytest.mark.parametrize("stages,microbatches", [(1, 4), (4, 4), (4, 16), (8, 20)])
def test_bf_bound_is_1f1b_at_constant_durations(stages: int, microbatches: int) -> None:
    trace = constant(stages=stages, microbatches=microbatches)
    assert bf_bound(trace=trace) == pytest.approx((microbatches + stages - 1) * (T_F + T_B))
    assert bf_makespan(trace, cap="inf") == pytest.approx(bf_bound(trace=trace))


def test_bf_bound_fails_under_the_1x_cap() -> None:
    """Counterexample: stage 0 (cap 2) must wait for B0 before F2, and stage 1 idles meanwhile."""
    trace = flat_trace(F=[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], B=[[2.0, 1.0, 1.0], [2.0, 1.0, 2.0]])
    assert bf_bound(trace=trace) == 10.0
    assert bf_makespan(trace, cap="inf") == 10.0
    assert bf_makespan(trace, cap="1x") == 11.0


def test_bf_bound_other_reading_is_not_a_bound() -> None:
    """F read as microbatch 0's forward latency plus the last stage's other forwards (B alike)
    undercounts a microbatch that is slow on every stage."""
    F, B = [[1.0, 3.0], [1.0, 3.0]], [[1.0, 1.0], [1.0, 1.0]]
    P, M, last = 2, 2, 1
    forward = sum(F[s][0] for s in range(P)) + sum(F[last][j] for j in range(1, M))
    backward = sum(B[last][j] for j in range(M - 1)) + sum(B[s][M - 1] for s in range(P))
    penalties = sum(max(F[s][j] for s in range(P)) - F[last][j] for j in range(1, M)) + sum(
        max(B[s][j] for s in range(P)) - B[last][j] for j in range(M - 1)
    )
    trace = flat_trace(F=F, B=B)
    assert forward + backward + penalties == 8.0
    assert bf_makespan(trace, cap="inf") == 9.0 <= bf_bound(trace=trace) == 10.0


def test_bf_bound_rejects_chunks_and_comm() -> None:
    with pytest.raises(ValueError, match="chunks"):
        bf_bound(trace=constant(stages=2, microbatches=4, chunks=2))
    with pytest.raises(ValueError, match="comm"):
        bf_bound(trace=generate(scenario="comm", stages=2, microbatches=4, chunks=1, seed=0))


# --- bounded receive buffers --------------------------------------------------------------


def min_buffer(*, policy: Policy, trace: Trace, cap: Cap) -> int:
    """The rule in rrfp_ray/policy/arbiter.py: 1 + the largest cap drop into a stage whose chunk 0 waits for
    gradients; under a byte gate, a stage's cap is the most microbatches its F->B limit admits (the lightest
    first) upstream, and 1 at the stage itself (one heavy microbatch may fill it)."""
    layout = layout_for(policy=policy, trace=trace)
    gates = memories(cap=cap, policy=policy, trace=trace, layout=layout, limits=None)
    counts = [Arbiter(layout=layout, stage=s, policy=policy, cap=cap).cap_fb for s in range(layout.stages)]
    most = [count if gate is None else _most_admitted(gate.held, gate.limit_fb) for count, gate in zip(counts, gates)]
    least = [count if gate is None else 1 for count, gate in zip(counts, gates)]
    drops = [
        most[s - 1] - least[s] for s in range(1, layout.stages) if s < layout.virtual_stages - 1 and least[s] < math.inf
    ]
    return 1 + int(max([0, *drops]))


def _most_admitted(held: tuple[float, ...], limit: float) -> float:
    """How many microbatches fit under `limit` at once, the lightest first (at least 1: an empty stage admits)."""
    if limit == math.inf:
        return math.inf
    total, count = 0.0, 0
    for size in sorted(held):
        total += size
        if total > limit * (1 + 1e-9):
            break
        count += 1
    return max(count, 1)


READY_NAMES = ("ready-gpipe", "ready-1f1b", "ready-zb-h1", "ready-interleaved", *RULES)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(names=READY_NAMES), extra=st.integers(0, 2))
def test_ready_policies_complete_with_the_minimum_buffer(case: tuple[Policy, Trace, Cap], extra: int) -> None:
    policy, trace, cap = case
    limit = min_buffer(policy=policy, trace=trace, cap=cap) + extra
    report = simulate(policy=policy, trace=trace, cap=cap, buffer_limit=limit)
    check_run(report, policy=policy, trace=trace, cap=cap, buffer_limit=limit)


@pytest.mark.parametrize(
    "name,chunks,cap,scenario,seed,needed",
    [
        ("bf", 1, "1x", "none", 0, 2),
        ("bf", 1, "2x", "lognormal", 0, 3),
        ("bfw", 1, "2x", "lognormal", 17, 3),
        ("ready-1f1b", 1, "1x", "none", 0, 2),
        ("bf", 2, "1x", "none", 0, 3),
        ("bf", 2, "2x", "straggler", 4, 5),
        ("ready-interleaved", 2, "2x", "straggler", 4, 5),
        ("bf", 3, "2x", "none", 0, 1),
        ("bf", 1, "4", "lognormal", 0, 1),
    ],
)
def test_minimum_buffer_is_tight(name: str, chunks: int, cap: str, scenario: str, seed: int, needed: int) -> None:
    """One message less than the rule deadlocks (P=4, M=16); the rule itself never does."""
    P, M = 4, 16
    policy = make_policy(name=name, stages=P, chunks=chunks, microbatches=M)
    trace = generate(scenario=scenario, stages=P, microbatches=M, chunks=chunks, seed=seed)
    assert min_buffer(policy=policy, trace=trace, cap=Cap.parse(cap)) == needed
    simulate(policy=policy, trace=trace, cap=Cap.parse(cap), buffer_limit=needed)
    if needed > 1:
        with pytest.raises(DeadlockError, match="stopped at"):
            simulate(policy=policy, trace=trace, cap=Cap.parse(cap), buffer_limit=needed - 1)


def test_buffer_limit_must_be_positive() -> None:
    policy = make_policy(name="bf", stages=2, chunks=1, microbatches=4)
    with pytest.raises(ValueError, match="buffer_limit"):
        simulate(policy=policy, trace=constant(stages=2, microbatches=4), cap=Cap.parse("1x"), buffer_limit=0)


# --- batch simulation ---------------------------------------------------------------------


def test_simulate_many_gives_the_makespans_of_one_call_each() -> None:
    """Mixed policies, placements, traces, caps, buffers and transports, traces shared between cases."""
    cases = []
    for stages, chunks, names in ((4, 1, ("1f1b", "zb-h1", "bf", "bfw", "cpw")), (4, 2, ("zbv", "ready-interleaved"))):
        microbatches = 8
        for seed, scenario in enumerate(("lognormal", "multimodal+comm")):
            trace = generate(scenario=scenario, stages=stages, microbatches=microbatches, chunks=chunks, seed=seed)
            for name in names:
                policy = make_policy(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
                for cap, limit, transport in (
                    ("1x", None, None),
                    ("2x", 3, None),
                    ("inf", None, TransportModel(message_ms=0.5)),
                ):
                    cases.append(
                        Case(policy=policy, trace=trace, cap=Cap.parse(cap), buffer_limit=limit, transport=transport)
                    )
    one_each = [
        simulate(
            policy=c.policy, trace=c.trace, cap=c.cap, buffer_limit=c.buffer_limit, transport=c.transport
        ).makespan_ms
        for c in cases
    ]
    assert simulate_many(cases=cases) == one_each
    assert len(set(one_each)) > len(cases) // 2  # the cases differ


def test_simulate_many_raises_on_a_deadlocking_case() -> None:
    policy = make_policy(name="bf", stages=4, chunks=1, microbatches=16)
    trace = generate(scenario="none", stages=4, microbatches=16, chunks=1, seed=0)
    ok = Case(policy=policy, trace=trace, cap=Cap.parse("1x"), buffer_limit=2)
    with pytest.raises(DeadlockError, match="stopped at"):
        simulate_many(cases=[ok, Case(policy=policy, trace=trace, cap=Cap.parse("1x"), buffer_limit=1)])


def test_a_report_builds_its_events_on_first_read_with_the_stats_they_give() -> None:
    trace = generate(scenario="lognormal", stages=4, microbatches=8, chunks=2, seed=3)
    policy = make_policy(name="interleaved", stages=4, chunks=2, microbatches=8)
    report = simulate(policy=policy, trace=trace, cap=Cap.parse("1x"))
    assert "events" not in vars(report)
    copied = pickle.loads(pickle.dumps(report))  # pickling builds them
    layout = layout_for(policy=policy, trace=trace)
    assert len(report.events) == len(copied.events) == sum(len(layout.actions(stage=s)) for s in range(4))
    assert copied == report
    assert IterationReport.from_json(report.to_json(with_events=True)) == report
    for stats in report.stages:
        own = [e for e in report.events if e.stage == stats.stage]
        expected = stage_stats(stage=stats.stage, events=own, wall_ms=report.makespan_ms)
        peaks = {"peak_inflight": stats.peak_inflight, "peak_buffered": stats.peak_buffered}
        assert stats == replace(expected, peak_bytes=stats.peak_bytes, **peaks)
