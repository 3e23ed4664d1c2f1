"""The results suite: every scenario x schedule x in-flight cap, in the simulator, on the Ray
runtime and against PyTorch's own schedules, into one JSON that `jobs/results.py` renders.

    python jobs/bench_suite.py                      # all four parts -> docs/results/suite.json
    python jobs/bench_suite.py --parts peers        # re-measure one part, keep the others' sections
    python jobs/bench_suite.py --quick --json OUT   # simulator only: P=4, one seed, two scenarios

1. sim: P in 8, 16, 32, M = 4P, seeds 0..2 (means): fixed gpipe, 1f1b, interleaved (v=2),
   zb-h1, and the readiness policies (bf, bfw and any further rule `policy_names()` lists) at
   caps 1x, 2x and inf; makespan, speedup over fixed 1f1b, makespan / lower bound, blocked
   fraction, peak in-flight and peak activation memory. Then bf's receive-buffer limit
   swept on multimodal+comm.
2. runtime: the Ray runtime at P=4, M=16 (synthetic sleep workload, seed 0) on every scenario:
   1f1b, zb-h1, interleaved, and the readiness policies at 1x, 2x and inf; a warm-up and
   then --iterations timed iterations per policy, the policies taking turns; the median, and
   the simulator's prediction for the very same trace and cap.
3. peers: PyTorch's Schedule1F1B, ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble
   (benchmarks/peers/torch_pipelining.py) on the same P=4 traces.
4. tp: the Ray runtime at PP=2 x TP=2, M=8 on lognormal-0.3, comm and multimodal+comm: 1f1b,
   bf@2x and bfw@2x under each TP agreement protocol (first, common) and without TP (tp1),
   one driver each, a warm-up and then --iterations timed iterations per run; the median, and
   what the agreement cost (rank 0 of each stage). On lognormal-0.3 both TP ranks replay the
   seed-0 trace; on the comm scenarios rank t's messages take the latencies drawn with seed t.

Interleaved (v=2) runs the same model: its trace is the v=1 trace with every op cut into two
equal halves, one per chunk (so each stage does exactly the same work per microbatch, and
t_f is 10 ms per chunk); only its message latencies (2P-1 links, not P-1) are fresh draws
of the same scenario with the same seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rrfp_ray.observe.telemetry import IterationReport, OpEvent, tp_summary  # noqa: E402
from rrfp_ray.policy.arbiter import Cap  # noqa: E402
from rrfp_ray.policy.pickers import Policy, make_policy, policy_names  # noqa: E402
from rrfp_ray.schedule.actions import Kind, parse_action  # noqa: E402
from rrfp_ray.schedule.generators import SCHEDULES  # noqa: E402
from rrfp_ray.sim.simulator import DeadlockError, bounds, simulate  # noqa: E402
from rrfp_ray.sim.variability import Trace, generate  # noqa: E402

T_F = 20.0
PARTS = ("sim", "runtime", "peers", "tp")
CAPS = ("1x", "2x", "inf")
FIXED = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
PEER_GROUPS = ((("1f1b", "zb-h1"), 1), (("interleaved",), 2))
BUFFER_SCENARIO = "multimodal+comm"
BUFFER_LIMITS = (2, 4, 8, 16, 32, None)
BUFFER_CAPS = ("2x", "inf")
DEFAULT_JSON = ROOT / "docs" / "results" / "suite.json"
TP = 2
TP_SCENARIOS = ("lognormal-0.3", "comm", "multimodal+comm")
TP_RANK_COMM = ("comm", "multimodal+comm")  # each TP rank's messages take their own latencies
TP_PROTOCOLS = ("first", "common")


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
    cap: str | None

    @property
    def label(self) -> str:
        return self.policy if self.cap is None else f"{self.policy}@{self.cap}"

    def make(self, *, stages: int, microbatches: int) -> Policy:
        return make_policy(name=self.policy, stages=stages, chunks=self.chunks, microbatches=microbatches)

    @property
    def parsed_cap(self) -> Cap:
        return Cap.parse(self.cap or "inf")


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
            print(f"skipping policy {name}: {error}", file=sys.stderr)
            continue
        if not policy.fixed:
            usable.append(name)
    return usable


def sim_runs(*, rules: Sequence[str]) -> list[Run]:
    return [Run(name, chunks, None) for name, chunks in FIXED] + [Run(r, 1, cap) for r in rules for cap in CAPS]


def activation_peak(*, events: Sequence[OpEvent], chunks: int, split: bool) -> float:
    """Most activations any stage held, in microbatches of a whole stage (one chunk holds 1/v):
    from a forward's start to the end of that microbatch-chunk's last backward (W under the split)."""
    release = Kind.W if split else Kind.B
    changes: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        kind = parse_action(event.action).kind
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


def figures(*, report: IterationReport, policy: Policy, trace: Trace) -> dict[str, float]:
    """What one iteration shows; memory_x is the activation peak over fixed 1F1B's (P microbatches)."""
    return {
        "makespan_ms": report.makespan_ms,
        "blocked_fraction": report.blocked_fraction,
        "bubble": report.bubble,
        "peak_inflight": report.peak_inflight,
        "memory_x": activation_peak(events=report.events, chunks=trace.chunks, split=policy.split) / trace.stages,
    }


