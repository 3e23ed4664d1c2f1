"""The per-stage arbiter: ready set, in-flight caps, receive-buffer bound, next_action().

One object per stage per iteration-run, shared by the simulator and the runtime (which
calls it under its own lock from the compute and receive threads). Its state is kept per
slot (`rrfp_ray.schedule.slots`): the simulator drives it by slot (`next_slot`, `on_done_slot`,
`on_arrival_slot`), the runtime by action and message (`next_action`, `on_done`, `on_arrival`),
which name the same calls.

In flight: a microbatch enters a stage with its chunk-0 F and leaves with its chunk-0 B or I
(the F->B count) or, under the B/W split, its chunk-0 W (the F->W count). Caps gate only
those admissions; see `rrfp_ray.policy.pickers`. With a `Memory` (microbatches of different
sizes) the caps count activation bytes: the next admission the picker would take enters only
while its bytes fit under both limits, or when the stage holds no microbatch.

Receive buffer: `buffered` counts delivered messages whose action has not started; the
receive side hands over a message only while `has_room()`. Every buffered message's action
is ready except a chunk-0 activation held by the cap, so a full buffer can deadlock only when
such activations fill it and the gradient that would free the cap cannot get in. On stage s
they are microbatches admitted on s-1 but not on s, and s holds them only at its own F->B
cap, so there are at most cap(s-1) - cap(s). Hence the rule: ready policies (bf, bfw,
ready-*) never deadlock when

    buffer_limit >= 1 + max(0, max over stages s >= 1 of cap(s-1) - cap(s)),

cap(s) being stage s's `cap_fb`, skipping a stage whose chunk 0 is the last virtual stage
(v = 1, s = P-1: its B needs no gradient) and stages without a cap. Under a byte gate (`Memory`),
cap(s-1) is the most microbatches stage s-1's F->B limit admits at once (the lightest first) and
cap(s) is 1 (one heavy microbatch may fill stage s). That is 1 for `inf` and
count caps (`4`); over 1f1b / zb-h1 (caps P-s at 1x) 2 at 1x and 3 at 2x (1 when P = 2);
over interleaved at P=4, M=16, 3 at 1x and 5 at 2x for v=2 (caps 8,8,7,5 at 1x), 1 for v=3
(caps all 8). Where the rule asks for more than 1, one less deadlocks on some trace
(tests/test_simulator.py). The argument does not cover fixed policies, whose next list action
can wait on a message queued behind buffered ones; measured at P=4, M=16 they needed 2
(gpipe, 1f1b, zb-h1) and 3 (interleaved v=2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from heapq import heappush

from rrfp_ray.policy.caps import Cap, Memory
from rrfp_ray.policy.pickers import hint_indexes, picker_for, ranked, take
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.layout import Layout, Message
from rrfp_ray.schedule.slots import FREES_FB, FREES_FW

_SLACK = 1e-9  # relative: byte sums that equal a limit up to rounding fit under it
# An arbiter's state of each slot, bits of one int: the delivery its action waits for has arrived, or it waits
# for none (`_NO_MESSAGE`, set from the start); it has started; it is done. They are set in that order, each
# once, so the hot paths add a bit and compare instead of masking (int `&` and `|` are slow in CPython).
_ARRIVED, _NO_MESSAGE, _STARTED, _DONE = 1, 2, 4, 8
_FIRST_STATE = bytes([_NO_MESSAGE, 0]) + bytes(254)  # a slot's state before the run, by `Slots.needs_message`
_RUNNING = tuple(_STARTED <= state < _DONE for state in range(2 * _DONE))  # per state: started, not done


def peak_bytes(actions: Sequence[Action], *, held: Sequence[float], release: tuple[Kind, ...]) -> float:
    """Most bytes a stage's list holds between chunk-0 F and the first chunk-0 action of a `release` kind."""
    total = peak = 0.0
    for action in actions:
        if action.chunk == 0:
            if action.kind is Kind.F:
                total += held[action.microbatch]
                peak = max(peak, total)
            elif action.kind in release:
                total -= held[action.microbatch]
    return peak


