"""How a stage times its own compute: for the per-layer costs it measures (`StageStats.layer_costs`,
`LayerWatch`), the reference computation that compares devices (`StageStats.probe_ms`, `Clock`),
and the slowdown that emulates a throttled device (`Throttle`).

Times are taken on the compute thread's clock: `time.perf_counter` on the CPU, CUDA events on a
GPU (recorded on the compute stream as the work is queued, read once the iteration is done). A
slowed device's sleep falls inside what is timed, so a measurement sees the device as slow as
its ops are."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from rrfp_ray.observe.telemetry import LayerCost

T = TypeVar("T")
Stamp = float | torch.cuda.Event  # a moment on the compute thread's clock (`stamp`)

PROBE_SIZE = 192  # the reference computation: a chain of PROBE_CHAIN float32 matmuls of this square size
PROBE_CHAIN = 4  # about 1 ms on one CPU core
REPEATS = 3  # timings a measurement takes the median of


@dataclass(frozen=True)
class Costs:
    """What a stage measured after an iteration: each of its layers' costs, and its device's probe."""

    layers: list[LayerCost]
    probe_ms: float


@dataclass(frozen=True)
class Throttle:
    """A device `factor` times slower than it is (1: as it is): after each compute, the thread
    sleeps factor - 1 times what the compute took."""

    factor: float = 1.0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"a slowdown factor must be >= 1, got {self.factor}")

    def run(self, compute: Callable[[], T]) -> T:
        if self.factor == 1.0:
            return compute()
        start = time.perf_counter()
        result = compute()
        _synchronize(self.device)
        time.sleep((self.factor - 1.0) * (time.perf_counter() - start))
        return result


@dataclass(frozen=True)
class Clock:
    """Times computations on `device`, each through `throttle`."""

    device: str = "cpu"
    throttle: Throttle = Throttle()

    def time_ms(self, compute: Callable[[], T]) -> tuple[T, float]:
        """`compute()`'s result and the ms it took."""
        if self.device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = self.throttle.run(compute)
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end)
        began = time.perf_counter()
        result = self.throttle.run(compute)
        return result, (time.perf_counter() - began) * 1e3

    def median_ms(self, compute: Callable[[], T], *, repeats: int = REPEATS) -> tuple[T, float]:
        """The last run's result and the median ms over `repeats` runs."""
        times = []
        for _ in range(repeats):
            result, ms = self.time_ms(compute)
            times.append(ms)
        return result, statistics.median(times)

    def probe_ms(self) -> float:
        """The median ms of the fixed reference computation (the same on every stage), on this device."""
        a = torch.full((PROBE_SIZE, PROBE_SIZE), 1.0 / PROBE_SIZE, device=self.device)

        def chain() -> torch.Tensor:
            x = a
            for _ in range(PROBE_CHAIN):
                x = x @ a
            return x

        return self.median_ms(chain)[1]


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def stamp(device: str) -> Stamp:
    """Now, on `device`'s clock: perf_counter seconds, or a CUDA event recorded on the current stream."""
    if device.startswith("cuda"):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_ms(start: Stamp, end: Stamp) -> float:
    """ms from `start` to `end` (CUDA events: once both have completed)."""
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)


@dataclass
class LayerWatch:
    """One microbatch's own work through a chunk's `layers` layers (model indices from `first_layer`),
    stamped as it runs, so measuring adds no compute: each layer's forward; the backward passes,
    split at the moments the gradient reaches each layer boundary (a hook on the tensor between
    layer j and j + 1 fires as layer j + 1's backward ends and layer j's begins), or, a weight pass
    that reaches no boundary, given to the layer whose parameters it accumulates; the wall time of
    the chunk's ops for it (`op`: the throttle's sleep included). A layer's cost is the ops' wall
    time shared out in proportion to what its own stamps measured."""

    device: str
    layers: int
    first_layer: int
    forward: list[tuple[Stamp, Stamp]] = field(default_factory=list)
    activation_bytes: list[int] = field(default_factory=list)
    param_bytes: list[int] = field(default_factory=list)
    _segments: list[tuple[int, Stamp, Stamp]] = field(default_factory=list)  # (layer offset, start, end)
    _ops: dict[bool, list[tuple[Stamp, Stamp]]] = field(default_factory=lambda: {True: [], False: []})
    _pass: tuple[Stamp, list[tuple[Stamp, int]]] | None = None  # the running backward pass: start, boundaries

    def boundary_hook(self, offset: int) -> Callable[[torch.Tensor], None]:
        """A tensor hook for the output of layer `offset`: the gradient reaching it starts that layer's backward."""

        def reached(_: torch.Tensor) -> None:
            if self._pass is not None:
                self._pass[1].append((stamp(self.device), offset))

        return reached

    def begin_pass(self) -> None:
        self._pass = (stamp(self.device), [])

    def end_pass(self, *, owner: int | None = None) -> None:
        """The backward pass begun last is done; reaching no boundary it goes to layer `owner` (None: the top one)."""
        if self._pass is None:
            raise RuntimeError("end_pass without begin_pass")
        start, reached = self._pass
        self._pass = None
        end = stamp(self.device)
        if not reached:
            self._segments.append((self.layers - 1 if owner is None else owner, start, end))
            return
        moments = [(start, self.layers - 1), *reached, (end, -1)]
        self._segments += [(layer, a, b) for (a, layer), (b, _) in zip(moments, moments[1:])]

    def op(self, *, forward: bool, start: Stamp, end: Stamp) -> None:
        """One of the chunk's ops for this microbatch took `start` to `end` (its forward, or a backward op)."""
        self._ops[forward].append((start, end))

    def costs(self) -> list[LayerCost]:
        """Each layer's cost, once the stamps have completed (`torch.cuda.synchronize` on a GPU)."""
        own_forward = [elapsed_ms(a, b) for a, b in self.forward]
        own_backward = [0.0] * self.layers
        for layer, a, b in self._segments:
            own_backward[layer] += elapsed_ms(a, b)
        forward = _shared(sum(elapsed_ms(a, b) for a, b in self._ops[True]), own_forward)
        backward = _shared(sum(elapsed_ms(a, b) for a, b in self._ops[False]), own_backward)
        return [
            LayerCost(
                layer=self.first_layer + j,
                forward_ms=forward[j],
                backward_ms=backward[j],
                param_bytes=self.param_bytes[j],
                activation_bytes=self.activation_bytes[j],
            )
            for j in range(self.layers)
        ]


def _shared(total: float, parts: list[float]) -> list[float]:
    """`total` shared out in proportion to `parts` (evenly when they are all 0)."""
    whole = sum(parts)
    if whole <= 0:
        return [total / len(parts)] * len(parts)
    return [total * part / whole for part in parts]
