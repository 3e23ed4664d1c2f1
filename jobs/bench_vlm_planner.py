"""What planning in the job's process costs the VLM's iterations: `planned` against the same plans handed in.

    python jobs/bench_vlm_planner.py --stages 2 --seeds 5 --iterations 10          # stage threads of this process
    python jobs/bench_vlm_planner.py --stages 2 --seeds 5 --iterations 10 --ray    # one Ray actor a stage

Per seed, two trainers from the same weights on the same data take turns, one iteration each, the first of the two
alternating by seed and iteration. One runs `planned` (order and packing): its planner, on a thread of this process,
makes the next iteration's plan while this one runs. The other runs each iteration under the plan the first made for
it, handed in with the activation bytes its arbiters gated by, with no planning beside it. Plans, gates, data and
weights being the same, the ratio of their makespans (the op schedule, the optimizer step left out) is what the
planner's work costs the stages: in-process the cores and the interpreter's lock the stage threads share with it
(`--switch-interval-ms`: how often the lock is forced from a thread that holds it, while the backends run an
iteration); with `--ray` (each trainer's stages its own actors, idle while the other trainer runs) the cores alone.
Prints per seed both medians, their ratio (the handed-in median over the planned one: below 1, planning slows the
stages; geometric mean over the seeds, lowest-highest) and the planner's wall time per plan.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from contextlib import ExitStack

from benchmarks.vlm import add_run_flags, backend, run_configs, spread, start_fabric
from rrfp_ray.job import run_job
from rrfp_ray.models.vlm import VLMConfig
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.ahead import Taken
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.train.api import Trainer
from rrfp_ray.train.planning import run_taken


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, iterations_help="timed iterations per seed (default 10)")
    args = parser.parse_args(argv)
    model, runs_of = run_configs(parser, args)
    return _compare(args=args, model=model, runs_of=runs_of)


def _compare(*, args: argparse.Namespace, model: VLMConfig, runs_of: list[RunConfig]) -> dict:
    """Per seed, `planned` and the same plans handed in, taking turns (the module's docstring)."""
    from rrfp_ray.plan.planner import Arrangement
    from rrfp_ray.recipes.vlm_workload import vlm_trainer

    where = start_fabric(args, trainers=2)
    print(
        f"P={args.stages} M={args.microbatches} on {where} a trainer, {os.cpu_count()} cores; "
        f"switch interval {args.switch_interval_ms:g} ms"
    )
    medians: dict[str, list[float]] = {"planned": [], "handed in": []}
    losses: dict[str, list[float]] = {name: [] for name in medians}
    planning_ms: list[float] = []
    for seed, run in enumerate(runs_of, start=args.first_seed):
        with ExitStack() as stack:
            planned, handed = (
                stack.enter_context(vlm_trainer(run, model=model, tail=args.image_tail, backend=backend(args)))
                for _ in "ab"
            )
            shape = {k: getattr(run.pipeline, k) for k in ("stages", "chunks", "microbatches")}
            times: dict[str, list[float]] = {name: [] for name in medians}
            ahead = None  # the plan the planned trainer made for the iteration both run next (None: not made yet)
            for i in range(args.warmup + args.iterations):
                first = ahead is not None and (seed + i) % 2 == 1  # the handed-in trainer's turn first
                if first:
                    other = _handed(handed, taken=ahead, shape=shape)
                report = planned.step(policy="planned", arrange=Arrangement.BOTH)
                if planned.planner_state() is None:
                    raise TimeoutError(f"the planner did not settle within {run.pipeline.timeout_s} s")
                if not first:
                    other = _handed(handed, taken=planned.planning.ran, shape=shape)
                ahead = planned.planning.ahead(iteration=planned.iteration)  # settled: made, unless it failed
                losses["planned"].append(report.loss)
                losses["handed in"].append(other.loss)
                if i >= args.warmup:
                    times["planned"].append(report.schedule_ms)
                    times["handed in"].append(other.schedule_ms)
            planning_ms += [1e3 * s for s in planned.planning_s[args.warmup :] if not math.isnan(s)]
        for name, values in times.items():
            medians[name].append(statistics.median(values))
        print(f"seed {seed}: " + ", ".join(f"{n} {m[-1]:.1f} ms" for n, m in medians.items()), flush=True)
    ratio, low, high = spread([h / p for h, p in zip(medians["handed in"], medians["planned"])])
    print(
        f"planned {statistics.median(medians['planned']):.1f} ms, the same plans handed in "
        f"{statistics.median(medians['handed in']):.1f} ms (medians over the seeds)"
    )
    print(f"handed in over planned: {ratio:.3f}x ({low:.3f}-{high:.3f}); below 1 planning slows the stages")
    print(f"planner wall time per plan (on its thread, beside the stages): {statistics.median(planning_ms):.1f} ms")
    return {
        "medians_ms": medians,
        "losses": losses,
        "handed_over_planned": ratio,
        "planning_ms": statistics.median(planning_ms),
    }


def _handed(trainer: Trainer, *, taken: Taken | None, shape: dict[str, int]) -> IterationReport:
    """One iteration of `trainer` under the plan `taken`, handed in, gated by the bytes it was gated by when planned."""
    if taken is None:
        raise RuntimeError("the planned trainer ran no plan to hand in")
    report = run_taken(backend=trainer.backend, taken=taken, iteration=trainer.iteration, shape=shape)
    trainer.iteration += 1
    return report


if __name__ == "__main__":
    run_job(main)
