"""The library of `jobs/bench_runtime.py`: a synthetic trace measured on Ray against the
simulator's prediction of the very same trace, with and without the transport model.

Per policy: the median measured iteration (optimizer step included) and its op schedule
(less the step, which the simulator lacks); the simulated makespan, plain and with the
`TransportModel` whose per-message cost this run measured (`message_cost_ms`); the speedup
over the baseline, measured and predicted; and the runtime's per-op overhead
(`rrfp_ray.runtime.breakdown`). The job's flags are checked here too (`checked`), before Ray starts.
"""

from __future__ import annotations

import argparse
import math
import statistics

from pydantic import ValidationError

from benchmarks.runtime_planned import planned_refusal
from rrfp_ray.cli import (
    PIPELINE_FLAGS,
    Flag,
    baseline_policy,
    config_error,
    file_dir,
    flag_names,
    flag_values,
    model_flags,
    one_placement,
    scenario_flags,
    variability,
    writable_dir,
)
from rrfp_ray.observe.telemetry import IterationReport, dp_summary, tp_summary
from rrfp_ray.runtime.breakdown import Phase
from rrfp_ray.runtime.breakdown import summarize as summarize_phases
from rrfp_ray.runtime.cpu import Role, per_op_us
from rrfp_ray.runtime.synthetic import LayerModel
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.sim.simulator import TransportModel, layout_for, simulate
from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.config import PLANNED, PipelineConfig

SHAPE = (("stages", "P", 4), ("microbatches", "M", 16), ("chunks", "v", 1))  # flag, trace key, default
PIPELINE = model_flags(  # the policy is each run's own
    PipelineConfig,
    without=(
        "policy",
        "hint",
        "buffer_limit",
        "link_timeout_s",
        "zero",
        "precision",
        "activation_checkpointing",
    ),
    flags=(
        *PIPELINE_FLAGS,
        *(
            Flag(name, default=None, help=f"default {default}; with --trace, the trace's {key}")
            for name, key, default in SHAPE
        ),
    ),
)
VARIABILITY = scenario_flags(scenario="lognormal")
FLAGS = {**flag_names(PIPELINE), **flag_names(VARIABILITY), "params": "scenario parameters"}


