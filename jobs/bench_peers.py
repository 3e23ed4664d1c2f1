"""Run PyTorch's own pipeline schedules (torch.distributed.pipelining) on a duration trace and print
each one's measured makespan next to the simulated makespan of the order it ran.

    python jobs/bench_peers.py --schedule 1f1b --stages 4 --microbatches 16 \\
        --scenario lognormal --sigma 0.3 --t-f 20 --iterations 5 [--variability-seed 0] \\
        [--trace FILE] [--cpu] [--json OUT]

``--schedule`` takes a comma-separated list; the schedules then run one after another in the
same P processes (torch.multiprocessing spawn, gloo on 127.0.0.1, one thread each), each sleeping
the trace's F / B / W times (jobs/benchmarks/peers/torch_pipelining.py says how they are timed and
what the ideal is). ``order`` says whether PyTorch's order is our schedule of the same name.

Schedules: gpipe (ScheduleGPipe), 1f1b (Schedule1F1B), interleaved (ScheduleInterleaved1F1B,
v >= 2), zb-h1 (ScheduleInterleavedZeroBubble, v = 1), zb-interleaved (the same with v >= 2),
zbv (ScheduleZBVZeroBubble, v = 2) and dualpipev (ScheduleDualPipeV, v = 2); the last two on the
V placement.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.peers.torch_pipelining import PEERS, measure_all, our_order
from rrfp_ray.job import run_job
from rrfp_ray.sim.trace import Trace
from rrfp_ray.sim.variability import SCENARIOS, generate, scenario_params

CPU_KEYS = ("all", "compute", "other", "op", "idle")
CPU_NOTE = (
    "CPU per executed op, us, per rank over the timed steps: all = the process's CPU clock (every thread, gloo's "
    "too) less its idle baseline (idle: the same process with no ops, over the same wall time) and the passes' own "
    "work (op: their sleeps and copies, by their thread's clock); compute: the main thread's clock less op; "
    "other: the rest of the process"
)
PARAMS = sorted({name for scenario in SCENARIOS for name in scenario_params(scenario)} - {"comm_ms"})


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.schedule.split(",") if name.strip()]
    trace = _checked(parser, "--trace" if args.trace else "--scenario", lambda: _trace(args, names=names))
    _checked(parser, "--schedule", lambda: [our_order(schedule=name, trace=trace) for name in names])
    if args.json and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"argument --json: no directory {Path(args.json).resolve().parent}")
    results = measure_all(
        schedules=names,
        trace=trace,
        iterations=args.iterations,
        warmup=args.warmup,
        payload_elems=args.payload_elems,
        timeout_s=args.timeout,
        cpu=args.cpu,
    )
    source = args.trace or f"{args.scenario} seed={args.variability_seed}"
    print(f"PyTorch pipelining, P={trace.stages} v={trace.chunks} M={trace.microbatches}, trace {source}")
    print(f"{'schedule':<16} {'PyTorch class':<30} {'measured ms':>12} {'ideal ms':>9} {'ratio':>6}  order")
    for name, r in results.items():
        same = {True: "= ours", False: "DIFFERS from ours", None: "-"}[r["order_matches"]]
        print(
            f"{name:<16} {r['pytorch_class']:<30} {r['measured_ms']:>12.1f} {r['ideal_ms']:>9.1f} "
            f"{r['ratio']:>6.3f}  {same}"
        )
    if args.cpu:
        print(CPU_NOTE)
        print(f"{'schedule':<16} {'rank':>4}" + "".join(f" {key:>9}" for key in CPU_KEYS))
        for name, r in results.items():
            for rank, figures in enumerate(r["cpu_per_rank"]):
                print(f"{name:<16} {rank:>4}" + "".join(f" {figures.get(key, float('nan')):9.1f}" for key in CPU_KEYS))
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": source, "results": results}, indent=2))


def _trace(args: argparse.Namespace, *, names: list[str]) -> Trace:
    if args.trace:
        return Trace.load(args.trace)
    chunked = any(not PEERS[name].chunks.allows(1) for name in names if name in PEERS)
    params = {name: getattr(args, name) for name in PARAMS if getattr(args, name) is not None}
    return generate(
        scenario=args.scenario,
        stages=args.stages,
        microbatches=args.microbatches,
        chunks=args.chunks or (2 if chunked else 1),
        seed=args.variability_seed,
        t_f=args.t_f,
        comm_ms=args.comm_ms,
        **params,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", help=f"comma-separated from: {', '.join(PEERS)} (default 1f1b)")
    parser.add_argument("--stages", type=_at_least(1), default=4, help="pipeline stages P = processes (default 4)")
    parser.add_argument("--microbatches", type=_at_least(1), default=16, help="microbatches M (default 16)")
    parser.add_argument(
        "--chunks", type=_at_least(1), help="chunks per stage v (default 2 for the interleaved and V ones, else 1)"
    )
    parser.add_argument("--scenario", default="none", help=f"'+'-joined names from: {', '.join(SCENARIOS)}")
    for name in PARAMS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, help="scenario parameter")
    parser.add_argument("--comm-ms", type=float, help="mean message latency in ms (also the comm scenario's mean)")
    parser.add_argument("--t-f", type=float, default=20.0, help="forward ms per op before the scenario (default 20)")
    parser.add_argument(
        "--variability-seed", type=_at_least(0), default=0, help="seed of the generated trace (default 0)"
    )
    parser.add_argument(
        "--trace", metavar="FILE", help="load this trace JSON (the shape and scenario flags are unused)"
    )
    parser.add_argument("--iterations", type=_at_least(1), default=5, help="timed steps per schedule (default 5)")
    parser.add_argument("--warmup", type=_at_least(0), default=1, help="untimed steps before them (default 1)")
    parser.add_argument(
        "--payload-elems", type=_at_least(1), default=4096, help="float32 elements per message (default 4096)"
    )
    parser.add_argument(
        "--timeout", type=_positive, default=300.0, help="seconds a rank waits on another (default 300)"
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="also print each rank's CPU per op, less its idle baseline (rrfp_ray.runtime.cpu)",
    )
    parser.add_argument("--json", metavar="OUT", help="write {trace, results: {schedule: figures}} here")
    return parser


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _checked(parser: argparse.ArgumentParser, flag: str, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except (ValueError, OSError) as error:
        parser.error(f"argument {flag}: {error}")


if __name__ == "__main__":
    run_job(main)
