"""Replay measured iterations in the simulator: simulated vs measured makespan on the measured trace.

    python jobs/train_gpt.py --scenario none --no-compare --policy bf --iterations 10
    python jobs/replay.py runs/train_gpt/telemetry-bf.jsonl --cap 2x

Each iteration of a telemetry file (what `jobs/train_gpt.py` and the Trainer write: every op's
start, end and the moment it became ready) becomes a trace of its ops' measured durations and
its messages' measured transits (`rrfp_ray.sim.replay`); the simulator runs the iteration's own
policy on it at `--cap` (the run's cap: train_gpt's default is 2x) and prints its makespan next
to the measured one, optimizer step left out. The pipeline's shape comes from the events.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rrfp_ray.job import run_job
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.schedule.actions import parse_action
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.replay import replay


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("telemetry", help="a telemetry-<policy>.jsonl with events")
    parser.add_argument("--cap", default="2x", help="the in-flight cap the run used (default 2x, train_gpt's)")
    parser.add_argument("--skip", type=int, default=1, help="leading iterations left out as warm-up (default 1)")
    args = parser.parse_args(argv)
    try:
        cap = Cap.parse(args.cap)
    except ValueError as error:
        parser.error(f"argument --cap: {error}")
    if args.skip < 0:
        parser.error(f"argument --skip: must be >= 0, got {args.skip}")
    path = Path(args.telemetry)
    if not path.is_file():
        parser.error(f"argument telemetry: no file {path}")
    try:
        reports = [IterationReport.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]
    except (ValueError, KeyError, TypeError) as error:
        parser.error(f"argument telemetry: {path} is not a telemetry file ({error})")
    reports = reports[args.skip :]
    if not reports or not reports[0].events:
        parser.error(f"argument telemetry: {path} has no iteration with events after --skip {args.skip}")
    first = reports[0]
    stages = 1 + max(e.stage for e in first.events)
    actions = [parse_action(e.action, stages=stages) for e in first.events]
    chunks = (1 + max(a.virtual_stage for a in actions)) // stages
    microbatches = 1 + max(a.microbatch for a in actions)
    policy = make_policy(name=first.policy, stages=stages, chunks=chunks, microbatches=microbatches)
    layout = Layout(stages=stages, chunks=chunks, microbatches=microbatches, placement=policy.placement)
    print(f"{first.policy}: P={stages} v={chunks} M={microbatches}, {policy.placement.value} placement, cap {cap}")
    rows = []
    for report in reports:
        result = replay(report, policy=policy, layout=layout, cap=cap)
        rows.append(
            {"iteration": report.iteration, "measured_ms": result.measured_ms, "simulated_ms": result.simulated_ms}
        )
        print(
            f"iter {report.iteration:3d}  measured {result.measured_ms:8.1f} ms  "
            f"simulated {result.simulated_ms:8.1f} ms  sim/meas {result.ratio:.3f}"
        )
    ratios = [r["simulated_ms"] / r["measured_ms"] for r in rows]
    print(
        f"median sim/meas {statistics.median(ratios):.3f} over {len(rows)} iterations "
        f"({min(ratios):.3f}-{max(ratios):.3f})"
    )
    return rows


if __name__ == "__main__":
    run_job(main)