def shape_from_trace(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill --stages, --microbatches and --chunks from --trace (a flag given as well must agree), else the defaults."""
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


def checked(
    parser: argparse.ArgumentParser, *, args: argparse.Namespace
) -> tuple[PipelineConfig, list[Trace], list[str]]:
    """The flags checked (errors name the flag): the pipeline, the trace of each TP rank (one unless
    --rank-comm) and the policies, the baseline first."""
    from rrfp_ray.train.config import VariabilityConfig

    if args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    if args.message_ms is not None and not args.message_ms >= 0:
        parser.error(f"--message-ms must be >= 0, got {args.message_ms:g}")
    if args.payload_elems < 1:
        parser.error(f"--payload-elems must be >= 1, got {args.payload_elems}")
    if args.grad_mb <= 0:
        parser.error(f"--grad-mb must be > 0, got {args.grad_mb:g}")
    if not 1 <= args.grad_layers <= int(args.grad_mb * 2**20) // 4:
        parser.error(
            f"--grad-layers must be >= 1 and at most the --grad-mb payload's float32 elements, got {args.grad_layers}"
        )
    if args.reduce_mb_per_s is not None and not args.reduce_mb_per_s > 0:
        parser.error(f"--reduce-mb-per-s must be > 0, got {args.reduce_mb_per_s:g}")
    if args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    if args.layer_mb < 0:
        parser.error(f"--layer-mb must be >= 0, got {args.layer_mb:g}")
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
        return PipelineConfig(**flag_values(args, flags=PIPELINE), policy=policy)

    try:
        pipeline = pipeline_of(baseline)
        seeds = range(args.variability_seed, args.variability_seed + (args.tp if args.rank_comm else 1))
        traces = [
            VariabilityConfig(**{**variability(args, flags=VARIABILITY), "seed": seed}).trace(pipeline=pipeline)
            for seed in seeds
        ]
    except ValidationError as error:
        config_error(parser, error, flags=FLAGS)
    except ValueError as error:
        parser.error(str(error))
    try:
        placement = one_placement({name: pipeline.resolved_policy(name) for name in names if name != PLANNED})
    except ValueError as error:
        parser.error(f"--policies: {error}")
    if PLANNED in names and (refusal := planned_refusal(args, pipeline=pipeline, names=names)):
        parser.error(refusal)
    baseline = baseline_policy(chunks=args.chunks, placement=placement)
    try:
        pipeline = pipeline_of(baseline)
    except ValidationError as error:
        config_error(parser, error, flags=FLAGS)
    try:
        layer_model(args, pipeline=pipeline).ranges(virtual_stages=pipeline.layout.virtual_stages)
    except ValueError as error:
        parser.error(f"--split: {error} (--layers {args.layers} per virtual stage)")
    if pipeline.balance.rebalance and (args.layers < 2 or pipeline.layer_split is not None):
        parser.error("--rebalance starts each policy evenly split: give it --layers 2 or more a stage, and no --split")
    names = [baseline, *(n for n in dict.fromkeys(names) if n != baseline)]
    return pipeline, traces, names


def layer_model(args: argparse.Namespace, *, pipeline: PipelineConfig) -> LayerModel:
    """The synthetic model --layers, --layer-mb and --split describe."""
    return LayerModel(
        layers=args.layers * pipeline.layout.virtual_stages,
        layer_bytes=int(args.layer_mb * 2**20),
        split=pipeline.layer_split,
    )


def simulated_ms(
    *, pipeline: PipelineConfig, trace: Trace, names: list[str], transport: TransportModel | None = None
) -> dict[str, float]:
    return {
        name: simulate(
            policy=pipeline.resolved_policy(name),
            trace=trace,
            cap=pipeline.cap,
            buffer_limit=pipeline.buffer_limit,
            transport=transport,
        ).makespan_ms
        for name in names
    }


def measure(*, driver, pipeline, names: list[str], iterations: int) -> dict[str, list]:
    """Iteration reports per policy (the first dropped as warm-up when there are more);
    policies take turns so drift hits all of them alike (`StageGroup.take_turns`, in the driver)."""
    import ray

    turns = {name: (pipeline.resolved_policy(name), None) for name in names}
    reports = ray.get(driver.take_turns.remote(runs=turns, rounds=iterations))
    return {name: runs[1:] if len(runs) > 1 else runs for name, runs in reports.items()}


def message_cost_ms(*, reports: dict[str, list[IterationReport]]) -> float:
    """The runtime's cost of one message, measured: the median `Phase.MESSAGE` (a message's hand-off by
    the sending compute thread until the receiving one can start its op, the injected latency excluded),
    over every message of the run: what `TransportModel.message_ms` stands for."""
    stages = (s.overhead_us for runs in reports.values() for r in runs for s in r.stages)
    median = summarize_phases(stages)[Phase.MESSAGE][0]
    return 0.0 if math.isnan(median) else median / 1e3


def summarize(
    *, reports: dict[str, list], simulated: dict[str, float], with_transport: dict[str, float], baseline: str
) -> dict[str, dict[str, float]]:
    """`measured_ms`: the full iteration, optimizer step included. The simulator has no step, so
    `ratio` compares it with the measured op schedule alone (`schedule_ms`: the makespan less
    the step that followed the last op); `ratio_transport` with the simulation under the transport model."""
    measured = {name: statistics.median(r.makespan_ms for r in runs) for name, runs in reports.items()}
    schedule = {name: statistics.median(r.schedule_ms for r in runs) for name, runs in reports.items()}
    return {
        name: {
            "measured_ms": measured[name],
            "step_ms": statistics.median(r.step_ms for r in runs),
            "schedule_ms": schedule[name],
            "sim_ms": simulated[name],
            "ratio": schedule[name] / simulated[name],
            "sim_transport_ms": with_transport[name],
            "ratio_transport": schedule[name] / with_transport[name],
            "speedup_measured": measured[baseline] / measured[name],
            "speedup_predicted": simulated[baseline] / simulated[name],
            "cpu_us_per_op": cpu_per_op(runs).get("all", math.nan),
            **tp_summary(runs),
            **dp_summary(runs),
        }
        for name, runs in reports.items()
    }


def cpu_per_op(runs: list[IterationReport]) -> dict[str, float]:
    """`rrfp_ray.runtime.cpu.per_op_us` of one policy's runs: each stage actor's iterations pooled, the median over
    them."""
    return per_op_us([s.cpu for s in actor] for actor in zip(*(r.stages for r in runs)))


def predict_exposed(
    *, pipeline: PipelineConfig, trace: Trace, names: list[str], reports: dict[str, list], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """The simulator's exposed reduce share per policy (`rrfp_ray.sim.reduction`), its bandwidth
    `--reduce-mb-per-s` or else calibrated on this run's measured bytes per reduce ms."""
    from rrfp_ray.sim.reduction import ReduceModel, with_reduction

    measured = [s for runs in reports.values() for r in runs for s in r.stages if s.reduce_ms > 0]
    calibrated = sum(s.reduce_bytes for s in measured) / sum(s.reduce_ms for s in measured)
    model = ReduceModel(
        chunk_bytes=int(args.grad_mb * 2**20) // 4 * 4,
        bucket_bytes=max(1, int(pipeline.dp_bucket_mb * 2**20)),
        bytes_per_ms=calibrated if args.reduce_mb_per_s is None else args.reduce_mb_per_s * 2**20 / 1e3,
        latency_ms=args.reduce_latency_ms,
        overlap=pipeline.dp_overlap,
        layers=args.grad_layers,
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


def compare(
    *,
    reports: dict[str, list],
    simulated: dict[str, float],
    pipeline: PipelineConfig,
    trace: Trace,
    names: list[str],
    args: argparse.Namespace,
    backend: LinkTransport,
) -> tuple[dict[str, dict[str, float]], TransportModel]:
    """The per-policy figures (`summarize`, with `predict_exposed` under --dp) and the transport model
    the sim+t figures ran under: a message costs --message-ms, else `message_cost_ms` of this run; over
    TCP links (`backend`, as the stages resolved it) a message holds its link for the median send of
    this run, over a collective one until the receiver has taken it."""
    message_ms = args.message_ms
    if message_ms is None:
        message_ms = message_cost_ms(reports=reports)
    send_ms = None
    if backend is LinkTransport.TCP:
        send_us = summarize_phases(s.overhead_us for runs in reports.values() for r in runs for s in r.stages)[
            Phase.SEND
        ][0]
        send_ms = min(message_ms, 0.0 if math.isnan(send_us) else send_us / 1e3)
    transport = TransportModel(message_ms=message_ms, send_ms=send_ms)
    with_transport = simulated_ms(pipeline=pipeline, trace=trace, names=names, transport=transport)
    results = summarize(reports=reports, simulated=simulated, with_transport=with_transport, baseline=names[0])
    if pipeline.dp > 1:
        for name, figures in predict_exposed(
            pipeline=pipeline, trace=trace, names=names, reports=reports, args=args
        ).items():
            results[name].update(figures)
    return results, transport


def table(*, results: dict[str, dict[str, float]], tp: bool, dp: bool) -> list[str]:
    """The per-policy lines the job prints."""
    lines = [
        f"{'policy':<12} {'measured ms':>11} {'step ms':>7} {'sim ms':>9} "
        f"{'meas/sim':>8} {'sim+t ms':>9} {'meas/sim+t':>10} "
        f"{'speedup':>8} {'predicted':>9} {'meas/pred':>9}"
        + (f" {'TP coord':>8} {'disagree':>8} {'rounds':>6} {'ms/round':>8}" if tp else "")
        + (f" {'reduce ms':>9} {'exposed':>7} {'own':>6} {'sim exp':>7} {'sum MB':>7} {'recv MB':>7}" if dp else "")
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<12} {r['measured_ms']:11.1f} {r['step_ms']:7.2f} {r['sim_ms']:9.1f} {r['ratio']:8.3f} "
            f"{r['sim_transport_ms']:9.1f} {r['ratio_transport']:10.3f} "
            f"{r['speedup_measured']:8.3f} {r['speedup_predicted']:9.3f} "
            f"{r['speedup_measured'] / r['speedup_predicted']:9.3f}"
            + (
                f" {r['tp_coord_fraction']:8.2%} {r['tp_disagreements']:8.1f} "
                f"{r['tp_rounds']:6.1f} {r['tp_ms_per_round']:8.3f}"
                if tp
                else ""
            )
            + (
                f" {r['dp_reduce_ms']:9.1f} {r['dp_exposed_fraction']:7.1%} {r['dp_exposed_own_fraction']:6.1%}"
                f" {r['sim_dp_exposed_fraction']:7.1%} {r['dp_reduce_bytes'] / 2**20:7.1f} "
                f"{r['dp_received_bytes'] / 2**20:7.1f}"
                if dp
                else ""
            )
        )
    return lines


