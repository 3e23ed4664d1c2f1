"""Measured against simulated: run one synthetic trace on Ray and in the simulator.

Every policy runs on one driver (the stage actors sleep each op's trace duration and send
real tensors over gloo links); the simulator replays the very same trace. Per policy it
prints the median measured iteration time (optimizer step included), the simulated one
(the op schedule alone: the simulator has no optimizer step, so the ratio compares it with
the measured time less the step), and the speedup over the fixed baseline (1f1b,
interleaved when --chunks > 1, zbv for the V-placed policies), measured and predicted:

    python jobs/bench_runtime.py --scenario lognormal --sigma 0.3 --microbatches 16
    python jobs/bench_runtime.py --chunks 2 --policies zbv,ready-zbv,dualpipev,ready-dualpipev

The policies of one run share one pipeline, so they must share a placement: looped
(gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zb-interleaved, bf, bfw, cpw and their ready-*)
or V (zbv, dualpipev, ready-zbv, ready-dualpipev); a mix is refused before Ray starts.

With --trace FILE the trace's P, M and v set --stages, --microbatches and --chunks.

With --tp T each stage is T actors that agree on their ops (`rrfp_ray.policy.agreement`); it also
prints the TP-coordination share of the stages' time, the disagreements, rounds per
iteration (summed over stages; rank 0 of each) and ms per round. --rank-comm gives each TP
rank its own message latencies (the simulator then sees rank 0's):

    python jobs/bench_runtime.py --stages 2 --tp 2 --microbatches 8 --scenario lognormal --sigma 0.3
    python jobs/bench_runtime.py --stages 2 --tp 2 --microbatches 8 --scenario comm --comm-ms 2 --rank-comm

With --dp D the whole pipeline runs D times, each stage summing a synthetic gradient of --grad-mb
MB per chunk over its replicas (in --dp-bucket-mb buckets) as soon as the chunk's last
weight-gradient op is done (--no-overlap: after every stage's last op); it prints the exposed
share of the reduce time (past every stage's last op, and past the stage's own):

    python jobs/bench_runtime.py --dp 2 --stages 4 --microbatches 16 --grad-mb 25 --policies 1f1b,bfw
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from actors.local_ray import start_ray
from rrfp_ray.cli import (
    add_log_level_flag,
    add_scenario_flags,
    baseline_policy,
    config_error,
    configure_logging,
    file_dir,
    one_placement,
    variability,
    writable_dir,
    write_pictures,
)
from rrfp_ray.observe.telemetry import dp_summary, tp_summary

if TYPE_CHECKING:
    from rrfp_ray.sim.variability import Trace
    from rrfp_ray.train.config import PipelineConfig

FLAGS = {
    "tp": "--tp",
    "tp_protocol": "--tp-protocol",
    "tp_gather": "--tp-gather",
    "dp": "--dp",
    "dp_bucket_mb": "--dp-bucket-mb",
    "stages": "--stages",
    "chunks": "--chunks",
    "microbatches": "--microbatches",
    "cap": "--cap",
    "timeout_s": "--timeout",
    "scenario": "--scenario",
    "t_f": "--t-f",
    "params": "scenario parameters",
}
SHAPE = (("stages", "P", 4), ("microbatches", "M", 16), ("chunks", "v", 1))  # flag, trace key, default


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, PipelineConfig, list[Trace], list[str]]:
    """The flags, the pipeline, the trace of each TP rank (one unless --rank-comm) and the policies."""
    from rrfp_ray.train.config import PipelineConfig, VariabilityConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe = parser.add_argument_group("pipeline")
    for name, key, default in SHAPE:
        help = f"default {default}; with --trace, the trace's {key}"
        pipe.add_argument(f"--{name}", type=int, default=None, help=help)
    pipe.add_argument("--cap", default="2x", help="in-flight cap: 1x/2x of the hint's peak, a count, or inf")
    pipe.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (actors) per stage")
    pipe.add_argument("--tp-protocol", default="common", help="TP agreement: first or common")
    pipe.add_argument("--tp-gather", default="tcp", help="what carries the TP agreement's all-gather: tcp or collective")
    pipe.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the whole pipeline")
    pipe.add_argument("--dp-bucket-mb", type=float, default=25.0, help="MB of gradients per DP all-reduce bucket")
    pipe.add_argument(
        "--no-overlap", action="store_true", help="with --dp: reduce every gradient after every stage's last op"
    )
    pipe.add_argument("--grad-mb", type=float, default=25.0, help="with --dp: MB of synthetic gradient per chunk")
    pipe.add_argument(
        "--reduce-mb-per-s",
        type=float,
        default=None,
        help="with --dp: the simulator's reduction bandwidth (default: the measured bytes / reduce time of this run)",
    )
    pipe.add_argument(
        "--reduce-latency-ms", type=float, default=0.0, help="with --dp: the simulator's latency per bucket"
    )
    pipe.add_argument(
        "--rank-comm",
        action="store_true",
        help="with --tp: each TP rank's messages take their own latencies (the scenario drawn with seed + rank)",
    )
    pipe.add_argument("--timeout", type=float, default=60.0, help="seconds before a stalled stage is an error")
    bench = parser.add_argument_group("benchmark")
    bench.add_argument(
        "--policies", default=None, help="comma-separated (default: 1f1b,bf,bfw; interleaved,bf,bfw for v > 1)"
    )
    bench.add_argument("--payload-elems", type=int, default=4096, help="float32 elements per message")
    bench.add_argument("--iterations", type=int, default=5, help="per policy; the first is a warm-up when > 1")
    bench.add_argument("--json", default=None, metavar="OUT", help="write the per-policy figures here")
    bench.add_argument("--out", default=None, metavar="DIR", help="write a Perfetto trace and a diagram per policy here")
    add_scenario_flags(parser, default="lognormal")
    add_log_level_flag(parser)
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    if args.payload_elems < 1:
        parser.error(f"--payload-elems must be >= 1, got {args.payload_elems}")
    if args.grad_mb <= 0:
        parser.error(f"--grad-mb must be > 0, got {args.grad_mb:g}")
    if args.reduce_mb_per_s is not None and not args.reduce_mb_per_s > 0:
        parser.error(f"--reduce-mb-per-s must be > 0, got {args.reduce_mb_per_s:g}")
    if args.reduce_latency_ms < 0:
        parser.error(f"--reduce-latency-ms must be >= 0, got {args.reduce_latency_ms:g}")
    if args.rank_comm and (args.tp < 2 or args.trace):
        parser.error("--rank-comm needs --tp >= 2 and a scenario (it draws each rank's latencies; not with --trace)")
    if args.out:
        writable_dir(parser, flag="--out", path=args.out)
    if args.json:
        file_dir(parser, flag="--json", path=args.json)
    shape_from_trace(parser, args)
    baseline = baseline_policy(chunks=args.chunks)
    names = [n.strip() for n in (args.policies or f"{baseline},bf,bfw").split(",") if n.strip()]

    def pipeline_of(policy: str) -> PipelineConfig:
        return PipelineConfig(
            stages=args.stages,
            chunks=args.chunks,
            microbatches=args.microbatches,
            policy=policy,
            cap=args.cap,
            timeout_s=args.timeout,
            tp=args.tp,
            tp_protocol=args.tp_protocol,
            tp_gather=args.tp_gather,
            dp=args.dp,
            dp_bucket_mb=args.dp_bucket_mb,
            dp_overlap=not args.no_overlap,
        )

    try:
        pipeline = pipeline_of(baseline)
        seeds = range(args.variability_seed, args.variability_seed + (args.tp if args.rank_comm else 1))
        traces = [VariabilityConfig(**{**variability(args), "seed": seed}).trace(pipeline=pipeline) for seed in seeds]
    except ValidationError as error:
        config_error(parser, error, flags=FLAGS)
    except ValueError as error:
        parser.error(str(error))
    try:
        placement = one_placement({name: pipeline.resolved_policy(name) for name in names})
    except ValueError as error:
        parser.error(f"--policies: {error}")
    baseline = baseline_policy(chunks=args.chunks, placement=placement)
    try:
        pipeline = pipeline_of(baseline)
    except ValidationError as error:
        config_error(parser, error, flags=FLAGS)
    names = [baseline, *(n for n in dict.fromkeys(names) if n != baseline)]
    return args, pipeline, traces, names


def shape_from_trace(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill --stages, --microbatches and --chunks from --trace (a flag given as well must agree), else the defaults."""
    from rrfp_ray.sim.variability import Trace

    trace = None
    if args.trace is not None:
        try:
            trace = Trace.load(args.trace)
        except (OSError, ValueError) as error:
            parser.error(f"--trace {args.trace}: {error}")
    for name, key, default in SHAPE:
        given = getattr(args, name)
        if trace is None:
            setattr(args, name, default if given is None else given)
            continue
        found = getattr(trace, name)
        if given is not None and given != found:
            parser.error(f"--{name} {given} disagrees with --trace {args.trace}, whose {key} is {found}")
        setattr(args, name, found)


