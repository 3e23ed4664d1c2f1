"""Trace replay: each action sleeps its trace duration (standing in for GPU kernel time)
and sends a real tensor of a configurable size."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rrfp_ray.actions import Action
from rrfp_ray.deps import Layout, Message
from rrfp_ray.variability import Trace


@dataclass(frozen=True)
class SyntheticWorkload:
    """What a stage needs to replay a trace; plain data, sent to every stage actor."""

    trace: Trace
    payload_elems: int = 4096
    rank_comm: tuple[Trace, ...] = ()  # with TP: rank t's messages take rank_comm[t]'s latencies

    def executor(self, *, stage: int, layout: Layout) -> SleepExecutor:
        return SleepExecutor(trace=self.trace, layout=layout, payload_elems=self.payload_elems)

    def latency(self, message: Message) -> float:
        return self.trace.latency(message)

    def with_tp(self, *, rank: int, size: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> SyntheticWorkload:
        """Every TP rank replays the same op durations (inside real ops, their collectives keep
        them in step). With `rank_comm`, each rank's messages take their own latencies, as over
        links of their own, so the ranks' ready sets differ."""
        if not self.rank_comm:
            return self
        if len(self.rank_comm) != size:
            raise ValueError(f"rank_comm holds {len(self.rank_comm)} traces, the TP group has {size} ranks")
        comm = self.rank_comm[rank]
        shape = (comm.stages, comm.microbatches, comm.chunks)
        if shape != (self.trace.stages, self.trace.microbatches, self.trace.chunks):
            raise ValueError(
                f"rank_comm[{rank}] is shaped (stages, microbatches, chunks) = {shape}, the trace "
                f"{(self.trace.stages, self.trace.microbatches, self.trace.chunks)}"
            )
        return replace(self, trace=replace(self.trace, commF=comm.commF, commB=comm.commB), rank_comm=())


class SleepExecutor:
    def __init__(self, *, trace: Trace, layout: Layout, payload_elems: int) -> None:
        if payload_elems < 1:
            raise ValueError(f"payload_elems must be >= 1, got {payload_elems}")
        self._trace = trace
        self._layout = layout
        self._payload = torch.zeros(payload_elems)

    def begin(self, *, iteration: int) -> None:
        pass

    def finish(self, *, iteration: int, all_reduce: Callable[[float], float]) -> None:
        return None

    def run(self, *, action: Action, iteration: int, payload: torch.Tensor | None, split: bool) -> torch.Tensor | None:
        deadline = time.perf_counter() + self._trace.duration(action, split=split) / 1e3
        while (left := deadline - time.perf_counter()) > 0:
            time.sleep(left)
        if self._layout.sends(action) is None:
            return None
        return self._payload
