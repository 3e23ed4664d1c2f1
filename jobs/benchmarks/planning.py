"""Planning ahead in the simulator: `planned` against the best fixed schedule, decomposed, with the oracle.

Per scenario, pipeline depth P (M = 4P, v = 1, cap 1x in bytes, split backward where the policy
splits) and seed, a run of iterations (`generate_iterations`) is simulated in order under:

- the fixed schedules 1f1b, zb-h1 and gpipe, the data in its own order; the best of them per
  seed is the baseline (gpipe holds all M in flight, so beating it is stricter);
- `bfw`: readiness alone;
- `planned-fixed`: the planned order (and packing) under fixed schedules only (what the order buys);
- `planned`: order and hint planned from the features and the telemetry of iterations <= k-2;
- `oracle`: the same search with the true durations (the ceiling);
- `expected`: the same search with each iteration's durations without the per-op noise no plan can see
  (the scenario without its `lognormal` part, the same draws otherwise), run on the true ones: what a
  planner that knew every microbatch's expected cost on every stage, drift and straggler included, would
  get; the gap from `expected` to `oracle` is the noise, the gap from `planned` to `expected` the cost model.

A ratio is the baseline's mean makespan over the policy's (> 1: faster), per seed; a cell is the
geometric mean over seeds with the lowest and highest seed. `room` is the baseline over the lower
bound of any schedule with the split (`rrfp_ray.sim.bounds.bounds`): what no plan can exceed. `choice` is planned
against the best policy it may choose, each run on the data in its own order (the check for traces with nothing to
plan).
`iteration_table` shows planned, expected and oracle the same way per iteration (a cell: the geometric mean over
seeds), which tells the first iterations, planned from features alone, from the later ones.
`targets` judges planned over the featured rows: every run of them, and the runs of the rows whose room reaches
the target (a row whose room is below it leaves no schedule a way to reach it: reported, not judged).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rrfp_ray.plan.loop import Planning, run
from rrfp_ray.plan.planner import HINTS, PlannerConfig, default_hints
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.bounds import bounds
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate_iterations

log = logging.getLogger(__name__)

FIXED = ("1f1b", "zb-h1", "gpipe")
COLUMNS = ("bfw", "planned-fixed", "planned", "expected", "oracle", "bound")
UNSEEN = "lognormal"  # the scenario part that draws per-op noise no plan can see
ITERATIONS = "iterations"  # a cell's key for each policy's makespan per iteration
BY_ITERATION = ("planned", "expected", "oracle")


@dataclass(frozen=True)
class Scenario:
    label: str
    scenario: str
    params: Mapping[str, float]
    featured: bool  # the data shows each microbatch's cost before the iteration

    @property
    def expected(self) -> str:
        """The scenario without its unseen per-op noise (`none` where nothing else is left)."""
        return "+".join(part for part in self.scenario.split("+") if part != UNSEEN) or "none"


SCENARIOS = (
    Scenario("multimodal+jitter", "multimodal+lognormal", {}, True),
    Scenario("varlen+jitter", "varlen+lognormal", {}, True),
    Scenario("varlen packed+jitter", "varlen+lognormal", {"docs": 4}, True),
    Scenario("multimodal+persistent", "multimodal+persistent", {}, True),
    Scenario("multimodal+drift", "multimodal+drift", {}, True),
    Scenario("persistent", "persistent", {}, False),
    Scenario("drift", "drift", {}, False),
    Scenario("pure jitter", "lognormal", {}, False),
    Scenario("none", "none", {}, False),
)


def cell(
    *, scenario: Scenario, stages: int, seed: int, iterations: int, simulations: int, samples: int
) -> dict[str, Any]:
    """One (scenario, P, seed): every policy's mean makespan over the iterations."""
    shape = {"stages": stages, "chunks": 1, "microbatches": 4 * stages}
    traces = generate_iterations(
        iterations=iterations, scenario=scenario.scenario, **shape, seed=seed, **scenario.params
    )
    cap = Cap.parse("1x")
    each: dict[str, list[float]] = {}  # per policy, each iteration's makespan
    for name in (*FIXED, *HINTS):
        policy = make_policy(name=name, **shape)
        each[name] = [simulate(policy=policy, trace=t, cap=cap).makespan_ms for t in traces]
    config = PlannerConfig(hints=default_hints(chunks=1), cap=cap, simulations=simulations, samples=samples, seed=seed)
    for planning in (Planning.PLANNED_FIXED, Planning.PLANNED, Planning.ORACLE):
        each[planning.value] = [
            report.makespan_ms for _, report in run(planning=planning, traces=traces, config=config)
        ]
    expected = generate_iterations(
        iterations=iterations, scenario=scenario.expected, **shape, seed=seed, **scenario.params
    )
    done = run(planning=Planning.ORACLE, traces=traces, config=config, plan_on=expected)
    each["expected"] = [report.makespan_ms for _, report in done]
    ms: dict[str, Any] = {name: statistics.fmean(values) for name, values in each.items()}
    ms["bound"] = statistics.fmean(bounds(trace=t, split=True).best_ms for t in traces)
    ms[ITERATIONS] = each
    return ms


