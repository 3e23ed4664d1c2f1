"""The library of `jobs/bench_runtime.py`: a synthetic trace measured on Ray against the
simulator's prediction of the very same trace, with and without the transport model.

Per policy: the median measured iteration (optimizer step included) and its op schedule
(less the step, which the simulator lacks); the simulated makespan, plain and with the
`TransportModel` whose per-message cost this run measured (`message_cost_ms`); the speedup
over the baseline, measured and predicted; and the runtime's per-op overhead
(`rrfp_ray.runtime.breakdown`).
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import TYPE_CHECKING

from rrfp_ray.observe.telemetry import IterationReport, dp_summary, tp_summary
from rrfp_ray.runtime.breakdown import Phase
from rrfp_ray.runtime.breakdown import summarize as summarize_phases
from rrfp_ray.schedule.actions import parse_action
from rrfp_ray.schedule.deps import Layout
from rrfp_ray.sim.simulator import TransportModel, layout_for, simulate
from rrfp_ray.sim.variability import Trace

if TYPE_CHECKING:
    from rrfp_ray.train.config import PipelineConfig


SHAPE = (("stages", "P", 4), ("microbatches", "M", 16), ("chunks", "v", 1))  # flag, trace key, default


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


def message_cost_ms(*, reports: dict[str, list[IterationReport]], pipeline: PipelineConfig, trace: Trace) -> float:
    """The runtime's cost of one message, measured: the median, over every message between two
    stages, of its consumer's ready time less its sender's op end and the trace's latency, plus
    the median wake-up of a waiting compute thread (what `TransportModel.message_ms` stands for)."""
    delays = []
    for name, runs in reports.items():
        policy = pipeline.resolved_policy(name)
        layout = layout_for(policy=policy, trace=trace)
        for report in runs:
            delays += _message_delays(report=report, layout=layout, trace=trace, placement=policy.placement)
    wakeup = summarize_phases(s.overhead_us for runs in reports.values() for r in runs for s in r.stages)[Phase.WAKEUP][0]
    return statistics.median(delays) + (0.0 if math.isnan(wakeup) else wakeup / 1e3)


def _message_delays(*, report: IterationReport, layout: Layout, trace: Trace, placement) -> list[float]:
    actions = [(parse_action(e.action, stages=layout.stages, placement=placement), e) for e in report.events]
    sent = {}
    for action, event in actions:
        message = layout.sends(action)
        if message is not None and not layout.is_local(message):
            sent[message] = event.end_ms
    delays = []
    for action, event in actions:
        message = layout.message_need(action)
        if message in sent:
            delays.append(event.ready_ms - sent[message] - trace.latency(message))
    return delays


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


def table(*, results: dict[str, dict[str, float]], tp: bool, dp: bool) -> list[str]:
    """The per-policy lines the job prints."""
    lines = [
        f"{'policy':<12} {'measured ms':>11} {'step ms':>7} {'sim ms':>9} {'meas/sim':>8} {'sim+t ms':>9} {'meas/sim+t':>10} "
        f"{'speedup':>8} {'predicted':>9} {'meas/pred':>9}"
        + (f" {'TP coord':>8} {'disagree':>8} {'rounds':>6} {'ms/round':>8}" if tp else "")
        + (f" {'reduce ms':>9} {'exposed':>7} {'own':>6} {'sim exp':>7}" if dp else "")
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<12} {r['measured_ms']:11.1f} {r['step_ms']:7.2f} {r['sim_ms']:9.1f} {r['ratio']:8.3f} "
            f"{r['sim_transport_ms']:9.1f} {r['ratio_transport']:10.3f} "
            f"{r['speedup_measured']:8.3f} {r['speedup_predicted']:9.3f} {r['speedup_measured'] / r['speedup_predicted']:9.3f}"
            + (
                f" {r['tp_coord_fraction']:8.2%} {r['tp_disagreements']:8.1f} {r['tp_rounds']:6.1f} {r['tp_ms_per_round']:8.3f}"
                if tp
                else ""
            )
            + (
                f" {r['dp_reduce_ms']:9.1f} {r['dp_exposed_fraction']:7.1%} {r['dp_exposed_own_fraction']:6.1%}"
                f" {r['sim_dp_exposed_fraction']:7.1%}"
                if dp
                else ""
            )
        )
    return lines


def breakdown_table(*, reports: dict[str, list[IterationReport]]) -> list[str]:
    """Per policy and phase (`rrfp_ray.runtime.breakdown`): median and p90 in us over every stage and measured iteration."""
    lines = [
        "per-op runtime overhead, us: median / p90 (n samples) over every stage and measured iteration",
        f"{'policy':<12}" + "".join(f" {phase.value:>22}" for phase in Phase),
    ]
    for name, runs in reports.items():
        figures = summarize_phases(s.overhead_us for r in runs for s in r.stages)
        lines.append(f"{name:<12}" + "".join(f" {f'{m:.0f} / {p:.0f} ({n})':>22}" for m, p, n in figures.values()))
    return lines


def dp_note(*, results: dict[str, dict[str, float]], grad_mb: float, pipeline: PipelineConfig, latency_ms: float) -> str:
    return (
        f"DP: {grad_mb:g} MB of gradient per chunk in {pipeline.dp_bucket_mb:g} MB buckets, "
        f"{'overlapped' if pipeline.dp_overlap else 'no overlap'}; exposed: the reduce time past every stage's last op "
        "(what it adds to the iteration), own: past the stage's own last op (median over stages and iterations); "
        f"sim exp: the simulator's exposed share at {next(iter(results.values()))['sim_reduce_mb_per_s']:.1f} MB/s "
        f"and {latency_ms:g} ms a bucket"
    )