def sim_part(*, scenarios: Sequence[Scenario], stages: Sequence[int], seeds: int, rules: Sequence[str]) -> list[dict]:
    runs = sim_runs(rules=rules)
    rows = []
    for spec in scenarios:
        for p in stages:
            m = 4 * p
            per_seed: dict[str, list[dict[str, float]]] = defaultdict(list)
            for seed in range(seeds):
                traces = spec.traces(stages=p, microbatches=m, seed=seed)
                for run in runs:
                    policy, trace = run.make(stages=p, microbatches=m), traces[run.chunks]
                    report = simulate(policy=policy, trace=trace, cap=run.parsed_cap)
                    cell = figures(report=report, policy=policy, trace=trace)
                    cell["lb_ratio"] = report.makespan_ms / bounds(trace=trace, split=policy.split).best_ms
                    per_seed[run.label].append(cell)
                base = per_seed["1f1b"][-1]["makespan_ms"]
                for cells in per_seed.values():
                    cells[-1]["speedup_vs_1f1b"] = base / cells[-1]["makespan_ms"]
            for run in runs:
                rows.append({**_where(spec, run, stages=p, microbatches=m), **_mean(per_seed[run.label])})
            best = max((r for r in rows[-len(runs) :]), key=lambda r: r["speedup_vs_1f1b"])
            print(f"sim {spec.label:>16} P={p:<3} best {best['run']} {best['speedup_vs_1f1b']:.3f}x", flush=True)
    return rows


def _where(spec: Scenario, run: Run, *, stages: int, microbatches: int) -> dict[str, Any]:
    return {
        "scenario": spec.label,
        "stages": stages,
        "microbatches": microbatches,
        "run": run.label,
        "policy": run.policy,
        "cap": run.cap,
        "chunks": run.chunks,
    }


def _mean(cells: list[dict[str, float]]) -> dict[str, float]:
    """Means over seeds; the peaks are the maximum over seeds."""
    out = {key: statistics.mean(c[key] for c in cells) for key in cells[0]}
    for key in ("peak_inflight", "memory_x"):
        out[key] = max(c[key] for c in cells)
    out["seeds"] = len(cells)
    return out


