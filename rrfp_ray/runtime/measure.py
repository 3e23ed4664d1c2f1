"""How a stage times its own compute: for the per-layer costs it measures (`StageStats.layer_costs`),
the reference computation that compares devices (`StageStats.probe_ms`), and the slowdown that
emulates a throttled device (`Throttle`).

Times are taken on the compute thread's clock: `time.perf_counter` on the CPU, CUDA events
(synchronized) on a GPU. A slowed device's sleep falls inside what is timed, so a measurement
sees the device as slow as its ops are."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from rrfp_ray.observe.telemetry import LayerCost

T = TypeVar("T")

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

        self.time_ms(chain)  # warm-up: the first run pays for allocation
        return self.median_ms(chain)[1]


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
