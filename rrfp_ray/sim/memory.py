"""Activation memory in bytes for an iteration, from per-microbatch activation bytes.

A stage holds a microbatch's bytes of all its chunks from its chunk-0 F on (`rrfp_ray.policy.caps.Memory`).
A cap `Kx` is K x the peak bytes per stage of the policy's own reference list on the same data
(`rrfp_ray.policy.arbiter.byte_limits`); a trace without bytes weighs every microbatch 1, which is the
count of microbatches the arbiter keeps without a `Memory`. The simulator (`memories`, over a trace) and the
runtime (`DataBytes.memories`, built once per iteration by the stage group) gate by the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rrfp_ray.policy.arbiter import byte_limits
from rrfp_ray.policy.caps import Cap, Memory
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.trace import Trace

Limits = tuple[tuple[float, float], ...]  # per stage, its (F->B, F->W) byte limits
Rows = Sequence[Sequence[float]]  # per virtual stage, per microbatch


def stage_rows(*, rows: Rows, layout: Layout) -> list[list[float]]:
    """Per stage and microbatch, the bytes its chunks hold there, from `rows[virtual stage][microbatch]`."""
    return [
        [
            sum(rows[layout.virtual_stage(stage=s, chunk=c)][m] for c in range(layout.chunks))
            for m in range(layout.microbatches)
        ]
        for s in range(layout.stages)
    ]


def weights(trace: Trace) -> Rows:
    """`trace`'s activation bytes; 1 for every microbatch where it has none."""
    if trace.activation_bytes is not None:
        return trace.activation_bytes
    return ((1.0,) * trace.microbatches,) * trace.virtual_stages


def held_bytes(*, trace: Trace, layout: Layout) -> list[list[float]] | None:
    """Per stage and microbatch, the bytes its chunks hold there; None for a trace without bytes."""
    return None if trace.activation_bytes is None else stage_rows(rows=trace.activation_bytes, layout=layout)


def limits_for(*, cap: Cap, reference: Policy, trace: Trace, layout: Layout) -> Limits | None:
    """The byte limits of `cap` over `reference`'s list on `trace`'s data (in its own order); None
    where the arbiter counts microbatches (no bytes in the trace, or a count or inf cap)."""
    held = held_bytes(trace=trace, layout=layout)
    return None if held is None else byte_limits(cap=cap, reference=reference, held=held, split=layout.split)


def gates(*, cap: Cap, policy: Policy, rows: Rows | None, layout: Layout, limits: Limits | None) -> list[Memory | None]:
    """Per stage, its `Memory` for the arbiter over `rows` (per virtual stage, per microbatch slot as run; None:
    count microbatches). `limits` None: those of `cap` over the policy's own list on these bytes."""
    if rows is None or cap.multiple is None:
        return [None] * layout.stages
    held = stage_rows(rows=rows, layout=layout)
    if limits is None:
        limits = byte_limits(cap=cap, reference=policy, held=held, split=layout.split)
    return [Memory(held=tuple(row), limit_fb=fb, limit_fw=fw) for row, (fb, fw) in zip(held, limits)]


def memories(
    *, cap: Cap, policy: Policy, trace: Trace, layout: Layout, limits: Limits | None
) -> Sequence[Memory | None]:
    """Per stage, its `Memory` for the arbiter on `trace` (as run; None: count microbatches). `limits` None:
    those of `cap` over the policy's own list on this trace; given, they gate a trace without bytes by its
    `weights` (a planned cap over another list than the policy's own)."""
    rows = trace.activation_bytes if limits is None else weights(trace)
    return gates(cap=cap, policy=policy, rows=rows, layout=layout, limits=limits)


@dataclass(frozen=True)
class DataBytes:
    """What a runtime iteration's data holds: `rows[virtual stage][data microbatch]`, the activation bytes each
    microbatch keeps on each virtual stage, and the byte `limits` to gate by (None: the cap over the policy's own
    list on these bytes, in the order run)."""

    rows: tuple[tuple[float, ...], ...]
    limits: Limits | None = None

    def memories(
        self, *, cap: Cap, policy: Policy, layout: Layout, order: Sequence[int] | None
    ) -> tuple[Memory | None, ...]:
        """Per stage, its arbiter's `Memory` when slot i runs data microbatch `order[i]` (None: microbatch i)."""
        V, M = layout.virtual_stages, layout.microbatches
        if len(self.rows) != V or any(len(row) != M for row in self.rows):
            got = [len(row) for row in self.rows]
            raise ValueError(
                f"activation bytes: expected {V} virtual stages x {M} microbatches, got rows of lengths {got}"
            )
        if self.limits is not None and len(self.limits) != layout.stages:
            raise ValueError(
                f"byte limits: expected one (F->B, F->W) pair per stage ({layout.stages}), got {len(self.limits)}"
            )
        rows = self.rows if order is None else tuple(tuple(row[j] for j in order) for row in self.rows)
        return tuple(gates(cap=cap, policy=policy, rows=rows, layout=layout, limits=self.limits))