def byte_limits(
    *, cap: Cap, reference: Policy, held: Sequence[Sequence[float]], split: bool
) -> tuple[tuple[float, float], ...] | None:
    """Per stage, its (F->B, F->W) byte limits: `cap`'s multiple of the peak bytes the reference list
    holds on this data (`held[stage][microbatch]`); F->W only under the split. None for a count or inf cap."""
    if cap.multiple is None:
        return None
    limits = []
    for stage, row in enumerate(held):
        actions = reference.order[stage]
        fb = peak_bytes(actions, held=row, release=(Kind.I, Kind.B))
        last = (Kind.W,) if any(a.kind is Kind.W for a in actions) else (Kind.B,)
        fw = peak_bytes(actions, held=row, release=last) if split else math.inf
        limits.append((cap.multiple * fb, cap.multiple * fw))
    return tuple(limits)


class Arbiter:
    # hot first: what the per-op paths read sits together in the object
    __slots__ = (
        "_pick", "_gate_bytes", "_room", "_state", "_begun", "buffered", "_admissions", "_heaps", "_heap_of",
        "_key_of", "_block", "_done_count", "_frees", "_follower", "peak_buffered", "inflight_fb", "inflight_fw",
        "peak_inflight", "cap_fb", "cap_fw", "memory", "buffer_limit", "bytes_fb", "bytes_fw", "peak_bytes",
        "layout", "stage", "policy", "_slots", "_total", "_picker", "_base", "_replayed", "_seen", "_overtook",
        "_hint_pos", "_started_by", "_unstarted_hint",
    )  # fmt: skip

    def __init__(
        self,
        *,
        layout: Layout,
        stage: int,
        policy: Policy,
        cap: Cap,
        buffer_limit: int | None = None,
        memory: Memory | None = None,
    ) -> None:
        if buffer_limit is not None and buffer_limit < 1:
            raise ValueError(f"buffer_limit must be >= 1 message (or None: unbounded), got {buffer_limit}")
        self.layout = layout
        self.stage = stage
        self.policy = policy
        index = hint_indexes(policy=policy, layout=layout)[stage]
        slots = self._slots = index.slots
        self.memory = memory
        if memory is None:
            self.cap_fb, self.cap_fw = index.count_caps(cap)
        else:
            if len(memory.held) != layout.microbatches:
                raise ValueError(f"memory holds {len(memory.held)} microbatches, expected {layout.microbatches}")
            self.cap_fb = self.cap_fw = math.inf
        self._gate_bytes = memory is not None and not policy.fixed  # a fixed list is its own cap
        self.bytes_fb = self.bytes_fw = 0.0  # with a memory: the bytes now held
        self.peak_bytes = 0.0
        self.buffer_limit = math.inf if buffer_limit is None else buffer_limit
        self._total = slots.actions_per_stage
        self._picker = picker_for(policy=policy, index=index)
        self._pick = self._picker.pick
        # the picker's ready set, which `_add` and the hot paths push slots onto (`rrfp_ray.policy.pickers`)
        self._heaps, self._heap_of, self._key_of = self._picker.heaps, self._picker.heap_of, self._picker.key_of
        size = slots.per_stage
        self._base = stage * size  # the stage's first op
        needs_message = slots.needs_message[self._base : self._base + size]
        self._state = list(needs_message.translate(_FIRST_STATE))
        # Which started actions overtook an earlier hint action is worked out when asked (`_catch_up`),
        # from the start order: `_replayed` starts are in `_overtook`, with `_seen` what they started.
        self._begun: list[int] = []
        self._replayed = 0
        self._seen: list[bool] = []  # both made by the first `_catch_up` that needs them (a fixed list never does)
        self._overtook: list[bool] = []
        self._hint_pos = index.position
        # `outside` ends the list: never started, it stops the scan for the first unstarted hint action
        self._started_by = [*index.started_by, slots.outside]
        self._block = slots.block  # slots per row: F, then the backward, then W
        self._admissions = slots.microbatches  # the first slots of a row are its chunk-0 actions
        self._follower, self._frees = slots.local_follower, slots.frees
        self._done_count = 0
        self._unstarted_hint = 0
        self.inflight_fb = 0
        self.inflight_fw = 0
        self._room = True  # whether both in-flight counts are under their caps (each cap is >= 1)
        self.buffered = 0
        self.peak_inflight = 0
        self.peak_buffered = 0
        # the forwards that wait for no message: the only actions without a local need
        slot = needs_message.find(0, 0, slots.block)
        while slot >= 0:
            self._add(slot)
            slot = needs_message.find(0, slot + 1, slots.block)

    def _add(self, slot: int) -> None:
        heappush(self._heaps[self._heap_of[slot]], self._key_of[slot])

    def _slot(self, action: Action) -> int:
        return self._slots.slot_of(action)

    def _in_layout(self, action: Action) -> bool:
        return self._slots.holds(action, stage=self.stage)

    @property
    def finished(self) -> bool:
        return self._done_count == self._total

    def has_room(self) -> bool:
        """Whether the receive side may hand over one more message."""
        return self.buffered < self.buffer_limit

    def hint_position(self, action: Action) -> int:
        return self._hint_pos[self._slot(action)] if self._in_layout(action) else -1

    def hint_position_of(self, slot: int) -> int:
        return self._hint_pos[slot]

    @property
    def started_slots(self) -> list[int]:
        """The slots of the started actions, in the order they started (read only)."""
        return self._begun

    def overtook(self, slot: int) -> bool:
        """Whether the started action of `slot` overtook an earlier hint action."""
        self._catch_up()
        return bool(self._overtook) and self._overtook[slot]

    @property
    def overtakes(self) -> int:
        """How many started actions overtook an earlier hint action."""
        self._catch_up()
        return sum(self._overtook)

    def on_arrival(self, message: Message) -> None:
        consumer = self.layout.consumer(message)
        if consumer.stage != self.stage:
            raise ValueError(f"stage {self.stage}: delivery {message} belongs to stage {consumer.stage}")
        self.on_arrival_slot(self._slot(consumer))

    def on_arrival_slot(self, slot: int) -> None:
        """The delivery that `slot`'s action waits for has arrived."""
        state = self._state
        if state[slot]:  # an action that waits for a message has no bit set before it arrives
            message = self._slots.message(self._base + slot)
            raise ValueError(f"stage {self.stage}: duplicate delivery {message}, or one its action does not wait for")
        state[slot] = _ARRIVED
        buffered = self.buffered = self.buffered + 1
        if buffered > self.peak_buffered:
            self.peak_buffered = buffered
        if slot < self._block or state[slot - self._block] >= _DONE:  # a forward, or a backward whose F is done
            heappush(self._heaps[self._heap_of[slot]], self._key_of[slot])

    def next_action(self) -> tuple[Action, bool] | None:
        """Choose and start the next action; returns it and whether it overtook an earlier hint action."""
        slot = self.next_slot()
        return None if slot < 0 else (self._slots.action(stage=self.stage, slot=slot), self.overtook(slot))

    def next_slot(self) -> int:
        """Choose and start the next action; returns its slot, or -1 if none is eligible."""
        if self._gate_bytes:
            slot = self._pick(self._fits())
        else:
            slot = self._pick(self._room)
        if slot < 0:
            return -1
        state = self._state
        self._begun.append(slot)
        if (before := state[slot]) != _NO_MESSAGE:  # it consumes its buffered delivery
            self.buffered -= 1
        state[slot] = before + _STARTED
        if slot < self._admissions:  # a chunk-0 F: the microbatch enters the stage
            inflight_fb = self.inflight_fb = self.inflight_fb + 1
            inflight = self.inflight_fw = self.inflight_fw + 1
            if inflight > self.peak_inflight:
                self.peak_inflight = inflight
            if inflight_fb >= self.cap_fb or inflight >= self.cap_fw:
                self._room = False
            if self.memory is not None:
                self.bytes_fb += self.memory.held[slot]
                self.bytes_fw += self.memory.held[slot]
                self.peak_bytes = max(self.peak_bytes, self.bytes_fw)
        return slot

    def candidates(self, k: int) -> list[Action]:
        """Up to `k` eligible actions, best first (the first is what `next_action` would start); starts none."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return [
            self._slots.action(stage=self.stage, slot=slot) for slot in ranked(self._picker, admit=self._admit(), k=k)
        ]

    def start(self, action: Action) -> bool:
        """Start `action`, one of `candidates`; returns whether it overtook an earlier hint action."""
        slot = self._slot(action) if self._in_layout(action) else -1
        if slot < 0 or not take(self._picker, slot=slot, admit=self._admit()):
            raise ValueError(f"action {action} is not eligible")
        picker_pick = self._pick
        self._pick = lambda admit: slot  # `next_slot` starts the taken slot as the picker's choice
        try:
            self.next_slot()
        finally:
            self._pick = picker_pick
        return self.overtook(slot)

    def _admit(self) -> bool:
        return self._fits() if self._gate_bytes else self._room

    def _fits(self) -> bool:
        """Whether the admission the picker would take next fits in the byte limits."""
        slot = self._picker.next_admission()
        if slot < 0:
            return True
        memory, weight = self.memory, self.memory.held[slot]
        fb = self.inflight_fb == 0 or self.bytes_fb + weight <= memory.limit_fb * (1 + _SLACK)
        return fb and (self.inflight_fw == 0 or self.bytes_fw + weight <= memory.limit_fw * (1 + _SLACK))

    def _catch_up(self) -> None:
        """Bring `_overtook` and `_unstarted_hint` up to the starts so far, in their order."""
        begun = self._begun
        if self._replayed == len(begun):
            return
        if self.policy.fixed:  # its picker starts the list's actions in their order: none overtakes
            self._unstarted_hint = self._replayed = len(begun)
            return
        if not self._seen:
            self._seen, self._overtook = [False] * len(self._state), [False] * len(self._state)
        seen, overtook, hint_pos, started_by = self._seen, self._overtook, self._hint_pos, self._started_by
        first = self._unstarted_hint
        for slot in begun[self._replayed :]:
            seen[slot] = True
            if hint_pos[slot] > first:  # `overtook` starts all False
                overtook[slot] = True
            while seen[started_by[first]]:
                first += 1
        self._unstarted_hint = first
        self._replayed = len(begun)

    def on_done(self, action: Action) -> Message | None:
        """Mark an action done; returns the message it sends, if any."""
        self.on_done_slot(self._slot(action))
        return self.layout.sends(action)

    def on_done_slot(self, slot: int) -> None:
        """Mark the action of `slot` done (what it sends: `Slots.sends`)."""
        state = self._state
        if not _RUNNING[(before := state[slot])]:
            action = self._slots.action(stage=self.stage, slot=slot)
            raise ValueError(f"stage {self.stage}: {action} done without being started, or twice")
        state[slot] = before + _DONE
        self._done_count += 1
        frees = self._frees[slot]
        if frees:  # FREES_FB, FREES_FW or both (= 3), told apart by comparisons as above
            if frees != FREES_FW:
                self.inflight_fb -= 1
            if frees >= FREES_FW:
                self.inflight_fw -= 1
            if not self._room:  # only a lower count can make room
                self._room = self.inflight_fb < self.cap_fb and self.inflight_fw < self.cap_fw
            if self.memory is not None:  # a chunk-0 B, I or W: its microbatch's bytes go
                held = self.memory.held[slot % self._block]
                if frees & FREES_FB:
                    self.bytes_fb -= held
                if frees & FREES_FW:
                    self.bytes_fw -= held
        follower = self._follower[slot]
        if follower >= 0 and state[follower]:  # not started: only its input bits can be set
            heappush(self._heaps[self._heap_of[follower]], self._key_of[follower])

    def waiting_for(self) -> str:
        """What the stage waits for, for timeout errors: the next unstarted hint actions and their needs."""
        self._catch_up()
        hint = self.policy.order[self.stage]
        pending = [
            action
            for action, slot in zip(hint[self._unstarted_hint :], self._started_by[self._unstarted_hint :])
            if not self._state[slot] & _STARTED
        ][:3]
        parts = []
        for action in pending:
            if not self._in_layout(action):
                parts.append(f"{action} (not an action of this stage's layout)")
                continue
            local, message = self.layout.local_need(action), self.layout.message_need(action)
            if local is not None and not self._state[self._slot(local)] & _DONE:
                parts.append(f"{action} (needs {local} done here)")
            elif message is not None and not self._state[self._slot(action)] & _ARRIVED:
                parts.append(f"{action} (needs {self.layout.link(message)} for microbatch {message.microbatch})")
            else:
                parts.append(f"{action} (ready; held by the policy or the in-flight cap)")
        done = f"{self._done_count}/{self._total} actions done"
        return f"stage {self.stage}: {done}; next in hint: {', '.join(parts) or 'none'}"
