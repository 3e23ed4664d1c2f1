"""Rebalancing in the simulator: after the rebalancer's moves against the best split, and the gain.

    python jobs/bench_rebalance.py --stages 8,16,32 --json rebalance.json

See `benchmarks.rebalancing` for what each column is. Simulated, so deterministic under the seed: the
numbers do not depend on the machine; only the run time does.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from benchmarks.rebalancing import SCENARIOS, cell, table, worst_gap
from rrfp_ray.cli import count, counts
from rrfp_ray.job import run_job
from rrfp_ray.policy.policy import policy_names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=counts, default=[8, 16, 32], help="pipeline depths P (M = 4P)")
    parser.add_argument("--policies", default="1f1b,bfw", help="comma-separated policies (default 1f1b,bfw)")
    parser.add_argument("--layers", type=count, default=4, help="layers per stage at the start (default 4)")
    parser.add_argument("--iterations", type=count, default=60, help="iterations per run (default 60)")
    parser.add_argument("--span", type=count, default=30, help="iterations the persistent straggler stays (default 30)")
    parser.add_argument("--threshold", type=float, default=0.1, help="rebalance_threshold (default 0.1)")
    parser.add_argument("--window", type=count, default=5, help="rebalance_window, measured iterations (default 5)")
    parser.add_argument("--layer-mb", type=float, default=10.0, help="parameter MB per layer (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traces (default 0)")
    parser.add_argument("--scenarios", help="comma-separated (default all): " + ", ".join(s.label for s in SCENARIOS))
    parser.add_argument("--json", help="write every cell here")
    parser.add_argument("--out", help="write the Markdown table here")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in policy_names() or p.endswith("hint")]
    if unknown:
        parser.error(f"argument --policies: unknown {unknown}")
    if not args.threshold > 0 or args.layer_mb < 0 or args.seed < 0:
        parser.error("arguments --threshold > 0, --layer-mb >= 0 and --seed >= 0")
    known = {s.label: s for s in SCENARIOS}
    labels = args.scenarios.split(",") if args.scenarios else list(known)
    if missing := [label for label in labels if label not in known]:
        parser.error(f"argument --scenarios: unknown {missing}; known: {', '.join(known)}")
    if args.iterations < 2 * args.window + 10:
        parser.error(f"argument --iterations: needs >= 2 x --window + 10 = {2 * args.window + 10}")

    rows, started = {}, time.monotonic()
    for stages in args.stages:
        for label in labels:
            for policy in policies:
                rows[(label, stages, policy)] = cell(
                    scenario=known[label],
                    stages=stages,
                    policy=policy,
                    layers=args.layers,
                    iterations=args.iterations,
                    span=args.span,
                    threshold=args.threshold,
                    window=args.window,
                    layer_mb=args.layer_mb,
                    seed=args.seed,
                )
                row = table({(label, stages, policy): rows[(label, stages, policy)]})[-1]
                print(f"{row}  <- done at {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    command = "python jobs/bench_rebalance.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    moved = {key: r for key, r in rows.items() if r["moves"]}
    gap = f"worst after / balanced where it moved: {worst_gap(moved):.3f} (target <= 1.05)" if moved else ""
    text = "\n".join([f"`{command}`", "", *table(rows), "", gap]).rstrip()
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        cells = {f"{label} P={stages} {policy}": r for (label, stages, policy), r in rows.items()}
        Path(args.json).write_text(json.dumps({"command": command, "cells": cells}, indent=1))


if __name__ == "__main__":
    run_job(main)
