"""CPU time a stage's process spends per op: the figure that carries over from a shared 2-core
machine to a GPU node, where wall-clock ratios do not.

A process's CPU clock (`time.process_time`) counts every thread it has, the runtime's and the
hosting framework's (Ray's) alike. Its idle baseline is what the same process burns with no ops
running (`idle_rate`, CPU seconds per wall second, measured over a short window), scaled to the
measured wall time. What an op does itself (`OpClock`, on the thread that runs it) is the
workload's, not the runtime's, and is subtracted too. The runtime's own threads each keep their
CPU clock in a `ThreadClock`, marked by the thread itself before it blocks, so a reader sees every
CPU second spent up to the thread's last block with no call into another thread's clock.

`CpuUse` is one stage's iteration: `per_op_us` turns stages' iterations into microseconds per
executed op, by role. `jobs/bench_runtime.py --breakdown` and `jobs/bench_peers.py --cpu` print it.
"""

from __future__ import annotations

import enum
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class Role(enum.Enum):
    COMPUTE = "compute"  # the compute thread, less its ops' own work
    SEND = "send"  # the link send threads
    RECEIVE = "receive"  # the link receive threads (none for links the compute thread polls)
    OTHER = "other"  # every other thread of the process (the host framework's), less the idle baseline


class ThreadClock:
    """One thread's CPU seconds, as of its last `mark` (made by that thread)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0

    def mark(self) -> None:
        self.cpu_s = time.thread_time()


class OpClock:
    """CPU seconds the ops' own work took on the thread that ran them (`timing` around each)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0

    @staticmethod
    def now() -> float:
        """The calling thread's CPU clock, to pass to `add` later."""
        return time.thread_time()

    def add(self, *, since: float) -> None:
        """Count the calling thread's CPU since `since` (a `now()` of the same thread)."""
        self.cpu_s += time.thread_time() - since


def idle_rate(*, window_s: float = 0.1) -> float:
    """CPU seconds per wall second this process spends while the calling thread sleeps `window_s`
    (the caller makes sure no op runs meanwhile)."""
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(window_s)
    return max(0.0, (time.process_time() - cpu) / (time.perf_counter() - wall))


@dataclass(frozen=True)
class CpuUse:
    """One stage's CPU seconds over one iteration (or one run of steps) of `wall_s` seconds and `ops` ops."""

    ops: int
    wall_s: float
    process_s: float  # every thread, by the process's CPU clock
    idle_s: float  # the idle baseline over `wall_s`
    op_s: float  # the ops' own work
    compute_s: float  # the compute thread, ops included
    send_s: float = 0.0
    receive_s: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return dict(vars(self))  # its fields, flat: no deep copy of each float as `asdict` makes

    @property
    def runtime_s(self) -> float:
        """The runtime's cost: the process less its idle baseline and the ops' own work."""
        return self.process_s - self.idle_s - self.op_s

    def roles_s(self) -> dict[Role, float]:
        compute = self.compute_s - self.op_s
        return {
            Role.COMPUTE: compute,
            Role.SEND: self.send_s,
            Role.RECEIVE: self.receive_s,
            Role.OTHER: self.runtime_s - compute - self.send_s - self.receive_s,
        }


class Meter:
    """Reads a process's clocks at the start and at the end of a span of work (on the compute thread)."""

    def __init__(self, *, idle: float) -> None:
        self.idle = idle
        self._start = self._read(send=(), receive=())

    def start(self, *, send: Iterable[ThreadClock], receive: Iterable[ThreadClock]) -> None:
        self._start = self._read(send=send, receive=receive)

    def stop(self, *, ops: int, op: OpClock, send: Iterable[ThreadClock], receive: Iterable[ThreadClock]) -> CpuUse:
        end = self._read(send=send, receive=receive)
        wall, process, compute, sent, received = (b - a for a, b in zip(self._start, end))
        return CpuUse(
            ops=ops,
            wall_s=wall,
            process_s=process,
            idle_s=self.idle * wall,
            op_s=op.cpu_s,
            compute_s=compute,
            send_s=sent,
            receive_s=received,
        )

    @staticmethod
    def _read(*, send: Iterable[ThreadClock], receive: Iterable[ThreadClock]) -> tuple[float, ...]:
        return (
            time.perf_counter(),
            time.process_time(),
            time.thread_time(),
            sum(c.cpu_s for c in send),
            sum(c.cpu_s for c in receive),
        )


class StageCpu:
    """A stage worker's clocks: one per receive thread (`receiver`), its ops' (`op`), and a `Meter` per
    iteration (`begin`, `end`) over the given send threads' clocks; the idle baseline is measured once."""

    def __init__(self) -> None:
        self.op = OpClock()
        self._receive: list[ThreadClock] = []
        self._send: list[ThreadClock] = []
        self._idle: float | None = None
        self._meter = Meter(idle=0.0)

    def receiver(self) -> ThreadClock:
        clock = ThreadClock()
        self._receive.append(clock)
        return clock

    def begin(self, *, send: list[ThreadClock]) -> None:
        """Called by the compute thread while no op runs."""
        if self._idle is None:
            self._idle = idle_rate()
        self._send, self.op = send, OpClock()
        self._meter = Meter(idle=self._idle)
        self._meter.start(send=send, receive=self._receive)

    def end(self, *, ops: int) -> CpuUse:
        return self._meter.stop(ops=ops, op=self.op, send=self._send, receive=self._receive)


def per_op_us(stages: Iterable[Iterable[Mapping[str, float]]]) -> dict[str, float]:
    """Microseconds per op: each stage's iterations (`CpuUse.to_dict()`s) pooled, then the median
    over stages; the runtime's ("all"), per role, the ops' own ("op") and the idle baseline ("idle")."""
    rows: dict[str, list[float]] = {}
    for iterations in stages:
        uses = [CpuUse(**raw) for raw in iterations]
        ops = sum(use.ops for use in uses)
        if ops <= 0:
            continue
        figures = {"all": sum(use.runtime_s for use in uses)}
        for role in Role:
            figures[role.value] = sum(use.roles_s()[role] for use in uses)
        figures |= {"op": sum(use.op_s for use in uses), "idle": sum(use.idle_s for use in uses)}
        for key, seconds in figures.items():
            rows.setdefault(key, []).append(seconds * 1e6 / ops)
    return {key: statistics.median(values) for key, values in rows.items()}
