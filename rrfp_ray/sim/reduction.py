"""The simulator's model of data parallelism's gradient reduction, over a simulated iteration.

Each stage reduces on a link of its own (its communication thread), so the reduction never
delays an op: it only delays the optimizer step. A chunk's gradients go to the link once its
last weight-gradient op ends (`completes_weights`, the runtime's rule), the chunks in the
replicas' common order (`reduce_order`), each in buckets taking bytes / bandwidth + latency;
without overlap every chunk waits for the last op of every stage. The replicas replay one
trace, so their chunks are ready together and the group's all-reduce starts when they are.
A bucket costs the same whether it is all-reduced or, with ZeRO-1, reduced to its owner.
The exposed time is the runtime's (`rrfp_ray.observe.telemetry.with_exposed_reduce`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rrfp_ray.observe.telemetry import IterationReport, with_exposed_reduce
from rrfp_ray.schedule.actions import parse_action
from rrfp_ray.schedule.deps import Layout
from rrfp_ray.schedule.grad_ready import completes_weights, reduce_order


@dataclass(frozen=True)
class ReduceModel:
    chunk_bytes: int  # gradient bytes of one chunk on one stage
    bucket_bytes: int
    bytes_per_ms: float  # the link's bandwidth
    latency_ms: float = 0.0  # per bucket
    overlap: bool = True

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.bucket_bytes < 1:
            raise ValueError(f"chunk_bytes and bucket_bytes must be >= 1, got {self.chunk_bytes}, {self.bucket_bytes}")
        if not (self.bytes_per_ms > 0 and math.isfinite(self.bytes_per_ms)) or not self.latency_ms >= 0:
            raise ValueError(f"bytes_per_ms must be finite and > 0, latency_ms >= 0: got {self.bytes_per_ms}, {self.latency_ms}")

    def chunk_ms(self) -> float:
        """One chunk's buckets, one after another on the link."""
        full, rest = divmod(self.chunk_bytes, self.bucket_bytes)
        sizes = [self.bucket_bytes] * full + ([rest] if rest else [])
        return sum(size / self.bytes_per_ms + self.latency_ms for size in sizes)


def with_reduction(report: IterationReport, *, layout: Layout, model: ReduceModel) -> IterationReport:
    """`report` (a simulated iteration, every stage started at 0) with each stage's reduce time,
    bytes, end and exposed time filled in; its makespan stays the op schedule's."""
    last_weight: dict[tuple[int, int], float] = {}  # (stage, chunk): when its last weight-gradient op ended
    last_op = [0.0] * layout.stages
    for event in report.events:
        action = parse_action(event.action, stages=layout.stages, placement=layout.placement)
        last_op[event.stage] = max(last_op[event.stage], event.end_ms)
        if completes_weights(action):
            key = (event.stage, action.chunk)
            last_weight[key] = max(last_weight.get(key, 0.0), event.end_ms)
    everyone_done = max(last_op)
    stages = []
    for stats in report.stages:
        free = 0.0
        for chunk in reduce_order(chunks=layout.chunks):
            ready = last_weight[(stats.stage, chunk)] if model.overlap else everyone_done
            free = max(free, ready) + model.chunk_ms()
        stages.append(
            replace(
                stats,
                last_op_ms=last_op[stats.stage],
                reduce_ms=layout.chunks * model.chunk_ms(),
                reduce_bytes=layout.chunks * model.chunk_bytes,
                reduce_end_ms=free,
            )
        )
    return replace(report, stages=with_exposed_reduce(stages, origin=min(s.started_at for s in stages)))
