"""A measured iteration as a trace, to replay it in the simulator: each op's measured duration and
each message's measured transit (`measured_trace`), and what the replay predicts (`replay`).

Transit is from the end of the op that sent a message to the moment its consumer became ready,
on the report's one clock (`merge_stage_reports` puts every stage's events on it). Where the
consumer waited on its own forward longer than on the message, that moment is when the forward
ended: the transit is then an upper bound, and any value up to it makes the consumer ready at
the same moment, so the replay is not changed by it. Without the B/W split a full backward's time is the trace's B (its
W is 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rrfp_ray.observe.telemetry import IterationReport, OpEvent
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.actions import Action, Kind, parse_action
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.trace import Trace


def measured_trace(report: IterationReport, *, layout: Layout) -> Trace:
    """The trace of what `report` measured, for a pipeline of `layout` (its split says how a backward was run)."""
    events: dict[Action, OpEvent] = {
        parse_action(e.action, stages=layout.stages, placement=layout.placement): e for e in report.events
    }
    expected = {a for s in range(layout.stages) for a in layout.actions(stage=s)}
    if set(events) != expected:
        missing = sorted(map(str, expected - set(events)))[:5]
        raise ValueError(
            f"report of iteration {report.iteration} does not hold every op of the layout (missing {missing})"
        )
    rows = {key: _zeros(layout.virtual_stages, layout.microbatches) for key in ("F", "B", "W")}
    comm = {key: _zeros(layout.virtual_stages - 1, layout.microbatches) for key in ("commF", "commB")}
    for action, event in events.items():
        vs, m = action.virtual_stage, action.microbatch
        rows["W" if action.kind is Kind.W else "F" if action.kind is Kind.F else "B"][vs][m] = (
            event.end_ms - event.start_ms
        )
        message = layout.message_need(action)
        if message is None or layout.is_local(message):
            continue
        sender_vs = vs - 1 if action.kind is Kind.F else vs + 1
        kind = Kind.F if action.kind is Kind.F else layout.backward
        sender = events[layout.action(kind=kind, virtual_stage=sender_vs, microbatch=m)]
        transit = event.ready_ms - sender.end_ms
        row = vs - 1 if action.kind is Kind.F else vs
        comm["commF" if action.kind is Kind.F else "commB"][row][m] = max(0.0, transit)
    return Trace(stages=layout.stages, microbatches=layout.microbatches, chunks=layout.chunks, **rows, **comm)


@dataclass(frozen=True)
class Replay:
    measured_ms: float  # the op schedule's makespan as measured (the optimizer step left out)
    simulated_ms: float  # the simulator's makespan for the same policy and cap on the measured trace

    @property
    def ratio(self) -> float:
        return self.simulated_ms / self.measured_ms


def replay(report: IterationReport, *, policy: Policy, layout: Layout, cap: Cap) -> Replay:
    """The report's measured op times simulated under `policy` and `cap`, gated in bytes as its stages were
    (`StageStats.gate_bytes`), else counting microbatches."""
    run_layout = policy.layout_over(layout)
    trace = measured_trace(report, layout=run_layout)
    gated = {s.stage: s for s in report.stages if s.replica == 0 and s.gate_bytes}
    limits = None
    if len(gated) == layout.stages:
        rows = _zeros(run_layout.virtual_stages, run_layout.microbatches)
        for stage, stats in gated.items():  # a stage's bytes on its chunk 0: the gate sums its chunks
            rows[run_layout.virtual_stage(stage=stage, chunk=0)] = list(stats.gate_bytes)
        trace = replace(trace, activation_bytes=rows)
        limits = tuple(
            tuple(math.inf if x is None else x for x in gated[stage].gate_limits) for stage in range(layout.stages)
        )
    simulated = simulate(policy=policy, trace=trace, cap=cap, byte_limits=limits)
    return Replay(measured_ms=report.schedule_ms, simulated_ms=simulated.makespan_ms)


def _zeros(rows: int, columns: int) -> list[list[float]]:
    return [[0.0] * columns for _ in range(rows)]
