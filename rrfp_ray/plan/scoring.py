"""Scoring a plan: its mean makespan over the predicted iterations, by the shared simulator and arbiter."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rrfp_ray.plan.plans import Plan
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.trace import Trace


def score(*, plans: Sequence[Plan], samples: Sequence[Trace]) -> list[float]:
    """Per plan, the mean simulated makespan (ms) over `samples` (data-indexed traces of one shape)."""
    first = samples[0]
    shape = {"stages": first.stages, "chunks": first.chunks, "microbatches": first.microbatches}
    scores = []
    for plan in plans:
        policy = plan.validate(**shape)
        runs = [simulate(policy=policy, trace=t.reordered(plan.order), cap=plan.cap) for t in samples]
        scores.append(statistics.fmean(r.makespan_ms for r in runs))
    return scores
