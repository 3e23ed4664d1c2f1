"""When a stage's gradients are final and in which order data parallelism sums them: one rule
for the runtime's reduction (`rrfp_ray.runtime.reduce`) and the simulator's model of it
(`rrfp_ray.sim.reduction`)."""

from __future__ import annotations

from rrfp_ray.schedule.actions import Action, Kind


def completes_weights(action: Action) -> bool:
    """Whether `action` writes weight gradients: W, or the full backward B (never split)."""
    return action.kind in (Kind.W, Kind.B)


def reduce_order(*, chunks: int) -> list[int]:
    """The order every replica reduces a stage's chunks in: the last chunk's backward ends first."""
    return list(reversed(range(chunks)))
