"""Activation memory in bytes for a simulated iteration, from a trace's per-microbatch bytes.

A stage holds a microbatch's bytes of all its chunks from its chunk-0 F on (`rrfp_ray.policy.arbiter.Memory`).
A cap `Kx` is K x the peak bytes per stage of the policy's own reference list on the same data
(`rrfp_ray.policy.arbiter.byte_limits`); a trace without bytes weighs every microbatch 1, which is the
count of microbatches the arbiter keeps without a `Memory`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rrfp_ray.policy.arbiter import Cap, Memory, byte_limits
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.trace import Trace

Limits = tuple[tuple[float, float], ...]  # per stage, its (F->B, F->W) byte limits


def held_bytes(*, trace: Trace, layout: Layout) -> list[list[float]] | None:
    """Per stage and microbatch, the bytes its chunks hold there; None for a trace without bytes."""
    if trace.activation_bytes is None:
        return None
    rows = trace.activation_bytes
    return [
        [
            sum(rows[layout.virtual_stage(stage=s, chunk=c)][m] for c in range(layout.chunks))
            for m in range(layout.microbatches)
        ]
        for s in range(layout.stages)
    ]


def limits_for(*, cap: Cap, reference: Policy, trace: Trace, layout: Layout) -> Limits | None:
    """The byte limits of `cap` over `reference`'s list on `trace`'s data (in its own order); None
    where the arbiter counts microbatches (no bytes in the trace, or a count or inf cap)."""
    held = held_bytes(trace=trace, layout=layout)
    return None if held is None else byte_limits(cap=cap, reference=reference, held=held, split=layout.split)


def memories(
    *, cap: Cap, policy: Policy, trace: Trace, layout: Layout, limits: Limits | None
) -> Sequence[Memory | None]:
    """Per stage, its `Memory` for the arbiter (None: count microbatches). `limits` None: those of
    `cap` over the policy's own list on this trace."""
    held = held_bytes(trace=trace, layout=layout)
    if held is None or cap.multiple is None:
        return [None] * layout.stages
    if limits is None:
        limits = byte_limits(cap=cap, reference=policy, held=held, split=layout.split)
    return [Memory(held=tuple(row), limit_fb=fb, limit_fw=fw) for row, (fb, fw) in zip(held, limits)]
