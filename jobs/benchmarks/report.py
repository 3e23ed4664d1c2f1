"""The suite's JSON read back (`Suite`), and the helpers that format its figures for the report.

Shared by jobs/benchmarks/claims.py, jobs/benchmarks/render.py and jobs/benchmarks/plots.py; `jobs/results.py`
renders docs/RESULTS.md with them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

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
    """The JSON with lookups; sections a run did not produce are empty."""

    def __init__(self, data: dict[str, Any]) -> None:
        if "meta" not in data:
            raise ValueError("json: no 'meta' section; is this the output of jobs/bench_suite.py?")
        self.data = data
        self.meta = data["meta"]
        if isinstance(self.meta.get("sim_seeds"), int):  # JSON written before the seeds were listed: 0..N-1
            self.meta["sim_seeds"] = list(range(self.meta["sim_seeds"]))
        self.scenarios = [s["label"] for s in self.meta["scenarios"]]
        self.rules = self.meta["readiness_policies"]
        self.sim = data.get("sim", {}).get("rows", [])
        self.buffer = data.get("buffer", {}).get("rows", [])
        self.runtime = data.get("runtime", {}).get("rows", [])
        self.peers = data.get("peers", {}).get("rows", [])
        self.tp = data.get("tp", {}).get("rows", [])
        self.stages = sorted({r["stages"] for r in self.sim})
        self.runs = list(dict.fromkeys(r["run"] for r in self.sim))
        self.ray_stages = sorted({r.get("stages", 4) for r in self.runtime + self.peers})

    def cell(self, *, scenario: str, stages: int, run: str) -> dict | None:
        return next((r for r in self.sim if (r["scenario"], r["stages"], r["run"]) == (scenario, stages, run)), None)

    def sim_rows(self, *, scenarios: Iterable[str], where: Callable[[dict], bool] = lambda r: True) -> list[dict]:
        wanted = set(scenarios)
        return [r for r in self.sim if r["scenario"] in wanted and where(r)]

    def ready(self, row: dict) -> bool:
        """A readiness run: an arbiter under a cap (a rule, or a ready-* list), not a fixed list."""
        return row.get("cap") is not None

    def runtime_rows(self, *, scenario: str, stages: int | None = None) -> list[dict]:
        """One row per run at P=`stages` (default: the smallest measured), over the seeds (`over_seeds`)."""
        return over_seeds(self._at(self.runtime, scenario=scenario, stages=stages), name="run")

    def peer_rows(self, *, scenario: str, stages: int | None = None) -> list[dict]:
        return over_seeds(self._at(self.peers, scenario=scenario, stages=stages), name="schedule")

    def _at(self, rows: list[dict], *, scenario: str, stages: int | None) -> list[dict]:
        p = stages if stages is not None else (self.ray_stages or [4])[0]
        return [r for r in rows if r["scenario"] == scenario and r.get("stages", 4) == p]


MEDIANS = ("measured_ms", "sim_ms", "ideal_ms", "blocked_fraction")
MAXIMA = ("memory_x", "peak_inflight")


def over_seeds(rows: list[dict], *, name: str) -> list[dict]:
    """Rows of one (scenario, P) merged per `name` over their seeds: the median over seeds of each
    seed's median (MEDIANS), the most over seeds (MAXIMA), and `seed_ms` {seed: measured_ms}."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row[name], []).append(row)
    out = []
    for group in groups.values():
        merged = {**group[0], "seeds": len(group)}
        for key in MEDIANS:
            if key in merged:
                merged[key] = statistics.median(r[key] for r in group)
        for key in MAXIMA:
            if key in merged:
                merged[key] = max(r[key] for r in group)
        merged["seed_ms"] = {r.get("seed", 0): r["measured_ms"] for r in group}
        out.append(merged)
    return out


def seed_spread(ours: dict, theirs: dict) -> tuple[float, float]:
    """Least and most per-seed ratio ours / theirs over the seeds both measured."""
    common = sorted(set(ours["seed_ms"]) & set(theirs["seed_ms"]))
    ratios = [ours["seed_ms"][seed] / theirs["seed_ms"][seed] for seed in common]
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
