"""Policies: names, the three pickers, and what they run on constant-duration traces."""

from __future__ import annotations

import pytest

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.policy.arbiter import Arbiter
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.pickers import BFPicker, FixedPicker, ListPicker, Picker, hint_indexes
from rrfp_ray.policy.policy import Policy, Rule, make_policy, policy_names
from rrfp_ray.schedule.actions import Action, Kind, Placement, parse_action
from rrfp_ray.schedule.generators import build
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.schedule.slots import slots_of
from rrfp_ray.schedule.validate import Hint
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate


def acts(text: str, *, stages: int) -> list[Action]:
    return [parse_action(word, stages=stages) for word in text.split()]


class Driven:
    """A picker fed and read by action, through its layout's slots (stage `stage`)."""

    def __init__(self, picker: Picker, *, layout: Layout, stage: int = 0) -> None:
        self.picker, self.slots, self.stage = picker, slots_of(layout), stage

    def add(self, action: Action) -> None:
        self.picker.add(self.slots.slot_of(action))

    def pick(self, *, admit: bool) -> Action | None:
        slot = self.picker.pick(admit=admit)
        return None if slot < 0 else self.slots.action(stage=self.stage, slot=slot)


def bf(*, with_w: bool, stages: int = 1, chunks: int = 3, microbatches: int = 8) -> Driven:
    layout = Layout(stages=stages, chunks=chunks, microbatches=microbatches, split=with_w)
    return Driven(BFPicker(slots=slots_of(layout), with_w=with_w), layout=layout)


def listed(kind: type[FixedPicker | ListPicker], order: list[Action], *, stages: int, stage: int) -> Driven:
    layout = Layout(stages=stages, chunks=1, microbatches=1 + max(a.microbatch for a in order))
    policy = Policy(
        name="t", order={s: order if s == stage else [] for s in range(stages)}, fixed=True, rule=None, split=False
    )
    return Driven(kind(index=hint_indexes(policy=policy, layout=layout)[stage]), layout=layout, stage=stage)


def executed(report: IterationReport, *, stage: int) -> list[str]:
    events = sorted((e for e in report.events if e.stage == stage), key=lambda e: e.start_ms)
    return [e.action for e in events]


def texts(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions]


