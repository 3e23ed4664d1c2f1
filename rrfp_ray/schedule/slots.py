"""Integer indices of a layout's actions and messages, for the hot paths of the arbiter and the simulator.

A stage numbers its actions by *slot*: ``(row * chunks + chunk) * microbatches + microbatch``,
row 0 for F, 1 for the backward that sends the gradient (I, or B without the split), 2 for W.
One more slot, `Slots.outside`, stands for actions that are not the stage's. Across stages an
action's *op* index is ``stage * per_stage + slot``; a delivery is named by the op it makes
ready (its consumer), as `Layout.consumer` names it.

`slots_of(layout)` builds the tables once per layout. They say, per op, the op its completion
makes ready on the same stage (`follower`) and the op its message makes ready (`sends`), and
per consumer op the link its message takes (`link`, -1 for the V's local turn). They mirror
`Layout.local_followers`, `Layout.sends` and `Layout.link`, which stay the definitions.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.layout import Layout, Link, Message

ROWS = 3  # F, the backward (I or B), W
FREES_FB, FREES_FW = 1, 2  # `Slots.frees`: what an action's end takes off its stage's in-flight counts
DONE, DELIVERY, LINK_FREE = 0, 1, 2  # the kinds of the simulator's events (`Slots.completions`)
_ROW = {Kind.F: 0, Kind.I: 1, Kind.B: 1, Kind.W: 2}


class Slots:
    """The integer tables of one layout (see the module's docstring); build with `slots_of`."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        P, C, M, V = layout.stages, layout.chunks, layout.microbatches, layout.virtual_stages
        self.chunks, self.microbatches = C, M
        self.block = C * M  # slots per row
        self.per_stage = ROWS * self.block + 1
        self.outside = self.per_stage - 1
        self.ops = P * self.per_stage
        self.kinds = (Kind.F, layout.backward, Kind.W)  # per row
        self.locate = [layout.locate(vs) for vs in range(V)]
        self.virtual_stage = [[layout.virtual_stage(stage=s, chunk=c) for c in range(C)] for s in range(P)]
        rows = ROWS if layout.split else 2
        self.actions_per_stage = C * M * rows
        self.links = layout.links()
        link_index = {link: i for i, link in enumerate(self.links)}
        self.follower = [-1] * self.ops
        self.sends = [-1] * self.ops
        self.link = [-1] * self.ops
        self.needs_message = bytearray(self.ops)  # per op, 1 if it waits for a message
        first_follower_row = rows - 1  # F -> backward; I -> W under the split
        # per slot, on any stage: the slot its end makes ready locally (-1: none), and which in-flight
        # counts its end lowers (a chunk-0 backward the F->B count, and F->W too without the split;
        # a chunk-0 W the F->W count)
        followed = first_follower_row * self.block
        self.local_follower = [s + self.block if s < followed else -1 for s in range(self.per_stage)]
        self.frees = [0] * self.per_stage
        self.frees[self.block : self.block + M] = [FREES_FB if layout.split else FREES_FB | FREES_FW] * M
        if layout.split:
            self.frees[2 * self.block : 2 * self.block + M] = [FREES_FW] * M
        for s in range(P):
            base = s * self.per_stage
            for c in range(C):
                vs = self.virtual_stage[s][c]
                for m in range(M):
                    for row in range(first_follower_row):
                        self.follower[base + self.slot(row=row, chunk=c, microbatch=m)] = base + self.slot(
                            row=row + 1, chunk=c, microbatch=m
                        )
                    forward, backward = base + c * M + m, base + self.slot(row=1, chunk=c, microbatch=m)
                    if vs < V - 1:
                        self._route(forward, Message(kind=Kind.F, virtual_stage=vs + 1, microbatch=m), link_index)
                    if vs > 0:
                        self._route(backward, Message(kind=Kind.B, virtual_stage=vs - 1, microbatch=m), link_index)

    def _route(self, op: int, message: Message, link_index: dict[Link, int]) -> None:
        stage, chunk = self.locate[message.virtual_stage]
        row = 0 if message.kind is Kind.F else 1
        consumer = stage * self.per_stage + self.slot(row=row, chunk=chunk, microbatch=message.microbatch)
        self.sends[op] = consumer
        self.needs_message[consumer] = 1
        self.link[consumer] = -1 if self.layout.is_local(message) else link_index[self.layout.link(message)]

    def slot(self, *, row: int, chunk: int, microbatch: int) -> int:
        return (row * self.chunks + chunk) * self.microbatches + microbatch

    def slot_of(self, action: Action) -> int:
        """The slot of an action of the layout on its own stage (not checked: see `holds`)."""
        return (_ROW[action.kind] * self.chunks + action.chunk) * self.microbatches + action.microbatch

    def holds(self, action: Action, *, stage: int) -> bool:
        """Whether `action` is one of `stage`'s actions in this layout (any kind)."""
        vs, m = action.virtual_stage, action.microbatch
        return 0 <= vs < len(self.locate) and self.locate[vs] == (stage, action.chunk) and 0 <= m < self.microbatches

    def decode(self, slot: int) -> tuple[int, int, int]:
        """(row, chunk, microbatch) of a slot."""
        row, rest = divmod(slot, self.block)
        chunk, microbatch = divmod(rest, self.microbatches)
        return row, chunk, microbatch

    def action(self, *, stage: int, slot: int) -> Action:
        row, chunk, microbatch = self.decode(slot)
        return self.layout.action(
            kind=self.kinds[row], virtual_stage=self.virtual_stage[stage][chunk], microbatch=microbatch
        )

    @functools.cached_property
    def op_stage(self) -> list[int]:
        """Per op, its stage."""
        return [stage for stage in range(self.layout.stages) for _ in range(self.per_stage)]

    @functools.cached_property
    def op_slot(self) -> list[int]:
        """Per op, its slot on its stage."""
        return list(range(self.per_stage)) * self.layout.stages

    @functools.cached_property
    def deliveries(self) -> list[tuple[int, int, int, int, int, int, int] | None]:
        """Per op, the simulator's event of the delivery that makes it ready: ``(DELIVERY, stage, slot, -1, -1,
        op, link)``, of 7 as `completions`; None for an op that waits for no message."""
        return [
            (DELIVERY, stage, slot, -1, -1, op, self.link[op]) if self.needs_message[op] else None
            for op, (stage, slot) in enumerate(zip(self.op_stage, self.op_slot))
        ]

    @functools.cached_property
    def completions(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """Per op, the simulator's event of its end: ``(DONE, stage, slot, receiver, receiver's slot, -1, link)``,
        of 7 as `deliveries`, with the receiver, its slot and the link of the delivery of its message (-1 for
        each: it sends none). One lookup of one flat tuple brings all that the end of an op needs; the op the
        delivery makes ready, ``receiver * per_stage + receiver's slot``, is left out, one object less to read."""
        stages, slots, links = self.op_stage, self.op_slot, self.link
        return [
            (DONE, stage, slot, -1, -1, -1, -1)
            if consumer < 0
            else (DONE, stage, slot, stages[consumer], slots[consumer], -1, links[consumer])
            for stage, slot, consumer in zip(stages, slots, self.sends)
        ]

    @functools.cached_property
    def texts(self) -> list[str]:
        """Per op, ``str`` of its action (for reports; "" for each stage's `outside` slot)."""
        texts = []
        for stage in range(self.layout.stages):
            for kind in self.kinds:
                for chunk in range(self.chunks):
                    head = f"{self.virtual_stage[stage][chunk]}{kind.value}"
                    texts += [f"{head}{m}" for m in range(self.microbatches)]
            texts.append("")
        return texts

    def message(self, consumer: int) -> Message:
        """The delivery that makes op `consumer` ready."""
        stage, slot = divmod(consumer, self.per_stage)
        row, chunk, microbatch = self.decode(slot)
        kind = Kind.F if row == 0 else Kind.B
        return Message(kind=kind, virtual_stage=self.virtual_stage[stage][chunk], microbatch=microbatch)


_INTS: list[int] = []


def interned(values: Iterable[int]) -> list[int]:
    """`values`, each number >= 0 as the one int object that every such list holds for it: per-stage tables of
    the hot paths then share their numbers' memory instead of each stage reading its own copies."""
    values = list(values)
    if (top := max(values, default=-1)) >= len(_INTS):
        _INTS.extend(range(len(_INTS), top + 1))
    ints = _INTS
    return [ints[v] if v >= 0 else v for v in values]


@functools.lru_cache(maxsize=16)
def slots_of(layout: Layout) -> Slots:
    return Slots(layout)
