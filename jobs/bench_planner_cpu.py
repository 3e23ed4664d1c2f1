"""What the planner's own work costs in CPU: process time per plan and per observed iteration, and the share of a
plan spent simulating candidates.

    python jobs/bench_planner_cpu.py --stages 2 --microbatches 8 --scenario multimodal+lognormal
    python jobs/bench_planner_cpu.py --stages 8 --microbatches 32 --scenario varlen+lognormal --docs 4

Plans --iterations simulated iterations as `planned` does (`rrfp_ray.plan.loop.run`, one chunk per stage, cap 1x,
the default hints and budget, seed 0), --runs times in this process. Per run: the median process time of
`Planner.plan` and of `Planner.observe`, and the simulations' share of the plans' time (`simulate_many` as the
scoring calls it); prints the median of each over the runs and a hash of every plan, so that two trees (another
revision first on PYTHONPATH) can be compared on the same plans.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from rrfp_ray.cli import count
from rrfp_ray.job import run_job
from rrfp_ray.plan import scoring
from rrfp_ray.plan.loop import Planning, run
from rrfp_ray.plan.planner import Planner, PlannerConfig, default_hints
from rrfp_ray.policy.caps import Cap
from rrfp_ray.sim.variability import generate_iterations


def timed(function: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """`function`, each call's process time appended to `spent`."""

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent.append(time.process_time() - start)

    return call


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=count, default=2, help="pipeline stages P (default 2)")
    parser.add_argument("--microbatches", type=count, default=8, help="microbatches M (default 8)")
    parser.add_argument(
        "--scenario", default="multimodal+lognormal", help="trace scenario (default multimodal+lognormal)"
    )
    parser.add_argument(
        "--docs", type=int, default=0, help="samples per microbatch, which plans pack (default 0: none)"
    )
    parser.add_argument("--iterations", type=count, default=8, help="planned iterations per run (default 8)")
    parser.add_argument("--runs", type=count, default=5, help="runs, each a fresh planner (default 5)")
    args = parser.parse_args(argv)
    if args.docs < 0:
        parser.error(f"argument --docs: must be >= 0, got {args.docs}")
    shape = {"stages": args.stages, "chunks": 1, "microbatches": args.microbatches}
    extra = {"docs": args.docs} if args.docs else {}
    try:
        traces = generate_iterations(iterations=args.iterations, scenario=args.scenario, seed=0, **shape, **extra)
    except ValueError as error:
        parser.error(str(error))
    config = PlannerConfig(hints=default_hints(chunks=1), cap=Cap.parse("1x"), seed=0)
    plans, observes, simulations = [], [], []
    plan, observe, simulate_many = Planner.plan, Planner.observe, scoring.simulate_many
    Planner.plan, Planner.observe = timed(plan, plans), timed(observe, observes)
    scoring.simulate_many = timed(simulate_many, simulations)
    try:
        per_run = []
        for _ in range(args.runs):
            del plans[:], observes[:], simulations[:]
            done = run(planning=Planning.PLANNED, traces=traces, config=config)
            per_run.append((statistics.median(plans), statistics.median(observes), sum(simulations) / sum(plans)))
    finally:
        Planner.plan, Planner.observe, scoring.simulate_many = plan, observe, simulate_many
    digest = hashlib.sha1(repr([(p, r.makespan_ms) for p, r in done]).encode()).hexdigest()[:12]
    result = {
        "plan_ms": 1e3 * statistics.median(r[0] for r in per_run),
        "observe_ms": 1e3 * statistics.median(r[1] for r in per_run),
        "simulation_share": statistics.median(r[2] for r in per_run),
        "plans": digest,
    }
    print(
        f"P={args.stages} M={args.microbatches} {args.scenario}"
        + (f" docs={args.docs}" if args.docs else "")
        + f": CPU per plan {result['plan_ms']:.2f} ms (simulation {result['simulation_share']:.0%}), per observed"
        f" iteration {result['observe_ms']:.2f} ms; median of {args.runs} runs of {args.iterations} plans;"
        f" plans {digest}"
    )
    return result


if __name__ == "__main__":
    run_job(main)
