"""Trace replay: each action sleeps its trace duration (standing in for GPU kernel time)
and sends a real tensor of a configurable size. Under data parallelism each chunk holds a
synthetic gradient of `grad_elems` float32 elements in `grad_layers` tensors; a chunk's last
weight-gradient op finalizes them one by one through its duration, the last layer first, as a
real backward does."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rrfp_ray.plan.packing import Packing
from rrfp_ray.runtime.executor import TieSpec
from rrfp_ray.runtime.reduce import ChunkGradients, GradSink
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.grad_ready import even_split
from rrfp_ray.schedule.layout import Layout, Message
from rrfp_ray.sim.trace import Trace


@dataclass(frozen=True)
class InStep:
    """How a synthetic op keeps its TP group in step. Inside a real F or B the TP layers'
    collectives hold every rank until the last has reached them, so the op ends its
    duration after the latest rank started it; a W calls no collective."""

    rank: int
    size: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]  # sum over the TP group

    def start(self, *, action: Action, now: float) -> float:
        """When `action`'s duration starts counting (wall-clock seconds; a stage's TP ranks share a node)."""
        if action.kind is Kind.W:
            return now
        starts = torch.zeros(self.size, dtype=torch.float64)
        starts[self.rank] = now
        return float(self.all_reduce(starts).max())


@dataclass(frozen=True)
class SyntheticWorkload:
    """What a stage needs to replay a trace; plain data, sent to every stage actor."""

    trace: Trace
    payload_elems: int = 4096
    rank_comm: tuple[Trace, ...] = ()  # with TP: rank t's messages take rank_comm[t]'s latencies
    in_step: InStep | None = None  # set by with_tp
    grad_elems: int = 0  # float32 elements of gradient per chunk that data parallelism reduces
    grad_layers: int = 1  # tensors they are split into, one finalized after another
    ties: tuple[TieSpec, ...] = ()  # no parameters, so none shared between stages

    def executor(self, *, stage: int, layout: Layout) -> SleepExecutor:
        return SleepExecutor(
            trace=self.trace,
            layout=layout,
            payload_elems=self.payload_elems,
            in_step=self.in_step,
            grad_elems=self.grad_elems,
            grad_layers=self.grad_layers,
        )

    def with_dp(
        self, *, rank: int, zero_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> SyntheticWorkload:
        """Every replica replays the same trace (it has no optimizer state to shard)."""
        return self

    def latency(self, message: Message) -> float:
        return self.trace.latency(message)

    def with_ties(self, *, reduce: Callable[[tuple[int, ...], torch.Tensor], torch.Tensor]) -> SyntheticWorkload:
        """It has no tied parameters: nothing to sum."""
        return self

    def with_tp(self, *, rank: int, size: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> SyntheticWorkload:
        """Every TP rank replays the same op durations, its F and B ops in step with the group
        (`InStep`). With `rank_comm`, each rank's messages take their own latencies, as over
        links of their own, so the ranks' ready sets differ."""
        in_step = InStep(rank=rank, size=size, all_reduce=all_reduce)
        if not self.rank_comm:
            return replace(self, in_step=in_step)
        if len(self.rank_comm) != size:
            raise ValueError(f"rank_comm holds {len(self.rank_comm)} traces, the TP group has {size} ranks")
        comm = self.rank_comm[rank]
        shape = (comm.stages, comm.microbatches, comm.chunks)
        if shape != (self.trace.stages, self.trace.microbatches, self.trace.chunks):
            raise ValueError(
                f"rank_comm[{rank}] is shaped (stages, microbatches, chunks) = {shape}, the trace "
                f"{(self.trace.stages, self.trace.microbatches, self.trace.chunks)}"
            )
        trace = replace(self.trace, commF=comm.commF, commB=comm.commB)
        return replace(self, trace=trace, rank_comm=(), in_step=in_step)


class SleepExecutor:
    def __init__(
        self,
        *,
        trace: Trace,
        layout: Layout,
        payload_elems: int,
        in_step: InStep | None = None,
        grad_elems: int = 0,
        grad_layers: int = 1,
    ) -> None:
        if payload_elems < 1:
            raise ValueError(f"payload_elems must be >= 1, got {payload_elems}")
        if grad_elems < 0:
            raise ValueError(f"grad_elems must be >= 0, got {grad_elems}")
        if grad_layers < 1 or 0 < grad_elems < grad_layers:
            raise ValueError(f"grad_layers must be >= 1 and at most grad_elems = {grad_elems}, got {grad_layers}")
        # each chunk's gradient layers in the order a backward finalizes them: the last layer first
        sizes = even_split(grad_elems, parts=grad_layers) if grad_elems else []
        self._grads = {c: [torch.zeros(n) for n in reversed(sizes)] for c in range(layout.chunks)}
        self._trace = trace
        self._layout = layout
        self._payload = torch.zeros(payload_elems)
        self._in_step = in_step

    def begin(self, *, iteration: int, order: tuple[int, ...] | None = None, packing: Packing | None = None) -> None:
        pass

    def finish(self, *, iteration: int, all_reduce: Callable[[float], float]) -> None:
        return None

    def gradients(self, *, chunk: int) -> ChunkGradients:
        return ChunkGradients(tensors=list(self._grads[chunk]))

    def run(
        self, *, action: Action, iteration: int, payload: torch.Tensor | None, release: GradSink | None = None
    ) -> torch.Tensor | None:
        start = time.time()
        if self._in_step is not None:
            start = self._in_step.start(action=action, now=start)
        duration = self._trace.duration(action) / 1e3
        layers = self._grads[action.chunk] if release is not None else []
        for index, layer in enumerate(layers):  # each layer's share of the op, then its gradient is final
            _sleep_until(start + duration * (index + 1) / len(layers))
            release(ChunkGradients(tensors=[layer]))
        _sleep_until(start + duration)
        if self._layout.sends(action) is None:
            return None
        return self._payload


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.time()) > 0:
        time.sleep(left)
