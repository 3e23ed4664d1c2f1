"""The simulator's model of data parallelism's gradient reduction, over a simulated iteration.

Each stage reduces on a link of its own (its communication thread), so the reduction never
delays an op: it only delays the optimizer step. A chunk's gradient is `layers` equal tensors
that its last weight-gradient op (`completes_weights`, the runtime's rule) finalizes one after
another through its duration, the last layer first, as the runtime's synthetic workload does;
the tensors go into buckets as the runtime cuts them (`Bucketer`), and a bucket goes to the link
once its last tensor is final, the chunks in the replicas' common order (`reduce_order`), each
bucket taking bytes / bandwidth + latency. Without overlap every bucket waits for the last op of
every stage. The replicas replay one trace, so their buckets are ready together and the group's
all-reduce starts when they are. A bucket costs the same whether it is all-reduced or, with
ZeRO-1, reduced to its owner. The exposed time is the runtime's
(`rrfp_ray.observe.telemetry.with_exposed_reduce`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rrfp_ray.observe.telemetry import IterationReport, with_exposed_reduce
from rrfp_ray.schedule.actions import parse_action
from rrfp_ray.schedule.grad_ready import Bucketer, completes_weights, even_split, reduce_order
from rrfp_ray.schedule.layout import Layout


@dataclass(frozen=True)
class ReduceModel:
    chunk_bytes: int  # gradient bytes of one chunk on one stage
    bucket_bytes: int
    bytes_per_ms: float  # the link's bandwidth
    latency_ms: float = 0.0  # per bucket
    overlap: bool = True
    layers: int = 1  # equal tensors the chunk's gradient is, finalized one by one through its last weight-gradient op

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.bucket_bytes < 1:
            raise ValueError(f"chunk_bytes and bucket_bytes must be >= 1, got {self.chunk_bytes}, {self.bucket_bytes}")
        if not (self.bytes_per_ms > 0 and math.isfinite(self.bytes_per_ms)) or not self.latency_ms >= 0:
            raise ValueError(
                f"bytes_per_ms must be finite and > 0, latency_ms >= 0: got {self.bytes_per_ms}, {self.latency_ms}"
            )
        if not 1 <= self.layers <= self.chunk_bytes:
            raise ValueError(f"layers must be in [1, chunk_bytes = {self.chunk_bytes}], got {self.layers}")

    def buckets(self) -> list[tuple[int, int]]:
        """One chunk's buckets in the order they are summed: (how many of the layers are final when it can go,
        bytes)."""
        sizes = list(reversed(even_split(self.chunk_bytes, parts=self.layers)))  # the last layer first
        bucketer: Bucketer[int] = Bucketer(bucket_bytes=self.bucket_bytes)
        groups = [group for index, size in enumerate(sizes) for group in bucketer.add(index, nbytes=size)]
        return [(group[-1] + 1, sum(sizes[i] for i in group)) for group in groups + bucketer.flush()]

    def bucket_ms(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_ms + self.latency_ms

    def chunk_ms(self) -> float:
        """One chunk's buckets, one after another on the link."""
        return sum(self.bucket_ms(nbytes) for _, nbytes in self.buckets())


def with_reduction(report: IterationReport, *, layout: Layout, model: ReduceModel) -> IterationReport:
    """`report` (a simulated iteration, every stage started at 0) with each stage's reduce time,
    bytes, end and exposed time filled in; its makespan stays the op schedule's."""
    last_weight: dict[
        tuple[int, int], tuple[float, float]
    ] = {}  # (stage, chunk): (start, end) of its last weight-gradient op
    last_op = [0.0] * layout.stages
    for event in report.events:
        action = parse_action(event.action, stages=layout.stages, placement=layout.placement)
        last_op[event.stage] = max(last_op[event.stage], event.end_ms)
        if completes_weights(action):
            key = (event.stage, action.chunk)
            last_weight[key] = max(
                last_weight.get(key, (0.0, 0.0)), (event.start_ms, event.end_ms), key=lambda span: span[1]
            )
    everyone_done = max(last_op)
    buckets = model.buckets()
    stages = []
    for stats in report.stages:
        free = 0.0
        for chunk in reduce_order(chunks=layout.chunks):
            start, end = last_weight[(stats.stage, chunk)]
            for final, nbytes in buckets:
                ready = start + (end - start) * final / model.layers if model.overlap else everyone_done
                free = max(free, ready) + model.bucket_ms(nbytes)
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
