"""What readiness agreement costs: PP x TP in one process on the synthetic (sleep) workload.

    python jobs/bench_tp.py

For each protocol (`first`, `common`) and jitter model, runs --iterations iterations of
LocalBackend.over(tp=--tp) over SleepExecutor (t_f = --t-f ms, lognormal --sigma) and prints the
TP-coordination time (agreement rounds and the waits after a failed round, not the waits
of a rank with nothing eligible) as a fraction of the ranks' wall time, the disagreement rate (rounds
that decided nothing although some rank offered an op, per round and per op run), conflicts
per op (disagreements where every rank offered an op: the only kind `common` can avoid), rounds
per op (idle rounds, where no rank had an op, included) and the median makespan, next to
the same pipeline without TP. Jitter models: `shared`, every rank of a stage replays the same
trace; `per-rank`, each TP rank its own seed (its own GPU's jitter). Either way an F or B ends
its duration after the later rank of its stage started it (`rrfp_ray.runtime.synthetic.InStep`).
"""

from __future__ import annotations

import argparse
import statistics

from rrfp_ray.cli import add_log_level_flag, configure_logging
from rrfp_ray.job import run_job
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.policy.agreement import TPProtocol
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.backend import IterationSettings, LocalBackend


def _runs(
    args: argparse.Namespace, *, cap: Cap, tp: int, protocol: TPProtocol, per_rank: bool
) -> list[IterationReport]:
    policy = make_policy(name=args.policy, stages=args.stages, chunks=1, microbatches=args.microbatches)
    layout = Layout(stages=args.stages, chunks=1, microbatches=args.microbatches, split=policy.split)
    reports = []
    settings = IterationSettings(tp_protocol=protocol)
    with LocalBackend.over(layout=layout, timeout_s=60, tp=tp, k=args.k, settings=settings) as pipeline:
        for i in range(args.iterations):
            executors = []
            for s in range(args.stages):
                for t in range(tp):
                    seed = args.seed + 1000 * i + (t if per_rank else 0)
                    trace = generate(
                        scenario="lognormal",
                        stages=args.stages,
                        microbatches=args.microbatches,
                        chunks=1,
                        seed=seed,
                        t_f=args.t_f,
                        sigma=args.sigma,
                    )
                    workload = SyntheticWorkload(trace=trace)
                    if tp > 1:
                        workload = workload.with_tp(rank=t, size=tp, all_reduce=pipeline.tp_all_reduce(stage=s, rank=t))
                    executors.append(workload.executor(stage=s, layout=layout))
            reports.append(
                pipeline.run_iteration(
                    iteration=i,
                    policy=policy,
                    cap=cap,
                    executors=executors,
                )
            )
    return reports


def _row(name: str, reports: list[IterationReport], *, ops: int) -> str:
    stages = [s for r in reports for s in r.stages]
    wall = sum(s.wall_ms for s in stages)
    rounds = sum(s.tp_rounds for s in stages)
    disagreements = sum(s.tp_disagreements for s in stages)
    conflicts = sum(s.tp_conflicts for s in stages)
    tp_fraction = sum(s.tp_ms for s in stages) / wall if wall else 0.0
    executed = ops * len(stages)
    makespan = statistics.median(r.makespan_ms for r in reports)
    return (
        f"| {name} | {tp_fraction:.2%} | {disagreements / rounds if rounds else 0.0:.2%} | "
        f"{disagreements / executed:.3f} | {conflicts / executed:.3f} | {rounds / executed:.2f} | {makespan:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--policy", default="bf")
    parser.add_argument("--cap", default="2x")
    parser.add_argument("--t-f", type=float, default=20.0)
    parser.add_argument("--sigma", type=float, default=0.3)
    parser.add_argument("--k", type=int, default=4, help="ops each rank offers per round under 'common'")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    add_log_level_flag(parser)
    args = parser.parse_args()
    configure_logging(args)
    try:
        cap = Cap.parse(args.cap)
    except ValueError as error:
        parser.error(f"--cap: {error}")
    ops = 2 * args.microbatches
    print(
        f"PP={args.stages} x TP={args.tp}, M={args.microbatches}, {args.policy}, cap {cap}, "
        f"t_f={args.t_f:g} ms, lognormal sigma={args.sigma:g}, {args.iterations} iterations"
    )
    print(
        "| run | tp time / wall | disagreements / rounds | disagreements per op | conflicts per op | rounds per op "
        "| median makespan ms |"
    )
    print("|---|---|---|---|---|---|---|")
    print(_row("no TP", _runs(args, cap=cap, tp=1, protocol=TPProtocol.FIRST, per_rank=False), ops=ops))
    for per_rank in (False, True):
        for protocol in TPProtocol:
            name = f"{protocol.value}, {'per-rank' if per_rank else 'shared'} jitter"
            runs = _runs(args, cap=cap, tp=args.tp, protocol=protocol, per_rank=per_rank)
            print(_row(name, runs, ops=ops), flush=True)


if __name__ == "__main__":
    run_job(main)
