"""What an action needs before it is ready, and what it sends when done.

Shared by the validator, the arbiter, the simulator and the runtime, so all four agree.
``V = stages * chunks`` virtual stages; the placement says which stage holds each.

- F(vs, m) needs the activation of F(vs-1, m) delivered (vs = 0 reads its own data).
- I or B (vs, m) needs F(vs, m) done here and the gradient of the backward of (vs+1, m)
  delivered (the last virtual stage needs only its own F: the loss).
- W(vs, m) needs I(vs, m) done here. Without the B/W split there is no I or W: B does both.

A delivery between two virtual stages on one stage (the V's turn on stage P-1) is a local
hand-off: it uses no link.
"""

from __future__ import annotations

from dataclasses import dataclass

from rrfp_ray.schedule.actions import Action, Kind, Placement


@dataclass(frozen=True)
class Message:
    """A delivery into ``virtual_stage``: an activation (kind F) or a gradient (kind B)."""

    kind: Kind
    virtual_stage: int
    microbatch: int


@dataclass(frozen=True)
class Link:
    """A directed channel between two stages; one per (src, dst, kind)."""

    src: int
    dst: int
    kind: Kind

    def __str__(self) -> str:
        what = "activations" if self.kind is Kind.F else "gradients"
        return f"{what} {self.src}->{self.dst}"


@dataclass(frozen=True)
class Layout:
    stages: int
    chunks: int
    microbatches: int
    split: bool = False
    placement: Placement = Placement.LOOPED

    def __post_init__(self) -> None:
        for name in ("stages", "chunks", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.placement is Placement.V and self.chunks != 2:
            raise ValueError(f"the V placement holds 2 chunks per stage (--chunks 2), got chunks={self.chunks}")

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    @property
    def backward(self) -> Kind:
        """The kind that sends the gradient upstream: I with the B/W split, else B."""
        return Kind.I if self.split else Kind.B

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return (Kind.F, Kind.I, Kind.W) if self.split else (Kind.F, Kind.B)

    @property
    def loss_stage(self) -> int:
        """The stage holding the last virtual stage: it reads the labels and computes the loss."""
        return self.locate(self.virtual_stages - 1)[0]

    def locate(self, virtual_stage: int) -> tuple[int, int]:
        """(stage, chunk) holding a virtual stage."""
        return self.placement.locate(virtual_stage=virtual_stage, stages=self.stages)

    def virtual_stage(self, *, stage: int, chunk: int) -> int:
        return self.placement.virtual_stage(stage=stage, chunk=chunk, stages=self.stages)

    def action(self, *, kind: Kind, virtual_stage: int, microbatch: int) -> Action:
        return self.placement.action(kind=kind, virtual_stage=virtual_stage, microbatch=microbatch, stages=self.stages)

    def vs(self, action: Action) -> int:
        return action.virtual_stage

    def actions(self, *, stage: int) -> list[Action]:
        """Every action the stage runs in one iteration."""
        return [
            self.action(kind=kind, virtual_stage=self.virtual_stage(stage=stage, chunk=c), microbatch=m)
            for c in range(self.chunks)
            for m in range(self.microbatches)
            for kind in self.kinds
        ]

    def arrivals(self, *, stage: int) -> dict[Link, int]:
        """How many messages `stage` receives on each of its inbound links in one iteration."""
        counts: dict[Link, int] = {}
        for action in self.actions(stage=stage):
            message = self.message_need(action)
            if message is not None:
                counts[self.link(message)] = counts.get(self.link(message), 0) + 1
        return counts

    def local_need(self, action: Action) -> Action | None:
        """The action on the same stage that must be done first."""
        if action.kind.backward:
            return self.action(kind=Kind.F, virtual_stage=action.virtual_stage, microbatch=action.microbatch)
        if action.kind is Kind.W:
            return self.action(kind=Kind.I, virtual_stage=action.virtual_stage, microbatch=action.microbatch)
        return None

    def local_followers(self, action: Action) -> list[Action]:
        """The actions on the same stage whose local need is `action`."""
        kind = {Kind.F: self.backward, Kind.I: Kind.W}.get(action.kind)
        if kind is None:
            return []
        return [self.action(kind=kind, virtual_stage=action.virtual_stage, microbatch=action.microbatch)]

    def message_need(self, action: Action) -> Message | None:
        """The delivery the action waits for, if any."""
        vs = action.virtual_stage
        if action.kind is Kind.F and vs > 0:
            return Message(kind=Kind.F, virtual_stage=vs, microbatch=action.microbatch)
        if action.kind.backward and vs < self.virtual_stages - 1:
            return Message(kind=Kind.B, virtual_stage=vs, microbatch=action.microbatch)
        return None

    def sends(self, action: Action) -> Message | None:
        """The delivery the action produces when done, if any."""
        vs = action.virtual_stage
        if action.kind is Kind.F and vs < self.virtual_stages - 1:
            return Message(kind=Kind.F, virtual_stage=vs + 1, microbatch=action.microbatch)
        if action.kind.backward and vs > 0:
            return Message(kind=Kind.B, virtual_stage=vs - 1, microbatch=action.microbatch)
        return None

    def consumer(self, message: Message) -> Action:
        """The action a delivery makes ready (with its local need)."""
        kind = Kind.F if message.kind is Kind.F else self.backward
        return self.action(kind=kind, virtual_stage=message.virtual_stage, microbatch=message.microbatch)

    def dst(self, message: Message) -> int:
        return self.locate(message.virtual_stage)[0]

    def src(self, message: Message) -> int:
        step = -1 if message.kind is Kind.F else 1
        return self.locate(message.virtual_stage + step)[0]

    def is_local(self, message: Message) -> bool:
        """Whether the delivery is the V's turn (virtual stage P-1 to P on stage P-1): a hand-off, no link.

        Looped with one stage the wrap link 0->0 stays a link, as before V placement existed."""
        return self.placement is Placement.V and self.src(message) == self.dst(message)

    def link(self, message: Message) -> Link:
        return Link(src=self.src(message), dst=self.dst(message), kind=message.kind)

    def links(self) -> list[Link]:
        """Every directed link the layout uses, in a stable order (local hand-offs use none)."""
        found: dict[Link, None] = {}
        for vs in range(1, self.virtual_stages):
            for kind, target in ((Kind.F, vs), (Kind.B, vs - 1)):
                message = Message(kind=kind, virtual_stage=target, microbatch=0)
                if not self.is_local(message):
                    found[self.link(message)] = None
        return list(found)