def breakdown_table(*, reports: dict[str, list[IterationReport]]) -> list[str]:
    """Per policy and phase (`rrfp_ray.runtime.breakdown`): median and p90 in us over every stage and measured
    iteration."""
    lines = [
        "per-op runtime overhead, us: median / p90 (n samples) over every stage and measured iteration",
        f"{'policy':<12}" + "".join(f" {phase.value:>22}" for phase in Phase),
    ]
    for name, runs in reports.items():
        figures = summarize_phases(s.overhead_us for r in runs for s in r.stages)
        lines.append(f"{name:<12}" + "".join(f" {f'{m:.0f} / {p:.0f} ({n})':>22}" for m, p, n in figures.values()))
    keys = ["all", *(role.value for role in Role), "op", "idle"]
    lines += [
        "",
        (
            "CPU per executed op, us, median over stage actors: all = the process's CPU clock (every thread, Ray's "
            "too) less its idle baseline (idle: the same process with no ops, over the same wall time) and the ops' "
            "own work (op: the synthetic op's sleep, by the compute thread's clock); compute / send / receive: those "
            "threads' own clocks; other: the rest of the process"
        ),
        f"{'policy':<12}" + "".join(f" {key:>9}" for key in keys),
    ]
    for name, runs in reports.items():
        figures = cpu_per_op(runs)
        lines.append(f"{name:<12}" + "".join(f" {figures.get(key, math.nan):9.1f}" for key in keys))
    return lines


