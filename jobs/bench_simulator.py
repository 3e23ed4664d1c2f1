"""How fast the simulator is, and how the policies scale with the pipeline depth.

    python jobs/bench_simulator.py --out docs/scale.md

1. Speed: per P in --speed-stages (M = 4P, or PxM, v=1, zb-h1 and bfw, cap 1x, lognormal 0.6),
   CPU ms per iteration (this process's time, the best of several calls: steadier than wall time
   on a shared machine) and simulated ops/s of `simulate` (full report) and of `simulate_many`
   (makespans only), and the speed-up over the simulator of --baseline (a git revision), timed
   the same way in the same run in a subprocess over `git archive` of that revision; its
   makespans must equal ours.
2. For P in --stages, M = 4P, every scenario below, policies 1f1b, bf, bfw at --cap: the
   speedup over fixed 1f1b and makespan / lower bound (`bounds().best_ms`), means over --seeds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rrfp_ray.cli import count, counts
from rrfp_ray.job import run_job
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.bounds import bounds
from rrfp_ray.sim.simulator import Case, simulate, simulate_many
from rrfp_ray.sim.variability import generate

SCENARIOS = ("none", "lognormal", "straggler", "imbalance", "comm", "multimodal", "multimodal+comm")
POLICIES = ("1f1b", "bf", "bfw")
SPEED_POLICIES = ("zb-h1", "bfw")
REPO = Path(__file__).resolve().parents[1]
# Run with the baseline tree first on sys.path: CPU ms per `simulate` call (the best of as many calls as ours)
# and the makespans, as JSON.
BASELINE = """
import json, sys, time
try:
    from rrfp_ray.policy.caps import Cap
except ImportError:  # a revision from before policy/caps.py
    from rrfp_ray.policy.arbiter import Cap
try:
    from rrfp_ray.policy.policy import make_policy