def ratios(ms: Mapping[str, Any]) -> dict[str, float]:
    best = min(ms[name] for name in FIXED)
    out = {name: best / ms[name] for name in COLUMNS}
    out["choice"] = min(ms[name] for name in HINTS) / ms["planned"]
    return out


def summary(values: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean, lowest, highest."""
    return math.exp(statistics.fmean(math.log(v) for v in values)), min(values), max(values)


def table(rows: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]]) -> list[str]:
    """Markdown: one row per (scenario, P), a cell per column: geomean (lowest-highest) over seeds."""
    head = ["scenario", "P", "best fixed ms", *COLUMNS[:-1], "room", "planned / its best choice"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (label, stages), seeds in rows.items():
        r = [ratios(ms) for ms in seeds]
        best = statistics.fmean(min(ms[n] for n in FIXED) for ms in seeds)
        cells = []
        for name in (*COLUMNS, "choice"):
            g, low, high = summary([x[name] for x in r])
            cells.append(f"{g:.3f}x ({low:.3f}-{high:.3f})")
        lines.append(f"| {label} | {stages} | {best:.0f} | " + " | ".join(cells) + " |")
    return lines


def iteration_table(rows: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]]) -> list[str]:
    """Markdown: per (scenario, P) and column of `BY_ITERATION`, per iteration k, the geometric mean over seeds of
    the seed's best fixed schedule (by its mean over the run, as in `table`) at k over the column at k."""
    count = max(len(ms[ITERATIONS]["planned"]) for seeds in rows.values() for ms in seeds)
    head = ["scenario", "P", "column", *(f"iteration {k}" for k in range(count))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (label, stages), seeds in rows.items():
        for name in BY_ITERATION:
            cells = []
            for k in range(len(seeds[0][ITERATIONS][name])):
                per_seed = []
                for ms in seeds:
                    best = min(FIXED, key=lambda fixed: ms[fixed])
                    per_seed.append(ms[ITERATIONS][best][k] / ms[ITERATIONS][name][k])
                cells.append(f"{summary(per_seed)[0]:.3f}x")
            cells += [""] * (count - len(cells))
            lines.append(f"| {label} | {stages} | {name} | " + " | ".join(cells) + " |")
    return lines


def targets(rows: Mapping[tuple[str, int], Sequence[Mapping[str, Any]]], *, target: Mapping[int, float]) -> list[str]:
    """Markdown bullets, per P among the featured rows of `rows`: planned, expected, oracle and room over all their
    runs (geometric mean; planned's lowest run), and where some row's room (geometric mean over its seeds) is below
    `target[P]`, the same over the others; each line says whether planned reaches the target."""
    featured = {s.label for s in SCENARIOS if s.featured}
    lines = []
    for stages in dict.fromkeys(p for _, p in rows):
        judged = {label: seeds for (label, p), seeds in rows.items() if p == stages and label in featured}
        if not judged:
            continue
        room = {label: summary([ratios(ms)["bound"] for ms in seeds])[0] for label, seeds in judged.items()}
        goal = target[stages]
        reachable = [label for label in judged if room[label] >= goal]
        left = "; ".join(f"{label}, room {room[label]:.3f}x" for label in judged if room[label] < goal)
        judgements = [(list(judged), "featured rows")]
        if left:
            judgements.append((reachable, f"featured rows whose room reaches {goal:.2f}x (left out: {left})"))
        for labels, what in judgements:
            runs = [ratios(ms) for label in labels for ms in judged[label]]
            counted = f"{len(labels)} rows, {len(runs)} runs"
            if not runs:
                lines.append(f"- P={stages}, {what}: none")
                continue
            g = {name: summary([r[name] for r in runs]) for name in ("planned", "expected", "oracle", "bound")}
            verdict = "reached" if g["planned"][0] >= goal else "not reached"
            lines.append(
                f"- P={stages}, {what}, {counted}: planned {g['planned'][0]:.3f}x (lowest run "
                f"{g['planned'][1]:.3f}x), expected {g['expected'][0]:.3f}x, oracle {g['oracle'][0]:.3f}x, room "
                f"{g['bound'][0]:.3f}x; {goal:.2f}x {verdict}"
            )
    return lines
