"""A GPT run as jobs/train_gpt.py reports it: one policy trained to the run's iterations with its
per-iteration line and summary, its comparison with the fixed baselines, and the DP check."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rrfp_ray.observe.telemetry import IterationReport, append_jsonl, dp_summary
from rrfp_ray.policy.caps import Cap
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import injected_traces
from rrfp_ray.schedule.actions import parse_action
from rrfp_ray.sim.trace import of_iteration
from rrfp_ray.train.api import Trainer
from rrfp_ray.train.config import PLANNED

Summary = dict[str, Any]
LOSS_TOLERANCE = 1e-5  # relative: one iteration's loss under another order of the same float sums


class PolicyRun:
    """`policy` trained on `trainer` up to the run's iterations (from wherever the trainer is: a
    resumed run starts later): telemetry to `telemetry`, TensorBoard scalars to `tensorboard`."""

    def __init__(
        self, *, trainer: Trainer, run: RunConfig, policy: str, telemetry: Path, tensorboard: str | None = None
    ) -> None:
        self.trainer, self.run, self.policy = trainer, run, policy
        self.telemetry, self.tensorboard = telemetry, tensorboard
        self.reports: list[IterationReport] = []
        self.tokens: list[int] = []  # real tokens per iteration: with --varlen, padding is left out
        self.val_loss: float | None = None

    def iterations(self) -> Iterator[str]:
        """Trains one iteration per item, yielding its line (validation every `val_every` and at the end)."""
        trainer, run = self.trainer, self.run
        board = None
        if self.tensorboard:
            from rrfp_ray.observe.tensorboard import TensorBoardLog

            board = TensorBoardLog(directory=Path(self.tensorboard), run=self.policy)
        source = trainer.workload.data  # its tokens(iteration=...): the real tokens of an iteration
        self.telemetry.unlink(missing_ok=True)
        try:
            while trainer.iteration < run.train.iterations:
                iteration = trainer.iteration
                report = trainer.step(policy=self.policy)
                self.reports.append(report)
                append_jsonl(path=self.telemetry, report=report)
                tokens = source.tokens(iteration=iteration)
                self.tokens.append(tokens)
                if board is not None:
                    board.iteration(report, tokens=tokens)
                line = self._line(report, iteration=iteration, tokens=tokens)
                every = run.train.val_every
                if every and (trainer.iteration % every == 0 or trainer.iteration == run.train.iterations):
                    self.val_loss = trainer.evaluate()
                    line += f"  val {self.val_loss:.4f}"
                    if board is not None:
                        board.validation(iteration=iteration, loss=self.val_loss)
                yield line
        finally:
            if board is not None:
                board.close()

    def _line(self, report: IterationReport, *, iteration: int, tokens: int) -> str:
        line = (
            f"[{self.policy}] iter {iteration:3d}  loss {report.loss:.4f}  {report.makespan_ms:7.1f} ms "
            f"(step {report.step_ms:4.1f})  "
            f"{tokens / report.makespan_ms * 1e3:8.0f} tok/s  bubble {report.bubble:5.1%}  "
            f"blocked {report.blocked_fraction:5.1%}"
        )
        if self.run.pipeline.tp > 1:
            line += f"  TP agreement {report.tp_fraction:4.2%}"
        if self.policy == PLANNED:
            line += f"  plan wait {self.trainer.plan_wait_s[-1] * 1e3:.2f} ms"
        if report.restart:
            line += f"  (first after restart {report.restart})"
        if report.shape is not None:
            line += f"  at {report.shape}"
        if report.skipped_step:
            line += "  step skipped (non-finite gradients)"
        if self.trainer.moves and (move := self.trainer.moves[-1]).iteration == report.iteration:
            line += f"  rebalanced {','.join(map(str, move.before))} -> {','.join(map(str, move.after))} "
            line += f"({move.seconds:.2f} s)"
        return line

    def summary(self) -> Summary:
        reports, pipeline = self.reports, self.run.pipeline
        summary = {
            "policy": self.policy,
            "iterations": self.run.train.iterations,
            "loss_first": reports[0].loss,
            "loss_last": reports[-1].loss,
            "val_loss_last": self.val_loss,
            "iteration_ms_median": statistics.median(r.makespan_ms for r in reports),  # optimizer step included
            "step_ms_median": statistics.median(r.step_ms for r in reports),
            "tokens_per_s": sum(self.tokens) / sum(r.makespan_ms for r in reports) * 1e3,  # real tokens (no padding)
            "peak_inflight": max(r.peak_inflight for r in reports),
            "restarts": self.trainer.restarts,
            "skipped_steps": sum(r.skipped_step for r in reports),
            "precision": pipeline.precision.value,
            "varlen": self.run.train.varlen,
        }
        if pipeline.balance.rebalance:
            summary["moves"] = [asdict(move) for move in self.trainer.moves]
        if pipeline.tp > 1:
            summary["tp_coord_fraction"] = statistics.median(r.tp_fraction for r in reports)
        if pipeline.dp > 1:
            summary |= dp_summary(reports)  # with optim_bytes_per_actor: ZeRO-1 holds ~1/D
        return summary | op_times(run=self.run, reports=reports)


def op_times(*, run: RunConfig, reports: list[IterationReport]) -> Summary:
    """Mean measured op time, and how much of it the injected variability slept (the trace's time of that op)."""
    events = [e for r in reports for e in r.events]
    if not events:
        return {}
    injected = injected_traces(run)
    slept = []
    for report in reports:
        trace = of_iteration(injected, report.iteration)
        for event in report.events:
            action = parse_action(event.action, stages=run.pipeline.stages)
            if report.order is not None:  # the slot's data microbatch, whose row the trace's sleep was
                action = replace(action, microbatch=report.order[action.microbatch])
            slept.append(0.0 if trace is None else trace.duration(action))
    return {
        "op_ms_mean": statistics.mean(e.end_ms - e.start_ms for e in events),
        "injected_ms_mean": statistics.mean(slept),
    }


def state_lines(summary: Summary) -> list[str]:
    """What the job prints after a policy's iterations: with DP, the largest optimizer state of an
    actor and what the gradient reduction moved and left exposed (medians over stages and iterations)."""
    if "optim_bytes_per_actor" not in summary:
        return []
    most = summary["optim_bytes_per_actor"] / 2**20
    line = (
        f"[{summary['policy']}] optimizer state per actor: at most {most:.2f} MiB; DP reduce per stage: "
        f"{summary['dp_reduce_bytes'] / 2**20:.2f} MiB summed, {summary['dp_received_bytes'] / 2**20:.2f} MiB of sums "
        f"received (share {summary['dp_received_share']:.2f}), {summary['dp_reduce_ms']:.1f} ms, "
        f"exposed {summary['dp_exposed_fraction']:.0%}"
    )
    return [line]


def compared(
    summary: Summary, *, baselines: dict[str, Summary], runs: dict[str, list[IterationReport]], cap: Cap
) -> Summary:
    """What the closing lines say of a run (`summary`) trained after fixed schedules (`baselines`: name ->
    summary) from the same initial weights and data: the faster of them (`baseline`), the speedup of the run's
    median iteration over its, the run's cap, and the relative difference of an iteration's loss from that of
    the same iteration under any of them (`runs`: name -> reports): the largest on the first iteration (the
    same weights and data, float sums in another order) and over the run (where those differences compound
    through the optimizer steps)."""
    best = min(baselines.values(), key=lambda base: base["iteration_ms_median"])
    own = [report.loss for report in runs[summary["policy"]]]
    differences = [
        [abs(a - b) / abs(b) for a, b in zip(own, (report.loss for report in runs[name]), strict=True)]
        for name in baselines
    ]
    return {
        "baselines": baselines,
        "baseline": best,
        "cap": str(cap),
        "speedup_vs_baseline": best["iteration_ms_median"] / summary["iteration_ms_median"],
        "first_rel_loss_diff_vs_baselines": max(each[0] for each in differences),
        "max_rel_loss_diff_vs_baselines": max(max(each) for each in differences),
    }


def outcome_lines(summary: Summary) -> list[str]:
    """The run's closing lines: its losses, median iteration and tokens/s; after fixed baselines (`compared`),
    theirs, the speedup over the faster at the run's cap, and whether the losses agree."""
    val = summary["val_loss_last"] or float("nan")
    own = (
        f"{summary['policy']}: loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} (val {val:.3f}), "
        f"median iteration {summary['iteration_ms_median']:.1f} ms, {summary['tokens_per_s']:.0f} tokens/s"
    )
    if "baseline" not in summary:
        return [own]
    fixed = [
        f"fixed {name}: loss {base['loss_first']:.3f} -> {base['loss_last']:.3f}, median iteration "
        f"{base['iteration_ms_median']:.1f} ms"
        for name, base in summary["baselines"].items()
    ]
    if summary["cap"] == "1x":
        memory = "at equal activation memory (cap 1x: no stage holds more in flight than the fixed schedules' peak)"
    else:
        memory = f"with cap {summary['cap']} (the fixed schedules hold 1x: not equal memory)"
    first, worst = summary["first_rel_loss_diff_vs_baselines"], summary["max_rel_loss_diff_vs_baselines"]
    return [
        own,
        *fixed,
        f"speedup of {summary['policy']} over the faster fixed schedule, {summary['baseline']['policy']}, {memory}: "
        f"{summary['speedup_vs_baseline']:.2f}x",
        f"losses: the first iteration's (the same weights and data) differs from the fixed schedules' by {first:.1e} "
        f"({'equal' if first < LOSS_TOLERANCE else 'DIFFERENT'} within {LOSS_TOLERANCE:g}: the same mathematics, "
        f"float sums in another order); those differences compound through the optimizer steps to {worst:.1e} "
        "at most over the run",
        *source_lines(summary),
    ]


def source_lines(summary: Summary) -> list[str]:
    """Where a speedup comes from when ops sleep injected delays."""
    if not summary.get("injected_ms_mean"):
        return []
    op, slept = summary["op_ms_mean"], summary["injected_ms_mean"]
    return [
        f"where it comes from: an op took {op:.1f} ms on average, {slept:.1f} ms of it an injected sleep (the "
        f"--scenario trace) and {op - slept:.1f} ms the model's own compute and the runtime; a readiness or planned "
        "policy gains by running other ready work around those sleeps, as it would around slow GPU kernels. "
        "--scenario none removes them."
    ]


def dp_check(*, run: RunConfig, losses: list[float], trainer_for: Callable[[RunConfig], Trainer]) -> Summary:
    """The same iterations trained as one pipeline of dp x microbatches in this process (the trainer
    `trainer_for` builds), without injected delays: the largest relative difference from `losses`
    and the reference losses."""
    pipeline = run.pipeline.replaced(dp=1, zero=0, microbatches=run.pipeline.global_microbatches)
    quiet = run.variability.model_copy(update={"scenario": "none", "trace_file": None})
    reference = run.model_copy(update={"pipeline": pipeline, "variability": quiet})
    with trainer_for(reference) as trainer:
        expected = [r.loss for r in trainer.fit(len(losses))]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
    return {"iterations": len(losses), "max_rel_loss_diff": worst, "reference_losses": expected}


def dp_check_line(*, run: RunConfig, check: Summary) -> str:
    worst = check["max_rel_loss_diff"]
    return (
        f"dp check: dp={run.pipeline.dp} x microbatches={run.pipeline.microbatches} against one pipeline of "
        f"{run.pipeline.global_microbatches} microbatches (in-process), {check['iterations']} iterations: largest "
        f"relative loss difference {worst:.2e} ({'equal' if worst < 1e-4 else 'DIFFERENT'} within 1e-4)"
    )
