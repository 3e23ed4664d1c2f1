"""`planned` on Ray beside fixed schedules (`jobs/bench_runtime.py --policies ...,planned`).

Per seed, a generated run of iterations (`generate_iterations`: what each microbatch's data shows, its
features, beside its durations) is replayed by the stage actors: iteration k sleeps its own trace, each
slot its data microbatch's durations. Every policy runs the iterations one after another on the one
pipeline (the seeds rotate which goes first); `planned` plans iteration k+1 on this process's planning
thread while the actors run k (`rrfp_ray.plan.ahead.Lookahead`, as the `Trainer` does), and what each
iteration waited for its plan is recorded. A policy's figure for a seed is its mean iteration over the
iterations after the first (the first of each policy is a warm-up, and `planned`'s is planned from the
features alone before it runs). The stages replay a full backward as the trace's I + W, as the simulator does,
so `planned` has no backward to learn by running it (`PlannerConfig.learn_backwards` off). Where a trace
carries activation bytes, every policy but a fixed one gates its
admissions on them (`planned`: its cap over its reference list on the data in its own order, as
`rrfp_ray.plan.loop` simulates it).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.ahead import Lookahead, Seen, seen
from rrfp_ray.plan.planner import Planner, PlannerConfig, default_hints
from rrfp_ray.plan.scoring import planned_limits
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.sim.memory import DataBytes, weights
from rrfp_ray.sim.trace import Trace, of_iteration
from rrfp_ray.train.config import PLANNED, PipelineConfig

Run = dict[str, Any]


def run(
    *,
    driver,
    pipeline: PipelineConfig,
    names: Sequence[str],
    seeds: Sequence[int],
    traces_for: Callable[[int], tuple[Trace, ...]],
    workload_for: Callable[[tuple[Trace, ...]], SyntheticWorkload],
) -> list[dict[str, Run]]:
    """Per seed, per policy: `iteration_ms` (every iteration), and for `planned` `plan_wait_ms` and
    `planning_ms` per iteration. `traces_for(seed)`: the seed's run of iterations; `workload_for(traces)`:
    what the stage actors replay for them."""
    import ray

    results = []
    base = 0  # iteration numbers grow over the whole benchmark; iteration i replays trace i % len(traces)
    for turn, seed in enumerate(seeds):
        traces = traces_for(seed)
        ray.get(driver.set_workload.remote(workload=workload_for(traces)))
        first = turn % len(names)
        by_policy: dict[str, Run] = {}
        for name in (*names[first:], *names[:first]):
            if name == PLANNED:
                by_policy[name] = _planned(driver=driver, pipeline=pipeline, traces=traces, base=base, seed=seed)
            else:
                policy = pipeline.resolved_policy(name)
                reports = [
                    ray.get(
                        driver.run_iteration.remote(
                            iteration=base + k,
                            policy=policy,
                            cap=pipeline.cap,
                            data_bytes=None if policy.fixed else trace_bytes(trace),
                        )
                    )
                    for k, trace in enumerate(traces)
                ]
                by_policy[name] = {"iteration_ms": [r.makespan_ms for r in reports]}
            base += len(traces)
        results.append({name: by_policy[name] for name in names})
    return results


def trace_bytes(trace: Trace) -> DataBytes | None:
    """The bytes a trace's microbatches hold, as the stages' arbiters gate by them (None: the trace has none)."""
    return None if trace.activation_bytes is None else DataBytes(rows=trace.activation_bytes)


def _planned(*, driver, pipeline: PipelineConfig, traces: tuple[Trace, ...], base: int, seed: int) -> Run:
    """The run's iterations planned ahead: iteration k+1's plan made while k runs, from k+1's features and
    the telemetry of iterations <= k-1."""
    import ray

    shape = {"stages": pipeline.stages, "chunks": pipeline.chunks, "microbatches": pipeline.microbatches}
    config = PlannerConfig(
        hints=default_hints(chunks=pipeline.chunks),
        cap=pipeline.cap,
        simulations=pipeline.plan_simulations,
        samples=pipeline.plan_samples,
        seed=seed,
        learn_backwards=False,  # a replayed full backward sleeps the trace's I + W, as a simulated one costs
    )

    def shows(iteration: int) -> Seen | None:
        features = of_iteration(traces, iteration).features
        return None if features is None else seen(features, replicas=1, microbatches=pipeline.microbatches)

    lookahead = Lookahead(planner=Planner(config=config, **shape), shows=shows, timeout_s=pipeline.timeout_s)
    reports: list[IterationReport] = []
    waits, planning = [], []
    try:
        for k in range(len(traces)):
            taken = lookahead.take(iteration=base + k)
            policy = taken.plan.validate(**shape)
            if k + 1 < len(traces):
                lookahead.ask(iteration=base + k + 1)
            trace = traces[k]
            gate = None
            if not policy.fixed:
                limits = planned_limits(cap=taken.plan.cap, trace=trace, split=policy.split)
                gate = DataBytes(rows=tuple(map(tuple, weights(trace))), limits=limits)
            report = ray.get(
                driver.run_iteration.remote(
                    iteration=base + k,
                    policy=policy,
                    cap=taken.plan.cap,
                    order=tuple(taken.plan.order),
                    data_bytes=gate,
                )
            )
            lookahead.observe(report=report, taken=taken)
            reports.append(report)
            waits.append(taken.wait_s * 1e3)
            planning.append(taken.planning_s * 1e3)
    finally:
        lookahead.close()
    return {
        "iteration_ms": [r.makespan_ms for r in reports],
        "plan_wait_ms": waits,
        "planning_ms": planning,
        "hints": [r.policy for r in reports],
    }


def planned_refusal(args, *, pipeline: PipelineConfig, names: Sequence[str]) -> str | None:
    """Why `--policies ... planned` cannot run as asked (None: it can): it replays generated iterations on
    one pipeline of one replica (the run's baseline, fixed 1F1B, is always among --policies)."""
    if args.trace or args.tp > 1 or pipeline.dp > 1 or pipeline.balance.rebalance:
        return (
            f"--policies {','.join(names)}: {PLANNED} on Ray replays a generated run of iterations on one pipeline "
            "(a --scenario, --tp 1, --dp 1, no --rebalance, no --trace)"
        )
    if args.seeds < 1:
        return f"--seeds must be >= 1, got {args.seeds}"
    return None


def mean_after_first(values: Sequence[float]) -> float:
    return statistics.fmean(values[1:] if len(values) > 1 else values)


def geomean(values: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean, lowest, highest."""
    return math.exp(statistics.fmean(math.log(v) for v in values)), min(values), max(values)


def summarize(results: list[dict[str, Run]], *, fixed: Sequence[str]) -> dict[str, Any]:
    """Per policy the mean iteration per seed; `planned` over the best fixed schedule per seed (its
    geometric mean, lowest and highest), and the plan wait: over the iterations after the first, the
    median wait and the summed wait over the summed iterations; the first plan's wait apart."""
    per_seed = [{name: mean_after_first(run["iteration_ms"]) for name, run in seed.items()} for seed in results]
    ratios = [min(ms[name] for name in fixed) / ms[PLANNED] for ms in per_seed]
    best = [min(fixed, key=lambda name, ms=ms: ms[name]) for ms in per_seed]
    waits = [w for seed in results for w in seed[PLANNED]["plan_wait_ms"][1:]]
    ran = [ms for seed in results for ms in seed[PLANNED]["iteration_ms"][1:]]
    made = [p for seed in results for p in seed[PLANNED]["planning_ms"][1:] if not math.isnan(p)]
    mean, low, high = geomean(ratios)
    return {
        "iteration_ms_per_seed": per_seed,
        "best_fixed_per_seed": best,
        "planned_over_best_fixed": {"geomean": mean, "lowest": low, "highest": high, "per_seed": ratios},
        "plan_wait_ms_median": statistics.median(waits) if waits else 0.0,
        "plan_wait_fraction": sum(waits) / sum(ran) if ran else 0.0,
        "first_plan_wait_ms": [seed[PLANNED]["plan_wait_ms"][0] for seed in results],
        "planning_ms_median": statistics.median(made) if made else math.nan,
        "late_plans": sum(math.isnan(p) for seed in results for p in seed[PLANNED]["planning_ms"][1:]),
    }


def lines(summary: dict[str, Any], *, names: Sequence[str], fixed: Sequence[str]) -> list[str]:
    per_seed = summary["iteration_ms_per_seed"]
    out = ["mean iteration ms per seed (iterations after the first): " + ", ".join(names)]
    out += [
        f"  seed {i}: " + "  ".join(f"{name} {ms[name]:.1f}" for name in names) + f"  (best fixed: {best})"
        for i, (ms, best) in enumerate(zip(per_seed, summary["best_fixed_per_seed"], strict=True))
    ]
    ratio = summary["planned_over_best_fixed"]
    out.append(
        f"planned over the best fixed of {', '.join(fixed)} per seed: geometric mean {ratio['geomean']:.3f}x "
        f"(lowest {ratio['lowest']:.3f}x, highest {ratio['highest']:.3f}x) over {len(per_seed)} seeds"
    )
    out.append(
        f"plan wait: median {summary['plan_wait_ms_median']:.3f} ms; summed wait / summed iteration "
        f"{summary['plan_wait_fraction']:.3%}; the first plan (before its iteration runs): "
        + ", ".join(f"{w:.1f}" for w in summary["first_plan_wait_ms"])
        + f" ms; planning median {summary['planning_ms_median']:.1f} ms, late plans {summary['late_plans']}"
    )
    return out


def job(*, args: argparse.Namespace, pipeline: PipelineConfig, names: list[str]) -> dict:
    """The job's `planned` among --policies: beside the fixed schedules of --policies over --seeds generated runs of
    --iterations iterations; prints the summary and writes --json."""
    import ray

    from actors.driver import PipelineDriver
    from actors.local_ray import start_ray
    from actors.teardown import end_actors
    from benchmarks import runtime
    from rrfp_ray.cli import configure_logging, variability
    from rrfp_ray.sim.variability import generate_iterations

    config = variability(args, flags=runtime.VARIABILITY)
    model = runtime.layer_model(args, pipeline=pipeline)

    def traces_for(seed: int) -> tuple:
        shape = {"stages": pipeline.stages, "microbatches": pipeline.microbatches, "chunks": pipeline.chunks}
        return generate_iterations(
            iterations=args.iterations, scenario=config["scenario"], **shape, seed=seed, t_f=config["t_f"],
            **config["params"],
        )  # fmt: skip

    def workload_for(traces: tuple) -> SyntheticWorkload:
        return SyntheticWorkload(
            trace=traces[0],
            iterations=traces,
            payload_elems=args.payload_elems,
            layers=args.layers,
            layer_bytes=model.layer_bytes,
            layer_split=model.split,
        )

    seeds = range(args.variability_seed, args.variability_seed + args.seeds)
    fixed = [name for name in names if name != PLANNED and pipeline.resolved_policy(name).fixed]
    print(start_ray(num_cpus=max(2, pipeline.actors), log_level=configure_logging(args)))
    driver = PipelineDriver.remote(pipeline=pipeline, workload=workload_for(traces_for(seeds[0])))
    try:
        print(f"{pipeline.actors} stage actors up in {ray.get(driver.startup_seconds.remote()):.1f} s")
        results = run(
            driver=driver, pipeline=pipeline, names=names, seeds=seeds, traces_for=traces_for,
            workload_for=workload_for,
        )  # fmt: skip
        ray.get(driver.shutdown.remote())
        end_actors([driver], timeout_s=30.0)
    finally:
        ray.kill(driver)
    summary = summarize(results, fixed=fixed)
    print(
        f"P={pipeline.stages} M={pipeline.microbatches} cap={pipeline.cap} scenario={args.scenario} t_f={args.t_f:g} "
        f"seeds {seeds.start}-{seeds.stop - 1}, {args.iterations} iterations a seed and policy"
    )
    print("\n".join(lines(summary, names=names, fixed=fixed)))
    summary["runs"] = results
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    return summary
