"""Policies: which eligible action a stage runs next.

A policy is plain data (`Policy`), built once from its CLI name and sent to every stage;
each stage's arbiter turns it into a `Picker` that holds that stage's ready actions.

- fixed (a schedule name: `gpipe`, `1f1b`, `interleaved`, `looped-bfs`, `zb-h1`,
  `zb-interleaved`, `zbv`, `dualpipev`; or `hint`): only the next action of the list.
- `ready-<schedule>` / `ready-hint`: the first *ready* action in list order.
- `bf`: alternate one ready backward (B, or I under the split) then one ready F; F prefers the lowest chunk, B the highest,
  then the lowest microbatch. `bfw` adds the B/W split: W only when no F or B is eligible.
- `cpw`: `bfw`, except that when an admission waits on the F->W cap alone, the chunk-0 W that
  frees it runs first (it inherits the admission's priority); see `CPWPicker` and
  docs/policy_past_bf.md.

The memory cap gates only *admissions* (chunk-0 F, where a microbatch enters the stage).
Forwards of later chunks and all backwards are never gated: they are what frees memory, so
an admitted microbatch can always reach its loss and come back, and no cap >= 1 can
deadlock. `bf` with v > 1 ranks an admission after every runnable later-chunk forward of
an already admitted microbatch ("finish what you started"); see `BFPicker`.

`ranked` lists a picker's best few actions without taking them and `take` takes any one of
them, for callers that must agree with others before starting one (`rrfp_ray.policy.agreement`).
"""

from __future__ import annotations

import copy
import enum
import heapq
from dataclasses import dataclass, field, replace

from rrfp_ray.schedule.actions import Action, Kind, Placement
from rrfp_ray.schedule.deps import Layout
from rrfp_ray.schedule.generators import SCHEDULES, build, lookup
from rrfp_ray.schedule.validate import Hint


class Rule(enum.Enum):
    """Policies that pick by rule over the ready set, not by a list."""

    BF = "bf"
    BFW = "bfw"
    CPW = "cpw"

    @property
    def split(self) -> bool:
        return self is not Rule.BF

    def picker(self) -> Picker:
        return CPWPicker() if self is Rule.CPW else BFPicker(with_w=self is Rule.BFW)


@dataclass(frozen=True)
class Policy:
    name: str
    order: dict[int, list[Action]] = field(repr=False)  # the hint list per stage (the reference list for rules)
    fixed: bool
    rule: Rule | None  # None for list policies
    split: bool
    placement: Placement = Placement.LOOPED

    def layout_over(self, pipeline: Layout) -> Layout:
        """The pipeline's layout with this policy's B/W split; its placement must be the pipeline's."""
        if self.placement is not pipeline.placement:
            raise ValueError(
                f"policy {self.name!r} runs on the {self.placement.value} placement, the pipeline was built "
                f"{pipeline.placement.value}: run policies of one placement on one pipeline"
            )
        return replace(pipeline, split=self.split)

    def picker(self, *, stage: int) -> Picker:
        if self.rule is not None:
            return self.rule.picker()
        if self.fixed:
            return FixedPicker(order=self.order[stage])
        return ListPicker(order=self.order[stage])


def policy_names() -> list[str]:
    return [*SCHEDULES, *(f"ready-{name}" for name in SCHEDULES), *(r.value for r in Rule), "hint", "ready-hint"]


def make_policy(*, name: str, stages: int, chunks: int, microbatches: int, hint: Hint | None = None) -> Policy:
    """Resolve a CLI policy name; `hint` is the user's order for `hint` / `ready-hint`."""
    base = name.removeprefix("ready-")
    if base == "hint":
        if hint is None:
            raise ValueError(f"policy {name!r} needs a hint order (--hint FILE)")
        split = any(a.kind is Kind.W for actions in hint.order.values() for a in actions)
        return Policy(name=name, order=hint.order, fixed=base == name, rule=None, split=split, placement=hint.placement)
    if name in {r.value for r in Rule}:
        rule = Rule(name)
        reference = ("zb-h1" if rule.split else "1f1b") if chunks == 1 else "interleaved"
        order = build(name=reference, stages=stages, chunks=chunks, microbatches=microbatches)
        return Policy(name=name, order=order, fixed=False, rule=rule, split=rule.split)
    if base not in SCHEDULES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    schedule = lookup(base)
    order = build(name=base, stages=stages, chunks=chunks, microbatches=microbatches)
    return Policy(
        name=name, order=order, fixed=base == name, rule=None, split=schedule.splits, placement=schedule.placement
    )


def _admits(action: Action) -> bool:
    return action.kind is Kind.F and action.chunk == 0


class FixedPicker:
    """Only the next action of the list may run; caps do not apply (the list is its own cap)."""

    def __init__(self, *, order: list[Action]) -> None:
        self._order = order
        self._next = 0
        self._ready: set[Action] = set()

    def add(self, action: Action) -> None:
        self._ready.add(action)

    def pick(self, *, admit: bool) -> Action | None:
        if self._next < len(self._order) and self._order[self._next] in self._ready:
            action = self._order[self._next]
            self._ready.remove(action)
            self._next += 1
            return action
        return None