def buffer_part(*, spec: Scenario, stages: Sequence[int], seeds: int) -> list[dict]:
    """bf's makespan at each receive-buffer limit over the unbounded one; deadlocks counted."""
    rows = []
    for p in stages:
        m = 4 * p
        policy = make_policy(name="bf", stages=p, chunks=1, microbatches=m)
        for cap in BUFFER_CAPS:
            ratios: dict[int | None, list[float]] = defaultdict(list)
            deadlocks: dict[int | None, int] = defaultdict(int)
            buffered = 0
            for seed in range(seeds):
                trace = spec.traces(stages=p, microbatches=m, seed=seed)[1]
                free = simulate(policy=policy, trace=trace, cap=Cap.parse(cap))
                buffered = max(buffered, max(s.peak_buffered for s in free.stages))
                for limit in BUFFER_LIMITS:
                    try:
                        ms = simulate(policy=policy, trace=trace, cap=Cap.parse(cap), buffer_limit=limit).makespan_ms
                    except DeadlockError:
                        deadlocks[limit] += 1
                        continue
                    ratios[limit].append(ms / free.makespan_ms)
            for limit in BUFFER_LIMITS:
                rows.append(
                    {
                        "scenario": spec.label,
                        "stages": p,
                        "microbatches": m,
                        "policy": "bf",
                        "cap": cap,
                        "buffer_limit": limit,
                        "makespan_rel": statistics.mean(ratios[limit]) if ratios[limit] else None,
                        "makespan_rel_max": max(ratios[limit]) if ratios[limit] else None,
                        "deadlocks": deadlocks[limit],
                        "seeds": seeds,
                        "unbounded_peak_buffered": buffered,
                    }
                )
            print(f"buffer P={p} cap {cap}: " + ", ".join(_buffer_cell(r) for r in rows[-len(BUFFER_LIMITS) :]))
    return rows


def _buffer_cell(row: dict) -> str:
    limit = "inf" if row["buffer_limit"] is None else row["buffer_limit"]
    rel = "deadlock" if row["makespan_rel"] is None else f"{row['makespan_rel']:.3f}"
    return f"{limit}: {rel}"


def runtime_runs(*, rules: Sequence[str]) -> list[Run]:
    fixed = [Run("1f1b", 1, None), Run("zb-h1", 1, None), Run("interleaved", 2, None)]
    return fixed + [Run(r, 1, cap) for r in rules for cap in CAPS]


@dataclass
class RayPart:
    """A part measured on Ray: per driver and scenario a warm-up and then timed iterations of every
    run; what its drivers measured stays when one of them fails."""

    warmup: int
    iterations: int
    rows: list[dict] = field(default_factory=list)
    startup_s: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    counter: Iterator[int] = field(default_factory=itertools.count)  # numbers the iterations of all its drivers

    def drive(
        self, *, name: str, pipeline: Any, group: Sequence[Run], workloads: Sequence[tuple[Scenario, Any]]
    ) -> Iterator[tuple[Scenario, dict[str, list]]]:
        """One driver for `pipeline` over the scenarios, each with its workload, the runs taking
        turns; yields each scenario's timed reports by run. A failure ends it, in `errors`."""
        import ray

        from actors.driver import PipelineDriver

        driver = PipelineDriver.remote(pipeline=pipeline, workload=workloads[0][1])
        try:
            self.startup_s[name] = ray.get(driver.startup_seconds.remote())
            for spec, workload in workloads:
                ray.get(driver.set_workload.remote(workload=workload))
                rounds = self.warmup + self.iterations
                reports = _turns(driver=driver, group=group, pipeline=pipeline, counter=self.counter, rounds=rounds)
                yield spec, {label: runs[self.warmup :] for label, runs in reports.items()}
            ray.get(driver.shutdown.remote())
        except Exception as error:  # keep what was measured; the report says what failed
            self.errors.append(f"{name}: {type(error).__name__}: {error}")
            print(f"driver {name} failed: {error}", file=sys.stderr, flush=True)
        finally:
            ray.kill(driver)

    def section(self) -> dict[str, Any]:
        return {"rows": self.rows, "startup_s": self.startup_s, "errors": self.errors}


