"""What an action needs before it is ready, and what it sends when done.

Shared by the validator, the arbiter, the simulator and the runtime, so all four agree.
Virtual stage ``vs = chunk * stages + stage``; ``V = stages * chunks``.

- F(vs, m) needs the activation of F(vs-1, m) delivered (vs = 0 reads its own data).
- B(vs, m) needs F(vs, m) done here and the gradient of B(vs+1, m) delivered
  (the last virtual stage needs only its own F: the loss).
- W(vs, m) needs B(vs, m) done here. Without the B/W split, B also does W's work.
"""

from __future__ import annotations

from dataclasses import dataclass

from rrfp_ray.schedule.actions import Action, Kind, place


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

    def __post_init__(self) -> None:
        for name in ("stages", "chunks", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return (Kind.F, Kind.B, Kind.W) if self.split else (Kind.F, Kind.B)

    def action(self, *, kind: Kind, virtual_stage: int, microbatch: int) -> Action:
        stage, chunk = place(virtual_stage=virtual_stage, stages=self.stages)
        return Action(stage=stage, kind=kind, microbatch=microbatch, chunk=chunk)

    def vs(self, action: Action) -> int:
        return action.virtual_stage(stages=self.stages)

    def actions(self, *, stage: int) -> list[Action]:
        """Every action the stage runs in one iteration."""
        return [
            Action(stage=stage, kind=kind, microbatch=m, chunk=c)
            for c in range(self.chunks)
            for m in range(self.microbatches)
            for kind in self.kinds
        ]

    def local_need(self, action: Action) -> Action | None:
        """The action on the same stage that must be done first."""
        if action.kind is Kind.B:
            return Action(stage=action.stage, kind=Kind.F, microbatch=action.microbatch, chunk=action.chunk)
        if action.kind is Kind.W:
            return Action(stage=action.stage, kind=Kind.B, microbatch=action.microbatch, chunk=action.chunk)
        return None

    def local_followers(self, action: Action) -> list[Action]:
        """The actions on the same stage whose local need is `action`."""
        kind = {Kind.F: Kind.B, Kind.B: Kind.W if self.split else None}.get(action.kind)
        if kind is None:
            return []
        return [Action(stage=action.stage, kind=kind, microbatch=action.microbatch, chunk=action.chunk)]

    def message_need(self, action: Action) -> Message | None:
        """The delivery the action waits for, if any."""
        vs = self.vs(action)
        if action.kind is Kind.F and vs > 0:
            return Message(kind=Kind.F, virtual_stage=vs, microbatch=action.microbatch)
        if action.kind is Kind.B and vs < self.virtual_stages - 1:
            return Message(kind=Kind.B, virtual_stage=vs, microbatch=action.microbatch)
        return None

    def sends(self, action: Action) -> Message | None:
        """The delivery the action produces when done, if any."""
        vs = self.vs(action)
        if action.kind is Kind.F and vs < self.virtual_stages - 1:
            return Message(kind=Kind.F, virtual_stage=vs + 1, microbatch=action.microbatch)
        if action.kind is Kind.B and vs > 0:
            return Message(kind=Kind.B, virtual_stage=vs - 1, microbatch=action.microbatch)
        return None

    def consumer(self, message: Message) -> Action:
        """The action a delivery makes ready (with its local need)."""
        return self.action(kind=message.kind, virtual_stage=message.virtual_stage, microbatch=message.microbatch)

    def dst(self, message: Message) -> int:
        return place(virtual_stage=message.virtual_stage, stages=self.stages)[0]

    def src(self, message: Message) -> int:
        step = -1 if message.kind is Kind.F else 1
        return place(virtual_stage=message.virtual_stage + step, stages=self.stages)[0]

    def link(self, message: Message) -> Link:
        return Link(src=self.src(message), dst=self.dst(message), kind=message.kind)

    def links(self) -> list[Link]:
        """Every directed link the layout uses, in a stable order."""
        found: dict[Link, None] = {}
        for vs in range(1, self.virtual_stages):
            for kind, target in ((Kind.F, vs), (Kind.B, vs - 1)):
                found[self.link(Message(kind=kind, virtual_stage=target, microbatch=0))] = None
        return list(found)
