"""The suite's JSON read back (`Suite`), and the helpers that format its figures for the report.

Shared by jobs/benchmarks/claims.py, jobs/benchmarks/render.py and jobs/benchmarks/plots.py; `jobs/results.py`
renders docs/RESULTS.md with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from benchmarks.rows import (
    BufferRow,
    FidelityRow,
    Measured,
    PeerRow,
    R,
    RuntimeRow,
    SimRow,
    TPRow,
    over_seeds,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {"json": ROOT / "docs/results/suite.json", "out": ROOT / "docs/RESULTS.md", "plots": ROOT / "docs/results"}
SUITE = "python jobs/bench_suite.py"
MEMORY_LIMIT = 2.0 + 1e-9  # "no more than 2x 1F1B's activation memory"
FIXED_COLORS = {
    "gpipe": "tab:gray",
    "1f1b": "black",
    "1f1b-2x": "dimgray",
    "zb-h1": "tab:brown",
    "zb-h2": "sienna",
    "interleaved": "tab:purple",
    "zbv": "tab:pink",
    "dualpipev": "magenta",
}


class Suite:
    """The JSON with lookups, its rows typed (`benchmarks.rows`, read on first use); sections a run did not
    produce are empty."""

    def __init__(self, data: dict[str, Any]) -> None:
        if "meta" not in data:
            raise ValueError("json: no 'meta' section; is this the output of jobs/bench_suite.py?")
        self.data = data
        self.meta = data["meta"]
        if isinstance(self.meta.get("sim_seeds"), int):  # JSON written before the seeds were listed: 0..N-1
            self.meta["sim_seeds"] = list(range(self.meta["sim_seeds"]))
        self.scenarios = [s["label"] for s in self.meta["scenarios"]]
        self.rules = self.meta["readiness_policies"]

    @cached_property
    def sim(self) -> list[SimRow]:
        return [SimRow.of(r) for r in self._rows("sim")]

    @cached_property
    def buffer(self) -> list[BufferRow]:
        return [BufferRow.of(r) for r in self._rows("buffer")]

    @cached_property
    def runtime(self) -> list[RuntimeRow]:
        return [RuntimeRow.of(r) for r in self._rows("runtime")]

    @cached_property
    def peers(self) -> list[PeerRow]:
        return [PeerRow.of(r) for r in self._rows("peers")]

    @cached_property
    def tp(self) -> list[TPRow]:
        return [TPRow.of(r) for r in self._rows("tp")]

    @cached_property
    def fidelity(self) -> list[FidelityRow]:
        return [FidelityRow.of(r) for r in self._rows("fidelity")]

    @property
    def stages(self) -> list[int]:
        """The simulator part's pipeline depths."""
        return sorted({r.stages for r in self.sim})

    @property
    def runs(self) -> list[str]:
        return list(dict.fromkeys(r.run for r in self.sim))

    @property
    def ray_stages(self) -> list[int]:
        """The depths the Ray parts (runtime, peers) measured."""
        return sorted({r.stages for r in [*self.runtime, *self.peers]})

    def _rows(self, part: str) -> list[dict[str, Any]]:
        return self.data.get(part, {}).get("rows", [])

    def cell(self, *, scenario: str, stages: int, run: str) -> SimRow | None:
        return next((r for r in self.sim if (r.scenario, r.stages, r.run) == (scenario, stages, run)), None)

    def sim_rows(self, *, scenarios: Iterable[str], where: Callable[[SimRow], bool] = lambda r: True) -> list[SimRow]:
        wanted = set(scenarios)
        return [r for r in self.sim if r.scenario in wanted and where(r)]

    def runtime_rows(self, *, scenario: str, stages: int | None = None) -> list[RuntimeRow]:
        """One row per run at P=`stages` (default: the smallest measured), over the seeds (`over_seeds`)."""
        return over_seeds(self._at(self.runtime, scenario=scenario, stages=stages), name=lambda r: r.run)

    def peer_rows(self, *, scenario: str, stages: int | None = None) -> list[PeerRow]:
        return over_seeds(self._at(self.peers, scenario=scenario, stages=stages), name=lambda r: r.schedule)

    def _at(self, rows: list[R], *, scenario: str, stages: int | None) -> list[R]:
        p = stages if stages is not None else (self.ray_stages or [4])[0]
        return [r for r in rows if r.scenario == scenario and r.stages == p]


def seed_spread(ours: Measured, theirs: Measured) -> tuple[float, float]:
    """Least and most per-seed ratio ours / theirs over the seeds both measured."""
    common = sorted(set(ours.seed_ms) & set(theirs.seed_ms))
    ratios = [ours.seed_ms[seed] / theirs.seed_ms[seed] for seed in common]
    return (min(ratios), max(ratios)) if ratios else (float("nan"), float("nan"))


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
    return lines


def x(value: float) -> str:
    return f"{value:.2f}x"


def pct(value: float, *, digits: int = 0) -> str:
    return f"{100 * value:.{digits}f}%"


def span(values: Sequence[float], fmt: Callable[[float], str] = x) -> str:
    """A range like 1.10-1.25x: the unit once, after it."""
    low, high = fmt(min(values)), fmt(max(values))
    unit = low[-1] if low[-1] in "x%" else ""
    return low if low == high else f"{low.removesuffix(unit)}-{high}"


def missing(part: str) -> str:
    return f"not in this JSON (run `{SUITE}` with the {part} part)"
