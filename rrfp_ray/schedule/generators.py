"""Classic pipeline schedules as plain data: per stage, its compute order for one iteration.

Each generator returns ``{stage: [Action, ...]}``: F and B actions, or F, I and W for zb-h1.
The orders are those of PyTorch's ``torch.distributed.pipelining`` (2.13) schedules for the
same stages P, chunks v and microbatches M, and so are the microbatch counts they refuse:

- ``gpipe``: all forwards, then all backwards.
- ``1f1b``: ``P-1-s`` warmup forwards on stage ``s``, then one forward and one backward at a
  time, then the remaining backwards (``Schedule1F1B``; needs ``M >= P``).
- ``interleaved``: the same pattern over v chunks per stage, in rounds of ``M // R``
  microbatches per chunk, ``R = max(1, M // P)`` (``ScheduleInterleaved1F1B``; needs
  ``M % R == 0``).
- ``zb-h1``: 1F1B with the backward split into I (input gradient) and W (weight gradient);
  stage ``s`` runs each W ``s`` input gradients after its I, filling the drain bubble
  (``ScheduleInterleavedZeroBubble`` with one stage per rank; needs ``M % R == 0``).

Two more are fixed baselines given twice 1F1B's activation memory (PyTorch has neither):

- ``1f1b-2x``: 1F1B whose stage ``s`` runs ``min(2(P-s), M)`` forwards before its first
  backward, so it holds up to ``2(P-s)`` microbatches, twice 1F1B's ``P-s``.
- ``zb-h2``: ZB-H2 of the zero-bubble paper (Qi et al. 2023, section 3.2): stage ``s`` runs
  ``min(2(P-s)-1, M)`` forwards before its first input gradient, the most that fit before that
  gradient can arrive at unit times, then one I and one F at a time, each W ``s`` input gradients
  after its I as in zb-h1, so that W's fill the steady state and the drain. Its peak is ``2P-1`` microbatches
  on stage 0, the paper's ``(2p-1) M_B``, under twice 1F1B's ``P``. With equal F, I and W times it
  has no bubble but the pipeline's start and end (``P-1`` steps, as zb-h1); the extra forwards buy
  slack when durations vary.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rrfp_ray.schedule.actions import Action, Kind, Placement
from rrfp_ray.schedule.torch_import import imported

Order = dict[int, list[Action]]


def gpipe(*, stages: int, microbatches: int) -> Order:
    _require_positive(stages=stages, microbatches=microbatches)
    return {
        s: [
            _action(kind=kind, stage=s, stages=stages, microbatch=m)
            for kind in (Kind.F, Kind.B)
            for m in range(microbatches)
        ]
        for s in range(stages)
    }


def one_f_one_b(*, stages: int, microbatches: int) -> Order:
    _require_positive(stages=stages, microbatches=microbatches)
    if microbatches < stages:
        raise ValueError(
            f"microbatches must be >= stages for 1f1b (as PyTorch's Schedule1F1B requires), "
            f"got microbatches={microbatches} < stages={stages}"
        )
    return {s: _one_f_one_b_stage(stage=s, stages=stages, microbatches=microbatches) for s in range(stages)}


def interleaved(*, stages: int, chunks: int, microbatches: int) -> Order:
    _require_positive(stages=stages, microbatches=microbatches)
    if chunks < 2:
        raise ValueError(f"chunks (--chunks) must be >= 2 for interleaved (use 1f1b for one chunk), got {chunks}")
    per_round = _microbatches_per_round(stages=stages, microbatches=microbatches, name="interleaved")
    order: Order = {}
    for s in range(stages):
        turns = {"stage": s, "stages": stages, "chunks": chunks, "per_round": per_round, "microbatches": microbatches}
        forwards = _chunk_turns(kind=Kind.F, **turns)
        backwards = _chunk_turns(kind=Kind.B, **turns)
        warmup = min((chunks - 1) * per_round + 2 * (stages - 1 - s), chunks * microbatches)
        order[s] = _alternate(forwards=forwards, backwards=backwards, warmup=warmup)
    return order


def zb_h1(*, stages: int, microbatches: int) -> Order:
    _require_positive(stages=stages, microbatches=microbatches)
    _microbatches_per_round(stages=stages, microbatches=microbatches, name="zb-h1")
    return {
        s: _defer_weights(_one_f_one_b_stage(stage=s, stages=stages, microbatches=microbatches, backward=Kind.I), lag=s)
        for s in range(stages)
    }


def one_f_one_b_2x(*, stages: int, microbatches: int) -> Order:
    _require_positive(stages=stages, microbatches=microbatches)
    return {
        s: _one_f_one_b_stage(stage=s, stages=stages, microbatches=microbatches, ahead=2 * (stages - s))
        for s in range(stages)
    }


def zb_h2(*, stages: int, microbatches: int) -> Order:
    _require_positive(stages=stages, microbatches=microbatches)
    return {
        s: _defer_weights(
            _one_f_one_b_stage(
                stage=s, stages=stages, microbatches=microbatches, backward=Kind.I, ahead=2 * (stages - s) - 1
            ),
            lag=s,
        )
        for s in range(stages)
    }


class Chunks(enum.Enum):
    """The chunk counts a schedule takes."""

    ONE = "1"
    MANY = ">= 2"
    ANY = ">= 1"
    TWO = "2"

    def allows(self, chunks: int) -> bool:
        return {Chunks.ONE: chunks == 1, Chunks.MANY: chunks >= 2, Chunks.ANY: chunks >= 1, Chunks.TWO: chunks == 2}[
            self
        ]


@dataclass(frozen=True)
class Schedule:
    generate: Callable[..., Order]  # (stages, chunks, microbatches) -> Order
    chunks: Chunks
    splits: bool  # has I and W actions (backward split into input and weight gradients)
    placement: Placement = Placement.LOOPED


def _imported(name: str) -> Callable[..., Order]:
    return lambda *, stages, chunks, microbatches: imported(
        name=name, stages=stages, chunks=chunks, microbatches=microbatches
    )


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(generate=lambda *, chunks, **size: gpipe(**size), chunks=Chunks.ONE, splits=False),
    "1f1b": Schedule(generate=lambda *, chunks, **size: one_f_one_b(**size), chunks=Chunks.ONE, splits=False),
    "interleaved": Schedule(generate=interleaved, chunks=Chunks.MANY, splits=False),
    "looped-bfs": Schedule(generate=_imported("looped-bfs"), chunks=Chunks.ANY, splits=False),
    "zb-h1": Schedule(generate=lambda *, chunks, **size: zb_h1(**size), chunks=Chunks.ONE, splits=True),
    "1f1b-2x": Schedule(generate=lambda *, chunks, **size: one_f_one_b_2x(**size), chunks=Chunks.ONE, splits=False),
    "zb-h2": Schedule(generate=lambda *, chunks, **size: zb_h2(**size), chunks=Chunks.ONE, splits=True),
    "zb-interleaved": Schedule(generate=_imported("zb-interleaved"), chunks=Chunks.ANY, splits=True),
    "zbv": Schedule(generate=_imported("zbv"), chunks=Chunks.TWO, splits=True, placement=Placement.V),
    "dualpipev": Schedule(generate=_imported("dualpipev"), chunks=Chunks.TWO, splits=True, placement=Placement.V),
}


def build(*, name: str, stages: int, chunks: int, microbatches: int) -> Order:
    schedule = lookup(name)
    if not schedule.chunks.allows(chunks):
        why = " (the V placement holds two virtual stages per stage)" if schedule.placement is Placement.V else ""
        raise ValueError(f"chunks (--chunks) must be {schedule.chunks.value} for schedule {name!r}{why}, got {chunks}")
    _require_positive(stages=stages, microbatches=microbatches)
    return schedule.generate(stages=stages, chunks=chunks, microbatches=microbatches)


def splits(name: str) -> bool:
    return lookup(name).splits


def lookup(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule name {name!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def peak_inflight(order: Order, *, stage: int) -> int:
    """Most microbatches held between their chunk-0 F and their last chunk-0 backward (W if split)."""
    actions = _stage_list(order, stage=stage)
    release = (Kind.W,) if any(a.kind is Kind.W for a in actions) else (Kind.B,)
    return _peak(actions, release=release)


def peak_inflight_fb(order: Order, *, stage: int) -> int:
    """Most microbatches held between their chunk-0 F and their chunk-0 I or B, split or not."""
    return _peak(_stage_list(order, stage=stage), release=(Kind.I, Kind.B))


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _microbatches_per_round(*, stages: int, microbatches: int, name: str) -> int:
    rounds = max(1, microbatches // stages)
    if microbatches % rounds != 0:
        raise ValueError(
            f"microbatches must be a multiple of the number of rounds max(1, microbatches // stages) = {rounds} "
            f"for {name} (as PyTorch requires), got microbatches={microbatches} with stages={stages}"
        )
    return microbatches // rounds


def _action(*, kind: Kind, stage: int, stages: int, microbatch: int, chunk: int = 0) -> Action:
    virtual_stage = Placement.LOOPED.virtual_stage(stage=stage, chunk=chunk, stages=stages)
    return Placement.LOOPED.action(kind=kind, virtual_stage=virtual_stage, microbatch=microbatch, stages=stages)


def _chunk_turns(
    *, stage: int, stages: int, kind: Kind, chunks: int, per_round: int, microbatches: int
) -> list[Action]:
    """Every action of one kind, chunks taking turns in blocks of ``per_round`` microbatches.

    Forwards start with chunk 0, backwards with the last chunk.
    """
    ops = []
    for k in range(chunks * microbatches):
        turn = (k // per_round) % chunks
        microbatch = (k // (per_round * chunks)) * per_round + k % per_round
        chunk = turn if kind is Kind.F else chunks - 1 - turn
        ops.append(_action(kind=kind, stage=stage, stages=stages, microbatch=microbatch, chunk=chunk))
    return ops


def _one_f_one_b_stage(
    *, stage: int, stages: int, microbatches: int, backward: Kind = Kind.B, ahead: int | None = None
) -> list[Action]:
    """``ahead`` forwards (default ``P-s``, 1F1B's) before the first backward, then one of each at a time."""
    forwards = [_action(kind=Kind.F, stage=stage, stages=stages, microbatch=m) for m in range(microbatches)]
    backwards = [_action(kind=backward, stage=stage, stages=stages, microbatch=m) for m in range(microbatches)]
    ahead = stages - stage if ahead is None else ahead
    return _alternate(forwards=forwards, backwards=backwards, warmup=min(ahead - 1, microbatches))


def _alternate(*, forwards: Sequence[Action], backwards: Sequence[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward at a time, then the remaining backwards."""
    steady = forwards[warmup:]
    ops = list(forwards[:warmup])
    for i, backward in enumerate(backwards):
        if i < len(steady):
            ops.append(steady[i])
        ops.append(backward)
    return ops


def _defer_weights(ops: Sequence[Action], *, lag: int) -> list[Action]:
    """Insert each I's W after the I that comes ``lag`` input gradients later; the rest at the end."""
    out: list[Action] = []
    pending: deque[Action] = deque()
    for op in ops:
        out.append(op)
        if op.kind is Kind.I:
            pending.append(replace(op, kind=Kind.W))
            if len(pending) > lag:
                out.append(pending.popleft())
    return out + list(pending)


def _stage_list(order: Order, *, stage: int) -> list[Action]:
    if stage not in order:
        raise ValueError(f"stage {stage} is not in the order (stages: {sorted(order)})")
    return order[stage]


def _peak(actions: Sequence[Action], *, release: tuple[Kind, ...]) -> int:
    held = peak = 0
    for action in actions:
        if action.chunk != 0:
            continue
        if action.kind is Kind.F:
            held += 1
            peak = max(peak, held)
        elif action.kind in release:
            held -= 1
    return peak
