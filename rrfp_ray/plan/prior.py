"""Planning before any telemetry, when neither which stages' costs follow the data's feature nor what a
microbatch's activations weigh has been measured.

The prior makes every op's cost proportional to its microbatch's feature (`rrfp_ray.plan.costs.prior`). Where the
feature drives only some stages (a vision encoder in front of a language model, a head at the back), an order made
for every stage at once can cost more than one made for the stages the data drives. So until the model has measured
an op, a plan is scored over hypotheses of which physical stages follow the feature (`hypotheses`: all of them, the
front half, the back half), each a predicted iteration whose other stages cost their row's mean, and a candidate's
score is its mean makespan over them. The scored iterations weigh every microbatch the same (no bytes measured
yet, as a trace without bytes does), while a fixed hint, which no cap bends, must still fit its cap on the prior's
bytes (`Guard`).

The predicted iterations show no spread either (none is measured), and on an iteration whose ops take exactly their
predicted time a fixed list scores as well as readiness over it, although it falls behind wherever ops jitter: so
these plans choose among the hints that adapt (`adaptive`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rrfp_ray.plan.plans import policy_for
from rrfp_ray.plan.scoring import Guard, Samples
from rrfp_ray.sim.trace import Trace


def hypotheses(*, stages: int) -> list[frozenset[int]]:
    """The sets of physical stages whose costs may follow the feature: all, the front half, the back half (one
    set where the pipeline has one stage)."""
    half = (stages + 1) // 2
    sets = [frozenset(range(stages)), frozenset(range(half)), frozenset(range(stages - half, stages))]
    return list(dict.fromkeys(sets))


def following(trace: Trace, *, stages: frozenset[int]) -> Trace:
    """`trace` with the ops of every virtual stage outside `stages` (physical ones) at their row's mean, as if only
    `stages` followed the feature, and without activation bytes (every microbatch weighs the same)."""

    def flat(rows: Sequence[Sequence[float]]) -> list[list[float]]:
        return [
            list(row) if vs % trace.stages in stages else [float(np.mean(row))] * len(row)
            for vs, row in enumerate(rows)
        ]

    return trace.replaced(F=flat(trace.F), B=flat(trace.B), W=flat(trace.W), activation_bytes=None)


def hypothesised(predicted: Samples, *, basis: Trace | None) -> Samples:
    """Each predicted iteration of `predicted` under each of `hypotheses`, guarded by the first one's bytes
    (`basis`: the data before packing, on which the cap is measured; None: the predicted iteration itself)."""
    sets = hypotheses(stages=predicted[0].stages)
    return Samples(
        [following(t, stages=s) for s in sets for t in predicted],
        unsplit=[following(t, stages=s) for s in sets for t in predicted.unsplit],
        guard=Guard(trace=predicted[0], basis=basis),
    )


def adaptive(hints: Sequence[str], *, stages: int, chunks: int, microbatches: int) -> tuple[str, ...]:
    """The hints among `hints` that are not fixed lists (all of them where every one is fixed), in their order."""
    shape = {"stages": stages, "chunks": chunks, "microbatches": microbatches}
    ready = tuple(hint for hint in hints if not policy_for(name=hint, **shape).fixed)
    return ready or tuple(hints)
