"""The results suite's scenario table and runs, and its simulator parts (sim and buffer), for
`jobs/bench_suite.py`; jobs/benchmarks/suite_ray.py holds the parts measured on Ray and PyTorch.

Interleaved (v=2) runs the same model: its trace is the v=1 trace with every op cut into two
equal halves, one per chunk (so each stage does exactly the same work per microbatch, and
t_f is 10 ms per chunk); only its message latencies (2P-1 links, not P-1) are fresh draws
of the same scenario with the same seed.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.rows import BufferRow, SimRow
from rrfp_ray.observe.telemetry import IterationReport, OpEvent
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy, make_policy, policy_names
from rrfp_ray.schedule.actions import Kind, action_kind
from rrfp_ray.schedule.generators import SCHEDULES
from rrfp_ray.sim.bounds import bounds
from rrfp_ray.sim.simulator import DeadlockError, simulate
from rrfp_ray.sim.trace import Trace
from rrfp_ray.sim.variability import generate

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
T_F = 20.0
PARTS = ("sim", "runtime", "peers", "tp", "fidelity")
CELL_PARTS = ("runtime", "peers")  # re-measuring some of their (scenario, P) cells keeps the others
CAPS = tuple(Cap.parse(text) for text in ("1x", "2x", "inf"))
FIXED = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("1f1b-2x", 1),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("interleaved", 2),
    ("zbv", 2),
    ("dualpipev", 2),
)
READY_LISTS = (
    ("ready-1f1b", 1),
    ("ready-zb-h1", 1),
    ("ready-interleaved", 2),
    ("ready-zbv", 2),
    ("ready-dualpipev", 2),
)
READY_CAPS = tuple(Cap.parse(text) for text in ("1x", "2x"))
# cpw was designed on seeds 200-239 and reported on 0-9 (jobs/benchmarks/attribution.py CPW_SEEDS):
# the suite uses others.
SEEDS = range(1000, 1003)
QUICK_SEEDS = range(1000, 1002)
BUFFER_SCENARIO = "multimodal+comm"
BUFFER_LIMITS = (2, 4, 8, 16, 32, None)
BUFFER_CAPS = tuple(Cap.parse(text) for text in ("2x", "inf"))
DEFAULT_JSON = ROOT / "docs" / "results" / "suite.json"


@dataclass(frozen=True)
class Scenario:
    label: str
    scenario: str  # for variability.generate, '+'-joined
    params: dict[str, float] = field(default_factory=dict)

    def traces(self, *, stages: int, microbatches: int, seed: int) -> dict[int, Trace]:
        """The v=1 trace and its v=2 cut (see the module doc), by chunks."""
        shape = {"stages": stages, "microbatches": microbatches, "seed": seed}
        whole = generate(scenario=self.scenario, chunks=1, t_f=T_F, **shape, **self.params)
        fresh = generate(scenario=self.scenario, chunks=2, t_f=T_F / 2, **shape, **self.params)
        return {1: whole, 2: halved(trace=whole, comm_from=fresh)}


SCENARIOS = (
    Scenario("none", "none"),
    Scenario("lognormal-0.3", "lognormal", {"sigma": 0.3}),
    Scenario("lognormal-0.6", "lognormal", {"sigma": 0.6}),
    Scenario("straggler", "straggler", {"p": 0.05, "k": 3.0}),
    Scenario("comm", "comm", {"comm_ms": 2.0, "sigma": 1.24}),
    Scenario("imbalance", "imbalance", {"rho": 1.5}),
    Scenario("multimodal", "multimodal", {"sigma": 0.6, "frac": 0.5}),
    Scenario("multimodal+comm", "multimodal+comm", {"comm_ms": 2.0, "multimodal.sigma": 0.6, "comm.sigma": 1.24}),
)
QUICK_SCENARIOS = ("none", BUFFER_SCENARIO)


@dataclass(frozen=True)
class Run:
    """One policy at one cap; cap None for a fixed list (the list is its own cap)."""

    policy: str
    chunks: int
    cap: Cap | None

    @property
    def label(self) -> str:
        return self.policy if self.cap is None else f"{self.policy}@{self.cap}"

    def make(self, *, stages: int, microbatches: int) -> Policy:
        return make_policy(name=self.policy, stages=stages, chunks=self.chunks, microbatches=microbatches)

    @property
    def arbiter_cap(self) -> Cap:
        """The cap the arbiter gets: none (inf) for a fixed list."""
        return self.cap or Cap()


def halved(*, trace: Trace, comm_from: Trace) -> Trace:
    """`trace` (v=1) cut into two chunks per stage, each running half of every op; messages from `comm_from`."""
    if trace.chunks != 1 or comm_from.chunks != 2:
        raise ValueError(f"trace must have chunks=1 and comm_from chunks=2, got {trace.chunks} and {comm_from.chunks}")

    def half(rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(x / 2 for x in row) for row in rows) * 2  # rows vs = c*P + s: chunk 0, then chunk 1

    return Trace(
        stages=trace.stages,
        microbatches=trace.microbatches,
        chunks=2,
        F=half(trace.F),
        B=half(trace.B),
        W=half(trace.W),
        commF=comm_from.commF,
        commB=comm_from.commB,
    )


def readiness_policies() -> list[str]:
    """bf, bfw and any later rule (not a schedule, not ready-*, not a user hint) that builds at P=4, M=16."""
    known = {*SCHEDULES, "hint", "ready-hint"}
    names = [n for n in policy_names() if n not in known and not n.startswith("ready-")]
    usable = []
    for name in names:
        try:
            policy = make_policy(name=name, stages=4, chunks=1, microbatches=16)
            simulate(
                policy=policy, trace=generate(scenario="none", stages=4, microbatches=16, chunks=1, seed=0), cap=Cap()
            )
        except (ValueError, DeadlockError) as error:
            log.warning("skipping policy %s: %s", name, error)
            continue
        if not policy.fixed:
            usable.append(name)
    return usable


def sim_runs(*, rules: Sequence[str]) -> list[Run]:
    fixed = [Run(name, chunks, None) for name, chunks in FIXED]
    lists = [Run(name, chunks, cap) for name, chunks in READY_LISTS for cap in READY_CAPS]
    return fixed + [Run(r, 1, cap) for r in rules for cap in CAPS] + lists


def activation_peak(*, events: Sequence[OpEvent], chunks: int, split: bool) -> float:
    """Most activations any stage held, in microbatches of a whole stage (one chunk holds 1/v):
    from a forward's start to the end of that microbatch-chunk's last backward (W under the split)."""
    release = Kind.W if split else Kind.B
    changes: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        kind = action_kind(event.action)
        if kind is Kind.F:
            changes[event.stage].append((event.start_ms, 1 / chunks))
        elif kind is release:
            changes[event.stage].append((event.end_ms, -1 / chunks))
    peak = 0.0
    for stage_changes in changes.values():
        held = 0.0
        for _, delta in sorted(stage_changes):  # at one instant, releases sort first
            held += delta
            peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class Figures:
    """What one iteration shows; memory_x is the activation peak over fixed 1F1B's (P microbatches)."""

    makespan_ms: float
    blocked_fraction: float
    bubble: float
    peak_inflight: int
    memory_x: float


