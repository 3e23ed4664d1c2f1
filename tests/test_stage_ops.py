"""A stage's per-slot tables (`rrfp_ray.runtime.stage_ops`) say what `Layout` defines, on every placement."""

from __future__ import annotations

import pytest

from rrfp_ray.runtime.stage_ops import stage_ops
from rrfp_ray.schedule.actions import Action, Kind, Placement
from rrfp_ray.schedule.layout import Layout, Message

LAYOUTS = [
    Layout(stages=3, chunks=1, microbatches=4),
    Layout(stages=2, chunks=2, microbatches=3, split=True),
    Layout(stages=3, chunks=2, microbatches=4, split=True, placement=Placement.V),
    Layout(stages=2, chunks=2, microbatches=2, placement=Placement.V),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_each_slot_holds_what_the_layout_defines_for_its_action(layout: Layout) -> None:
    for stage in range(layout.stages):
        ops = stage_ops(layout, stage)
        held = [a for a in ops.actions if a is not None]
        assert sorted(map(str, held)) == sorted(map(str, layout.actions(stage=stage)))
        for slot, action in enumerate(ops.actions):
            if action is None:
                assert (ops.sends[slot], ops.link[slot], ops.local_consumer[slot], ops.follower[slot]) == (
                    None,
                    None,
                    -1,
                    -1,
                )
                continue
            assert ops.slot(action) == slot and ops.texts[slot] == str(action)
            message = layout.sends(action)
            assert ops.sends[slot] == message
            local = message is not None and layout.is_local(message)
            assert ops.link[slot] == (layout.link(message) if message is not None and not local else None)
            consumer = ops.local_consumer[slot]
            assert (ops.actions[consumer] == layout.consumer(message)) if local else consumer == -1
            followers = layout.local_followers(action)
            assert [ops.actions[ops.follower[slot]]] == followers if followers else ops.follower[slot] == -1
            need = layout.message_need(action)
            if need is not None and not layout.is_local(need):
                assert ops.consumer(need) == slot
        assert ops.arrivals == layout.arrivals(stage=stage)


def test_a_message_or_action_of_another_stage_is_refused_naming_both() -> None:
    layout = LAYOUTS[0]
    ops = stage_ops(layout, 1)
    with pytest.raises(ValueError, match="stage 1: delivery .* belongs to stage 2"):
        ops.consumer(Message(kind=Kind.F, virtual_stage=2, microbatch=0))
    with pytest.raises(ValueError, match="stage 1: 0F0 is not one of its actions"):
        ops.slot(Action(virtual_stage=0, kind=Kind.F, microbatch=0, stage=0, chunk=0))
