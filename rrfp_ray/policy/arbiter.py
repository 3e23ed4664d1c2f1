"""The per-stage arbiter: ready set, in-flight caps, receive-buffer bound, next_action().

One object per stage per iteration-run, shared by the simulator and the runtime (which
calls it under its own lock from the compute and receive threads).

In flight: a microbatch enters a stage with its chunk-0 F and leaves with its chunk-0 B or I
(the F->B count) or, under the B/W split, its chunk-0 W (the F->W count). Caps gate only
those admissions; see `rrfp_ray.policy.pickers`.

Receive buffer: `buffered` counts delivered messages whose action has not started; the
receive side hands over a message only while `has_room()`. Every buffered message's action
is ready except a chunk-0 activation held by the cap, so a full buffer can deadlock only when
such activations fill it and the gradient that would free the cap cannot get in. On stage s
they are microbatches admitted on s-1 but not on s, and s holds them only at its own F->B
cap, so there are at most cap(s-1) - cap(s). Hence the rule: ready policies (bf, bfw,
ready-*) never deadlock when

    buffer_limit >= 1 + max(0, max over stages s >= 1 of cap(s-1) - cap(s)),

cap(s) being stage s's `cap_fb`, skipping a stage whose chunk 0 is the last virtual stage
(v = 1, s = P-1: its B needs no gradient) and stages without a cap. That is 1 for `inf` and
count caps (`4`); over 1f1b / zb-h1 (caps P-s at 1x) 2 at 1x and 3 at 2x (1 when P = 2);
over interleaved at P=4, M=16, 3 at 1x and 5 at 2x for v=2 (caps 8,8,7,5 at 1x), 1 for v=3
(caps all 8). Where the rule asks for more than 1, one less deadlocks on some trace
(tests/test_simulator.py). The argument does not cover fixed policies, whose next list action
can wait on a message queued behind buffered ones; measured at P=4, M=16 they needed 2
(gpipe, 1f1b, zb-h1) and 3 (interleaved v=2).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from rrfp_ray.policy.pickers import Policy, ranked, take
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.deps import Layout, Message
from rrfp_ray.schedule.generators import peak_inflight, peak_inflight_fb

_CAP = re.compile(r"^(?:(\d+(?:\.\d+)?)x|(\d+)|inf)$")


@dataclass(frozen=True)
class Cap:
    """An in-flight cap: a multiple of the hint schedule's own peak (`2x`), a count (`6`) or `inf`."""

    multiple: float | None = None
    count: int | None = None

    @classmethod
    def parse(cls, text: str) -> Cap:
        match = _CAP.match(text.strip().lower())
        if match is None:
            raise ValueError(f"cap must look like '1x', '2x', '1.5x', an integer >= 1 or 'inf', got {text!r}")
        multiple, count = match.groups()
        if multiple is not None:
            if float(multiple) <= 0:
                raise ValueError(f"cap multiple must be > 0, got {text!r}")
            return cls(multiple=float(multiple))
        if count is not None:
            if int(count) < 1:
                raise ValueError(f"cap must be >= 1 microbatch, got {text!r}")
            return cls(count=int(count))
        return cls()

    def limit(self, *, peak: int) -> float:
        if self.count is not None:
            return self.count
        if self.multiple is not None:
            return max(1, math.ceil(self.multiple * peak))
        return math.inf

    def __str__(self) -> str:
        if self.count is not None:
            return str(self.count)
        return "inf" if self.multiple is None else f"{self.multiple:g}x"


