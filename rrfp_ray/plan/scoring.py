"""Scoring plans: their mean makespans over the predicted iterations, by the shared simulator and arbiter.

All plans of one call are simulated in one batch (`rrfp_ray.sim.simulator.simulate_many`), which
builds its per-policy and per-layout tables once for the whole batch. Memory is in bytes, every
microbatch weighing 1 where the samples carry none (`weights`): a plan's cap `Kx` is K x the peak bytes
per stage of `reference_for` its hint's backward (zb-h1 for a split one, 1f1b for a full one, with one
chunk per stage) on the data in its own order, whatever the plan's order or hint, so every plan of an
iteration and backward gets the same memory; a plan whose fixed hint would hold more scores inf (the
planner never plans past the cap). Where a plan packs the samples anew, its memory is measured on the
data as the source gave it (`basis`), so a packing can neither raise nor lower the cap: a plan runs
with the bytes a fixed schedule holds on the same batch.

A full backward need not cost what its two halves cost apart (on a CPU it often costs less), so the
predicted iterations may come as :class:`Samples`: the split backward's costs, and beside them the
same draws with a full backward's own costs, which a plan whose hint does not split simulates; before any bytes are
measured they may carry none, and a `Guard` with the prior's bytes that a fixed hint must fit all the same.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rrfp_ray.plan.plans import Plan, policy_for
from rrfp_ray.policy.arbiter import byte_limits, peak_bytes
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.pickers import hint_indexes
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.memory import Limits, Rows, stage_rows, weights
from rrfp_ray.sim.simulator import Case, layout_for, simulate_many
from rrfp_ray.sim.trace import Trace


@dataclass(frozen=True)
class Guard:
    """A predicted iteration whose activation bytes a fixed hint must fit, where the samples scored carry none:
    `trace` as the plan runs it (packed, in data order), `basis` the data before packing (None: `trace`)."""

    trace: Trace
    basis: Trace | None = None

    def admits(self, *, plan: Plan, policy: Policy) -> bool:
        if not policy.fixed:
            return True
        limits = planned_limits(cap=plan.cap, trace=self.basis or self.trace, split=policy.split)
        return within(policy=policy, trace=self.trace.reordered(plan.order), limits=limits)


class Samples(tuple[Trace, ...]):
    """Predicted iterations of one shape with the split backward's costs (I in B, and W); `unsplit`: the same
    draws with a full backward's own costs (B, W 0), one per item; `guard`: where given, the bytes a fixed hint
    must also fit (`Guard`)."""

    unsplit: tuple[Trace, ...]
    guard: Guard | None

    def __new__(cls, split: Sequence[Trace], *, unsplit: Sequence[Trace], guard: Guard | None = None) -> Samples:
        if len(split) != len(unsplit):
            raise ValueError(f"{len(split)} split samples but {len(unsplit)} unsplit ones")
        samples = super().__new__(cls, split)
        samples.unsplit = tuple(unsplit)
        samples.guard = guard
        return samples


def family(samples: Sequence[Trace], *, split: bool) -> Sequence[Trace]:
    """The samples a plan with (`split`) or without a split backward simulates."""
    return samples.unsplit if isinstance(samples, Samples) and not split else samples


def reference_for(*, split: bool, stages: int, chunks: int, microbatches: int) -> Policy:
    """The list a planned cap is a multiple of: the readiness rules' reference for the hint's backward
    (zb-h1 split, 1f1b full; interleaved when v > 1)."""
    return policy_for(name="bfw" if split else "bf", stages=stages, chunks=chunks, microbatches=microbatches)


def planned_limits(*, cap: Cap, trace: Trace, split: bool) -> Limits | None:
    """The byte limits of a planned iteration whose hint splits the backward (or not): `cap` over the
    reference list on `trace`'s `weights` in data order (None: a count or inf cap)."""
    return planned_byte_limits(cap=cap, rows=weights(trace), split=split, stages=trace.stages, chunks=trace.chunks)


def limits_each(*, cap: Cap, traces: Sequence[Trace], split: bool) -> list[Limits | None]:
    """`planned_limits` of each of `traces` (of one shape), computed once per bytes they hold in common (the draws of
    one prediction share theirs)."""
    made: dict[int, Limits | None] = {}
    for trace in traces:
        if id(trace.activation_bytes) not in made:
            made[id(trace.activation_bytes)] = planned_limits(cap=cap, trace=trace, split=split)
    return [made[id(trace.activation_bytes)] for trace in traces]