def figures(*, report: IterationReport, policy: Policy, trace: Trace) -> Figures:
    return Figures(
        makespan_ms=report.makespan_ms,
        blocked_fraction=report.blocked_fraction,
        bubble=report.bubble,
        peak_inflight=report.peak_inflight,
        memory_x=activation_peak(events=report.events, chunks=trace.chunks, split=policy.split) / trace.stages,
    )


def sim_part(
    *, scenarios: Sequence[Scenario], stages: Sequence[int], seeds: Sequence[int], rules: Sequence[str]
) -> list[dict]:
    runs = sim_runs(rules=rules)
    rows: list[SimRow] = []
    for p in stages:
        m = 4 * p
        policies = {(run.policy, run.chunks): run.make(stages=p, microbatches=m) for run in runs}
        for spec in scenarios:
            per_seed: dict[str, list[tuple[Figures, float]]] = defaultdict(list)  # run -> (figures, lb_ratio)
            for seed in seeds:
                traces = spec.traces(stages=p, microbatches=m, seed=seed)
                for run in runs:
                    policy, trace = policies[run.policy, run.chunks], traces[run.chunks]
                    report = simulate(policy=policy, trace=trace, cap=run.arbiter_cap)
                    bound = bounds(trace=trace, split=policy.split).best_ms
                    per_seed[run.label].append((figures(report=report, policy=policy, trace=trace), bound))
            base = [cell.makespan_ms for cell, _ in per_seed["1f1b"]]
            for run in runs:
                rows.append(_sim_row(spec, run, stages=p, microbatches=m, cells=per_seed[run.label], base=base))
            best = max(rows[-len(runs) :], key=lambda r: r.speedup_vs_1f1b)
            log.info(f"sim {spec.label:>16} P={p:<3} best {best.run} {best.speedup_vs_1f1b:.3f}x")
    return [asdict(row) for row in rows]