class Arbiter:
    def __init__(
        self, *, layout: Layout, stage: int, policy: Policy, cap: Cap, buffer_limit: int | None = None
    ) -> None:
        if buffer_limit is not None and buffer_limit < 1:
            raise ValueError(f"buffer_limit must be >= 1 message (or None: unbounded), got {buffer_limit}")
        self.layout = layout
        self.stage = stage
        self.policy = policy
        hint = policy.order[stage]
        self.cap_fb = cap.limit(peak=peak_inflight_fb(policy.order, stage=stage))
        self.cap_fw = cap.limit(peak=peak_inflight(policy.order, stage=stage)) if layout.split else math.inf
        self.buffer_limit = math.inf if buffer_limit is None else buffer_limit
        actions = layout.actions(stage=stage)
        self._total = len(actions)
        self._picker = policy.picker(stage=stage)
        # Per-action state in flat lists indexed by `_slot`; the last entry is never set and
        # stands for hint actions outside the layout.
        size = 3 * layout.chunks * layout.microbatches + 1
        self._done = [False] * size
        self._started = [False] * size
        self._arrived = [False] * size  # the delivery an action waits for has arrived
        self._hint_pos = [-1] * size
        self._hint_slots = [self._hint_slot(action) for action in hint]
        for i, action in enumerate(hint):
            if self._in_layout(action):
                self._hint_pos[self._slot(action)] = i
        self._done_count = 0
        self._unstarted_hint = 0
        self.inflight_fb = 0
        self.inflight_fw = 0
        self.buffered = 0
        self.peak_inflight = 0
        self.peak_buffered = 0
        for action in actions:
            if layout.local_need(action) is None and layout.message_need(action) is None:
                self._picker.add(action)

    def _slot(self, action: Action) -> int:
        kind = 0 if action.kind is Kind.F else 2 if action.kind is Kind.W else 1  # I and B share a slot
        return (kind * self.layout.chunks + action.chunk) * self.layout.microbatches + action.microbatch

    def _in_layout(self, action: Action) -> bool:
        return (
            0 <= action.virtual_stage < self.layout.virtual_stages
            and self.layout.locate(action.virtual_stage) == (self.stage, action.chunk)
            and 0 <= action.microbatch < self.layout.microbatches
        )

    def _hint_slot(self, action: Action) -> int:
        """The slot whose start counts as this hint action's start."""
        if not self._in_layout(action):
            return len(self._started) - 1
        if action.kind is Kind.W and not self.layout.split:  # a policy without the split runs W inside its B
            return self._slot(replace(action, kind=Kind.B))
        return self._slot(action)

    @property
    def finished(self) -> bool:
        return self._done_count == self._total

    def has_room(self) -> bool:
        """Whether the receive side may hand over one more message."""
        return self.buffered < self.buffer_limit

    def hint_position(self, action: Action) -> int:
        return self._hint_pos[self._slot(action)] if self._in_layout(action) else -1

    def on_arrival(self, message: Message) -> None:
        consumer = self.layout.consumer(message)
        if consumer.stage != self.stage:
            raise ValueError(f"stage {self.stage}: delivery {message} belongs to stage {consumer.stage}")
        slot = self._slot(consumer)
        if self._arrived[slot]:
            raise ValueError(f"stage {self.stage}: duplicate delivery {message}")
        self._arrived[slot] = True
        self.buffered += 1
        self.peak_buffered = max(self.peak_buffered, self.buffered)
        need = self.layout.local_need(consumer)
        if need is None or self._done[self._slot(need)]:
            self._picker.add(consumer)

    def next_action(self) -> tuple[Action, bool] | None:
        """Choose and start the next action; returns it and whether it overtook an earlier hint action."""
        action = self._picker.pick(admit=self._admit())
        return None if action is None else (action, self._commit(action))

    def candidates(self, k: int) -> list[Action]:
        """Up to `k` eligible actions, best first (the first is what `next_action` would start); starts none."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return ranked(self._picker, admit=self._admit(), k=k)

    def start(self, action: Action) -> bool:
        """Start `action`, one of `candidates`; returns whether it overtook an earlier hint action."""
        take(self._picker, action=action, admit=self._admit())
        return self._commit(action)

    def _admit(self) -> bool:
        return self.inflight_fb < self.cap_fb and self.inflight_fw < self.cap_fw

    def _commit(self, action: Action) -> bool:
        slot = self._slot(action)
        self._started[slot] = True
        if self._arrived[slot]:  # it consumes its buffered delivery
            self.buffered -= 1
        if action.kind is Kind.F and action.chunk == 0:
            self.inflight_fb += 1
            self.inflight_fw += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight_fw)
        overtook = self._hint_pos[slot] > self._unstarted_hint
        hint_slots, started = self._hint_slots, self._started
        while self._unstarted_hint < len(hint_slots) and started[hint_slots[self._unstarted_hint]]:
            self._unstarted_hint += 1
        return overtook

    def on_done(self, action: Action) -> Message | None:
        """Mark an action done; returns the message it sends, if any."""
        slot = self._slot(action)
        if not self._started[slot] or self._done[slot]:
            raise ValueError(f"stage {self.stage}: {action} done without being started, or twice")
        self._done[slot] = True
        self._done_count += 1
        if action.chunk == 0 and action.kind is not Kind.F:
            if action.kind.backward:
                self.inflight_fb -= 1
            if action.kind is (Kind.W if self.layout.split else Kind.B):
                self.inflight_fw -= 1
        for follower in self.layout.local_followers(action):
            if self.layout.message_need(follower) is None or self._arrived[self._slot(follower)]:
                self._picker.add(follower)
        return self.layout.sends(action)

    def waiting_for(self) -> str:
        """What the stage waits for, for timeout errors: the next unstarted hint actions and their needs."""
        hint = self.policy.order[self.stage]
        pending = [
            action
            for action, slot in zip(hint[self._unstarted_hint :], self._hint_slots[self._unstarted_hint :])
            if not self._started[slot]
        ][:3]
        parts = []
        for action in pending:
            if not self._in_layout(action):
                parts.append(f"{action} (not an action of this stage's layout)")
                continue
            local, message = self.layout.local_need(action), self.layout.message_need(action)
            if local is not None and not self._done[self._slot(local)]:
                parts.append(f"{action} (needs {local} done here)")
            elif message is not None and not self._arrived[self._slot(action)]:
                parts.append(f"{action} (needs {self.layout.link(message)} for microbatch {message.microbatch})")
            else:
                parts.append(f"{action} (ready; held by the policy or the in-flight cap)")
        done = f"{self._done_count}/{self._total} actions done"
        return f"stage {self.stage}: {done}; next in hint: {', '.join(parts) or 'none'}"
