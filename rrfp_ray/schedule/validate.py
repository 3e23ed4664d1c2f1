"""Check a per-stage order: complete, locally ordered, and free of cross-stage deadlock.

Deadlock is checked by running the order at unit times: every action takes one step, a
message sent at step t can be used from step t+1, and each stage runs only the next action
of its list, once what it needs is there. Errors print the stage x step grid with the
faulty cells drawn as ``>1B3<``.

A hint file is JSON ``{stage: ["0F0", ...]}`` or torch's CSV (one row per stage); see `read_hint`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from rrfp_ray.schedule.actions import Action, Kind, Placement
from rrfp_ray.schedule.generators import Order
from rrfp_ray.schedule.layout import Layout, Message
from rrfp_ray.schedule.torch_import import translate

Cell = tuple[int, int]  # (stage, position in that stage's list)


def validate(order: Order, *, layout: Layout) -> None:
    """Raise ValueError, with the grid and a sentence on what is wrong, unless the order is sound."""
    _check_stages(order, layout=layout)
    _check_membership(order, layout=layout)
    _check_missing(order, layout=layout)
    _check_local_order(order, layout=layout)
    _check_progress(order, layout=layout)


def unit_steps(order: Order, *, layout: Layout) -> dict[int, list[int]]:
    """The step each stage runs its actions at, at unit times; a list stops where its stage stalls.

    Every listed action must be one of the layout's (``validate`` checks that first).
    """
    producer = _producers(layout)
    steps: dict[int, list[int]] = {s: [] for s in order}
    done: set[Action] = set()
    step = 0
    while True:
        ran = []
        for s, actions in order.items():
            position = len(steps[s])
            if position == len(actions):
                continue
            if _blocker(actions[position], layout=layout, producer=producer, done=done) is None:
                ran.append((s, actions[position]))
        if not ran:
            return steps
        for s, action in ran:
            steps[s].append(step)
            done.add(action)
        step += 1


def format_grid(
    order: Order, *, columns: Mapping[int, Sequence[int]] | None = None, marks: Collection[Cell] = ()
) -> str:
    """Rows are stages, columns steps, cells action text; blank cells are idle.

    ``columns[s][i]`` is the step of ``order[s][i]``; actions past the end of ``columns[s]`` are
    not drawn. Without ``columns`` each action sits at its position in the list. Cells in
    ``marks`` are drawn as ``>1B3<``.
    """
    rows: dict[int, dict[int, str]] = {}
    for s, actions in sorted(order.items()):
        at = range(len(actions)) if columns is None else columns.get(s, ())
        rows[s] = {step: f">{actions[i]}<" if (s, i) in marks else str(actions[i]) for i, step in enumerate(at)}
    width = 1 + max((step for row in rows.values() for step in row), default=-1)
    sizes = [max([len(str(step)), *(len(row.get(step, "")) for row in rows.values())]) for step in range(width)]
    labels = {s: f"stage {s}" for s in rows}
    label_size = max([len("step"), *(len(label) for label in labels.values())])

    def line(label: str, cells: Sequence[str]) -> str:
        return "  ".join([label.ljust(label_size), *(cell.ljust(size) for cell, size in zip(cells, sizes))]).rstrip()

    lines = [line("step" if columns is not None else "pos", [str(step) for step in range(width)])]
    lines += [line(labels[s], [row.get(step, "") for step in range(width)]) for s, row in rows.items()]
    return "\n".join(lines)


def _fail(
    order: Order, what: str, *, columns: Mapping[int, Sequence[int]] | None = None, marks: Collection[Cell] = ()
) -> None:
    grid = format_grid(order, columns=columns, marks=marks)
    where = "at unit times" if columns is not None else "as listed"
    raise ValueError(f"invalid pipeline order: {what}\n\norder {where}:\n{grid}")


def _check_stages(order: Order, *, layout: Layout) -> None:
    expected = set(range(layout.stages))
    foreign = sorted(set(order) - expected)
    if foreign:
        _fail(order, f"stage {foreign[0]} is not a stage of the layout (stages 0..{layout.stages - 1})")
    absent = sorted(expected - set(order))
    if absent:
        _fail(order, f"stage {absent[0]} has no list")


def _check_membership(order: Order, *, layout: Layout) -> None:
    for s in range(layout.stages):
        expected = set(layout.actions(stage=s))
        first: dict[Action, int] = {}
        for i, action in enumerate(order[s]):
            if action not in expected:
                why = _why_foreign(action, stage=s, layout=layout)
                _fail(order, f"stage {s} lists {action}, {why}", marks={(s, i)})
            if action in first:
                _fail(order, f"stage {s} lists {action} twice (positions {first[action]} and {i})", marks={(s, i)})
            first[action] = i


def _why_foreign(action: Action, *, stage: int, layout: Layout) -> str:
    if action.stage != stage:
        return f"which belongs to stage {action.stage}"
    if action.kind is Kind.W:
        return "but the layout does not split B into I and W"
    return f"which is out of range (chunks={layout.chunks}, microbatches={layout.microbatches})"


def _check_missing(order: Order, *, layout: Layout) -> None:
    for s in range(layout.stages):
        listed = set(order[s])
        missing = [a for a in layout.actions(stage=s) if a not in listed]
        if missing:
            names = ", ".join(str(a) for a in missing[:8]) + (", ..." if len(missing) > 8 else "")
            _fail(order, f"stage {s} never runs {names} (missing from its list)")


def _check_local_order(order: Order, *, layout: Layout) -> None:
    for s in range(layout.stages):
        seen: set[Action] = set()
        for i, action in enumerate(order[s]):
            need = layout.local_need(action)
            if need is not None and need not in seen:
                _fail(
                    order,
                    f"{action} waits for {need} on the same stage, which stage {s} lists later",
                    marks={(s, i)},
                )
            seen.add(action)


def _check_progress(order: Order, *, layout: Layout) -> None:
    steps = unit_steps(order, layout=layout)
    stuck = {s: order[s][len(steps[s])] for s in sorted(order) if len(steps[s]) < len(order[s])}
    if not stuck:
        return
    stall = 1 + max((step for row in steps.values() for step in row), default=-1)
    producer = _producers(layout)
    done = {a for s, actions in order.items() for a in actions[: len(steps[s])]}
    # With complete, locally ordered lists a stalled action waits only for a message, whose
    # sender is on a stalled stage too; following those waits from stage to stage ends in a cycle.
    blocker = {s: _blocker(action, layout=layout, producer=producer, done=done) for s, action in stuck.items()}
    cycle = _cycle(blocker)
    reasons = []
    for s in cycle:
        source = blocker[s]
        what = "activation" if source.kind is Kind.F else "gradient"
        head = stuck[source.stage]
        after = "which is stalled too" if head == source else f"which stage {source.stage} runs only after {head}"
        reasons.append(f"{stuck[s]} waits for the {what} from {source}, {after}")
    columns = {s: [*row, stall] if s in cycle else row for s, row in steps.items()}
    marks = {(s, len(steps[s])) for s in cycle}
    _fail(order, f"deadlock at step {stall}: " + "; ".join(reasons), columns=columns, marks=marks)


def _producers(layout: Layout) -> dict[Message, Action]:
    """The action that sends each message."""
    found = {}
    for s in range(layout.stages):
        for action in layout.actions(stage=s):
            message = layout.sends(action)
            if message is not None:
                found[message] = action
    return found


def _blocker(action: Action, *, layout: Layout, producer: Mapping[Message, Action], done: set[Action]) -> Action | None:
    """The first action ``action`` still waits for, or None when it can run."""
    need = layout.local_need(action)
    if need is not None and need not in done:
        return need
    message = layout.message_need(action)
    if message is not None and producer[message] not in done:
        return producer[message]
    return None


def _cycle(blocker: Mapping[int, Action]) -> list[int]:
    """The stages on the wait cycle reached from the lowest stalled stage."""
    path: list[int] = []
    s = min(blocker)
    while s not in path:
        path.append(s)
        s = blocker[s].stage
    return path[path.index(s) :]


@dataclass(frozen=True)
class Hint:
    """A user's hint order and the placement its rows imply."""

    order: Order
    placement: Placement