except ImportError:  # a revision from before policy/policy.py
    from rrfp_ray.policy.pickers import make_policy
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate
out = {}
for stages, microbatches in json.loads(sys.argv[1]):
    trace = generate(scenario="lognormal", stages=stages, microbatches=microbatches, chunks=1, seed=0)
    for name in json.loads(sys.argv[2]):
        policy = make_policy(name=name, stages=stages, chunks=1, microbatches=microbatches)
        times = []
        for _ in range(max(3, 8000 // (stages * microbatches))):
            start = time.process_time()
            makespan = simulate(policy=policy, trace=trace, cap=Cap.parse("1x")).makespan_ms
            times.append((time.process_time() - start) * 1e3)
        out[f"{stages} {microbatches} {name}"] = [min(times), makespan]
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--stages", type=counts, default=[8, 16, 32, 64], help="comma-separated P values (default 8,16,32,64)"
    )
    parser.add_argument("--seeds", type=count, default=3, help="traces per cell, seeds 0..N-1 (default 3)")
    parser.add_argument("--cap", default="2x", help="in-flight cap (default 2x)")
    parser.add_argument("--out", help="write the Markdown report here")
    parser.add_argument(
        "--speed-stages", default="8,32,128", help="P (M = 4P) or PxM values of the speed table (default 8,32,128)"
    )
    parser.add_argument("--baseline", default="801989d", help="git revision to compare speed with ('' : none)")
    parser.add_argument("--speed-only", action="store_true", help="print the speed table and stop")
    args = parser.parse_args()
    try:
        cap = Cap.parse(args.cap)
    except ValueError as error:
        parser.error(f"argument --cap: {error}")

    try:
        shapes = [
            [int(n) for n in (f"{p}x{4 * int(p)}" if "x" not in p else p).split("x")]
            for p in args.speed_stages.split(",")
        ]
    except ValueError:
        shapes = []
    if not shapes or min(n for shape in shapes for n in shape) < 1:
        parser.error(
            f"argument --speed-stages: expected P or PxM values >= 1 like 8,128x1024, got {args.speed_stages!r}"
        )
    timing = speed_table(shapes=shapes, baseline=args.baseline)
    print(timing, flush=True)
    if args.speed_only:
        return
    rows = [row(scenario=s, stages=p, seeds=args.seeds, cap=cap) for s in SCENARIOS for p in args.stages]
    report = markdown(timing=timing, rows=rows, cap=cap, seeds=args.seeds)
    if args.out:
        Path(args.out).write_text(report)
    else:
        print(report)


def speed_table(*, shapes: list[list[int]], baseline: str) -> str:
    """Markdown: CPU ms per iteration and ops/s here, and the baseline's in the same run (see the module's
    docstring)."""
    load = os.getloadavg()[0]
    theirs = time_baseline(revision=baseline, shapes=shapes) if baseline else {}
    lines = [
        f"Speed ({platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs; "
        "lognormal, v=1, cap 1x; CPU ms, best of several calls; "
        f"baseline {baseline or 'none'}, timed in the same run; 1-minute load {load:.1f} before it):",
        "",
        "| P | M | policy | ops | simulate ms | ops/s | "
        "simulate_many ms | ops/s | baseline ms | speed-up | same makespan |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p, m in shapes:
        trace = generate(scenario="lognormal", stages=p, microbatches=m, chunks=1, seed=0)
        for name in SPEED_POLICIES:
            policy = make_policy(name=name, stages=p, chunks=1, microbatches=m)
            repeats = max(3, 8000 // (p * m))
            report = simulate(policy=policy, trace=trace, cap=Cap.parse("1x"))
            full = best_ms(
                functools.partial(simulate, policy=policy, trace=trace, cap=Cap.parse("1x")), repeats=repeats
            )
            case = Case(policy=policy, trace=trace, cap=Cap.parse("1x"))
            fast = best_ms(functools.partial(simulate_many, cases=[case]), repeats=repeats)
            ops = len(report.events)
            base_ms, base_makespan = theirs.get(f"{p} {m} {name}", (float("nan"), None))
            same = "-" if base_makespan is None else "yes" if base_makespan == report.makespan_ms else "NO"
            lines.append(
                f"| {p} | {m} | {name} | {ops} | {full:.1f} | {ops / full:.0f}k | {fast:.1f} | {ops / fast:.0f}k "
                f"| {base_ms:.1f} | {base_ms / full:.1f}x / {base_ms / fast:.1f}x | {same} |"
            )
    lines.append("")
    lines.append("speed-up: baseline ms / simulate ms, and / simulate_many ms; ops/s in thousands.")
    return "\n".join(lines)


def best_ms(run, *, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append((time.process_time() - start) * 1e3)
    return min(times)


def time_baseline(*, revision: str, shapes: list[list[int]]) -> dict[str, tuple[float, float]]:
    """CPU ms of one `simulate` call and its makespan per 'P M policy', by the simulator of git `revision`."""
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", revision, "rrfp_ray"], capture_output=True, check=False
        )
        if archive.returncode != 0:
            print(f"baseline {revision}: git archive failed: {archive.stderr.decode().strip()}", file=sys.stderr)
            return {}
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        env = {**os.environ, "PYTHONPATH": tree}
        out = subprocess.run(
            [sys.executable, "-c", BASELINE, json.dumps(shapes), json.dumps(SPEED_POLICIES)],
            capture_output=True,
            env=env,
            check=False,
            cwd=tree,
        )
    if out.returncode != 0:
        print(f"baseline {revision}: its timing failed:\n{out.stderr.decode().strip()}", file=sys.stderr)
        return {}
    return {key: tuple(value) for key, value in json.loads(out.stdout).items()}


def row(*, scenario: str, stages: int, seeds: int, cap: Cap) -> dict:
    microbatches = 4 * stages
    policies = [make_policy(name=n, stages=stages, chunks=1, microbatches=microbatches) for n in POLICIES]
    speedups: dict[str, list[float]] = {n: [] for n in POLICIES}
    ratios: dict[str, list[float]] = {n: [] for n in POLICIES}
    for seed in range(seeds):
        trace = generate(scenario=scenario, stages=stages, microbatches=microbatches, chunks=1, seed=seed)
        makespans = {p.name: simulate(policy=p, trace=trace, cap=cap).makespan_ms for p in policies}
        for p in policies:
            speedups[p.name].append(makespans["1f1b"] / makespans[p.name])
            ratios[p.name].append(makespans[p.name] / bounds(trace=trace, split=p.split).best_ms)
    result = {"scenario": scenario, "stages": stages, "microbatches": microbatches}
    for name in POLICIES:
        result[name] = (statistics.mean(speedups[name]), statistics.mean(ratios[name]))
    cells = "  ".join(f"{n} {result[n][0]:.3f}x /LB {result[n][1]:.3f}" for n in POLICIES)
    print(f"{scenario:>16} P={stages:<3} {cells}", flush=True)
    return result


def markdown(*, timing: str, rows: list[dict], cap: Cap, seeds: int) -> str:
    command = shlex.join(["python", *sys.argv])
    header = "| scenario | P | M | " + " | ".join(f"{n} speedup | {n} / LB" for n in POLICIES) + " |"
    lines = [
        "# Simulator: speed and scale",
        "",
        f"Generated by `{command}` (run from the repository root).",
        "",
        timing,
        "",
        f"Speedup = fixed 1f1b makespan / policy makespan; LB = `rrfp_ray.sim.bounds.bounds(...).best_ms`, "
        f"the largest of max stage work, critical path and stage window (for bfw with the B/W split). "
        f"v=1, M=4P, cap {cap} for all policies (fixed 1f1b ignores caps), t_f=20 ms, B+W=40 ms, "
        f"scenario parameters at their defaults; means over seeds 0..{seeds - 1}.",
        "",
        header,
        "|" + "---|" * (3 + 2 * len(POLICIES)),
    ]
    for r in rows:
        cells = " | ".join(f"{r[n][0]:.3f}x | {r[n][1]:.3f}" for n in POLICIES)
        lines.append(f"| {r['scenario']} | {r['stages']} | {r['microbatches']} | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_job(main)
