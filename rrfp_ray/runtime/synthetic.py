"""Trace replay: each action sleeps its trace duration (standing in for GPU kernel time) and sends a real tensor of a
configurable size. Given a run of `iterations`, iteration k replays its own trace (its ops' sleeps and its messages'
latencies), and a microbatch slot sleeps the durations of the data microbatch the iteration's order puts there (the
trace's rows are data microbatches, as its features are). Under data parallelism each chunk holds a synthetic
gradient of `grad_elems` float32 elements in `grad_layers` tensors; a chunk's last weight-gradient op finalizes them
one by one through its duration, the last layer first, as a real backward does.

The model is `layers` layers per virtual stage, each holding `layer_bytes` bytes of real parameters. A
trace row is a device's time for the layers an even split gives its virtual stage: one layer on
that device costs the row's duration over their count, so an op of a virtual stage that holds n
layers (`layer_split`) sleeps n such shares. A slow device (a scenario's `imbalance`) stays slow
whatever layers it holds."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rrfp_ray.observe.telemetry import LayerCost
from rrfp_ray.runtime.executor import TieSpec
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.measure import Costs
from rrfp_ray.runtime.reduce import ChunkGradients, GradSink
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.grad_ready import even_split
from rrfp_ray.schedule.layout import Layout, Message
from rrfp_ray.sim.trace import Trace, of_iteration


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
    layers: int = 1  # layers per virtual stage (per stage when v = 1), in the even split the trace is for
    layer_bytes: int = 0  # real parameter bytes each layer holds
    layer_split: tuple[int, ...] | None = None  # layers per virtual stage; None: even
    # a run of iterations of `trace`'s shape: iteration k replays iterations[k % their count] (empty: `trace` each time)
    iterations: tuple[Trace, ...] = ()

    def executor(self, *, stage: int, layout: Layout) -> SleepExecutor:
        return SleepExecutor(
            trace=self.trace,
            iterations=self.iterations,
            layout=layout,
            stage=stage,
            payload_elems=self.payload_elems,
            in_step=self.in_step,
            grad_elems=self.grad_elems,
            grad_layers=self.grad_layers,
            model=LayerModel(
                layers=self.layers * layout.virtual_stages, layer_bytes=self.layer_bytes, split=self.layer_split
            ),
        )

    def with_dp(
        self, *, rank: int, zero_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> SyntheticWorkload:
        """Every replica replays the same trace (it has no optimizer state to shard)."""
        return self

    def latency(self, message: Message, *, iteration: int) -> float:
        return (of_iteration(self.iterations, iteration) or self.trace).latency(message)

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
        own = [replace(t, commF=comm.commF, commB=comm.commB) for t in (self.trace, *self.iterations)]
        return replace(self, trace=own[0], iterations=tuple(own[1:]), rank_comm=(), in_step=in_step)


@dataclass(frozen=True)
class LayerModel:
    """A synthetic model of `layers` layers of `layer_bytes` parameter bytes each, cut `split` (None: even)."""

    layers: int = 1
    layer_bytes: int = 0
    split: tuple[int, ...] | None = None

    def ranges(self, *, virtual_stages: int, even: bool = False) -> list[range]:
        """The layers of each virtual stage under the split (`even`: the even split the trace is for)."""
        sizes = even_split(self.layers, parts=virtual_stages) if even or self.split is None else self.split
        if len(sizes) != virtual_stages or min(sizes) < 1 or sum(sizes) != self.layers:
            raise ValueError(
                f"the split {','.join(map(str, sizes))} must give each of the {virtual_stages} virtual stages at "
                f"least one of the {self.layers} layers, and all of them"
            )
        starts = list(itertools.accumulate(sizes, initial=0))
        return [range(a, b) for a, b in itertools.pairwise(starts)]

    def as_run(self, trace: Trace) -> Trace:
        """`trace` (for the even split) as this split runs it: each virtual stage's op durations and
        activation bytes times the layers it holds over the layers the even split gives it."""
        held = self.ranges(virtual_stages=trace.virtual_stages)
        even = self.ranges(virtual_stages=trace.virtual_stages, even=True)
        if held == even:
            return trace
        scale = [len(h) / len(e) for h, e in zip(held, even)]

        def scaled(rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(value * scale[vs] for value in row) for vs, row in enumerate(rows))

        activation = None if trace.activation_bytes is None else scaled(trace.activation_bytes)
        return replace(trace, F=scaled(trace.F), B=scaled(trace.B), W=scaled(trace.W), activation_bytes=activation)


PROBE_MS = 1.0  # the synthetic probe on a device of the pipeline's mean speed


class SleepExecutor:
    def __init__(
        self,
        *,
        trace: Trace,
        layout: Layout,
        payload_elems: int,
        stage: int = 0,
        in_step: InStep | None = None,
        grad_elems: int = 0,
        grad_layers: int = 1,
        model: LayerModel | None = None,
        iterations: tuple[Trace, ...] = (),
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
        self._trace = trace  # the even split's
        self._layout = layout
        self._payload = torch.zeros(payload_elems)
        self._in_step = in_step
        self._stage = stage
        model = LayerModel(layers=layout.virtual_stages) if model is None else model
        even = model.ranges(virtual_stages=layout.virtual_stages, even=True)
        held = model.ranges(virtual_stages=layout.virtual_stages)
        vs_of = {c: layout.virtual_stage(stage=stage, chunk=c) for c in range(layout.chunks)}
        self._shares = {c: len(even[vs]) for c, vs in vs_of.items()}  # the trace row's duration is this many layers'
        self._held = {c: held[vs] for c, vs in vs_of.items()}
        self._params = {i: torch.zeros(model.layer_bytes, dtype=torch.uint8) for r in self._held.values() for i in r}
        self._run_traces = tuple(model.as_run(t) for t in iterations or (trace,))
        self._run_trace = self._run_traces[0]  # begin sets the iteration's
        self._order: tuple[int, ...] | None = None  # begin sets it: the data microbatch of each slot
        self._watched: dict[int, list] | None = None  # measuring: chunk -> [microbatch, its F ms, its backward ms]

    def begin(self, *, args: IterationArgs) -> None:
        self._watched = {} if args.measure else None
        self._run_trace = of_iteration(self._run_traces, args.iteration)
        self._order = args.order

    def measure(self) -> Costs:
        """Each layer's forward and backward as this iteration's own ops measured them, slept on this
        thread: of each chunk, the first microbatch to run, its F and its backward (B, or I and W), each
        op's time shared evenly by the layers it holds (each costs its device's share of the trace); its
        parameter bytes (the tensor it holds) and the activation bytes one microbatch keeps (the trace's,
        shared by the layers of its row, or else one payload tensor a layer).

        The probe emulates the fixed reference computation on this device: it sleeps `PROBE_MS`
        times the device's speed factor, its mean op duration in the trace (F, B and W, over its
        chunks and microbatches) over the mean of every device's (`device_speed`)."""
        if self._watched is None:
            raise RuntimeError(f"stage {self._stage}: measure after an iteration begun without measure")
        costs = []
        for c, (_, forward, backward) in sorted(self._watched.items()):
            vs, layers = self._layout.virtual_stage(stage=self._stage, chunk=c), self._held[c]
            if self._trace.activation_bytes is not None:
                activation = int(statistics.mean(self._trace.activation_bytes[vs]) / self._shares[c])
            else:
                activation = self._payload.numel() * self._payload.element_size()
            costs += [
                LayerCost(
                    layer=layer,
                    forward_ms=forward / len(layers),
                    backward_ms=backward / len(layers),
                    param_bytes=self._params[layer].nbytes,
                    activation_bytes=activation,
                )
                for layer in layers
            ]
        self._watched = None
        return Costs(
            layers=costs,
            probe_ms=_timed_sleep_ms(
                PROBE_MS * device_speed(trace=self._trace, layout=self._layout, stage=self._stage)
            ),
        )

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
        data = action if self._order is None else replace(action, microbatch=self._order[action.microbatch])
        duration = self._run_trace.duration(data) / 1e3
        layers = self._grads[action.chunk] if release is not None else []
        for index, layer in enumerate(layers):  # each layer's share of the op, then its gradient is final
            _sleep_until(start + duration * (index + 1) / len(layers))
            release(ChunkGradients(tensors=[layer]))
        _sleep_until(start + duration)
        if self._watched is not None:
            self._note(action, ms=(time.time() - start) * 1e3)
        if self._layout.sends(action) is None:
            return None
        return self._payload

    def _note(self, action: Action, *, ms: float) -> None:
        """`action` took `ms`: noted when it is of its chunk's measured microbatch (the first to run its F)."""
        if action.kind is Kind.F and action.chunk not in self._watched:
            self._watched[action.chunk] = [action.microbatch, 0.0, 0.0]
        watched = self._watched.get(action.chunk)
        if watched is not None and watched[0] == action.microbatch:
            watched[1 if action.kind is Kind.F else 2] += ms


def device_speed(*, trace: Trace, layout: Layout, stage: int) -> float:
    """`stage`'s device's mean op duration in `trace` (F + B + W, over its chunks and microbatches) over the
    mean of every device's: its speed factor, 1 when all are alike."""

    def mean_op(device: int) -> float:
        rows = [layout.virtual_stage(stage=device, chunk=c) for c in range(layout.chunks)]
        return statistics.mean(
            trace.F[vs][m] + trace.B[vs][m] + trace.W[vs][m] for vs in rows for m in range(trace.microbatches)
        )

    overall = statistics.mean(mean_op(device) for device in range(layout.stages))
    return mean_op(stage) / overall if overall > 0 else 1.0


def _timed_sleep_ms(ms: float) -> float:
    """Sleeps `ms` and returns how long it took, in ms, on this thread's clock."""
    began = time.perf_counter()
    _sleep_until(time.time() + ms / 1e3)
    return (time.perf_counter() - began) * 1e3


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.time()) > 0:
        time.sleep(left)