def read_hint(text: str) -> dict[int, list[str]]:
    """A hint file's action texts per stage: JSON ``{"0": ["0F0", ...]}`` or torch's CSV."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"hint file is not valid JSON: {error}") from None
        if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
            raise ValueError('a hint order maps each stage to a list of actions like "0F0"')
        try:
            return {int(stage): [str(word) for word in words] for stage, words in data.items()}
        except ValueError as error:
            raise ValueError(f"hint stages must be integers: {error}") from None
    return {rank: row.split(",") for rank, row in enumerate(text.splitlines()) if row.strip()}


def parse_order(data: Mapping[int, Sequence[str]], *, stages: int, chunks: int, microbatches: int) -> Hint:
    """A user's hint order, validated; I and W actions mean the B/W split.

    The placement is the one under which each stage lists its own virtual stages (looped
    unless only V fits, which needs two chunks)."""
    cells = {int(stage): list(words) for stage, words in data.items()}
    candidates = [Placement.LOOPED, Placement.V] if chunks == 2 else [Placement.LOOPED]
    orders = {p: translate(cells, stages=stages, placement=p) for p in candidates}
    placement = next((p for p in candidates if _own_stages(orders[p])), Placement.LOOPED)
    order = orders[placement]
    split = any(a.kind is Kind.W for actions in order.values() for a in actions)
    validate(
        order, layout=Layout(stages=stages, chunks=chunks, microbatches=microbatches, split=split, placement=placement)
    )
    return Hint(order=order, placement=placement)


def _own_stages(order: Order) -> bool:
    return all(a.stage == s for s, actions in order.items() for a in actions)
