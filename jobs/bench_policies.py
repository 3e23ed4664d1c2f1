"""Where the policies land against the lower bounds: 1f1b, bf, bfw and cpw on the scenario suite.

    python jobs/bench_policies.py --out docs/policy_past_bf.md

1. For every scenario below at P=--stages, M=--microbatches, v=1, cap --cap, seeds 0..--seeds-1:
   per policy the means of makespan / stage-window bound, makespan / best bound (both from
   `rrfp_ray.sim.bounds.bounds` for the policy's layout), speedup over fixed 1f1b, and peak
   in-flight over 1f1b's; then cpw against bfw seed by seed.
2. cpw against bfw where memory is tighter or the pipeline deeper: caps 1x, 1.5x, 2x at P and 2P.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchmarks.console import show_progress
from benchmarks.policies import SCENARIOS, SENSITIVITY_CAPS, SENSITIVITY_SCENARIOS, markdown, paired, suite_row
from rrfp_ray.cli import count
from rrfp_ray.job import run_job
from rrfp_ray.policy.caps import Cap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=count, default=8, help="pipeline stages P (default 8)")
    parser.add_argument("--microbatches", type=int, help="microbatches M (default 4P)")
    parser.add_argument("--seeds", type=int, default=10, help="traces per scenario, seeds 0..N-1 (default 10)")
    parser.add_argument("--cap", default="2x", help="in-flight cap of the main table (default 2x)")
    parser.add_argument("--out", help="write the Markdown report here")
    args = parser.parse_args()
    microbatches = args.microbatches or 4 * args.stages
    if microbatches < args.stages:
        parser.error(f"argument --microbatches: must be >= --stages (1f1b needs M >= P), got {microbatches}")
    if args.seeds < 2:
        parser.error(f"argument --seeds: must be >= 2 (a standard error needs two), got {args.seeds}")
    try:
        cap = Cap.parse(args.cap)
    except ValueError as error:
        parser.error(f"argument --cap: {error}")

    show_progress()
    seeds = range(args.seeds)
    table = {
        label: suite_row(label=label, stages=args.stages, microbatches=microbatches, seeds=seeds, cap=cap)
        for label, _, _ in SCENARIOS
    }
    sensitivity = {
        (label, stages, text): paired(
            label=label, stages=stages, microbatches=4 * stages, seeds=seeds, cap=Cap.parse(text)
        )
        for label in SENSITIVITY_SCENARIOS
        for stages in (args.stages, 2 * args.stages)
        for text in SENSITIVITY_CAPS
    }
    for (label, stages, text), p in sensitivity.items():
        print(f"{label:>16} P={stages:<3} cap {text:<4} cpw vs bfw {p.mean:+.2f}% ± {p.stderr:.2f}", flush=True)
    report = markdown(
        table=table,
        sensitivity=sensitivity,
        stages=args.stages,
        microbatches=microbatches,
        seeds=args.seeds,
        cap=cap,
        command=shlex.join(["python", *sys.argv]),
    )
    if args.out:
        Path(args.out).write_text(report)
    else:
        print(report)


if __name__ == "__main__":
    run_job(main)
