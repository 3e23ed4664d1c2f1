"""Simulate one iteration under several policies on one duration trace and compare them
(`rrfp-simulate`, or by path: `python jobs/simulate.py`).

    python jobs/simulate.py --stages 8 --microbatches 32 --scenario lognormal --sigma 0.5
    python jobs/simulate.py --scenario multimodal+comm --policies 1f1b,bf --cap 1x --json out.json
    python jobs/simulate.py --trace run.json --policies 1f1b,zb-h1,gpipe,bfw,planned --cap 1x --json out.json

Speedups are against fixed 1f1b, or fixed interleaved when --chunks > 1; the lower bound is
`rrfp_ray.sim.bounds.bounds` for the policy's layout (with or without the B/W split).

A trace file may hold several iterations (``{"iterations": [...]}``), and ``--iterations N``
generates N of the scenario; every iteration is simulated in order, and per policy the
makespan is the mean over them (``iteration_ms`` in ``--json`` lists each). ``planned`` plans
iteration k from k's features and the simulated telemetry of iterations <= k-2
(`rrfp_ray.plan.loop`); ``planned-fixed`` plans with fixed schedules only; ``oracle``, the
same search with the true durations, is printed beside ``planned``. Where the trace records each
microbatch's samples (``--scenario varlen --docs 4``), the plans pack them into microbatches of
balanced cost first, and the spread of microbatch costs before and after is printed.

A cap ``Kx`` is K x the peak in-flight microbatches per stage of the policy's reference list, in
activation bytes where the trace has them (`rrfp_ray.sim.memory`; ``planned`` gets bfw's reference
on the data in its own order).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rrfp_ray.cli import (
    Flag,
    add_flags,
    add_log_level_flag,
    configure_logging,
    count,
    file_dir,
    model_flags,
    writable_dir,
    write_pictures,
)
from rrfp_ray.job import run_job
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.loop import Planning, run
from rrfp_ray.plan.packing import spread
from rrfp_ray.plan.planner import PlannerConfig
from rrfp_ray.plan.plans import Plan
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy, make_policy
from rrfp_ray.schedule.validate import Hint, parse_order, read_hint
from rrfp_ray.sim.bounds import bounds
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.trace import Trace, load_iterations, save_iterations
from rrfp_ray.sim.variability import SCENARIOS, describe, generate, generate_iterations, scenario_params
from rrfp_ray.train.sections import ScheduleConfig, ShapeConfig

PARAMS = sorted({name for scenario in SCENARIOS for name in scenario_params(scenario)} - {"comm_ms"})


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args)
    traces = load_or_generate(parser, args)
    trace = traces[0]
    cap = checked(parser, "--cap", lambda: Cap.parse(args.cap))
    baseline = "1f1b" if trace.chunks == 1 else "interleaved"
    hint = checked(parser, "--hint", lambda: load_hint(args.hint, trace)) if args.hint else None
    config = checked(
        parser,
        "--plan-simulations",
        lambda: PlannerConfig(hints=("bfw",), cap=cap, simulations=args.plan_simulations, samples=args.plan_samples),
    )
    names = args.policies.split(",") if args.policies else None
    if names and Planning.PLANNED.value in names and Planning.ORACLE.value not in names:
        names.insert(names.index(Planning.PLANNED.value) + 1, Planning.ORACLE.value)
    if names:
        policies = [
            Planning.of(n) or checked(parser, "--policies", lambda n=n: policy(n, trace, hint=hint)) for n in names
        ]
    else:
        policies = default_policies(trace)
    reference = checked(parser, "--microbatches", lambda: policy(baseline, trace))
    if args.json:
        file_dir(parser, flag="--json", path=args.json)
    if args.out:
        writable_dir(parser, flag="--out", path=args.out)
    if args.save_trace:
        checked(parser, "--save-trace", lambda: save_iterations(traces, args.save_trace))
    results, reports = compare(policies=policies, reference=reference, traces=traces, cap=cap, config=config)
    print(
        f"P={trace.stages} v={trace.chunks} M={trace.microbatches} iterations={len(traces)} "
        f"trace={args.trace or f'{args.scenario} seed={args.seed}'} cap={cap}; speedup vs fixed {baseline}"
    )
    print(table(results))
    for name, r in results.items():
        if "cost_spread" in r:
            before, after = r["cost_spread"]["before"], r["cost_spread"]["after"]
            print(
                f"{name}: packing, microbatch cost spread (max/min, mean over iterations) {before:.3f} -> {after:.3f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": baseline, "cap": str(cap), "policies": results}, indent=2))
    if args.out:
        diagrams = write_pictures(out=Path(args.out), runs=reports)
        print(f"wrote traces{' and diagrams' if diagrams else ''} to {args.out}/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, model=ShapeConfig, flags=SHAPE)
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
    parser.add_argument(
        "--iterations", type=count, default=1, help="iterations of the scenario to generate (default 1)"
    )
    add_flags(parser, model=ScheduleConfig, flags=PLAN)
    parser.add_argument("--trace", help="load this trace JSON instead of generating one")
    parser.add_argument("--save-trace", help="write the trace used to this JSON file")
    parser.add_argument(
        "--policies",
        help="comma-separated (default gpipe,1f1b,zb-h1,bf,bfw; interleaved,bf,bfw when v > 1); also "
        + ", ".join(p.value for p in Planning),
    )
    parser.add_argument(
        "--hint", help='JSON {stage: ["0F0", ...]} or torch\'s CSV schedule: the order for policies hint / ready-hint'
    )
    parser.add_argument("--cap", default="2x", help="in-flight cap: 1x, 2x, 1.5x, a count, or inf (default 2x)")
    parser.add_argument("--json", help="write {policies: {name: {makespan_ms, ...}}} here")
    parser.add_argument("--out", help="write a Perfetto trace and a pipeline diagram per policy into this directory")
    add_log_level_flag(parser)
    return parser


# A trace's shape: given, it must agree with a --trace's; else 4 stages of 1 chunk, 4P microbatches.
SHAPE = model_flags(
    ShapeConfig,
    without=("layer_split",),
    flags=(
        Flag("stages", default=None, default_note="4", parse=count),
        Flag("chunks", default=None, default_note="1", parse=count),
        Flag("microbatches", default=None, default_note="4P", parse=count),
    ),
)


# The planner's search budget, as the training jobs spell it.
PLAN = model_flags(
    ScheduleConfig,
    only=("plan_simulations", "plan_samples"),
    flags=(Flag("plan_simulations", parse=count), Flag("plan_samples", parse=count)),
)


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


def load_or_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Trace, ...]:
    if args.trace:
        traces = checked(parser, "--trace", lambda: load_iterations(args.trace))
        trace = traces[0]
        for flag, value, actual in (
            ("--iterations", args.iterations if args.iterations != 1 else None, len(traces)),
            ("--stages", args.stages, trace.stages),
            ("--chunks", args.chunks, trace.chunks),
            ("--microbatches", args.microbatches, trace.microbatches),
        ):
            if value is not None and value != actual:
                parser.error(f"argument {flag}: {value} disagrees with the trace's {actual}")
        for name, value in {**given_params(args), "comm_ms": args.comm_ms}.items():
            if value is not None:
                parser.error(f"argument --{name.replace('_', '-')}: not used with --trace")
        return traces
    stages = args.stages or 4
    base = {"stages": stages, "microbatches": args.microbatches or 4 * stages, "chunks": args.chunks or 1}
    names = args.scenario.split("+")
    checked(parser, "--scenario", lambda: [scenario_params(name.strip()) for name in names])
    one = {"stages": 1, "microbatches": 1, "chunks": 1, "seed": 0}
    for name, value in given_params(args).items():
        taker = next((n for n in names if name in scenario_params(n.strip())), None)
        if taker is None:
            parser.error(f"argument --{name}: scenario {args.scenario!r} takes no {name}")
        checked(
            parser,
            f"--{name}",
            lambda taker=taker, name=name, value=value: generate(scenario=taker, **one, **{name: value}),
        )
    checked(parser, "--comm-ms", lambda: generate(scenario="none", **one, comm_ms=args.comm_ms))
    checked(parser, "--t-f", lambda: generate(scenario="none", **one, t_f=args.t_f))
    return generate_iterations(
        iterations=args.iterations,
        scenario=args.scenario,
        **base,
        seed=args.seed,
        t_f=args.t_f,
        comm_ms=args.comm_ms,
        **given_params(args),
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
    *,
    policies: list[Policy | Planning],
    reference: Policy,
    traces: tuple[Trace, ...],
    cap: Cap,
    config: PlannerConfig,
) -> tuple[dict[str, dict[str, Any]], dict[str, list[IterationReport]]]:
    """Per policy, every iteration simulated in order; makespans are the means over the iterations."""
    base = statistics.fmean(simulate(policy=reference, trace=t, cap=cap).makespan_ms for t in traces)
    results, reports = {}, {}
    for p in policies:
        spreads = None
        if isinstance(p, Planning):
            done = run(planning=p, traces=traces, config=config)
            name, runs = p.value, [report for _, report in done]
            split = True
            if traces[0].samples is not None:
                spreads = [packing_spread(trace=t, plan=plan) for t, (plan, _) in zip(traces, done)]
        else:
            name, runs, split = (
                p.name,
                [simulate(policy=p, trace=t, cap=cap, iteration=k) for k, t in enumerate(traces)],
                p.split,
            )
        reports[name] = runs
        makespan = statistics.fmean(r.makespan_ms for r in runs)
        results[name] = {
            "makespan_ms": makespan,
            "iteration_ms": [r.makespan_ms for r in runs],
            "speedup_vs_1f1b": base / makespan,
            "bubble": statistics.fmean(r.bubble for r in runs),
            "peak_inflight": max(r.peak_inflight for r in runs),
            "lb_ms": statistics.fmean(bounds(trace=t, split=split).best_ms for t in traces),
        }
        if spreads:
            results[name]["cost_spread"] = {
                "before": statistics.fmean(b for b, _ in spreads),
                "after": statistics.fmean(a for _, a in spreads),
            }
    return results, reports


def packing_spread(*, trace: Trace, plan: Plan) -> tuple[float, float]:
    """max/min of the microbatches' cost features before and after the plan's packing."""
    packed = trace if plan.packing is None else trace.repacked(plan.packing)
    return spread(trace.features), spread(packed.features)


def table(results: dict[str, dict[str, float]]) -> str:
    lines = [f"{'policy':<20} {'makespan ms':>12} {'speedup':>8} {'bubble %':>9} {'peak in-flight':>15} {'/ bound':>8}"]
    for name, r in results.items():
        lines.append(
            f"{name:<20} {r['makespan_ms']:>12.1f} {r['speedup_vs_1f1b']:>7.3f}x {100 * r['bubble']:>9.1f} "
            f"{r['peak_inflight']:>15d} {r['makespan_ms'] / r['lb_ms']:>8.3f}"
        )
    return "\n".join(lines)


def command() -> None:
    """The `rrfp-simulate` command: `main` as every job runs it (`rrfp_ray.job.run_job`)."""
    run_job(main)