def dp_note(
    *, results: dict[str, dict[str, float]], grad_mb: float, layers: int, pipeline: PipelineConfig, latency_ms: float
) -> str:
    return (
        f"DP: {grad_mb:g} MB of gradient per chunk in {layers} layers (finalized one by one through the chunk's last "
        f"weight-gradient op), {pipeline.dp_bucket_mb:g} MB buckets, "
        f"{'overlapped' if pipeline.dp_overlap else 'no overlap'}; exposed: the reduce time past every stage's last op "
        "(what it adds to the iteration), own: past the stage's own last op (median over stages and iterations); "
        "sum MB / recv MB: bytes a stage summed / of sums it received per iteration (the synthetic gradients have no "
        "ZeRO-1 owner, so all of them; train_gpt.py --zero 1 prints the shrink); "
        f"sim exp: the simulator's exposed share at {next(iter(results.values()))['sim_reduce_mb_per_s']:.1f} MB/s "
        f"and {latency_ms:g} ms a bucket"
    )


def report_lines(
    *,
    results: dict[str, dict[str, float]],
    reports: dict[str, list[IterationReport]],
    pipeline: PipelineConfig,
    transport: TransportModel,
    args: argparse.Namespace,
) -> list[str]:
    """What the job prints after the run: the setting, how to read the table, the table, and the
    DP note (--dp) and per-op overhead (--breakdown)."""
    source = "--message-ms" if args.message_ms is not None else "measured in this run"
    lines = [
        "",
        f"D={pipeline.dp} P={pipeline.stages} v={pipeline.chunks} "
        f"T={pipeline.tp} M={pipeline.microbatches} cap={pipeline.cap} "
        f"links={pipeline.backend.value} scenario={args.scenario} t_f={args.t_f:g} ms, "
        f"median of {max(1, args.iterations - 1)} iteration(s)",
        "measured ms: the full iteration, optimizer step included (step ms: its share after the last op); "
        "the simulator has no step, so meas/sim = (measured - step) / sim; sim+t: the simulator with the "
        f"transport model at {transport.message_ms * 1e3:.0f} us a message ({source}), "
        + (
            "each holding its link until the receiver took it"
            if transport.send_ms is None
            else f"each holding its TCP link {transport.send_ms * 1e3:.0f} us (the median send)"
        ),
        *table(results=results, tp=pipeline.tp > 1, dp=pipeline.dp > 1),
    ]
    if pipeline.dp > 1:
        lines.append(
            dp_note(
                results=results,
                grad_mb=args.grad_mb,
                layers=args.grad_layers,
                pipeline=pipeline,
                latency_ms=args.reduce_latency_ms,
            )
        )
    if args.breakdown:
        lines += ["", *breakdown_table(reports=reports)]
    return lines
