"""Readiness agreement among the tensor-parallel ranks of one stage.

The ranks of a TP group hold the same arbiter state but receive messages at different
times, so their ready sets can differ; their collectives only match if they run the same
op in the same order. Before each op they run rounds of an all-gather of op ids until a
round decides one:

- `first` (the paper's): each rank offers its first choice (-1: none); the op runs when
  every rank offered it, else every rank defers and arbitrates again in a new round.
- `common`: each rank offers its `k` best eligible ops, best first (-1 pads); the op run is
  the first of rank 0's list that is in every rank's list; none common: a new round.

Both decide from the gathered lists alone, so every rank decides the same. Weight passes (W)
are agreed too, although off virtual stage 0 they call no TP collective: run unagreed, they
let the ranks drift apart (one runs a W while the other waits in a round for an op it has
ready), and bfw took 1.17x its simulated time instead of 1.05x (multimodal+comm with each
rank's own message latencies, PP=2 x TP=2 on Ray). A fixed policy needs no rounds at all:
every rank runs the same list.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rrfp_ray.schedule.actions import Action, Kind


class TPProtocol(enum.Enum):
    """How the ranks of a TP group agree on their next op (see the module's docstring)."""

    FIRST = "first"
    COMMON = "common"


class TPGather(enum.Enum):
    """What carries an agreement round's all-gather between the TP ranks of a stage: direct
    authenticated TCP connections, or the collective library's all-gather over the stage's TP
    group (gloo on CPU; NCCL on GPUs, the ids in a small device tensor)."""

    TCP = "tcp"
    COLLECTIVE = "collective"


NONE = -1
_KINDS = (Kind.F, Kind.B, Kind.W, Kind.I)
_CHUNK_BITS = 16


def op_id(action: Action) -> int:
    """A stable int for an action of one stage: microbatch, chunk and kind."""
    if not 0 <= action.chunk < 1 << _CHUNK_BITS:
        raise ValueError(f"action.chunk must be in [0, {1 << _CHUNK_BITS}), got {action.chunk}")
    return ((action.microbatch << _CHUNK_BITS) | action.chunk) * len(_KINDS) + _KINDS.index(action.kind)


@dataclass(frozen=True)
class TPContext:
    """One rank's view of its stage's TP group."""

    rank: int
    size: int
    all_gather: Callable[[list[int]], list[list[int]]]  # every rank's list, in rank order
    all_reduce: Callable[[Tensor], Tensor]  # sum over the group, for the TP layers
    protocol: TPProtocol = TPProtocol.FIRST
    k: int = 4  # ops each rank offers per round under `common`
    poll_s: float = 0.002  # after a round that decided nothing: how long to wait for an arrival before the next
    idle_s: float = 0.05  # with nothing eligible: the longest wait for an arrival before joining a round anyway

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if not isinstance(self.protocol, TPProtocol):
            raise TypeError(f"protocol must be a TPProtocol, got {self.protocol!r}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.poll_s <= 0 or self.idle_s <= 0:
            raise ValueError(f"poll_s and idle_s must be > 0, got {self.poll_s}, {self.idle_s}")

    @property
    def width(self) -> int:
        """How many op ids each rank offers per round."""
        return 1 if self.protocol is TPProtocol.FIRST else self.k


def offer(*, candidates: list[Action], width: int) -> list[int]:
    """The op ids a rank contributes to a round: its `width` best, padded with -1."""
    ids = [op_id(action) for action in candidates[:width]]
    return ids + [NONE] * (width - len(ids))


def decide(*, protocol: TPProtocol, gathered: list[list[int]]) -> int | None:
    """The op every rank runs after this round, or None: another round."""
    if protocol is TPProtocol.FIRST:
        firsts = {ids[0] for ids in gathered}
        return firsts.pop() if len(firsts) == 1 and NONE not in firsts else None
    return next((op for op in gathered[0] if op != NONE and all(op in ids for ids in gathered[1:])), None)


class Agreement:
    """Runs rounds for one rank and counts them.

    `cost_ms` is what the protocol itself costs: per round, the time from the moment the
    last rank joined it until the result is back. Waiting for a slower rank to join is not
    in it: that wait is the stage being blocked, and a TP collective inside the op would
    wait for that rank all the same. Each rank's joining time travels in its offer.
    """

    def __init__(self, *, tp: TPContext) -> None:
        self.tp = tp
        self.cost_ms = 0.0
        self.rounds = 0
        self.disagreements = 0  # rounds that decided nothing although some rank offered an op
        self.conflicts = 0  # of those, rounds where every rank offered one (none had to wait for an arrival)

    def round(self, candidates: list[Action]) -> Action | None:
        """One round over this rank's candidates (best first); the agreed action, or None."""
        rows = self.tp.all_gather([*offer(candidates=candidates, width=self.tp.width), time.time_ns() // 1000])
        self.cost_ms += max(0.0, time.time() * 1e3 - max(row[-1] for row in rows) / 1e3)
        gathered = [row[:-1] for row in rows]
        chosen = decide(protocol=self.tp.protocol, gathered=gathered)
        self.rounds += 1
        if chosen is None and any(ids[0] != NONE for ids in gathered):
            self.disagreements += 1
            self.conflicts += all(ids[0] != NONE for ids in gathered)
        if chosen is None:
            return None
        action = next((a for a in candidates if op_id(a) == chosen), None)
        if action is None:
            raise ValueError(f"agreed op {chosen} is not among this rank's candidates {candidates}")
        return action
