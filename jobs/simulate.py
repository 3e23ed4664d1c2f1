"""Simulate one iteration under several policies on one duration trace and compare them.

    python jobs/simulate.py --stages 8 --microbatches 32 --scenario lognormal --sigma 0.5
    python jobs/simulate.py --scenario multimodal+comm --policies 1f1b,bf --cap 1x --json out.json

Speedups are against fixed 1f1b, or fixed interleaved when --chunks > 1; the lower bound is
`rrfp_ray.sim.simulator.bounds` for the policy's layout (with or without the B/W split).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rrfp_ray.cli import add_log_level_flag, configure_logging, file_dir, writable_dir, write_pictures
from rrfp_ray.observe.telemetry import IterationReport  # noqa: E402
from rrfp_ray.policy.arbiter import Cap  # noqa: E402
from rrfp_ray.policy.pickers import Policy, make_policy  # noqa: E402
from rrfp_ray.schedule.validate import Hint, parse_order, read_hint  # noqa: E402
from rrfp_ray.sim.simulator import bounds, simulate  # noqa: E402
from rrfp_ray.sim.variability import SCENARIOS, Trace, describe, generate, scenario_params  # noqa: E402

PARAMS = sorted({name for scenario in SCENARIOS for name in scenario_params(scenario)} - {"comm_ms"})


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args)
    trace = load_or_generate(parser, args)
    cap = checked(parser, "--cap", lambda: Cap.parse(args.cap))
    baseline = "1f1b" if trace.chunks == 1 else "interleaved"
    hint = checked(parser, "--hint", lambda: load_hint(args.hint, trace)) if args.hint else None
    if args.policies:
        policies = [
            checked(parser, "--policies", lambda n=n: policy(n, trace, hint=hint)) for n in args.policies.split(",")
        ]
    else:
        policies = default_policies(trace)
    reference = checked(parser, "--microbatches", lambda: policy(baseline, trace))
    if args.json:
        file_dir(parser, flag="--json", path=args.json)
    if args.out:
        writable_dir(parser, flag="--out", path=args.out)
    if args.save_trace:
        checked(parser, "--save-trace", lambda: trace.save(args.save_trace))
    results, reports = compare(policies=policies, reference=reference, trace=trace, cap=cap)
    print(
        f"P={trace.stages} v={trace.chunks} M={trace.microbatches} "
        f"trace={args.trace or f'{args.scenario} seed={args.seed}'} cap={cap}; speedup vs fixed {baseline}"
    )
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": baseline, "cap": str(cap), "policies": results}, indent=2))
    if args.out:
        write_pictures(out=Path(args.out), runs={name: [report] for name, report in reports.items()})
        print(f"wrote traces and diagrams to {args.out}/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=count, help="pipeline stages P (default 4)")
    parser.add_argument("--chunks", type=count, help="chunks per stage v (default 1)")
    parser.add_argument("--microbatches", type=count, help="microbatches M (default 4P)")
    parser.add_argument(
        "--scenario",
        default="none",
        help="; ".join(f"{name}: {describe(name)}" for name in SCENARIOS) + ". Join with '+' (default none)",
    )
    for name in PARAMS:
        takes = [s for s in SCENARIOS if name in scenario_params(s)]
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, help=f"scenario parameter of {', '.join(takes)}")
    parser.add_argument("--comm-ms", type=float, help="mean message latency in ms (also the comm scenario's mean)")
    parser.add_argument("--t-f", type=float, default=20.0, help="forward ms per op before the scenario (default 20)")
    parser.add_argument("--seed", type=seed, default=0, help="trace seed (default 0)")
    parser.add_argument("--trace", help="load this trace JSON instead of generating one")
    parser.add_argument("--save-trace", help="write the trace used to this JSON file")
    parser.add_argument(
        "--policies", help="comma-separated (default gpipe,1f1b,zb-h1,bf,bfw; interleaved,bf,bfw when v > 1)"
    )
    parser.add_argument(
        "--hint", help='JSON {stage: ["0F0", ...]} or torch\'s CSV schedule: the order for policies hint / ready-hint'
    )
    parser.add_argument("--cap", default="2x", help="in-flight cap: 1x, 2x, 1.5x, a count, or inf (default 2x)")
    parser.add_argument("--json", help="write {policies: {name: {makespan_ms, ...}}} here")
    parser.add_argument("--out", help="write a Perfetto trace and a pipeline diagram per policy into this directory")
    add_log_level_flag(parser)
    return parser


def count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def checked(parser: argparse.ArgumentParser, flag: str, make: Callable[[], Any]) -> Any:
    """make(), or an argparse error naming `flag` with the library's ValueError."""
    try:
        return make()
    except (ValueError, OSError) as error:
        parser.error(f"argument {flag}: {error}")