def measure(*, driver, pipeline, names: list[str], iterations: int) -> dict[str, list]:
    """Iteration reports per policy (the first dropped as warm-up when there are more);
    policies take turns so drift hits all of them alike (`StageGroup.take_turns`, in the driver)."""
    import ray

    turns = {name: (pipeline.resolved_policy(name), None) for name in names}
    reports = ray.get(driver.take_turns.remote(runs=turns, rounds=iterations))
    return {name: runs[1:] if len(runs) > 1 else runs for name, runs in reports.items()}


def summarize(*, reports: dict[str, list], simulated: dict[str, float], baseline: str) -> dict[str, dict[str, float]]:
    """`measured_ms`: the full iteration, optimizer step included. The simulator has no step, so
    `ratio` compares it with the measured op schedule alone (`schedule_ms`: the makespan less
    the step that followed the last op)."""
    measured = {name: statistics.median(r.makespan_ms for r in runs) for name, runs in reports.items()}
    schedule = {name: statistics.median(r.schedule_ms for r in runs) for name, runs in reports.items()}
    return {
        name: {
            "measured_ms": measured[name],
            "step_ms": statistics.median(r.step_ms for r in runs),
            "schedule_ms": schedule[name],
            "sim_ms": simulated[name],
            "ratio": schedule[name] / simulated[name],
            "speedup_measured": measured[baseline] / measured[name],
            "speedup_predicted": simulated[baseline] / simulated[name],
            **tp_summary(runs),
            **dp_summary(runs),
        }
        for name, runs in reports.items()
    }


