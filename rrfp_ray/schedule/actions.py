"""Pipeline actions as PyTorch's ``torch.distributed.pipelining`` names them.

An action is one computation of one microbatch on one *virtual* stage, written
``{virtual stage}{kind}{microbatch}`` as torch writes its ``_Action``: ``0F1`` is the forward
of microbatch 1 on virtual stage 0, ``5I0`` the input gradient of microbatch 0 on virtual
stage 5, ``3W2`` a weight gradient, ``2B0`` a full backward (input and weight gradients).

Which physical stage holds a virtual stage, and as which of its chunks, is the placement:

- looped: virtual stage ``c * P + s`` is chunk c of stage s (GPipe, 1F1B, interleaved);
- V (two chunks): stage s holds virtual stages ``s`` (chunk 0) and ``2P-1-s`` (chunk 1), so
  the first and the last virtual stage, and with it the loss, live on stage 0 (ZBV, DualPipeV).

An `Action` carries its stage and chunk, resolved from the placement when it is made
(`Placement.action`, `parse_action`); they do not take part in equality.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field


class Kind(enum.Enum):
    F = "F"  # forward
    I = "I"  # noqa: E741  input gradient (torch's BACKWARD_INPUT), when backward is split
    W = "W"  # weight gradient (torch's BACKWARD_WEIGHT), when backward is split
    B = "B"  # full backward: input and weight gradients together (torch's FULL_BACKWARD)

    @property
    def backward(self) -> bool:
        """I or B: the pass that sends a gradient upstream."""
        return self is Kind.I or self is Kind.B


class Placement(enum.Enum):
    LOOPED = "looped"
    V = "v"

    def locate(self, *, virtual_stage: int, stages: int) -> tuple[int, int]:
        """(stage, chunk) that holds a virtual stage."""
        if self is Placement.V and virtual_stage >= stages:
            return 2 * stages - 1 - virtual_stage, 1
        return virtual_stage % stages, virtual_stage // stages

    def virtual_stage(self, *, stage: int, chunk: int, stages: int) -> int:
        if self is Placement.V and chunk == 1:
            return 2 * stages - 1 - stage
        return chunk * stages + stage

    def action(self, *, kind: Kind, virtual_stage: int, microbatch: int, stages: int) -> Action:
        stage, chunk = self.locate(virtual_stage=virtual_stage, stages=stages)
        return Action(virtual_stage=virtual_stage, kind=kind, microbatch=microbatch, stage=stage, chunk=chunk)


@dataclass(frozen=True)
class Action:
    virtual_stage: int
    kind: Kind
    microbatch: int
    stage: int = field(compare=False)  # the physical stage holding virtual_stage
    chunk: int = field(compare=False)  # which of that stage's chunks it is

    def __str__(self) -> str:
        return f"{self.virtual_stage}{self.kind.value}{self.microbatch}"


NOTATION_DOC = "docs/policies.md, section 'Action notation'"
_PATTERN = re.compile(r"^(\d+)([FIWB])(\d+)$")
_STAGE_CHUNK = re.compile(r"^\d+[FBW]\d+c\d+$")


def action_kind(text: str) -> Kind:
    """The kind of an action text, wherever it runs."""
    match = _PATTERN.match(text.strip())
    if match is None:
        raise ValueError(f"not an action: {text!r}")
    return Kind(match.group(2))


def parse_action(text: str, *, stages: int, placement: Placement = Placement.LOOPED) -> Action:
    """An action from torch's text form (``2F0``, ``5I0``); `stages` and `placement` say where it runs."""
    word = text.strip()
    match = _PATTERN.match(word)
    if match is None:
        if _STAGE_CHUNK.match(word):
            raise ValueError(
                f"{text!r} is in the stage-and-chunk action notation (stage, kind, microbatch, chunk), which is "
                f"refused; see {NOTATION_DOC}"
            )
        raise ValueError(f"not an action: {text!r} (expected virtual stage, F|I|W|B, microbatch, e.g. '2F0' or '5I3')")
    virtual_stage, kind, microbatch = match.groups()
    return placement.action(
        kind=Kind(kind), virtual_stage=int(virtual_stage), microbatch=int(microbatch), stages=stages
    )