class ListPicker:
    """The first ready action in list order, admissions only while the cap allows."""

    def __init__(self, *, order: list[Action]) -> None:
        self._pos = {action: i for i, action in enumerate(order)}
        self._admit: list[tuple[int, Action]] = []
        self._other: list[tuple[int, Action]] = []

    def add(self, action: Action) -> None:
        heapq.heappush(self._admit if _admits(action) else self._other, (self._pos[action], action))

    def pick(self, *, admit: bool) -> Action | None:
        heaps = [h for h in (self._other, self._admit if admit else None) if h]
        if not heaps:
            return None
        return heapq.heappop(min(heaps, key=lambda h: h[0][0]))[1]


class BFPicker:
    """Backward-forward alternation over ready actions (the paper's BF hint), W last (BFW).

    Forward preference: later-chunk forwards by (chunk, microbatch), then admissions by
    microbatch. Taken literally, "lowest chunk first" would rank every admission (chunk 0)
    first; with v > 1 a stage then admits up to its cap before it moves any admitted
    microbatch on, so backwards come late and the pipeline drains.
    """

    def __init__(self, *, with_w: bool) -> None:
        self._with_w = with_w
        self._backward_turn = True
        self._b: list[tuple[int, int, Action]] = []
        self._f_later: list[tuple[int, int, Action]] = []
        self._f_admit: list[tuple[int, int, Action]] = []
        self._w: list[tuple[int, int, Action]] = []

    def add(self, action: Action) -> None:
        if action.kind.backward:
            heapq.heappush(self._b, (-action.chunk, action.microbatch, action))
        elif action.kind is Kind.W:
            heapq.heappush(self._w, (action.microbatch, -action.chunk, action))
        else:
            heap = self._f_admit if _admits(action) else self._f_later
            heapq.heappush(heap, (action.chunk, action.microbatch, action))

    def _forward(self, *, admit: bool) -> Action | None:
        if self._f_later:
            return heapq.heappop(self._f_later)[2]
        if admit and self._f_admit:
            return heapq.heappop(self._f_admit)[2]
        return None

    def pick(self, *, admit: bool) -> Action | None:
        backward = heapq.heappop(self._b)[2] if self._backward_turn and self._b else None
        action = backward or self._forward(admit=admit)
        if action is None and self._b:
            action = heapq.heappop(self._b)[2]
        if action is None and self._with_w and self._w:
            return heapq.heappop(self._w)[2]
        if action is not None:
            self._backward_turn = action.kind is Kind.F
        return action


class CPWPicker(BFPicker):
    """BFW, plus priority inheritance for the W that frees a held admission.

    An admission (chunk-0 F) starts a microbatch's whole chain, the longest remaining path a
    stage can start. When the cap holds it and the F->B count is at a level at which an
    admission was allowed before, only the F->W cap can bind, so a chunk-0 W of a microbatch
    past its B is what lets the admission in: that W runs first (lowest microbatch), ahead of
    ready backwards. A ready later-chunk forward still comes first, as in BF. Otherwise this is
    BFW. The picker needs no durations: it counts its own chunk-0 F and B picks, which equals
    the arbiter's F->B count because a stage finishes each action before it picks the next.
    """

    def __init__(self) -> None:
        super().__init__(with_w=True)
        self._held = 0  # microbatches past their chunk-0 F and not their chunk-0 B
        self._admitted_at = -1  # the largest such count at which an admission was allowed

    def pick(self, *, admit: bool) -> Action | None:
        if admit:
            self._admitted_at = max(self._admitted_at, self._held)
        elif self._f_admit and not self._f_later and self._held <= self._admitted_at:
            freeing = self._chunk0_w()
            if freeing is not None:
                return freeing
        action = super().pick(admit=admit)
        if action is not None and action.chunk == 0:
            self._held += (action.kind is Kind.F) - action.kind.backward
        return action

    def _chunk0_w(self) -> Action | None:
        """Remove and return the lowest-microbatch chunk-0 W, if any."""
        entry = min((e for e in self._w if e[2].chunk == 0), default=None)
        if entry is None:
            return None
        self._w.remove(entry)
        heapq.heapify(self._w)
        return entry[2]


Picker = FixedPicker | ListPicker | BFPicker | CPWPicker


def ranked(picker: Picker, *, admit: bool, k: int) -> list[Action]:
    """Up to `k` actions `picker` could run now, best first, leaving it unchanged.

    The first is what `pick` returns; each next one is what `pick` would return were the
    earlier ones not ready (the picker's own state, e.g. BF's turn, as it is now)."""
    probe = copy.deepcopy(picker)
    state = _scalars(probe)
    actions: list[Action] = []
    while len(actions) < k and (action := probe.pick(admit=admit)) is not None:
        actions.append(action)
        vars(probe).update(state)
    return actions


def take(picker: Picker, *, action: Action, admit: bool) -> None:
    """Remove `action` from `picker` as `pick` would have, had it ranked first (see `ranked`)."""
    skipped: list[Action] = []
    state = _scalars(picker)
    chosen = picker.pick(admit=admit)
    while chosen != action:
        vars(picker).update(state)
        if chosen is None:
            for other in skipped:
                picker.add(other)
            raise ValueError(f"action {action} is not eligible")
        skipped.append(chosen)
        chosen = picker.pick(admit=admit)
    for other in skipped:
        picker.add(other)


def _scalars(picker: Picker) -> dict[str, bool | int]:
    """The picker's state besides its ready actions (turns and counters)."""
    return {name: value for name, value in vars(picker).items() if isinstance(value, (bool, int))}
