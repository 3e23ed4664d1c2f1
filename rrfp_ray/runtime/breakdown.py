"""Where a stage's per-op runtime overhead goes: samples, in microseconds, of the phases
between one op's end and the next op's start that are the runtime's own cost.

A stage worker records them on every iteration (a few clock reads per op); they travel in
`StageStats.overhead_us`, and `jobs/bench_runtime.py --breakdown` prints their median and p90.
"""

from __future__ import annotations

import enum
import statistics
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rrfp_ray.runtime.transport import Header


class Phase(enum.Enum):
    ARBITRATION = "arbitration"  # the compute thread choosing its next op (arbiter calls)
    HANDOFF = "compute->send"  # an output posted by the compute thread until its link's send thread takes it
    SEND = "send"  # the send thread's transfer of one message (header, description, payload)
    TRANSIT = "send->received"  # a frame stamped until the receiving thread has it (the stages share a clock)
    # a polled link's message the compute thread waited for: its wait's return until the message is read (its
    # Python and system calls); the rest of send->received is the sender's framing and write and the wake-up
    READ = "poll->read"
    ARRIVAL = "arrival->ready"  # a message's header received until its action is marked ready
    WAKEUP = "compute wake-up"  # an arrival's notify until the waiting compute thread runs again
    # one message: the sending compute thread's hand-off (plus the latency injected on its link) until the receiving
    # compute thread can start the op that needs it (woken for it, or at its delivery if it was busy then)
    MESSAGE = "one message"

    __hash__ = object.__hash__  # by identity: Enum's own hashes the name in Python, and every sample hashes a phase


_PHASES = tuple(Phase)  # iterated without the enum's own iterator, a Python generator


class Breakdown:
    """One stage's samples for one iteration; callers serialise `add` (the worker's lock, or one thread per phase)."""

    def __init__(self) -> None:
        self._samples: dict[Phase, list[float]] = {phase: [] for phase in _PHASES}

    def add(self, phase: Phase, seconds: float) -> None:
        self._samples[phase].append(seconds)

    def samples(self, phase: Phase) -> list[float]:
        """`phase`'s samples in seconds, to append to: a per-op path holds it where `add` would look it up."""
        return self._samples[phase]

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


class MessageClock:
    """`Phase.MESSAGE` samples; calls come under the worker's lock. A message delivered while the compute
    thread waits (`waiting`) becomes usable when it runs again (`woke`); else at its delivery."""

    def __init__(self) -> None:
        self.waiting = False
        self._woken_for: list[float] = []  # release times of the messages delivered during the wait

    def delivered(self, *, header: Header, received: float, into: Breakdown) -> None:
        """`header`'s message is delivered; its frame came in at `received` (wall-clock seconds). Called for the
        messages the compute thread waited for only: one it read after an op came at some unknown time during it."""
        into.add(Phase.TRANSIT, received - header.sent_at)
        if self.waiting:
            self._woken_for.append(header.released_at)
        else:
            into.add(Phase.MESSAGE, time.time() - header.released_at)

    def wait(self, cond: threading.Condition, *, timeout_s: float, into: Breakdown) -> None:
        """The compute thread's wait for an arrival, on the worker's `cond` (held)."""
        self.waiting = True
        cond.wait(timeout=timeout_s)
        self.waiting = False
        now = time.time()
        for released in self._woken_for:
            into.add(Phase.MESSAGE, now - released)
        self._woken_for.clear()
