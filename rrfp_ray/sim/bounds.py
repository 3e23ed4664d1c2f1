"""Lower bounds on any schedule's makespan for a trace, and the paper's upper bound on BF's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.trace import Trace


@dataclass(frozen=True)
class Bounds:
    max_stage_work_ms: float
    critical_path_ms: float
    stage_window_ms: float

    @property
    def best_ms(self) -> float:
        return max(self.max_stage_work_ms, self.critical_path_ms, self.stage_window_ms)


def _duration_of(*, trace: Trace) -> Callable[[Action], float]:
    """`trace.duration` without its per-call checks (the layout only makes valid actions)."""
    full = tuple(tuple(b + w for b, w in zip(*rows)) for rows in zip(trace.B, trace.W))
    rows_of = {Kind.F: trace.F, Kind.I: trace.B, Kind.W: trace.W, Kind.B: full}

    def duration(action: Action) -> float:
        return rows_of[action.kind][action.virtual_stage][action.microbatch]

    return duration


def bounds(*, trace: Trace, split: bool) -> Bounds:
    """Lower bounds on any schedule's makespan for this trace.

    - max stage work: no stage can finish before it has run all its actions;
    - critical path: the longest dependency chain of one microbatch (F down the
      virtual stages, B back up, with latencies, and its W on virtual stage 0 if split);
    - stage window: per stage, the earliest its first F can start + all its work + the
      shortest chain that must still run after its last action (none if that can be a W).
    """
    layout = Layout(stages=trace.stages, chunks=trace.chunks, microbatches=trace.microbatches, split=split)
    V, M = layout.virtual_stages, layout.microbatches
    duration = _duration_of(trace=trace)
    backward = [
        [duration(layout.action(kind=layout.backward, virtual_stage=vs, microbatch=m)) for m in range(M)]
        for vs in range(V)
    ]
    # head[vs][m]: earliest start of F(vs, m); chain[vs][m]: what must run after B(vs, m) ends.
    head, chain = [[0.0] * M], [[0.0] * M]
    for u in range(V - 1):
        head.append([h + (f + c) for h, f, c in zip(head[u], trace.F[u], trace.commF[u])])
        chain.append([t + (c + b) for t, c, b in zip(chain[u], trace.commB[u], backward[u])])
    tail = [[t + w for t, w in zip(row, trace.W[0])] for row in chain] if split else chain

    work = [sum(duration(a) for a in layout.actions(stage=s)) for s in range(layout.stages)]
    critical = max(head[V - 1][m] + trace.F[V - 1][m] + backward[V - 1][m] + tail[V - 1][m] for m in range(M))
    window = max(min(head[s]) + work[s] + (0.0 if split else min(tail[s])) for s in range(layout.stages))
    return Bounds(max_stage_work_ms=max(work), critical_path_ms=critical, stage_window_ms=window)


def bf_bound(*, trace: Trace) -> float:
    """The paper's upper bound on BF's makespan C for one chunk per stage (v = 1), no comm latency.

    C <= F + B + sum_{j=1}^{M-1} (F_max^j - F_last^j) + sum_{j=0}^{M-2} (B_max^j - B_last^j), read as:

    - F: makespan of the pure forward pipeline, every stage running the M forwards alone, in
      microbatch order, each as soon as its input is there (a flow shop over stages 0..P-1);
    - B: the same for the backwards alone (B + W: BF does not split), over stages P-1..0;
    - F_max^j, B_max^j: the longest forward / backward of microbatch j over the stages;
      F_last^j, B_last^j: that of the last stage (P-1).

    At constant durations this is 1F1B's makespan (M+P-1)(t_f+t_b), which BF attains.
    Measured (tests/test_simulator.py, and about 29,000 random traces, heavy tails included):
    it holds for BF with the cap at inf (the paper's model, no memory limit) and at 2x, but
    not at the 1x cap (P=2, M=3: 11 > 10, the cap makes stage 0 wait for a backward before its
    third forward). Reading F instead as microbatch 0's forward latency plus the last stage's
    other forwards (B likewise) gives no upper bound, even at cap inf (P=2, M=2: 9 > 8).
    """
    if trace.chunks != 1:
        raise ValueError(f"trace: bf_bound is for one chunk per stage, got chunks={trace.chunks}")
    if any(x != 0.0 for rows in (trace.commF, trace.commB) for row in rows for x in row):
        raise ValueError("trace: bf_bound assumes no communication latency; commF and commB must be 0")
    P, M = trace.stages, trace.microbatches
    backward = [[b + w for b, w in zip(rb, rw)] for rb, rw in zip(trace.B, trace.W)]
    forward_penalty = sum(max(trace.F[s][j] for s in range(P)) - trace.F[P - 1][j] for j in range(1, M))
    backward_penalty = sum(max(backward[s][j] for s in range(P)) - backward[P - 1][j] for j in range(M - 1))
    return _flow_shop(trace.F) + _flow_shop(backward[::-1]) + forward_penalty + backward_penalty


def _flow_shop(rows: Sequence[Sequence[float]]) -> float:
    """Makespan of microbatches 0..M-1 through the stages in row order, each stage in microbatch order."""
    done = [0.0] * len(rows[0])
    for row in rows:
        free = 0.0
        for m, cost in enumerate(row):
            free = done[m] = max(free, done[m]) + cost
    return done[-1]
