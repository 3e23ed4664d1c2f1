"""Classic pipeline schedules as plain data: per stage, its compute order for one iteration.

Each generator returns ``{stage: [Action, ...]}`` with F, B and (for zb-h1) W actions only.
The orders are those of PyTorch's ``torch.distributed.pipelining`` (2.13) schedules for the
same stages P, chunks v and microbatches M, and so are the microbatch counts they refuse:

- ``gpipe``: all forwards, then all backwards.
- ``1f1b``: ``P-1-s`` warmup forwards on stage ``s``, then one forward and one backward at a
  time, then the remaining backwards (``Schedule1F1B``; needs ``M >= P``).
- ``interleaved``: the same pattern over v chunks per stage, in rounds of ``M // R``
  microbatches per chunk, ``R = max(1, M // P)`` (``ScheduleInterleaved1F1B``; needs
  ``M % R == 0``).
- ``zb-h1``: 1F1B with the backward split into B (input gradient) and W (weight gradient);
  stage ``s`` runs each W ``s`` backwards after its B, filling the drain bubble
  (``ScheduleInterleavedZeroBubble`` with one stage per rank; needs ``M % R == 0``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rrfp_ray.schedule.actions import Action, Kind

Order = dict[int, list[Action]]


def gpipe(*, stages: int, microbatches: int) -> Order:
    _require_positive(stages=stages, microbatches=microbatches)
    return {
        s: [Action(stage=s, kind=kind, microbatch=m) for kind in (Kind.F, Kind.B) for m in range(microbatches)]
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
        raise ValueError(f"chunks must be >= 2 for interleaved (use 1f1b for one chunk), got {chunks}")
    per_round = _microbatches_per_round(stages=stages, microbatches=microbatches, name="interleaved")
    order: Order = {}
    for s in range(stages):
        forwards = _chunk_turns(stage=s, kind=Kind.F, chunks=chunks, per_round=per_round, microbatches=microbatches)
        backwards = _chunk_turns(stage=s, kind=Kind.B, chunks=chunks, per_round=per_round, microbatches=microbatches)
        warmup = min((chunks - 1) * per_round + 2 * (stages - 1 - s), chunks * microbatches)
        order[s] = _alternate(forwards=forwards, backwards=backwards, warmup=warmup)
    return order


def zb_h1(*, stages: int, microbatches: int) -> Order:
    _require_positive(stages=stages, microbatches=microbatches)
    _microbatches_per_round(stages=stages, microbatches=microbatches, name="zb-h1")
    return {
        s: _defer_weights(_one_f_one_b_stage(stage=s, stages=stages, microbatches=microbatches), lag=s)
        for s in range(stages)
    }


@dataclass(frozen=True)
class Schedule:
    generate: Callable[..., Order]
    chunked: bool  # takes chunks (>= 2); the others run one chunk per stage
    splits: bool  # has W actions (backward split into input and weight gradients)


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(generate=gpipe, chunked=False, splits=False),
    "1f1b": Schedule(generate=one_f_one_b, chunked=False, splits=False),
    "interleaved": Schedule(generate=interleaved, chunked=True, splits=False),
    "zb-h1": Schedule(generate=zb_h1, chunked=False, splits=True),
}


def build(*, name: str, stages: int, chunks: int, microbatches: int) -> Order:
    schedule = _lookup(name)
    if schedule.chunked:
        return schedule.generate(stages=stages, chunks=chunks, microbatches=microbatches)
    if chunks != 1:
        raise ValueError(f"chunks must be 1 for schedule {name!r} (only 'interleaved' takes chunks), got {chunks}")
    return schedule.generate(stages=stages, microbatches=microbatches)


def splits(name: str) -> bool:
    return _lookup(name).splits


def peak_inflight(order: Order, *, stage: int) -> int:
    """Most microbatches held between their chunk-0 F and their last chunk-0 backward (W if split)."""
    actions = _stage_list(order, stage=stage)
    release = Kind.W if any(a.kind is Kind.W for a in actions) else Kind.B
    return _peak(actions, release=release)


def peak_inflight_fb(order: Order, *, stage: int) -> int:
    """Most microbatches held between their chunk-0 F and their chunk-0 B, split or not."""
    return _peak(_stage_list(order, stage=stage), release=Kind.B)


def _lookup(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule name {name!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


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


def _chunk_turns(
    *, stage: int, kind: Kind, chunks: int, per_round: int, microbatches: int
) -> list[Action]:
    """Every action of one kind, chunks taking turns in blocks of ``per_round`` microbatches.

    Forwards start with chunk 0, backwards with the last chunk.
    """
    ops = []
    for k in range(chunks * microbatches):
        turn = (k // per_round) % chunks
        microbatch = (k // (per_round * chunks)) * per_round + k % per_round
        chunk = turn if kind is Kind.F else chunks - 1 - turn
        ops.append(Action(stage=stage, kind=kind, microbatch=microbatch, chunk=chunk))
    return ops


def _one_f_one_b_stage(*, stage: int, stages: int, microbatches: int) -> list[Action]:
    forwards = [Action(stage=stage, kind=Kind.F, microbatch=m) for m in range(microbatches)]
    backwards = [Action(stage=stage, kind=Kind.B, microbatch=m) for m in range(microbatches)]
    return _alternate(forwards=forwards, backwards=backwards, warmup=min(stages - 1 - stage, microbatches))


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
    """Insert each B's W after the B that comes ``lag`` backwards later; the rest at the end."""
    out: list[Action] = []
    pending: deque[Action] = deque()
    for op in ops:
        out.append(op)
        if op.kind is Kind.B:
            pending.append(Action(stage=op.stage, kind=Kind.W, microbatch=op.microbatch, chunk=op.chunk))
            if len(pending) > lag:
                out.append(pending.popleft())
    return out + list(pending)


def _stage_list(order: Order, *, stage: int) -> list[Action]:
    if stage not in order:
        raise ValueError(f"stage {stage} is not in the order (stages: {sorted(order)})")
    return order[stage]


def _peak(actions: Sequence[Action], *, release: Kind) -> int:
    held = peak = 0
    for action in actions:
        if action.chunk != 0:
            continue
        if action.kind is Kind.F:
            held += 1
            peak = max(peak, held)
        elif action.kind is release:
            held -= 1
    return peak
