"""What measuring per-layer costs adds to training: the GPT job in one process, its stages measuring
every --measure-every iterations (`StageStats.layer_costs`, `probe_ms`).

    python jobs/bench_measure.py --iterations 41 --measure-every 10

It times each `Trainer.step` and prints the median step of the iterations that measured and of those
that did not (the first two left out as warm-up), and the measurement's cost two ways with its share of
training time at that period, cost / (period x median unmeasured step): the difference of those medians
(on a loaded machine the steps vary by more than it), and the time the stages spent in their
executors' `measure` after the step (the slowest stage's, which the iteration waits for; the median
over measured iterations). The stamps inside the measured microbatch's ops are not in the second. With
--slow-device STAGE:FACTOR that stage computes FACTOR times slower, and the costs it measured show it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from pydantic import ValidationError

from rrfp_ray.cli import (
    VARIABILITY_FLAGS,
    Flag,
    add_flags,
    add_log_level_flag,
    config_error,
    configure_logging,
    flag_names,
    flag_values,
    model_flags,
)
from rrfp_ray.job import run_job
from rrfp_ray.models.gpt import GPTConfig
from rrfp_ray.recipes.config import RunConfig, TrainConfig
from rrfp_ray.runtime.executor import Executor, ExecutorWrapper
from rrfp_ray.runtime.measure import Costs
from rrfp_ray.train.config import PipelineConfig, VariabilityConfig

WARMUP = 2  # iterations left out of the medians


FLAGS = (  # each sets a RunConfig field; the defaults and help are this job's where its meaning is
    *model_flags(
        TrainConfig,
        prefix="train.",
        only=("iterations",),
        flags=(Flag("iterations", default=102, help="steps to time (the first two are a warm-up)"),),
    ),
    *model_flags(
        PipelineConfig,
        prefix="pipeline.",
        only=("measure_every", "stages", "microbatches"),
        flags=(
            Flag("measure_every", default=10, help="iterations between measurements"),
            Flag("stages", help="pipeline stages (threads of this process)"),
        ),
    ),
    *model_flags(GPTConfig, prefix="model.", only=("n_layer", "n_embd")),
    *model_flags(
        VariabilityConfig,
        prefix="variability.",
        only=("slow_devices",),
        flags=(replace(VARIABILITY_FLAGS["slow_devices"], help="stages that compute slower"),),
    ),
)


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, model=RunConfig, flags=FLAGS)
    add_log_level_flag(parser)
    args = parser.parse_args(argv)
    try:
        run = RunConfig(**flag_values(args, flags=FLAGS))
    except ValidationError as error:
        config_error(parser, error, flags=flag_names(FLAGS))
    if args.iterations < WARMUP + args.measure_every + 2:
        parser.error(f"--iterations must be at least {WARMUP + args.measure_every + 2} to measure after the warm-up")
    return args, run


class TimedMeasure(ExecutorWrapper):
    """An executor whose every `measure` is timed (`ms`, one per measured iteration)."""

    def __init__(self, inner: Executor) -> None:
        super().__init__(inner)
        self.ms: list[float] = []

    def measure(self) -> Costs:
        began = time.perf_counter()
        costs = self.inner.measure()
        self.ms.append((time.perf_counter() - began) * 1e3)
        return costs


def main(argv: list[str] | None = None) -> dict:
    args, run = parse(argv)
    configure_logging(args)
    from rrfp_ray.recipes.gpt_workload import gpt_trainer

    trainer = gpt_trainer(run)
    timed = [TimedMeasure(executor) for executor in trainer.backend.executors]
    trainer.backend.executors = timed
    steps, measured, last = [], [], None
    try:
        for _ in range(args.iterations):
            began = time.perf_counter()
            report = trainer.step()
            steps.append((time.perf_counter() - began) * 1e3)
            measured.append(bool(report.stages[0].layer_costs))
            last = report if measured[-1] else last
    finally:
        trainer.close()
    kept = range(WARMUP, len(steps))
    plain = statistics.median(steps[k] for k in kept if not measured[k])
    measuring = statistics.median(steps[k] for k in kept if measured[k])
    slowest = [max(times) for times in zip(*(executor.ms for executor in timed))][1:]  # the first: iteration 0
    costs = {"difference of medians": measuring - plain, "in measure": statistics.median(slowest)}
    shares = {way: cost / (args.measure_every * plain) for way, cost in costs.items()}
    print(f"step: {plain:.1f} ms unmeasured, {measuring:.1f} ms measured ({sum(measured[WARMUP:])} of them)")
    for way, cost in costs.items():
        print(f"measuring costs {cost:.1f} ms ({way}): {100 * shares[way]:.2f}% of training time")
    for stage in last.stages:
        layers = ", ".join(f"{c.layer}: F {c.forward_ms:.2f} B {c.backward_ms:.2f}" for c in stage.layer_costs)
        print(f"stage {stage.stage}: probe {stage.probe_ms:.2f} ms; layers (ms) {layers}")
    return {"unmeasured_ms": plain, "measured_ms": measuring, "measure_ms": costs, "overhead": shares}


if __name__ == "__main__":
    run_job(main)
