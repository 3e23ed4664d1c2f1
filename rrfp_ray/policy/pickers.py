"""Policies: which eligible action a stage runs next.

A policy is plain data (`Policy`), built once from its CLI name and sent to every stage;
each stage's arbiter turns it into a `Picker` that holds that stage's ready actions.

- fixed (a schedule name: `gpipe`, `1f1b`, `interleaved`, `looped-bfs`, `zb-h1`,
  `zb-interleaved`, `zbv`, `dualpipev`; or `hint`): only the next action of the list.
- `ready-<schedule>` / `ready-hint`: the first *ready* action in list order.
- `bf`: alternate one ready backward (B, or I under the split) then one ready F; F prefers the lowest chunk, B the
  highest, then the lowest microbatch. `bfw` adds the B/W split: W only when no F or B is eligible.
- `cpw`: `bfw`, except that when an admission waits on the F->W cap alone, the chunk-0 W that
  frees it runs first (it inherits the admission's priority); see `CPWPicker` and
  docs/policy_past_bf.md.

The memory cap gates only *admissions* (chunk-0 F, where a microbatch enters the stage).
Forwards of later chunks and all backwards are never gated: they are what frees memory, so
an admitted microbatch can always reach its loss and come back, and no cap >= 1 can
deadlock. `bf` with v > 1 ranks an admission after every runnable later-chunk forward of
an already admitted microbatch ("finish what you started"); see `BFPicker`.

Pickers hold a stage's ready actions as slots (`rrfp_ray.schedule.slots`), ranked by integer
keys in heaps, and the stage's hint list as a `HintIndex`, built once per policy and layout.
Where a ready slot goes is data: `add(slot)` pushes `key_of[slot]` onto `heaps[heap_of[slot]]`,
which the arbiter does itself on its hot path (the heaps are changed in place, never replaced).
Besides its ready set a picker has a small state of its own (BF's turn, CPW's counters), which
`snapshot` returns and `restore` sets back: `ranked` lists a picker's best few actions without
taking them and `take` takes any one of them, for callers that must agree with others before
starting one (`rrfp_ray.policy.agreement`). A capped picker's `next_admission` names the
admission it would take first (-1: none), which the arbiter's byte gate weighs.
"""

from __future__ import annotations

import copy
import functools
import math
import weakref
from dataclasses import dataclass
from heapq import heapify, heappop, heappush

from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy, Rule
from rrfp_ray.schedule.actions import Action
from rrfp_ray.schedule.generators import peak_inflight, peak_inflight_fb
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.schedule.slots import Slots, interned, slots_of


@dataclass(frozen=True)
class HintIndex:
    """One stage's hint list over its layout's slots, with the in-flight peaks the caps scale."""

    slots: Slots
    stage: int
    order: list[int]  # per hint entry, its action's slot (`slots.outside`: not an action of this stage)
    position: list[int]  # per slot, its last place in the hint list (-1: not in it)
    started_by: list[int]  # per hint entry, the slot whose start counts as its start (W runs inside B unsplit)
    missing: Action | None  # the first action of the stage not in the hint list
    peak_fb: int  # `peak_inflight_fb` of the hint
    peak_fw: int  # `peak_inflight` of the hint (the F->W count: under the split only)
    first_places: tuple[list[int], list[int]]  # `FixedPicker`'s heap_of and key_of

    def count_caps(self, cap: Cap) -> tuple[float, float]:
        """The (F->B, F->W) in-flight counts `cap` allows over this hint (F->W inf without the split)."""
        return cap.limit(peak=self.peak_fb), cap.limit(peak=self.peak_fw) if self.slots.layout.split else math.inf


def picker_for(*, policy: Policy, index: HintIndex) -> Picker:
    """A fresh picker of `policy` for the stage and layout of `index` (one of `hint_indexes(policy=policy, ...)`)."""
    if policy.rule is not None:
        if policy.rule is Rule.CPW:
            return CPWPicker(slots=index.slots)
        return BFPicker(slots=index.slots, with_w=policy.rule is Rule.BFW)
    if policy.fixed:
        return FixedPicker(index=index)
    return ListPicker(index=index)


