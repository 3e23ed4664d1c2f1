"""The wait for a plan against the iteration, `planned` on the GPT in one process (`benchmarks.plan_wait`).

    python jobs/bench_plan_wait.py --layers 2 --stages 2 --microbatches 4 --iterations 10

Prints the median wait for the plan over the median iteration (target: under 1%), the planning
time on its thread, and the iteration under the plans' first hint alone.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from benchmarks.plan_wait import lines, measure
from rrfp_ray.job import run_job


def at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=at_least(1), default=2, help="GPT layers (default 2)")
    parser.add_argument("--stages", type=at_least(1), default=2, help="pipeline stages P (default 2)")
    parser.add_argument("--microbatches", type=at_least(1), default=4, help="microbatches M (default 4)")
    parser.add_argument("--iterations", type=at_least(2), default=10, help="iterations per run (default 10)")
    args = parser.parse_args(argv)
    if args.layers + 2 < args.stages:  # the embedding, the blocks, the head: at least one per stage
        parser.error(f"argument --stages: at most --layers + 2 = {args.layers + 2}")
    waits = measure(layers=args.layers, stages=args.stages, microbatches=args.microbatches, iterations=args.iterations)
    command = "python jobs/bench_plan_wait.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    print("\n".join(lines(waits, command=command)))


if __name__ == "__main__":
    run_job(main)
