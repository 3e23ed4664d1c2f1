"""Where a stage's per-op runtime overhead goes: samples, in microseconds, of the phases
between one op's end and the next op's start that are the runtime's own cost.

A stage worker records them on every iteration (a few clock reads per op); they travel in
`StageStats.overhead_us`, and `jobs/bench_runtime.py --breakdown` prints their median and p90.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Iterable


class Phase(enum.Enum):
    ARBITRATION = "arbitration"  # the compute thread choosing its next op (arbiter calls)
    HANDOFF = "compute->send"  # an output posted by the compute thread until its link's send thread takes it
    SEND = "send"  # the send thread's transfer of one message (header, description, payload)
    TRANSIT = "send->received"  # a frame leaving until the receive thread has it (the stages share a clock)
    ARRIVAL = "arrival->ready"  # a message's header received until its action is marked ready
    WAKEUP = "compute wake-up"  # an arrival's notify until the waiting compute thread runs again


class Breakdown:
    """One stage's samples for one iteration; callers serialise `add` (the worker's lock, or one thread per phase)."""

    def __init__(self) -> None:
        self._samples: dict[Phase, list[float]] = {phase: [] for phase in Phase}

    def add(self, phase: Phase, seconds: float) -> None:
        self._samples[phase].append(seconds)

    def extend(self, other: Breakdown) -> None:
        for phase, samples in other._samples.items():
            self._samples[phase] += samples

    def to_us(self) -> dict[str, list[int]]:
        """Whole microseconds per phase, keyed by the phase's value (plain data for telemetry)."""
        return {phase.value: [round(s * 1e6) for s in samples] for phase, samples in self._samples.items()}


def summarize(stage_samples: Iterable[dict[str, list[int]]]) -> dict[Phase, tuple[float, float, int]]:
    """Median, p90 (us) and sample count per phase, pooled over the given stages' samples."""
    pooled: dict[Phase, list[int]] = {phase: [] for phase in Phase}
    for samples in stage_samples:
        for key, values in samples.items():
            pooled[Phase(key)].extend(values)
    return {phase: (_quantile(values, 0.5), _quantile(values, 0.9), len(values)) for phase, values in pooled.items()}


def _quantile(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]