def planned_byte_limits(*, cap: Cap, rows: Rows, split: bool, stages: int, chunks: int) -> Limits | None:
    """`planned_limits` over bytes alone: `rows[virtual stage][data microbatch]`, in data order."""
    microbatches = len(rows[0])
    reference = reference_for(split=split, stages=stages, chunks=chunks, microbatches=microbatches)
    layout = Layout(
        stages=stages, chunks=chunks, microbatches=microbatches, split=reference.split, placement=reference.placement
    )
    held = stage_rows(rows=rows, layout=layout)
    return byte_limits(cap=cap, reference=reference, held=held, split=layout.split)


def within(*, policy: Policy, trace: Trace, limits: Limits | None) -> bool:
    """Whether a fixed list (which no cap bends) holds no more bytes than `limits` on `trace` (as run)."""
    if limits is None or not policy.fixed:
        return True
    held = stage_rows(rows=weights(trace), layout=layout_for(policy=policy, trace=trace))
    for stage, (row, (fb, fw)) in enumerate(zip(held, limits)):
        actions = policy.order[stage]
        last = (Kind.W,) if policy.split else (Kind.B,)
        if peak_bytes(actions, held=row, release=(Kind.I, Kind.B)) > fb * (1 + 1e-9):
            return False
        if math.isfinite(fw) and peak_bytes(actions, held=row, release=last) > fw * (1 + 1e-9):
            return False
    return True


def counted(*, policy: Policy, cap: Cap, trace: Trace, limits: Limits | None) -> bool:
    """Whether the arbiter may count microbatches instead of gating `trace`'s `weights` by `limits`, which gates
    alike and simulates faster: where every microbatch of a stage weighs the same, w, and each limit is w times
    the arbiter's own count cap over the policy's list."""
    if limits is None:
        return True
    rows = weights(trace)
    if any(min(row) != max(row) for row in rows):
        return False
    layout = layout_for(policy=policy, trace=trace)
    for stage, ((fb, fw), index) in enumerate(zip(limits, hint_indexes(policy=policy, layout=layout))):
        weight = sum(rows[layout.virtual_stage(stage=stage, chunk=c)][0] for c in range(layout.chunks))
        caps = index.count_caps(cap)
        if weight <= 0 or not all(math.isclose(x, n * weight, rel_tol=1e-9) for x, n in zip((fb, fw), caps)):
            return False
    return True


LimitsCache = dict[tuple[Cap, bool], list[Limits | None]]  # per (cap, split backward), each sample's byte limits


def score(
    *,
    plans: Sequence[Plan],
    samples: Sequence[Trace],
    basis: Trace | None = None,
    limits: LimitsCache | None = None,
) -> list[float]:
    """Per plan, the mean simulated makespan (ms) over `samples` (data-indexed traces of one shape; `Samples`
    for a full backward's own costs); inf for a plan past its cap. `basis`: the data before packing, whose
    activation bytes in its own order set the cap (None: each sample's own). `limits`: the byte limits already
    computed for these samples and basis, filled in as needed (a search scores many batches over the same ones)."""
    first = samples[0]
    shape = {"stages": first.stages, "chunks": first.chunks, "microbatches": first.microbatches}
    limits = {} if limits is None else limits
    counts: dict[tuple[Cap, str], bool] = {}  # per (cap, hint): whether its gate counts (`counted`)
    bare: dict[bool, list[Trace]] = {}  # per split backward: the samples without bytes, for gates that count
    cases, fits = [], []
    for plan in plans:
        policy = plan.validate(**shape)
        own = family(samples, split=policy.split)
        key = (plan.cap, policy.split)
        if key not in limits:
            limits[key] = limits_each(cap=plan.cap, traces=[basis or t for t in own], split=policy.split)
        gated = limits[key]
        runs = [t.reordered(plan.order) for t in own] if policy.fixed else None  # a fixed list must fit the limits
        guard = samples.guard if isinstance(samples, Samples) else None
        fits.append(
            (runs is None or all(within(policy=policy, trace=r, limits=x) for r, x in zip(runs, gated)))
            and (guard is None or guard.admits(plan=plan, policy=policy))
        )
        if not fits[-1]:
            continue
        if (plan.cap, policy.name) not in counts:
            counts[plan.cap, policy.name] = counted(policy=policy, cap=plan.cap, trace=own[0], limits=gated[0])
        if counts[plan.cap, policy.name]:
            if policy.split not in bare:
                bare[policy.split] = [t.replaced(activation_bytes=None) for t in own]
            runs, gated = [t.reordered(plan.order) for t in bare[policy.split]], [None] * len(own)
        elif runs is None:
            runs = [t.reordered(plan.order) for t in own]
        cases += [Case(policy=policy, trace=r, cap=plan.cap, byte_limits=x) for r, x in zip(runs, gated)]
    makespans = iter(simulate_many(cases=cases))
    n = len(samples)
    return [statistics.fmean(next(makespans) for _ in range(n)) if ok else math.inf for ok in fits]