def _sim_row(
    spec: Scenario,
    run: Run,
    *,
    stages: int,
    microbatches: int,
    cells: list[tuple[Figures, float]],
    base: list[float],
) -> SimRow:
    """Means over seeds (the speedup a mean of each seed's over 1F1B's makespan `base`), each seed's makespan;
    the peaks are the maximum over seeds."""
    seen = [cell for cell, _ in cells]
    return SimRow(
        scenario=spec.label,
        stages=stages,
        microbatches=microbatches,
        run=run.label,
        policy=run.policy,
        cap=None if run.cap is None else str(run.cap),
        chunks=run.chunks,
        makespan_ms=statistics.mean(c.makespan_ms for c in seen),
        blocked_fraction=statistics.mean(c.blocked_fraction for c in seen),
        bubble=statistics.mean(c.bubble for c in seen),
        peak_inflight=max(c.peak_inflight for c in seen),
        memory_x=max(c.memory_x for c in seen),
        lb_ratio=statistics.mean(c.makespan_ms / bound for c, bound in cells),
        speedup_vs_1f1b=statistics.mean(b / c.makespan_ms for b, c in zip(base, seen)),
        seeds=len(seen),
        makespans=tuple(c.makespan_ms for c in seen),
    )


def where(spec: Scenario, run: Run, *, stages: int, microbatches: int) -> dict[str, Any]:
    """The keys of a Ray part's row: which scenario, shape and run it measured."""
    return {
        "scenario": spec.label,
        "stages": stages,
        "microbatches": microbatches,
        "run": run.label,
        "policy": run.policy,
        "cap": None if run.cap is None else str(run.cap),
        "chunks": run.chunks,
    }


def buffer_part(*, spec: Scenario, stages: Sequence[int], seeds: Sequence[int]) -> list[dict]:
    """bf's makespan at each receive-buffer limit over the unbounded one; deadlocks counted."""
    rows: list[BufferRow] = []
    for p in stages:
        m = 4 * p
        policy = make_policy(name="bf", stages=p, chunks=1, microbatches=m)
        for cap in BUFFER_CAPS:
            ratios: dict[int | None, list[float]] = defaultdict(list)
            deadlocks: dict[int | None, int] = defaultdict(int)
            buffered = 0
            for seed in seeds:
                trace = spec.traces(stages=p, microbatches=m, seed=seed)[1]
                free = simulate(policy=policy, trace=trace, cap=cap)
                buffered = max(buffered, max(s.peak_buffered for s in free.stages))
                for limit in BUFFER_LIMITS:
                    try:
                        ms = simulate(policy=policy, trace=trace, cap=cap, buffer_limit=limit).makespan_ms
                    except DeadlockError:
                        deadlocks[limit] += 1
                        continue
                    ratios[limit].append(ms / free.makespan_ms)
            for limit in BUFFER_LIMITS:
                rows.append(
                    BufferRow(
                        scenario=spec.label,
                        stages=p,
                        microbatches=m,
                        policy="bf",
                        cap=str(cap),
                        buffer_limit=limit,
                        makespan_rel=statistics.mean(ratios[limit]) if ratios[limit] else None,
                        makespan_rel_max=max(ratios[limit]) if ratios[limit] else None,
                        deadlocks=deadlocks[limit],
                        seeds=len(seeds),
                        unbounded_peak_buffered=buffered,
                    )
                )
            log.info(f"buffer P={p} cap {cap}: " + ", ".join(_buffer_cell(r) for r in rows[-len(BUFFER_LIMITS) :]))
    return [asdict(row) for row in rows]


