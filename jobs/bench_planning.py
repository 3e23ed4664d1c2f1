"""Planning ahead in the simulator: planned vs the best fixed schedule at cap 1x, decomposed, with the oracle.

    python jobs/bench_planning.py --stages 8,16,32 --seeds 5 --iterations 6,4,4 --simulations 32,16,8

See `benchmarks.planning` for what each column is. Simulated, so deterministic: the numbers do not
depend on the machine; only the run time does.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from benchmarks.planning import SCENARIOS, cell, iteration_table, table, targets
from rrfp_ray.cli import counts
from rrfp_ray.job import run_job


def ratios_list(text: str) -> list[float]:
    """Comma-separated speedups, each a finite number > 1 (argparse type)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be finite numbers > 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=counts, default=[8, 16, 32], help="pipeline depths P (M = 4P)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per scenario (default 5)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--iterations", type=counts, default=[6], help="iterations per run, one or one per P")
    parser.add_argument(
        "--simulations",
        type=counts,
        default=[32],
        help="planner budget (simulated iterations), one or one per P (default 32)",
    )
    parser.add_argument("--samples", type=int, default=2, help="noise samples per candidate (default 2)")
    parser.add_argument(
        "--scenarios", help="comma-separated labels (default all): " + ", ".join(s.label for s in SCENARIOS)
    )
    parser.add_argument(
        "--per-iteration",
        action="store_true",
        help="also print planned, expected and oracle against the best fixed schedule per iteration",
    )
    parser.add_argument(
        "--target",
        type=ratios_list,
        default=[1.10],
        help=(
            "the speedup planned is judged against over the featured rows, and over those whose room reaches it; "
            "one or one per P (default 1.10)"
        ),
    )
    parser.add_argument("--json", help="write the per-seed makespans here")
    parser.add_argument("--out", help="write the Markdown table here")
    args = parser.parse_args(argv)
    P = args.stages
    per_p = {}  # each per-P flag, one value per --stages entry
    for flag, values in (
        ("--iterations", args.iterations),
        ("--simulations", args.simulations),
        ("--target", args.target),
    ):
        if len(values) not in (1, len(P)):
            parser.error(f"argument {flag}: give one value or one per --stages entry ({len(P)})")
        per_p[flag] = dict(zip(P, values * len(P) if len(values) == 1 else values))
    if args.seeds < 1 or args.samples < 1:
        parser.error("arguments --seeds and --samples must be >= 1")
    if args.first_seed < 0:
        parser.error("argument --first-seed: must be >= 0")
    known = {s.label: s for s in SCENARIOS}
    labels = args.scenarios.split(",") if args.scenarios else list(known)
    unknown = [label for label in labels if label not in known]
    if unknown:
        parser.error(f"argument --scenarios: unknown {unknown}; known: {', '.join(known)}")
    if min(args.simulations) < args.samples:
        parser.error(f"argument --simulations: each must be >= --samples = {args.samples}")

    rows, started = {}, time.monotonic()
    for stages in P:
        for label in labels:
            rows[(label, stages)] = [
                cell(
                    scenario=known[label],
                    stages=stages,
                    seed=seed,
                    iterations=per_p["--iterations"][stages],
                    simulations=per_p["--simulations"][stages],
                    samples=args.samples,
                )
                for seed in range(args.first_seed, args.first_seed + args.seeds)
            ]
            row = table({(label, stages): rows[(label, stages)]})[-1]
            print(f"{row}  <- done at {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    command = "python jobs/bench_planning.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    judged = targets(rows, target=per_p["--target"])
    text = "\n".join(
        [
            f"`{command}`",
            "",
            *table(rows),
            *(["", *judged] if judged else []),
            *(["", *iteration_table(rows)] if args.per_iteration else []),
        ]
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        data = {f"{label} P={stages}": seeds for (label, stages), seeds in rows.items()}
        Path(args.json).write_text(json.dumps({"command": command, "cells": data}, indent=1))


if __name__ == "__main__":
    run_job(main)
