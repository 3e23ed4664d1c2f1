"""Scoring plans: their mean makespans over the predicted iterations, by the shared simulator and arbiter.

All plans of one call are simulated in one batch (`rrfp_ray.sim.simulator.simulate_many`), which
builds its per-policy and per-layout tables once for the whole batch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rrfp_ray.plan.plans import Plan
from rrfp_ray.sim.simulator import Case, simulate_many
from rrfp_ray.sim.trace import Trace


def score(*, plans: Sequence[Plan], samples: Sequence[Trace]) -> list[float]:
    """Per plan, the mean simulated makespan (ms) over `samples` (data-indexed traces of one shape)."""
    first = samples[0]
    shape = {"stages": first.stages, "chunks": first.chunks, "microbatches": first.microbatches}
    cases = [
        Case(policy=plan.validate(**shape), trace=t.reordered(plan.order), cap=plan.cap)
        for plan in plans
        for t in samples
    ]
    makespans = simulate_many(cases=cases)
    n = len(samples)
    return [statistics.fmean(makespans[i * n : (i + 1) * n]) for i in range(len(plans))]
