"""One stage's actions by slot (`rrfp_ray.schedule.slots`), with what the stage worker needs of each while it
runs worked out once per layout: the action and its text, the message it sends and that message's link or
local consumer, the action its end makes ready on the stage, and the messages each inbound link brings. The
compute thread's per-op path then indexes lists where it would build, hash and look up actions and messages.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.layout import Layout, Link, Message
from rrfp_ray.schedule.slots import Slots, slots_of


@dataclass(frozen=True)
class StageOps:
    """Per slot of `stage` (None or -1 where a slot holds no action of the layout, or the action has none)."""

    stage: int
    slots: Slots
    actions: tuple[Action | None, ...]
    texts: tuple[str, ...]
    sends: tuple[Message | None, ...]  # the message the action sends when done
    link: tuple[Link | None, ...]  # the link that message takes (None: none, or the V's local turn)
    local_consumer: tuple[int, ...]  # the slot the V's local turn makes ready
    follower: tuple[int, ...]  # the slot whose local need the action is
    arrivals: dict[Link, int]  # per inbound link, the messages one iteration brings (`Layout.arrivals`; read only)

    def slot(self, action: Action) -> int:
        if not self.slots.holds(action, stage=self.stage):
            raise ValueError(f"stage {self.stage}: {action} is not one of its actions")
        return self.slots.slot_of(action)

    def consumer(self, message: Message) -> int:
        """The slot of the action `message` makes ready; ValueError if it is another stage's."""
        stage, chunk = self.slots.locate[message.virtual_stage]
        if stage != self.stage:
            raise ValueError(f"stage {self.stage}: delivery {message} belongs to stage {stage}")
        row = 0 if message.kind is Kind.F else 1
        return (row * self.slots.chunks + chunk) * self.slots.microbatches + message.microbatch


@functools.lru_cache(maxsize=64)
def stage_ops(layout: Layout, stage: int) -> StageOps:
    slots = slots_of(layout)
    actions: list[Action | None] = [None] * slots.per_stage
    for action in layout.actions(stage=stage):
        actions[slots.slot_of(action)] = action
    sends = [None if a is None else layout.sends(a) for a in actions]
    local = [m is not None and layout.is_local(m) for m in sends]
    ops = StageOps(
        stage=stage,
        slots=slots,
        actions=tuple(actions),
        texts=tuple("" if a is None else str(a) for a in actions),
        sends=tuple(sends),
        link=tuple(None if m is None or is_local else layout.link(m) for m, is_local in zip(sends, local)),
        local_consumer=(),
        arrivals=layout.arrivals(stage=stage),
        follower=tuple(
            -1 if a is None or not (f := layout.local_followers(a)) else slots.slot_of(f[0]) for a in actions
        ),
    )
    consumers = tuple(ops.consumer(m) if is_local else -1 for m, is_local in zip(sends, local))
    return replace(ops, local_consumer=consumers)
