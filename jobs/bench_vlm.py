"""The multimodal workload on real compute: 1F1B, zb-h1, the readiness rules and `planned` on the VLM.

    python jobs/bench_vlm.py --stages 2 --seeds 5 --iterations 10            # in-process stages
    python jobs/bench_vlm.py --stages 2 --seeds 5 --iterations 10 --ray      # one Ray actor a stage
    python jobs/bench_vlm.py --seeds 2 --first-seed 3 --ray                  # seeds 3 and 4 of a run split in two

Prints a row per policy (see `benchmarks.vlm`: planned arranging the order, the packing or both, and
each fixed schedule on packed microbatches), the spread of the encoder's op times that the data
caused (P95/P5 of stage 0's forwards under 1F1B), the planner's CPU per iteration, and the targets:
the best planned row over the best fixed schedule >= 1.05x, holding no more peak activation bytes
than the fixed schedules; replayed makespans within 5% of the
measured. The best fixed schedule packed is printed beside it: what packing alone buys a fixed list. The
ceiling is printed last: the best plan for each iteration's measured op times (an oracle that knows them)
over the best fixed schedule, both simulated on those traces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from benchmarks.vlm import (
    FIXED,
    PACKED,
    PLANNED,
    POLICIES,
    PolicyRuns,
    add_run_flags,
    backend,
    best_of,
    best_readiness,
    ceiling,
    encoder_spread,
    op_medians,
    ratios,
    replay_ratio,
    run_configs,
    run_interleaved,
    run_seed,
    spread,
    start_fabric,
    table,
)
from rrfp_ray.job import run_job
from rrfp_ray.models.vlm import VLMConfig
from rrfp_ray.recipes.config import RunConfig


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, iterations_help="timed iterations per policy and seed (default 10)")
    parser.add_argument("--json", help="write every policy's per-seed median makespans here")
    args = parser.parse_args(argv)
    model, runs_of = run_configs(parser, args)
    return _measure(args=args, model=model, runs_of=runs_of)


def _measure(*, args: argparse.Namespace, model: VLMConfig, runs_of: list[RunConfig]) -> dict:
    """Every policy over the seeds, then the table and the targets (the module's docstring)."""
    from rrfp_ray.recipes.vlm_workload import vlm_trainer

    where = start_fabric(args, trainers=1)
    seeds = f"seeds {args.first_seed}..{args.first_seed + args.seeds - 1}"
    interval = f"switch interval {args.switch_interval_ms:g} ms"
    print(f"P={args.stages} M={args.microbatches} on {where}, {os.cpu_count()} cores; {seeds}; {interval}")
    runs = {name: PolicyRuns() for name in POLICIES}
    for seed, run in enumerate(runs_of, start=args.first_seed):
        timing = {"seed": seed, "warmup": args.warmup, "iterations": args.iterations, "runs": runs}
        if args.ray:
            with vlm_trainer(run, model=model, tail=args.image_tail, backend=backend(args)) as trainer:
                run_seed(trainer=trainer, **timing)
        else:
            with ExitStack() as stack:
                trainers = {
                    n: stack.enter_context(vlm_trainer(run, model=model, tail=args.image_tail, backend=backend(args)))
                    for n in runs
                }
                run_interleaved(trainers=trainers, **timing)
                trainer = trainers["1f1b"]
        print(f"seed {seed}: " + ", ".join(f"{n} {runs[n].medians()[-1]:.1f} ms" for n in POLICIES), flush=True)
    print("\n" + "\n".join(table(runs, trainer=trainer)))
    rule = best_readiness(runs)
    best_planned, best_packed = best_of(runs, list(PLANNED)), best_of(runs, list(PACKED))
    planned, _, _ = spread(ratios(runs, best_planned))
    encoder = encoder_spread(runs["1f1b"])
    plan_ms = 1e3 * statistics.median(s for name in PLANNED for s in runs[name].planning_s)
    iteration_ms = statistics.median(m for name in PLANNED for m in runs[name].medians())
    played = {name: replay_ratio(r, trainer=trainer) for name, r in runs.items()}
    worst = max(abs(r - 1) for r in played.values() if r is not None)
    print(f"\nencoder forward P95/P5 under 1f1b: {encoder:.2f}")
    print(f"best readiness rule: {rule} {spread(ratios(runs, rule))[0]:.3f}x over the best fixed ({', '.join(FIXED)})")
    ops = {name: op_medians(runs[name]) for name in FIXED}
    for name, medians in ops.items():
        print(f"median op ms under {name}: " + ", ".join(f"{key} {ms:.2f}" for key, ms in medians.items()))
    hints = {name: Counter(r.policy for seed in runs[name].reports for r in seed) for name in PLANNED}
    for name, counts in hints.items():
        print(f"{name} ran hints: " + ", ".join(f"{hint} {count}" for hint, count in counts.most_common()))
    print(f"planner CPU: {plan_ms:.1f} ms per iteration ({plan_ms / iteration_ms:.1%} of its median makespan)")
    print(f"best fixed packed: {best_packed} {spread(ratios(runs, best_packed))[0]:.3f}x over the best fixed")
    memory = runs[best_planned].peak_bytes() / max(runs[name].peak_bytes() for name in FIXED)
    print(
        f"target planned >= 1.05x the best fixed at equal peak activation bytes: {best_planned} {planned:.3f}x, "
        f"holding {memory:.2f}x the fixed schedules' peak bytes, "
        f"{'met' if planned >= 1.05 and memory <= 1.0 else 'not met'}"
    )
    oracle = spread(ceiling(runs, trainer=trainer))
    print(
        f"exact-duration oracle over the best fixed, simulated on their traces: {oracle[0]:.3f}x "
        f"({oracle[1]:.3f}-{oracle[2]:.3f})"
    )
    print(f"target replayed within 5%: worst {worst:.1%}, {'met' if worst <= 0.05 else 'not met'}")
    result = {
        "argv": sys.argv[1:],
        "medians_ms": {name: r.medians() for name, r in runs.items()},
        "encoder_p95_p5": encoder,
        "planning_ms": plan_ms,
        "op_ms": ops,
        "planned_hints": {name: dict(counts) for name, counts in hints.items()},
        "replayed_over_measured": played,
        "oracle_over_best_fixed": oracle[0],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    run_job(main)
