"""PyTorch's schedules as our orders: its classes' compute-only ``pipeline_order``, and its CSV.

torch's multi-stage schedule classes build their whole ``pipeline_order`` (every rank's
actions) in the constructor, from ``stage_index``/``num_stages``/``group_size`` of the stages
they are given, so stand-in stages that hold only those fields are enough: nothing runs.

Translation, the same for a class and for a CSV file (what ``_dump_csv`` writes):

- idle slots and communication (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD) are dropped;
- an overlapped forward and backward (DualPipeV's ``OVERLAP_F_B``) runs as its sub-actions,
  in their order: the F, then the backward;
- in a schedule that splits backward (has I or W), a full backward ``B`` runs as its I then
  its W, back to back: the same work, in the split layout every (stage, microbatch) has.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from rrfp_ray.schedule.actions import NOTATION_DOC, Action, Kind, Placement, parse_action

_COMPUTE = {"F": Kind.F, "I": Kind.I, "W": Kind.W, "B": Kind.B}
_SKIPPED = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
_CLASSES = {
    "looped-bfs": ("ScheduleLoopedBFS", Placement.LOOPED),
    "zb-interleaved": ("ScheduleInterleavedZeroBubble", Placement.LOOPED),
    "zbv": ("ScheduleZBVZeroBubble", Placement.V),
    "dualpipev": ("ScheduleDualPipeV", Placement.V),
}


@dataclass
class _StandIn:
    """What a multi-stage schedule's constructor reads from each of rank 0's stages."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    is_last: bool = False
    submod: None = None


def imported(*, name: str, stages: int, chunks: int, microbatches: int) -> dict[int, list[Action]]:
    """The order of torch's schedule class for `name` (one of looped-bfs, zb-interleaved, zbv, dualpipev).

    A microbatch count the class refuses raises ValueError with torch's own rule."""
    from torch.distributed.pipelining import schedules

    class_name, placement = _CLASSES[name]
    held = [placement.virtual_stage(stage=0, chunk=c, stages=stages) for c in range(chunks)]
    stand_ins = [_StandIn(stage_index=vs, num_stages=stages * chunks, group_size=stages) for vs in held]
    try:
        schedule = getattr(schedules, class_name)(stand_ins, microbatches)
    except (ValueError, AssertionError, RuntimeError) as error:
        raise ValueError(
            f"schedule {name!r} (torch's {class_name}) refuses microbatches={microbatches}: {error}"
        ) from None
    cells = {rank: [str(a) for a in actions if a is not None] for rank, actions in schedule.pipeline_order.items()}
    return translate(cells, stages=stages, placement=placement)


def translate(cells: dict[int, Iterable[str]], *, stages: int, placement: Placement) -> dict[int, list[Action]]:
    """torch action texts per rank as our order (see the module docstring)."""
    words = {rank: [w for cell in row for w in _compute_words(cell)] for rank, row in cells.items()}
    order = {rank: [parse_action(w, stages=stages, placement=placement) for w in row] for rank, row in words.items()}
    if any(a.kind in (Kind.I, Kind.W) for actions in order.values() for a in actions):
        _refuse_b_with_w(order)
        order = {rank: [b for a in actions for b in _split(a)] for rank, actions in order.items()}
    return order


def _compute_words(cell: str) -> list[str]:
    cell = cell.strip()
    if cell in ("", "None"):
        return []
    if cell.startswith("("):  # (0F3;3B1)OVERLAP_F_B
        inner, _, kind = cell[1:].partition(")")
        if kind != "OVERLAP_F_B":
            raise ValueError(f"torch action {cell!r}: only OVERLAP_F_B groups sub-actions")
        return [w for sub in inner.split(";") for w in _compute_words(sub)]
    if any(skip in cell for skip in _SKIPPED):
        return []
    return [cell]


def _split(action: Action) -> list[Action]:
    if action.kind is not Kind.B:
        return [action]
    return [replace(action, kind=Kind.I), replace(action, kind=Kind.W)]


def _refuse_b_with_w(order: dict[int, list[Action]]) -> None:
    """B and W of one microbatch: the stage-and-chunk notation's B meant the input gradient (torch's I)."""
    kinds: dict[tuple[int, int], set[Kind]] = {}
    for actions in order.values():
        for a in actions:
            kinds.setdefault((a.virtual_stage, a.microbatch), set()).add(a.kind)
    for (vs, m), found in sorted(kinds.items()):
        if Kind.B in found and Kind.W in found:
            raise ValueError(
                f"the order lists both {vs}B{m} and {vs}W{m}: B is the full backward; the input gradient alone is "
                f"I (torch's BACKWARD_INPUT), which the stage-and-chunk notation wrote B; see {NOTATION_DOC}"
            )