def runtime_part(
    *, scenarios: Sequence[Scenario], runs: Sequence[Run], stages: int, microbatches: int, warmup: int, iterations: int
) -> dict[str, Any]:
    """Per scenario and run: measured iteration times on Ray, and the simulator's for the same trace."""
    import ray

    from actors.local_ray import start_ray
    from rrfp_ray.runtime.synthetic import SyntheticWorkload
    from rrfp_ray.train.config import PipelineConfig

    print(start_ray(num_cpus=max(2, stages)), flush=True)
    traces = {spec.label: spec.traces(stages=stages, microbatches=microbatches, seed=0) for spec in scenarios}
    part = RayPart(warmup=warmup, iterations=iterations)
    try:
        for chunks in sorted({run.chunks for run in runs}):
            group = [run for run in runs if run.chunks == chunks]
            pipeline = PipelineConfig(
                stages=stages, chunks=chunks, microbatches=microbatches, policy=group[0].policy, timeout_s=120.0
            )
            workloads = [(spec, SyntheticWorkload(trace=traces[spec.label][chunks])) for spec in scenarios]
            for spec, reports in part.drive(name=f"v={chunks}", pipeline=pipeline, group=group, workloads=workloads):
                trace = traces[spec.label][chunks]
                for run in group:
                    policy = pipeline.resolved_policy(run.policy)
                    predicted = simulate(
                        policy=policy, trace=trace, cap=run.parsed_cap, buffer_limit=pipeline.buffer_limit
                    )
                    cells = [figures(report=r, policy=policy, trace=trace) for r in reports[run.label]]
                    row = {
                        **_where(spec, run, stages=stages, microbatches=microbatches),
                        "runs_ms": [c["makespan_ms"] for c in cells],
                        "measured_ms": statistics.median(c["makespan_ms"] for c in cells),
                        "sim_ms": predicted.makespan_ms,
                        "blocked_fraction": statistics.median(c["blocked_fraction"] for c in cells),
                        "peak_inflight": max(c["peak_inflight"] for c in cells),
                        "memory_x": max(c["memory_x"] for c in cells),
                    }
                    part.rows.append(row)
                    print(
                        f"runtime {spec.label:>16} {run.label:<12} {row['measured_ms']:8.1f} ms "
                        f"(sim {row['sim_ms']:8.1f}, memory {row['memory_x']:.2f}x)",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    return part.section()


TP_RUNS = (Run("1f1b", 1, None), Run("bf", 1, "2x"), Run("bfw", 1, "2x"))


def tp_workload(*, spec: Scenario, tp: int, stages: int, microbatches: int) -> Any:
    """Every rank computes the seed-0 trace; under TP on the comm scenarios rank t's messages
    take the latencies of the trace drawn with seed t (rank 0's are the seed-0 trace's)."""
    from rrfp_ray.runtime.synthetic import SyntheticWorkload

    traces = tuple(spec.traces(stages=stages, microbatches=microbatches, seed=t)[1] for t in range(tp))
    return SyntheticWorkload(trace=traces[0], rank_comm=traces if tp > 1 and spec.label in TP_RANK_COMM else ())


def tp_figures(*, reports: Sequence[IterationReport]) -> dict[str, Any]:
    """What the timed iterations of one run show (`tp_summary`: rank 0 of each stage), and ops per
    iteration over the stages."""
    return {
        "runs_ms": [r.makespan_ms for r in reports],
        "measured_ms": statistics.median(r.makespan_ms for r in reports),
        **tp_summary(list(reports)),
        "ops": len(reports[0].events),
    }


def tp_part(
    *, scenarios: Sequence[Scenario], stages: int, microbatches: int, warmup: int, iterations: int
) -> dict[str, Any]:
    """Per scenario, run and TP agreement protocol: measured iteration times on Ray and what the
    agreement cost; protocol tp1 is the same pipeline without TP, the baseline of vs_tp1."""
    import ray

    from actors.local_ray import start_ray
    from rrfp_ray.train.config import PipelineConfig

    print(start_ray(num_cpus=stages * TP), flush=True)
    part = RayPart(warmup=warmup, iterations=iterations)
    try:
        for protocol in ("tp1", *TP_PROTOCOLS):
            tp, agreement = (1, {}) if protocol == "tp1" else (TP, {"tp_protocol": protocol})
            pipeline = PipelineConfig(
                stages=stages, microbatches=microbatches, policy=TP_RUNS[0].policy, timeout_s=120.0, tp=tp, **agreement
            )
            shape = {"tp": tp, "stages": stages, "microbatches": microbatches}
            workloads = [(spec, tp_workload(spec=spec, **shape)) for spec in scenarios]
            for spec, reports in part.drive(name=protocol, pipeline=pipeline, group=TP_RUNS, workloads=workloads):
                for run in TP_RUNS:
                    row = {
                        **_where(spec, run, stages=stages, microbatches=microbatches),
                        "tp": tp,
                        "protocol": protocol,
                        **tp_figures(reports=reports[run.label]),
                    }
                    part.rows.append(row)
                    print(
                        f"tp {spec.label:>16} {run.label:<7} {protocol:<6} {row['measured_ms']:8.1f} ms, coordination "
                        f"{row['tp_coord_fraction']:.2%} over {row['tp_rounds']:.0f} rounds "
                        f"({row['tp_ms_per_round']:.3f} ms each)",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    baseline = {(r["scenario"], r["run"]): r["measured_ms"] for r in part.rows if r["protocol"] == "tp1"}
    for row in part.rows:
        tp1_ms = baseline.get((row["scenario"], row["run"]))
        row["vs_tp1"] = row["measured_ms"] / tp1_ms if tp1_ms else None
    return part.section()


def _turns(*, driver: Any, group: Sequence[Run], pipeline: Any, counter: Any, rounds: int) -> dict[str, list]:
    """`rounds` iterations of every run, the runs taking turns so that drift hits all of them alike."""
    import ray

    policies = {run.label: pipeline.resolved_policy(run.policy) for run in group}
    reports: dict[str, list] = {run.label: [] for run in group}
    for _ in range(rounds):
        for run in group:
            ref = driver.run_iteration.remote(iteration=next(counter), policy=policies[run.label], cap=run.parsed_cap)
            reports[run.label].append(ray.get(ref))
    return reports


def peers_part(*, scenarios: Sequence[Scenario], stages: int, microbatches: int, warmup: int, iterations: int) -> dict:
    from benchmarks.peers.torch_pipelining import measure_all

    rows, errors = [], []
    keep = ("pytorch_class", "runs_ms", "measured_ms", "ideal_ms", "ratio", "order_matches")
    for spec in scenarios:
        traces = spec.traces(stages=stages, microbatches=microbatches, seed=0)
        for schedules, chunks in PEER_GROUPS:
            try:
                results = measure_all(
                    schedules=list(schedules), trace=traces[chunks], iterations=iterations, warmup=warmup
                )
            except Exception as error:  # keep what was measured; the report says what failed
                errors.append(f"{spec.label} {','.join(schedules)}: {type(error).__name__}: {error}")
                print(f"peers {spec.label} {schedules} failed: {error}", file=sys.stderr, flush=True)
                continue
            for name, r in results.items():
                rows.append({"scenario": spec.label, "schedule": name, "chunks": chunks, **{k: r[k] for k in keep}})
                print(f"peers {spec.label:>16} {name:<12} {r['measured_ms']:8.1f} ms (ideal {r['ideal_ms']:8.1f})")
    return {"rows": rows, "errors": errors}


def timed(part: str, make: Callable[[], Any]) -> dict[str, Any]:
    """Run one part; its section carries the command, how long it took and how loaded the machine was."""
    start, load = time.perf_counter(), os.getloadavg()[0]
    result = make()
    section = result if isinstance(result, dict) else {"rows": result}
    section.update(
        command=shlex.join(["python", "jobs/bench_suite.py", *sys.argv[1:]]),
        finished=time.strftime("%Y-%m-%d %H:%M:%S"),
        wall_s=time.perf_counter() - start,
        load_avg_1min=[load, os.getloadavg()[0]],
    )
    print(f"{part}: {section['wall_s']:.0f} s", flush=True)
    return section


def meta(
    *, quick: bool, scenarios: Sequence[Scenario], rules: Sequence[str], stages: Sequence[int], seeds: int
) -> dict:
    return {
        "quick": quick,
        "t_f_ms": T_F,
        "b_ratio": 2.0,
        "w_split": 0.5,
        "scenarios": [{"label": s.label, "scenario": s.scenario, "params": s.params} for s in scenarios],
        "readiness_policies": list(rules),
        "sim_stages": list(stages),
        "sim_seeds": seeds,
        "caps": list(CAPS),
        "buffer_limits": list(BUFFER_LIMITS),
        "machine": f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs",
    }


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="simulator only, P=4, one seed, none and multimodal+comm")
    parser.add_argument("--json", default=str(DEFAULT_JSON), metavar="OUT", help=f"output (default {DEFAULT_JSON})")
    parser.add_argument(
        "--parts", help=f"comma-separated from {', '.join(PARTS)} (default all); other parts' sections in OUT are kept"
    )
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations on Ray and PyTorch (default 3)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in (args.parts or ",".join(PARTS)).split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"argument --parts: unknown {unknown or 'empty'}; choose from {', '.join(PARTS)}")
    if args.quick and args.parts is not None and parts != ["sim"]:
        parser.error("argument --parts: --quick runs the simulator part only")
    if args.iterations < 1:
        parser.error(f"argument --iterations: must be >= 1, got {args.iterations}")
    if Path(args.json) == DEFAULT_JSON:
        DEFAULT_JSON.parent.mkdir(parents=True, exist_ok=True)
    elif not Path(args.json).resolve().parent.is_dir():
        parser.error(f"argument --json: no directory {Path(args.json).resolve().parent}")
    args.parts = ["sim"] if args.quick else parts
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    started = time.perf_counter()
    out = Path(args.json)
    scenarios = [s for s in SCENARIOS if s.label in QUICK_SCENARIOS] if args.quick else list(SCENARIOS)
    stages, seeds = ((4,), 1) if args.quick else ((8, 16, 32), 3)
    rules = readiness_policies()
    keep = not args.quick and set(args.parts) != set(PARTS) and out.exists()
    data = json.loads(out.read_text()) if keep else {}
    data["meta"] = meta(quick=args.quick, scenarios=scenarios, rules=rules, stages=stages, seeds=seeds)
    shape = {"stages": 4, "microbatches": 16, "warmup": 1, "iterations": args.iterations}
    if "sim" in args.parts:
        data["sim"] = timed("sim", lambda: sim_part(scenarios=scenarios, stages=stages, seeds=seeds, rules=rules))
        buffer_spec = next(s for s in scenarios if s.label == BUFFER_SCENARIO)
        buffer_stages = (4,) if args.quick else (8, 16)
        data["buffer"] = timed("buffer", lambda: buffer_part(spec=buffer_spec, stages=buffer_stages, seeds=seeds))
    if "runtime" in args.parts:
        runs = runtime_runs(rules=rules)
        data["runtime"] = timed("runtime", lambda: runtime_part(scenarios=scenarios, runs=runs, **shape))
        data["runtime"].update(stages=4, microbatches=16, warmup=1, iterations=args.iterations)
    if "peers" in args.parts:
        data["peers"] = timed("peers", lambda: peers_part(scenarios=scenarios, **shape))
        data["peers"].update(stages=4, microbatches=16, warmup=1, iterations=args.iterations)
    if "tp" in args.parts:
        tp_shape = {"stages": 2, "microbatches": 8, "warmup": 1, "iterations": args.iterations}
        tp_scenarios = [s for s in SCENARIOS if s.label in TP_SCENARIOS]
        data["tp"] = timed("tp", lambda: tp_part(scenarios=tp_scenarios, **tp_shape))
        data["tp"].update(tp=TP, **tp_shape)
    data["meta"]["wall_s"] = time.perf_counter() - started
    data["meta"]["parts_run"] = args.parts
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out} in {data['meta']['wall_s']:.0f} s", flush=True)
    return data


if __name__ == "__main__":
    main()
