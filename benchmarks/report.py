"""The suite's JSON read back (`Suite`), and the helpers that format its figures for the report.

Shared by benchmarks/claims.py, benchmarks/render.py and benchmarks/plots.py; `jobs/results.py`
renders docs/RESULTS.md with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"json": ROOT / "docs/results/suite.json", "out": ROOT / "docs/RESULTS.md", "plots": ROOT / "docs/results"}
SUITE = "python jobs/bench_suite.py"
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
        self.scenarios = [s["label"] for s in self.meta["scenarios"]]
        self.rules = self.meta["readiness_policies"]
        self.sim = data.get("sim", {}).get("rows", [])
        self.buffer = data.get("buffer", {}).get("rows", [])
        self.runtime = data.get("runtime", {}).get("rows", [])
        self.peers = data.get("peers", {}).get("rows", [])
        self.tp = data.get("tp", {}).get("rows", [])
        self.stages = sorted({r["stages"] for r in self.sim})
        self.runs = list(dict.fromkeys(r["run"] for r in self.sim))

    def cell(self, *, scenario: str, stages: int, run: str) -> dict | None:
        return next((r for r in self.sim if (r["scenario"], r["stages"], r["run"]) == (scenario, stages, run)), None)

    def sim_rows(self, *, scenarios: Iterable[str], where: Callable[[dict], bool] = lambda r: True) -> list[dict]:
        wanted = set(scenarios)
        return [r for r in self.sim if r["scenario"] in wanted and where(r)]

    def ready(self, row: dict) -> bool:
        return row["policy"] in self.rules

    def runtime_rows(self, *, scenario: str) -> list[dict]:
        return [r for r in self.runtime if r["scenario"] == scenario]

    def peer_rows(self, *, scenario: str) -> list[dict]:
        return [r for r in self.peers if r["scenario"] == scenario]


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
