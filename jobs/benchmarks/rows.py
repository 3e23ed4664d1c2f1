"""The suite's rows as the report reads them: one frozen type per part of the JSON (`of` reads a JSON
row, ignoring the keys the report does not use), and the TP part's protocols as an enum.

JSON written by older suites lacks a few keys; their defaults say what those suites measured
(one seed, seed 0, P=4 on Ray, no per-seed makespans).
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Self, TypeVar


class Agreement(enum.StrEnum):
    """How the TP part's run agreed: without TP (its baseline), or a TP protocol."""

    TP1 = "tp1"
    FIRST = "first"
    COMMON = "common"


class _Row:
    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Self:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{name: value for name, value in row.items() if name in names})


@dataclass(frozen=True, kw_only=True)
class Cell(_Row):
    """One run in one (scenario, P), as the attribution compares runs: its mean makespan over the seeds,
    each seed's, and its peak activation memory over fixed 1F1B's."""

    run: str
    makespan_ms: float
    memory_x: float
    makespans: tuple[float, ...] = ()

    @property
    def per_seed(self) -> tuple[float, ...]:
        """Each seed's makespan (a JSON written before they were kept: the mean alone)."""
        return tuple(self.makespans) or (self.makespan_ms,)


@dataclass(frozen=True, kw_only=True)
class SimRow(Cell):
    """The simulator part: one run of one (scenario, P) over the seeds."""

    scenario: str
    stages: int
    microbatches: int
    policy: str
    cap: str | None  # None: a fixed list
    chunks: int
    speedup_vs_1f1b: float
    lb_ratio: float
    blocked_fraction: float
    bubble: float
    peak_inflight: int
    seeds: int = 1

    @property
    def ready(self) -> bool:
        """A readiness run: an arbiter under a cap (a rule, or a ready-* list), not a fixed list."""
        return self.cap is not None


@dataclass(frozen=True, kw_only=True)
class BufferRow(_Row):
    """The buffer part: one receive-buffer limit at one (scenario, P, cap), over the seeds."""

    scenario: str
    stages: int
    microbatches: int
    policy: str
    cap: str
    buffer_limit: int | None  # None: unbounded
    makespan_rel: float | None  # mean over the unbounded run's; None: it deadlocked
    makespan_rel_max: float | None
    deadlocks: int  # seeds that deadlocked
    seeds: int
    unbounded_peak_buffered: int


@dataclass(frozen=True, kw_only=True)
class Measured(_Row):
    """A measured row of one seed on Ray (or, merged `over_seeds`, of every seed: `seeds`, `seed_ms`)."""

    scenario: str
    measured_ms: float
    stages: int = 4
    seed: int = 0
    seeds: int = 1
    seed_ms: Mapping[int, float] = field(default_factory=dict)  # merged: each seed's measured_ms

    def medians(self, group: list[Self]) -> dict[str, float]:
        """The figures merged over seeds as medians (`over_seeds`)."""
        return {"measured_ms": statistics.median(r.measured_ms for r in group)}


@dataclass(frozen=True, kw_only=True)
class RuntimeRow(Measured):
    """The runtime part: one run of one (scenario, P, seed) on Ray."""

    run: str
    policy: str
    cap: str | None
    memory_x: float
    blocked_fraction: float
    peak_inflight: int
    sim_ms: float  # the simulated makespan of the same trace

    @property
    def ready(self) -> bool:
        return self.cap is not None

    def medians(self, group: list[Self]) -> dict[str, Any]:
        return {
            **super().medians(group),
            "blocked_fraction": statistics.median(r.blocked_fraction for r in group),
            "sim_ms": statistics.median(r.sim_ms for r in group),
            "memory_x": max(r.memory_x for r in group),
            "peak_inflight": max(r.peak_inflight for r in group),
        }


@dataclass(frozen=True, kw_only=True)
class PeerRow(Measured):
    """The peers part: one PyTorch schedule on one (scenario, P, seed), and its order simulated (`ideal_ms`)."""

    schedule: str
    ideal_ms: float

    def medians(self, group: list[Self]) -> dict[str, Any]:
        return {**super().medians(group), "ideal_ms": statistics.median(r.ideal_ms for r in group)}


R = TypeVar("R", bound=Measured)


def over_seeds(rows: list[R], *, name: Callable[[R], str]) -> list[R]:
    """Rows of one (scenario, P) merged per `name` (their run or schedule) over their seeds: the median over
    seeds of each seed's median, the most over seeds for memory, and `seed_ms` {seed: measured_ms}."""
    groups: dict[str, list[R]] = {}
    for row in rows:
        groups.setdefault(name(row), []).append(row)
    return [
        replace(group[0], **group[0].medians(group), seeds=len(group), seed_ms={r.seed: r.measured_ms for r in group})
        for group in groups.values()
    ]


@dataclass(frozen=True, kw_only=True)
class TPRow(_Row):
    """The TP part: one run of one scenario under one protocol (or without TP)."""

    scenario: str
    run: str
    policy: str
    cap: str | None
    tp: int
    protocol: Agreement
    measured_ms: float
    tp_coord_fraction: float
    tp_rounds: float
    tp_ms_per_round: float
    tp_disagreements: float
    disagreements_per_round: float
    vs_tp1: float | None = None  # over the same run without TP

    def __post_init__(self) -> None:
        object.__setattr__(self, "protocol", Agreement(self.protocol))

    @property
    def ready(self) -> bool:
        return self.cap is not None


@dataclass(frozen=True, kw_only=True)
class FidelityRow(_Row):
    """The fidelity part: one policy of the GPT run at one P, measured and replayed in the simulator."""

    stages: int
    microbatches: int
    policy: str
    cap: str
    runs_ms: tuple[float, ...]  # each timed iteration's
    measured_ms: float
    schedule_ms: float
    simulated_ms: float
    sim_over_measured: float
    op_ms_mean: float
