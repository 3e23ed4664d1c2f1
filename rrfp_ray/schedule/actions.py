"""Pipeline actions: what one stage runs for one microbatch of one chunk.

The compact text form is ``{stage}{kind}{microbatch}``, with ``c{chunk}`` appended
when the chunk is not 0: ``2F0`` is the forward of microbatch 0 on stage 2,
``1B3c1`` the input-gradient backward of microbatch 3 on stage 1's second chunk.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(enum.Enum):
    F = "F"  # forward
    B = "B"  # backward; input gradient (and weight gradient too when not split)
    W = "W"  # weight gradient, only when the policy splits backward


@dataclass(frozen=True)
class Action:
    stage: int
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        return text if self.chunk == 0 else f"{text}c{self.chunk}"

    def virtual_stage(self, *, stages: int) -> int:
        return self.chunk * stages + self.stage


_PATTERN = re.compile(r"^(\d+)([FBW])(\d+)(?:c(\d+))?$")


def parse_action(text: str) -> Action:
    match = _PATTERN.match(text.strip())
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. '2F0' or '1B3c1')")
    stage, kind, microbatch, chunk = match.groups()
    return Action(stage=int(stage), kind=Kind(kind), microbatch=int(microbatch), chunk=int(chunk or 0))


def place(*, virtual_stage: int, stages: int) -> tuple[int, int]:
    """(stage, chunk) that holds a virtual stage."""
    return virtual_stage % stages, virtual_stage // stages