def hint_indexes(*, policy: Policy, layout: Layout) -> tuple[HintIndex, ...]:
    """Per stage, its `HintIndex`; built once per policy object and layout."""
    per_layout = _INDEXES.get(id(policy))
    if per_layout is None:
        per_layout = _INDEXES[id(policy)] = {}
        weakref.finalize(policy, _INDEXES.pop, id(policy), None)
    indexes = per_layout.get(layout)
    if indexes is None:
        slots = slots_of(layout)
        indexes = per_layout[layout] = tuple(_index(policy=policy, slots=slots, stage=s) for s in range(layout.stages))
    return indexes


_INDEXES: dict[int, dict[Layout, tuple[HintIndex, ...]]] = {}


def _index(*, policy: Policy, slots: Slots, stage: int) -> HintIndex:
    hint = policy.order[stage]
    outside, block = slots.outside, slots.block
    order = [slots.slot_of(a) if slots.holds(a, stage=stage) else outside for a in hint]
    position = [-1] * slots.per_stage
    for i, slot in enumerate(order):
        position[slot] = i
    position[outside] = -1
    unsplit = not slots.layout.split
    started_by = [slot - block if unsplit and 2 * block <= slot < outside else slot for slot in order]
    listed = slots.actions_per_stage
    missing = next((slot for slot in range(listed) if position[slot] < 0), None)
    order = interned(order)
    return HintIndex(
        slots=slots,
        stage=stage,
        order=order,
        position=interned(position),
        started_by=interned(started_by),
        missing=None if missing is None else slots.action(stage=stage, slot=missing),
        peak_fb=peak_inflight_fb(policy.order, stage=stage),
        peak_fw=peak_inflight(policy.order, stage=stage),
        first_places=_first_places(order=order, slots=slots),
    )


class _Heaps:
    """The ready set: slot `s` waits in `heaps[heap_of[s]]` under key `key_of[s]`."""

    __slots__ = ("heaps", "heap_of", "key_of")
    heaps: tuple[list[int], ...]
    heap_of: list[int]
    key_of: list[int]

    def add(self, slot: int) -> None:
        heappush(self.heaps[self.heap_of[slot]], self.key_of[slot])


_BUCKETS = 16  # `FixedPicker`'s heaps: ready slots spread by place, so that each heap stays small


def _first_places(*, order: list[int], slots: Slots) -> tuple[list[int], list[int]]:
    """Per slot: the heap of its first place in `order` (place mod `_BUCKETS`) and that place, or a
    heap never read and 0 if it has none (`FixedPicker`'s tables)."""
    heap_of, key_of = [_BUCKETS] * slots.per_stage, [0] * slots.per_stage
    for place, slot in reversed(list(enumerate(order))):
        heap_of[slot], key_of[slot] = place % _BUCKETS, place
    heap_of[slots.outside], key_of[slots.outside] = _BUCKETS, 0
    return interned(heap_of), interned(key_of)


class FixedPicker(_Heaps):
    """Only the next action of the list may run; caps do not apply (the list is its own cap).

    Ready slots wait under their first place in the list, in the heap of that place mod `_BUCKETS`
    (forwards that arrive long before their place pile up: spread, each pop sifts a small heap);
    a slot not in the list, in a heap never read."""

    __slots__ = ("_next", "_order")

    def __init__(self, *, index: HintIndex) -> None:
        self._order = index.order
        self._next = 0
        self.heap_of, self.key_of = index.first_places
        self.heaps = tuple([] for _ in range(_BUCKETS + 1))

    def pick(self, admit: bool) -> int:
        place = self._next
        ready = self.heaps[place % _BUCKETS]
        if ready and ready[0] == place:
            self._next = place + 1
            return self._order[heappop(ready)]
        return -1

    def snapshot(self) -> tuple[int, ...]:
        return (self._next,)

    def restore(self, state: tuple[int, ...]) -> None:
        (self._next,) = state

    def copy(self) -> FixedPicker:
        other = copy.copy(self)
        other.heaps = tuple(heap.copy() for heap in self.heaps)
        return other