def run(
    name: str, *, stages: int, microbatches: int, chunks: int = 1, cap: str = "1x", **trace_args: float
) -> IterationReport:
    policy = make_policy(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
    trace = generate(scenario="none", stages=stages, microbatches=microbatches, chunks=chunks, seed=0, **trace_args)
    return simulate(policy=policy, trace=trace, cap=Cap.parse(cap))


# --- names -------------------------------------------------------------------------------


def test_policy_names_resolve() -> None:
    rules = {r.value for r in Rule}
    for name in policy_names():
        if name.endswith("hint"):
            continue
        base = name.removeprefix("ready-")
        chunks = 2 if base in ("interleaved", "zbv", "dualpipev") else 1
        policy = make_policy(name=name, stages=2, chunks=chunks, microbatches=4)
        assert policy.name == name
        assert policy.fixed == (not name.startswith("ready-") and name not in rules)
        split = ("zb-h1", "zb-h2", "zb-interleaved", "zbv", "dualpipev")
        assert policy.split == (base in split or name in ("bfw", "cpw"))
        assert policy.rule == (Rule(name) if name in rules else None)
        assert policy.placement is (Placement.V if base in ("zbv", "dualpipev") else Placement.LOOPED)


def test_rules_take_their_reference_list() -> None:
    assert make_policy(name="bf", stages=3, chunks=1, microbatches=6).order == build(
        name="1f1b", stages=3, chunks=1, microbatches=6
    )
    assert make_policy(name="bfw", stages=3, chunks=1, microbatches=6).order == build(
        name="zb-h1", stages=3, chunks=1, microbatches=6
    )
    assert make_policy(name="bf", stages=3, chunks=2, microbatches=6).order == build(
        name="interleaved", stages=3, chunks=2, microbatches=6
    )


def test_hint_policies() -> None:
    hint = Hint(order={0: acts("0F0 0F1 0B0 0B1", stages=1)}, placement=Placement.LOOPED)
    assert make_policy(name="hint", stages=1, chunks=1, microbatches=2, hint=hint).fixed
    ready = make_policy(name="ready-hint", stages=1, chunks=1, microbatches=2, hint=hint)
    assert not ready.fixed and not ready.split
    with pytest.raises(ValueError, match="hint"):
        make_policy(name="ready-hint", stages=1, chunks=1, microbatches=2)


@pytest.mark.parametrize("name", ["fifo", "ready-bf", "ready-", "BF"])
def test_unknown_policy_names_the_policy(name: str) -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy(name=name, stages=2, chunks=1, microbatches=4)


@pytest.mark.parametrize(
    "text,limit",
    [("1x", 4), ("2x", 8), ("1.5x", 6), ("0.1x", 1), ("3", 3), ("inf", float("inf")), (" 2X ", 8)],
)
def test_cap_parse_and_limit(text: str, limit: float) -> None:
    assert Cap.parse(text).limit(peak=4) == limit


@pytest.mark.parametrize("text", ["0", "0x", "-1", "2y", "", "x", "1.5"])
def test_bad_caps_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cap"):
        Cap.parse(text)


# --- pickers -----------------------------------------------------------------------------


def test_fixed_picker_runs_only_the_next_list_action() -> None:
    picker = listed(FixedPicker, acts("0F0 0F1 0B0 0B1", stages=1), stages=1, stage=0)
    picker.add(parse_action("0F1", stages=1))
    assert picker.pick(admit=True) is None
    picker.add(parse_action("0F0", stages=1))
    assert picker.pick(admit=False) == parse_action("0F0", stages=1)  # the list is its own cap
    assert picker.pick(admit=True) == parse_action("0F1", stages=1)
    assert picker.pick(admit=True) is None


def test_list_picker_takes_the_first_ready_action_and_gates_admissions() -> None:
    picker = listed(ListPicker, acts("1F0 1F1 1B0 1F2 1B1 1B2", stages=2), stages=2, stage=1)
    for action in acts("1F2 1B1 1F1", stages=2):
        picker.add(action)
    assert picker.pick(admit=False) == parse_action("1B1", stages=2)
    assert picker.pick(admit=False) is None
    assert picker.pick(admit=True) == parse_action("1F1", stages=2)
    assert picker.pick(admit=True) == parse_action("1F2", stages=2)


def test_bf_picker_alternates_backward_and_forward() -> None:
    picker = bf(with_w=False)
    for action in acts("0F2 0F3 0B0 0B1", stages=1):
        picker.add(action)
    picked = [picker.pick(admit=True) for _ in range(5)]
    assert picked == [*acts("0B0 0F2 0B1 0F3", stages=1), None]


def test_bf_picker_falls_back_to_the_other_direction() -> None:
    picker = bf(with_w=False)
    for action in acts("0B0 0B1", stages=1):
        picker.add(action)
    assert [picker.pick(admit=True) for _ in range(2)] == acts("0B0 0B1", stages=1)
    picker.add(parse_action("0F5", stages=1))
    picker.add(parse_action("0F6", stages=1))
    assert picker.pick(admit=True) == parse_action("0F5", stages=1)
    picker.add(parse_action("0B2", stages=1))
    assert picker.pick(admit=True) == parse_action("0B2", stages=1)  # after an F it is B's turn
    assert picker.pick(admit=True) == parse_action("0F6", stages=1)


def test_bf_picker_orders_within_a_direction() -> None:
    """Two stages, stage 0: virtual stage 2 is its chunk 1, virtual stage 4 its chunk 2."""
    picker = bf(with_w=False, stages=2)
    for action in acts("0B3 2B1 2B2 0B0", stages=2):
        picker.add(action)
    assert [picker.pick(admit=True) for _ in range(4)] == acts("2B1 2B2 0B0 0B3", stages=2)
    picker = bf(with_w=False, stages=2)
    for action in acts("0F4 4F3 4F1 2F2 0F3", stages=2):
        picker.add(action)
    assert [picker.pick(admit=True) for _ in range(5)] == acts("2F2 4F1 4F3 0F3 0F4", stages=2)


def test_bf_picker_gates_only_admissions() -> None:
    picker = bf(with_w=False, stages=2)
    for action in acts("0F0 2F1", stages=2):
        picker.add(action)
    assert picker.pick(admit=False) == parse_action("2F1", stages=2)
    assert picker.pick(admit=False) is None
    assert picker.pick(admit=True) == parse_action("0F0", stages=2)


def test_bfw_picker_runs_w_only_when_nothing_else_is_eligible() -> None:
    picker = bf(with_w=True)
    for action in acts("0W1 0W0 0F3 0I2", stages=1):
        picker.add(action)
    assert [picker.pick(admit=False) for _ in range(4)] == [*acts("0I2 0W0 0W1", stages=1), None]
    picker.add(parse_action("0I4", stages=1))
    assert picker.pick(admit=True) == parse_action("0F3", stages=1)  # still F's turn: a W does not take it
    assert picker.pick(admit=True) == parse_action("0I4", stages=1)


# --- what they run at constant durations -------------------------------------------------


EXACT = [(schedule, args) for schedule in ("gpipe", "1f1b") for args in ({}, {"b_ratio": 1.0}, {"b_ratio": 3.0})]


@pytest.mark.parametrize("schedule,trace_args", [*EXACT, ("zb-h1", {}), ("zb-h1", {"b_ratio": 3.0})])
def test_ready_list_at_1x_runs_exactly_its_list(schedule: str, trace_args: dict) -> None:
    """zb-h1 only with B = W >= t_f: with B = W = t_f / 2 (b_ratio 1) its list idles where
    a later action is ready, like interleaved below."""
    for stages in range(1, 7):
        for microbatches in range(stages, 3 * stages + 1):
            try:
                order = build(name=schedule, stages=stages, chunks=1, microbatches=microbatches)
            except ValueError:
                continue
            report = run(f"ready-{schedule}", stages=stages, microbatches=microbatches, **trace_args)
            for s in range(stages):
                assert executed(report, stage=s) == texts(order[s]), (stages, microbatches, s)


@pytest.mark.parametrize(
    "schedule,chunks,trace_args",
    [
        ("interleaved", 2, {}),
        ("interleaved", 3, {}),
        ("interleaved", 2, {"b_ratio": 1.0}),
        ("zb-h1", 1, {"b_ratio": 1.0}),
    ],
)
def test_ready_list_at_1x_matches_its_list_makespan(schedule: str, chunks: int, trace_args: dict) -> None:
    """Not its order: these lists idle at constant durations where a later action is ready and
    admissible, and the ready policy runs it there, without changing the makespan."""
    differs = 0
    for stages in range(1, 7):
        for microbatches in range(stages, 3 * stages + 1):
            try:
                fixed = run(schedule, stages=stages, chunks=chunks, microbatches=microbatches, **trace_args)
            except ValueError:
                continue
            ready = run(f"ready-{schedule}", stages=stages, chunks=chunks, microbatches=microbatches, **trace_args)
            assert ready.makespan_ms == fixed.makespan_ms, (stages, microbatches)
            differs += any(executed(ready, stage=s) != executed(fixed, stage=s) for s in range(stages))
    assert differs > 0


def test_ready_interleaved_fills_the_lists_idle_gap() -> None:
    """P=4, v=2, M=8: the list makes stage 0 wait for 4B0 (its chunk 1, ready at 14) after 0F6;
    the ready policy runs the already admissible 0F7 at 11 instead."""
    report = run("ready-interleaved", stages=4, chunks=2, microbatches=8, t_f=1.0)
    fixed = run("interleaved", stages=4, chunks=2, microbatches=8, t_f=1.0)
    starts = {e.action: e.start_ms for e in report.events if e.stage == 0}
    fixed_starts = {e.action: e.start_ms for e in fixed.events if e.stage == 0}
    assert (fixed_starts["4B0"], fixed_starts["0F7"]) == (14.0, 16.0)
    assert (starts["0F7"], starts["4B0"]) == (11.0, 14.0)


def test_readiness_can_lose_to_the_fixed_list() -> None:
    """Greedy is not optimal: with B = 2.1 t_f and W = 0.9 t_f (P=3, M=3) stage 1 starts 1W1 at
    112 because 1I2 is ready only at 113, and 1I2 then waits until 121."""
    args = {"t_f": 10.0, "b_ratio": 3.0, "w_split": 0.3}
    ready = run("ready-zb-h1", stages=3, microbatches=3, **args)
    fixed = run("zb-h1", stages=3, microbatches=3, **args)
    assert (ready.makespan_ms, fixed.makespan_ms) == (172.0, 164.0)
    assert {e.action: e.start_ms for e in ready.events if e.stage == 1}["1I2"] == 121.0


def test_fixed_policies_run_their_list_under_jitter_at_any_cap() -> None:
    for name, chunks in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
        policy = make_policy(name=name, stages=4, chunks=chunks, microbatches=8)
        trace = generate(scenario="lognormal+comm", stages=4, microbatches=8, chunks=chunks, seed=1)
        for cap in ("1", "1x", "inf"):
            report = simulate(policy=policy, trace=trace, cap=Cap.parse(cap))
            assert all(executed(report, stage=s) == texts(policy.order[s]) for s in range(4)), (name, cap)


# The literal "F prefers the lowest chunk" rule (an admission, chunk 0, ranked before the
# forwards of admitted microbatches) gives 1.078, 1.131, 1.040, 1.061, 1.090, 1.120, 1.053,
# 1.081, 1.048, 1.025, 1.059, 1.091 on this grid; BFPicker's rule at most 1.039 (P=4, v=3, M=16).
BF_GRID = [(P, v, M) for P in (2, 3, 4) for v in (2, 3) for M in (4 * P, 8 * P)]


@pytest.mark.parametrize("stages,chunks,microbatches", BF_GRID)
def test_bf_with_chunks_keeps_up_with_interleaved_at_1x(stages: int, chunks: int, microbatches: int) -> None:
    bf = run("bf", stages=stages, chunks=chunks, microbatches=microbatches)
    interleaved = run("interleaved", stages=stages, chunks=chunks, microbatches=microbatches)
    assert bf.makespan_ms <= 1.05 * interleaved.makespan_ms
    assert bf.peak_inflight <= interleaved.peak_inflight


def test_bf_admits_no_more_than_the_cap_with_chunks() -> None:
    policy = make_policy(name="bf", stages=4, chunks=2, microbatches=16)
    trace = generate(scenario="lognormal", stages=4, microbatches=16, chunks=2, seed=0)
    report = simulate(policy=policy, trace=trace, cap=Cap.parse("3"))
    assert max(s.peak_inflight for s in report.stages) == 3
    assert {e.action for e in report.events} >= {f"{4 + s}{k}{m}" for s in range(4) for k in "FB" for m in range(16)}


@pytest.mark.parametrize("policy", ["1f1b", "bfw"])
def test_a_second_delivery_of_one_message_is_refused_before_and_after_its_action_starts(policy):
    layout = Layout(stages=2, chunks=1, microbatches=2, split=policy == "bfw")
    arbiter = Arbiter(
        layout=layout, stage=1, policy=make_policy(name=policy, stages=2, chunks=1, microbatches=2), cap=Cap.parse("1x")
    )
    forward = layout.action(kind=Kind.F, virtual_stage=1, microbatch=0)
    message = layout.message_need(forward)
    arbiter.on_arrival(message)
    with pytest.raises(ValueError, match="duplicate delivery"):
        arbiter.on_arrival(message)
    assert arbiter.next_action() == (forward, False)
    with pytest.raises(ValueError, match="duplicate delivery"):
        arbiter.on_arrival(message)
