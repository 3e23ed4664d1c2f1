"""Print, in the simulator with the transport model, what holding an overtake for the first unstarted
hint action's message does to ready policies against their fixed hint list (zb-h1) at cap 1x: speed
relative to zb-h1 (zb-h1's makespan over the policy's; above 1: faster), mean over seeds, per
scenario, message cost and hold (`TransportModel.hold_messages`, in message costs; 0: no hold).

    python jobs/bench_hold.py [--stages 4,8] [--message-ms 0.1,0.3] [--holds 0,1,2,3] [--seeds 10] [--t-f 2]
"""

from __future__ import annotations

import argparse
import statistics

from rrfp_ray.job import run_job
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.simulator import Case, TransportModel, simulate_many
from rrfp_ray.sim.variability import generate

_SCENARIOS = (("none", {}), ("lognormal", {"sigma": 0.3}), ("lognormal", {"sigma": 0.6}), ("straggler", {}))
_READY = ("bfw", "ready-zb-h1")
_FIXED = "zb-h1"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="4,8", help="pipeline sizes P, comma-separated (M = 4P)")
    parser.add_argument("--message-ms", default="0.1,0.3", help="message costs, comma-separated")
    parser.add_argument("--holds", default="0,1,2,3", help="holds in message costs, comma-separated")
    parser.add_argument("--seeds", type=int, default=10, help="seeds per scenario that draws (none: one)")
    parser.add_argument("--t-f", type=float, default=2.0, help="forward op ms")
    args = parser.parse_args(argv)
    try:
        stages = [int(p) for p in args.stages.split(",")]
        costs = [float(c) for c in args.message_ms.split(",")]
        holds = [float(h) for h in args.holds.split(",")]
    except ValueError:
        parser.error("--stages, --message-ms and --holds take numbers, comma-separated")
    if min(stages) < 2 or min(costs) <= 0 or min(holds) < 0 or args.seeds < 1 or args.t_f <= 0:
        parser.error("--stages >= 2, --message-ms > 0, --holds >= 0, --seeds >= 1 and --t-f > 0")
    print(f"speed relative to {_FIXED} at cap 1x, t_f={args.t_f:g} ms (mean over seeds)")
    print(f"{'P':>2} {'scenario':<20} {'msg ms':>6} {'hold':>5} " + " ".join(f"{name:>12}" for name in _READY))
    for p in stages:
        for scenario, params in _SCENARIOS:
            seeds = range(1 if scenario == "none" else args.seeds)
            traces = [
                generate(scenario=scenario, stages=p, microbatches=4 * p, chunks=1, seed=s, t_f=args.t_f, **params)
                for s in seeds
            ]
            label = scenario + "".join(f" {k}={v:g}" for k, v in params.items())
            for cost in costs:
                for hold in holds:
                    transport = TransportModel(message_ms=cost, hold_messages=hold)
                    fixed = _makespans(name=_FIXED, stages=p, traces=traces, transport=transport)
                    speeds = [
                        statistics.mean(
                            f / r
                            for f, r in zip(fixed, _makespans(name=n, stages=p, traces=traces, transport=transport))
                        )
                        for n in _READY
                    ]
                    print(f"{p:>2} {label:<20} {cost:>6g} {hold:>5g} " + " ".join(f"{s:>12.3f}" for s in speeds))


def _makespans(*, name: str, stages: int, traces: list, transport: TransportModel) -> list[float]:
    policy = make_policy(name=name, stages=stages, chunks=1, microbatches=4 * stages)
    cases = [Case(policy=policy, trace=t, cap=Cap.parse("1x"), transport=transport) for t in traces]
    return simulate_many(cases=cases)


if __name__ == "__main__":
    run_job(main)