class ListPicker(_Heaps):
    """The first ready action in list order, admissions only while the cap allows."""

    __slots__ = ("_other", "_admit", "_order")

    def __init__(self, *, index: HintIndex) -> None:
        if index.missing is not None:
            raise ValueError(f"stage {index.stage}: action {index.missing} is not in the hint list")
        self._order = index.order
        self.key_of = index.position  # ready slots wait under their hint positions
        self.heap_of = _admission_heaps(per_stage=index.slots.per_stage, admissions=index.slots.microbatches)
        self._admit: list[int] = []  # hint positions
        self._other: list[int] = []
        self.heaps = (self._admit, self._other)

    def pick(self, admit: bool) -> int:
        other, admissions = self._other, self._admit
        if admit and admissions and not (other and other[0] < admissions[0]):
            return self._order[heappop(admissions)]
        return self._order[heappop(other)] if other else -1

    def next_admission(self) -> int:
        return self._order[self._admit[0]] if self._admit else -1

    def snapshot(self) -> tuple[int, ...]:
        return ()

    def restore(self, state: tuple[int, ...]) -> None:
        pass

    def copy(self) -> ListPicker:
        other = copy.copy(self)
        other._admit, other._other = self._admit.copy(), self._other.copy()
        other.heaps = (other._admit, other._other)
        return other


@functools.lru_cache(maxsize=16)
def _admission_heaps(*, per_stage: int, admissions: int) -> list[int]:
    """Per slot, 0 for an admission (the first `admissions` slots are the chunk-0 forwards), else 1."""
    return [0] * admissions + [1] * (per_stage - admissions)


_B, _W, _F_LATER, _F_ADMIT = range(4)  # BF's heaps