def given_params(args: argparse.Namespace) -> dict[str, float]:
    return {name: getattr(args, name) for name in PARAMS if getattr(args, name) is not None}


def load_or_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Trace:
    if args.trace:
        trace = checked(parser, "--trace", lambda: Trace.load(args.trace))
        for flag, value, actual in (
            ("--stages", args.stages, trace.stages),
            ("--chunks", args.chunks, trace.chunks),
            ("--microbatches", args.microbatches, trace.microbatches),
        ):
            if value is not None and value != actual:
                parser.error(f"argument {flag}: {value} disagrees with the trace's {actual}")
        for name, value in {**given_params(args), "comm_ms": args.comm_ms}.items():
            if value is not None:
                parser.error(f"argument --{name.replace('_', '-')}: not used with --trace")
        return trace
    stages = args.stages or 4
    base = {"stages": stages, "microbatches": args.microbatches or 4 * stages, "chunks": args.chunks or 1}
    names = args.scenario.split("+")
    checked(parser, "--scenario", lambda: [scenario_params(name.strip()) for name in names])
    one = {"stages": 1, "microbatches": 1, "chunks": 1, "seed": 0}
    for name, value in given_params(args).items():
        taker = next((n for n in names if name in scenario_params(n.strip())), None)
        if taker is None:
            parser.error(f"argument --{name}: scenario {args.scenario!r} takes no {name}")
        checked(parser, f"--{name}", lambda: generate(scenario=taker, **one, **{name: value}))
    checked(parser, "--comm-ms", lambda: generate(scenario="none", **one, comm_ms=args.comm_ms))
    checked(parser, "--t-f", lambda: generate(scenario="none", **one, t_f=args.t_f))
    return generate(
        scenario=args.scenario, **base, seed=args.seed, t_f=args.t_f, comm_ms=args.comm_ms, **given_params(args)
    )


def default_policies(trace: Trace) -> list[Policy]:
    """gpipe, 1f1b, zb-h1, bf, bfw (interleaved, bf, bfw when v > 1), less those this shape refuses."""
    names = ["gpipe", "1f1b", "zb-h1", "bf", "bfw"] if trace.chunks == 1 else ["interleaved", "bf", "bfw"]
    policies = []
    for name in names:
        try:
            policies.append(policy(name, trace))
        except ValueError as error:
            print(f"skipping {name}: {error}", file=sys.stderr)
    return policies


def policy(name: str, trace: Trace, *, hint: Hint | None = None) -> Policy:
    return make_policy(name=name, stages=trace.stages, chunks=trace.chunks, microbatches=trace.microbatches, hint=hint)


def load_hint(path: str, trace: Trace) -> Hint:
    data = read_hint(Path(path).read_text())
    return parse_order(data, stages=trace.stages, chunks=trace.chunks, microbatches=trace.microbatches)


def compare(
    *, policies: list[Policy], reference: Policy, trace: Trace, cap: Cap
) -> tuple[dict[str, dict[str, float]], dict[str, IterationReport]]:
    base = simulate(policy=reference, trace=trace, cap=cap).makespan_ms
    results, reports = {}, {}
    for p in policies:
        report = reports[p.name] = simulate(policy=p, trace=trace, cap=cap)
        results[p.name] = {
            "makespan_ms": report.makespan_ms,
            "speedup_vs_1f1b": base / report.makespan_ms,
            "bubble": report.bubble,
            "peak_inflight": report.peak_inflight,
            "lb_ms": bounds(trace=trace, split=p.split).best_ms,
        }
    return results, reports


def table(results: dict[str, dict[str, float]]) -> str:
    lines = [f"{'policy':<20} {'makespan ms':>12} {'speedup':>8} {'bubble %':>9} {'peak in-flight':>15} {'/ bound':>8}"]
    for name, r in results.items():
        lines.append(
            f"{name:<20} {r['makespan_ms']:>12.1f} {r['speedup_vs_1f1b']:>7.3f}x {100 * r['bubble']:>9.1f} "
            f"{r['peak_inflight']:>15d} {r['makespan_ms'] / r['lb_ms']:>8.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