def predict_exposed(
    *, pipeline: PipelineConfig, trace: Trace, names: list[str], reports: dict[str, list], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """The simulator's exposed reduce share per policy (`rrfp_ray.sim.reduction`), its bandwidth
    `--reduce-mb-per-s` or else calibrated on this run's measured bytes per reduce ms."""
    from rrfp_ray.sim.reduction import ReduceModel, with_reduction
    from rrfp_ray.sim.simulator import layout_for, simulate

    measured = [s for runs in reports.values() for r in runs for s in r.stages if s.reduce_ms > 0]
    calibrated = sum(s.reduce_bytes for s in measured) / sum(s.reduce_ms for s in measured)
    model = ReduceModel(
        chunk_bytes=int(args.grad_mb * 2**20) // 4 * 4,
        bucket_bytes=max(1, int(pipeline.dp_bucket_mb * 2**20)),
        bytes_per_ms=calibrated if args.reduce_mb_per_s is None else args.reduce_mb_per_s * 2**20 / 1e3,
        latency_ms=args.reduce_latency_ms,
        overlap=pipeline.dp_overlap,
    )
    predicted = {}
    for name in names:
        policy = pipeline.resolved_policy(name)
        report = simulate(policy=policy, trace=trace, cap=pipeline.cap, buffer_limit=pipeline.buffer_limit)
        summary = dp_summary([with_reduction(report, layout=layout_for(policy=policy, trace=trace), model=model)])
        predicted[name] = {
            "sim_dp_exposed_fraction": summary["dp_exposed_fraction"],
            "sim_dp_exposed_ms": summary["dp_exposed_ms"],
            "sim_reduce_mb_per_s": model.bytes_per_ms * 1e3 / 2**20,
        }
    return predicted


def main(argv: list[str] | None = None) -> dict:
    args, pipeline, traces, names = parse(argv)
    trace = traces[0]
    import ray

    from actors.driver import PipelineDriver
    from rrfp_ray.runtime.synthetic import SyntheticWorkload
    from rrfp_ray.sim.simulator import simulate

    cap = pipeline.cap
    simulated = {
        name: simulate(
            policy=pipeline.resolved_policy(name), trace=trace, cap=cap, buffer_limit=pipeline.buffer_limit
        ).makespan_ms
        for name in names
    }
    log_level = configure_logging(args)
    print(start_ray(num_cpus=max(2, pipeline.actors), log_level=log_level))
    driver = PipelineDriver.remote(
        pipeline=pipeline,
        workload=SyntheticWorkload(
            trace=trace,
            payload_elems=args.payload_elems,
            rank_comm=tuple(traces) if args.rank_comm else (),
            grad_elems=int(args.grad_mb * 2**20) // 4 if pipeline.dp > 1 else 0,
        ),
    )
    try:
        print(f"{pipeline.actors} stage actors up in {ray.get(driver.startup_seconds.remote()):.1f} s")
        reports = measure(driver=driver, pipeline=pipeline, names=names, iterations=args.iterations)
        ray.get(driver.shutdown.remote())
    finally:
        ray.kill(driver)
    results = summarize(reports=reports, simulated=simulated, baseline=names[0])
    if pipeline.dp > 1:
        for name, figures in predict_exposed(pipeline=pipeline, trace=trace, names=names, reports=reports, args=args).items():
            results[name].update(figures)
    if args.out:
        write_pictures(out=Path(args.out), runs=reports)
    print(
        f"\nD={pipeline.dp} P={pipeline.stages} v={pipeline.chunks} T={pipeline.tp} M={pipeline.microbatches} cap={pipeline.cap} "
        f"scenario={args.scenario} t_f={args.t_f:g} ms, median of {max(1, args.iterations - 1)} iteration(s)"
    )
    print(
        "measured ms: the full iteration, optimizer step included (step ms: its share after the last op); "
        "the simulator has no step, so meas/sim = (measured - step) / sim"
    )
    print(
        f"{'policy':<12} {'measured ms':>11} {'step ms':>7} {'sim ms':>9} {'meas/sim':>8} {'speedup':>8} "
        f"{'predicted':>9} {'meas/pred':>9}"
        + (f" {'TP coord':>8} {'disagree':>8} {'rounds':>6} {'ms/round':>8}" if pipeline.tp > 1 else "")
        + (f" {'reduce ms':>9} {'exposed':>7} {'own':>6} {'sim exp':>7}" if pipeline.dp > 1 else "")
    )
    for name, r in results.items():
        print(
            f"{name:<12} {r['measured_ms']:11.1f} {r['step_ms']:7.2f} {r['sim_ms']:9.1f} {r['ratio']:8.3f} "
            f"{r['speedup_measured']:8.3f} {r['speedup_predicted']:9.3f} {r['speedup_measured'] / r['speedup_predicted']:9.3f}"
            + (
                f" {r['tp_coord_fraction']:8.2%} {r['tp_disagreements']:8.1f} {r['tp_rounds']:6.1f} {r['tp_ms_per_round']:8.3f}"
                if pipeline.tp > 1
                else ""
            )
            + (
                f" {r['dp_reduce_ms']:9.1f} {r['dp_exposed_fraction']:7.1%} {r['dp_exposed_own_fraction']:6.1%}"
                f" {r['sim_dp_exposed_fraction']:7.1%}"
                if pipeline.dp > 1
                else ""
            )
        )
    if pipeline.dp > 1:
        print(
            f"DP: {args.grad_mb:g} MB of gradient per chunk in {pipeline.dp_bucket_mb:g} MB buckets, "
            f"{'no overlap' if args.no_overlap else 'overlapped'}; exposed: the reduce time past every stage's last op "
            "(what it adds to the iteration), own: past the stage's own last op (median over stages and iterations); "
            f"sim exp: the simulator's exposed share at {next(iter(results.values()))['sim_reduce_mb_per_s']:.1f} MB/s "
            f"and {args.reduce_latency_ms:g} ms a bucket"
        )
    summary = {"policies": results}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    return summary


if __name__ == "__main__":
    main()