@functools.lru_cache(maxsize=16)
def _bf_keys(*, chunks: int, microbatches: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per slot, its BF heap and key; per key, the slot of a backward and of a W.

    Backward keys rank (-chunk, microbatch), W keys (microbatch, -chunk), forward keys (chunk,
    microbatch): a forward's key is its slot."""
    C, M = chunks, microbatches
    size = 3 * C * M + 1
    heap, key = [_F_ADMIT] * size, list(range(size))
    backward_slot, w_slot = [0] * (C * M), [0] * (C * M)
    for c in range(C):
        for m in range(M):
            forward, backward, w = c * M + m, (C + c) * M + m, (2 * C + c) * M + m
            heap[forward] = _F_ADMIT if c == 0 else _F_LATER
            heap[backward], key[backward] = _B, (C - 1 - c) * M + m
            heap[w], key[w] = _W, m * C + (C - 1 - c)
            backward_slot[key[backward]], w_slot[key[w]] = backward, w
    return heap, key, backward_slot, w_slot


class BFPicker(_Heaps):
    """Backward-forward alternation over ready actions (the paper's BF hint), W last (BFW).

    Forward preference: later-chunk forwards by (chunk, microbatch), then admissions by
    microbatch. Taken literally, "lowest chunk first" would rank every admission (chunk 0)
    first; with v > 1 a stage then admits up to its cap before it moves any admitted
    microbatch on, so backwards come late and the pipeline drains.
    """

    __slots__ = ("_backward_turn", "_b", "_f_later", "_f_admit", "_w", "_backward_slot", "_w_slot", "_with_w")

    def __init__(self, *, slots: Slots, with_w: bool) -> None:
        self._with_w = with_w
        self._backward_turn = True
        self.heap_of, self.key_of, self._backward_slot, self._w_slot = _bf_keys(
            chunks=slots.chunks, microbatches=slots.microbatches
        )
        self._set_heaps(([], [], [], []))

    def _set_heaps(self, heaps: tuple[list[int], list[int], list[int], list[int]]) -> None:
        self.heaps = heaps
        self._b, self._w, self._f_later, self._f_admit = heaps

    def pick(self, admit: bool) -> int:
        if self._backward_turn and self._b:
            self._backward_turn = False
            return self._backward_slot[heappop(self._b)]
        if self._f_later:
            self._backward_turn = True
            return heappop(self._f_later)
        if admit and self._f_admit:
            self._backward_turn = True
            return heappop(self._f_admit)
        if self._b:
            self._backward_turn = False
            return self._backward_slot[heappop(self._b)]
        if self._with_w and self._w:
            return self._w_slot[heappop(self._w)]
        return -1

    def next_admission(self) -> int:
        return self._f_admit[0] if self._f_admit else -1

    def snapshot(self) -> tuple[int, ...]:
        return (self._backward_turn,)

    def restore(self, state: tuple[int, ...]) -> None:
        (self._backward_turn,) = state

    def copy(self) -> BFPicker:
        other = copy.copy(self)
        other._set_heaps(tuple(heap.copy() for heap in self.heaps))
        return other


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

    __slots__ = ("_chunks", "_admissions", "_block", "_held", "_admitted_at")

    def __init__(self, *, slots: Slots) -> None:
        super().__init__(slots=slots, with_w=True)
        self._chunks = slots.chunks
        self._admissions = slots.microbatches  # slots below it are chunk-0 forwards
        self._block = slots.block  # chunk-0 backwards are the slots from it on, `_admissions` of them
        self._held = 0  # microbatches past their chunk-0 F and not their chunk-0 B
        self._admitted_at = -1  # the largest such count at which an admission was allowed

    def pick(self, admit: bool) -> int:
        if admit:
            self._admitted_at = max(self._admitted_at, self._held)
        elif self._f_admit and not self._f_later and self._held <= self._admitted_at:
            freeing = self._chunk0_w()
            if freeing >= 0:
                return freeing
        slot = super().pick(admit)
        if 0 <= slot < self._admissions:
            self._held += 1
        elif 0 <= slot - self._block < self._admissions:
            self._held -= 1
        return slot

    def _chunk0_w(self) -> int:
        """Remove and return the lowest-microbatch chunk-0 W, if any (-1: none)."""
        chunk0 = self._chunks - 1  # W keys are microbatch * chunks + (chunks - 1 - chunk)
        key = min((k for k in self._w if k % self._chunks == chunk0), default=-1)
        if key < 0:
            return -1
        self._w.remove(key)
        heapify(self._w)
        return self._w_slot[key]

    def snapshot(self) -> tuple[int, ...]:
        return (self._backward_turn, self._held, self._admitted_at)

    def restore(self, state: tuple[int, ...]) -> None:
        self._backward_turn, self._held, self._admitted_at = state


Picker = FixedPicker | ListPicker | BFPicker | CPWPicker


def ranked(picker: Picker, *, admit: bool, k: int) -> list[int]:
    """Up to `k` slots `picker` could start now, best first, leaving it unchanged.

    The first is what `pick` returns; each next one is what `pick` would return were the
    earlier ones not ready (the picker's own state, e.g. BF's turn, as it is now)."""
    probe = picker.copy()
    state = probe.snapshot()
    slots: list[int] = []
    while len(slots) < k and (slot := probe.pick(admit=admit)) >= 0:
        slots.append(slot)
        probe.restore(state)
    return slots


def take(picker: Picker, *, slot: int, admit: bool) -> bool:
    """Remove `slot` from `picker` as `pick` would have, had it ranked first (see `ranked`);
    False, the picker unchanged, if it is not one `ranked` lists."""
    skipped: list[int] = []
    state = picker.snapshot()
    chosen = picker.pick(admit=admit)
    while chosen != slot:
        picker.restore(state)
        if chosen < 0:
            for other in skipped:
                picker.add(other)
            return False
        skipped.append(chosen)
        chosen = picker.pick(admit=admit)
    for other in skipped:
        picker.add(other)
    return True