def _buffer_cell(row: BufferRow) -> str:
    limit = "inf" if row.buffer_limit is None else row.buffer_limit
    rel = "deadlock" if row.makespan_rel is None else f"{row.makespan_rel:.3f}"
    return f"{limit}: {rel}"


def runtime_runs(*, rules: Sequence[str]) -> list[Run]:
    """On Ray: the fixed baselines at 1x and 2x memory, v=2 interleaved, the rules at caps 1x and 2x,
    and on the V placement zbv against ready-zbv at both caps."""
    fixed = [Run(name, 1, None) for name in ("1f1b", "1f1b-2x", "zb-h1", "zb-h2")] + [Run("interleaved", 2, None)]
    v_placed = [Run("zbv", 2, None)] + [Run("ready-zbv", 2, cap) for cap in READY_CAPS]
    return fixed + [Run(r, 1, cap) for r in rules for cap in READY_CAPS] + v_placed


def timed(*, part: str, make: Callable[[], Any], command: str) -> dict[str, Any]:
    """Run one part; its section carries the command, how long it took, how loaded the machine
    was and the code it ran (`code_version`), also as the first entry of its `log` of runs."""
    start, load = time.perf_counter(), os.getloadavg()[0]
    result = make()
    section = result if isinstance(result, dict) else {"rows": result}
    section.update(
        command=command,
        finished=time.strftime("%Y-%m-%d %H:%M:%S"),
        wall_s=time.perf_counter() - start,
        load_avg_1min=[load, os.getloadavg()[0]],
        commit=code_version(),
    )
    section["log"] = [{k: section[k] for k in ("command", "finished", "wall_s", "load_avg_1min", "commit")}]
    log.info(f"{part}: {section['wall_s']:.0f} s")
    return section


def merge_cells(*, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`new`'s rows and errors, with `old`'s rows (and errors and runs, if any of them stay) of the
    (scenario, P) cells `new` did not measure: a part measured over several invocations."""
    measured = {(row["scenario"], row["stages"]) for row in new["rows"]}
    kept = [row for row in (old or {}).get("rows", []) if (row["scenario"], row["stages"]) not in measured]
    if not kept:
        return new
    merged = {**new, "rows": kept + new["rows"], "log": old.get("log", []) + new["log"]}
    merged["errors"] = old.get("errors", []) + new.get("errors", [])
    merged["wall_s"] = sum(run["wall_s"] for run in merged["log"])
    return merged


def kept_cells_mismatch(
    *, data: dict[str, Any], cells: set[tuple[str, int]], seeds: Sequence[int], iterations: int
) -> str | None:
    """Why the cells of `data`'s measured parts that a run of `cells` keeps (`merge_cells`) do not
    match its --seeds and --iterations (None: they do, or it keeps none)."""
    wanted = {"seeds": list(seeds), "iterations": iterations}
    for part in CELL_PARTS:
        section = data.get(part) or {}
        if not {(row["scenario"], row["stages"]) for row in section.get("rows", [])} - cells:
            continue
        differs = {k: section[k] for k, v in wanted.items() if k in section and section[k] != v}
        if differs:
            return (
                f"its {part} cells were measured with {differs}; re-measure them with the same --seeds and --iterations"
            )
    return None


def code_version(*, root: Path = ROOT) -> str:
    """The commit of this checkout, `+changes` if tracked files outside docs/ (where the suite's own
    outputs live) differ from it ("unknown" without git)."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        changes = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.stdout.strip() + ("+changes" if changes.stdout.strip() else "")


def meta(
    *, quick: bool, scenarios: Sequence[Scenario], rules: Sequence[str], stages: Sequence[int], seeds: Sequence[int]
) -> dict[str, Any]:
    """The JSON's meta section: the suite's shape, scenarios and machine."""
    return {
        "quick": quick,
        "t_f_ms": T_F,
        "b_ratio": 2.0,
        "w_split": 0.5,
        "scenarios": [{"label": s.label, "scenario": s.scenario, "params": s.params} for s in scenarios],
        "readiness_policies": list(rules),
        "sim_stages": list(stages),
        "sim_seeds": list(seeds),
        "caps": [str(cap) for cap in CAPS],
        "buffer_limits": list(BUFFER_LIMITS),
        "machine": f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs",
    }
