"""Per-layer cost measurement and per-device slowdown: costs exactly on measured iterations, a slow
device's layers measured slow and a layer moved off it fast, the synthetic workload's ops following
the layers they hold, exact parameter bytes, and bad --slow-device / --layers values refused."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import bench_measure
import bench_runtime
import train_gpt
from rrfp_ray.runtime.iteration import measures
from rrfp_ray.runtime.measure import Clock, Throttle
from rrfp_ray.runtime.synthetic import LayerModel, SyntheticWorkload, device_speed
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.api import Trainer
from rrfp_ray.train.backend import LocalBackend
from rrfp_ray.train.config import PipelineConfig, VariabilityConfig

WIDTH = 16
SLEEP_S = 0.02  # each layer's forward: long enough to beat the threads' scheduling noise


class SleepyLinear(nn.Module):
    """A linear layer whose forward also waits SLEEP_S (its compute, as far as timing goes)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return self.linear(x)


class Batches:
    microbatches = 2

    def microbatch(self, *, iteration: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(iteration * 10 + index)
        return torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator)


def _trainer(
    *, measure_every: int | None, split: tuple[int, ...] | None = None, slow: dict[int, float] | None = None
) -> Trainer:
    pipeline = PipelineConfig(
        stages=2, microbatches=2, policy="1f1b", timeout_s=60, measure_every=measure_every, layer_split=split
    )
    return Trainer(
        model=lambda: [SleepyLinear() for _ in range(4)],
        loss_fn=nn.functional.mse_loss,
        data=Batches(),
        pipeline=pipeline,
        slow_devices=slow,
    )


def test_the_measuring_rule_is_every_period_from_iteration_0_and_never_at_0() -> None:
    assert [k for k in range(7) if measures(iteration=k, period=3)] == [0, 3, 6]
    assert not any(measures(iteration=k, period=0) for k in range(7))
    assert PipelineConfig().balance.measure_period == 0
    assert PipelineConfig(rebalance=True).balance.measure_period == 10


def test_costs_appear_exactly_on_measured_iterations_with_each_layer_once_and_exact_param_bytes() -> None:
    with _trainer(measure_every=2) as trainer:
        reports = trainer.fit(4)
    per_layer = WIDTH * WIDTH * 4 + WIDTH * 4  # float32 weight and bias
    for report in reports:
        measured = report.iteration % 2 == 0
        for stage in report.stages:
            assert bool(stage.layer_costs) == measured
            assert (stage.probe_ms is not None) == measured
            if measured:
                assert [c.layer for c in stage.layer_costs] == [2 * stage.stage, 2 * stage.stage + 1]
                assert all(c.param_bytes == per_layer for c in stage.layer_costs)
                assert all(c.forward_ms > 0 and c.backward_ms > 0 and c.activation_bytes > 0 for c in stage.layer_costs)
                assert stage.probe_ms > 0


def test_with_measuring_off_no_iteration_carries_costs() -> None:
    with _trainer(measure_every=None) as trainer:
        reports = trainer.fit(3)
    assert all(not s.layer_costs and s.probe_ms is None for r in reports for s in r.stages)


def _forward_ms(trainer: Trainer) -> dict[int, float]:
    """Each layer's median measured forward over five iterations (after a warm-up one)."""
    reports = trainer.fit(6)[1:]
    layers = [c.layer for s in reports[0].stages for c in s.layer_costs]
    return {
        layer: statistics.median(
            c.forward_ms for r in reports for s in r.stages for c in s.layer_costs if c.layer == layer
        )
        for layer in layers
    }


def test_a_slow_device_measures_its_layers_slow_and_a_layer_moved_off_it_fast() -> None:
    with _trainer(measure_every=1, slow={1: 2.0}) as trainer:
        even = _forward_ms(trainer)
    assert 1.4 < even[2] / even[1] < 3.0  # layer 2 on the slowed stage 1, layer 1 on stage 0: the same layer
    with _trainer(measure_every=1, split=(3, 1), slow={1: 2.0}) as trainer:
        moved = _forward_ms(trainer)
    assert 0.7 < moved[2] / moved[1] < 1.4  # layer 2 now on stage 0
    assert 1.4 < moved[3] / moved[1] < 3.0


def test_the_throttle_slows_what_the_clock_times_by_its_factor() -> None:
    clock = Clock(throttle=Throttle(factor=2.0))
    _, slow = clock.median_ms(lambda: time.sleep(SLEEP_S), repeats=5)
    _, plain = Clock().median_ms(lambda: time.sleep(SLEEP_S), repeats=5)
    assert 1.4 < slow / plain < 3.0
    with pytest.raises(ValueError, match="factor must be >= 1"):
        Throttle(factor=0.5)


def test_the_synthetic_split_scales_each_virtual_stage_by_the_layers_it_holds() -> None:
    trace = generate(scenario="imbalance", stages=2, microbatches=2, chunks=1, seed=0, t_f=10.0)
    run = LayerModel(layers=4, split=(1, 3)).as_run(trace)
    assert run.F[0] == pytest.approx([f / 2 for f in trace.F[0]])
    assert run.F[1] == pytest.approx([f * 1.5 for f in trace.F[1]])
    assert LayerModel(layers=4).as_run(trace) == trace
    with pytest.raises(ValueError, match="at least one of the 4 layers"):
        LayerModel(layers=4, split=(4, 1)).ranges(virtual_stages=2)


def _synthetic(split: tuple[int, ...] | None) -> dict:
    pipeline = PipelineConfig(stages=2, microbatches=4, policy="1f1b", timeout_s=60)
    trace = generate(scenario="imbalance", stages=2, microbatches=4, chunks=1, seed=0, t_f=40.0)
    workload = SyntheticWorkload(trace=trace, layers=2, layer_bytes=1000, layer_split=split)
    with LocalBackend.over(layout=pipeline.layout) as local:
        local.group.set_workload(workload=workload)
        report = local.group.run_iteration(
            iteration=0,
            policy=pipeline.resolved_policy("1f1b"),
            cap=pipeline.cap,
            buffer_limit=None,
            tp_protocol=pipeline.tp_protocol,
            measure=True,
        )
    forward = {
        s: statistics.median(e.end_ms - e.start_ms for e in report.events if e.stage == s and "F" in e.action)
        for s in (0, 1)
    }
    costs = {c.layer: c for s in report.stages for c in s.layer_costs}
    return {"forward": forward, "costs": costs, "probe": {s.stage: s.probe_ms for s in report.stages}}


def test_the_synthetic_ops_follow_their_layer_count_and_the_slow_device_stays_slow() -> None:
    even, moved = _synthetic(None), _synthetic((1, 3))
    # imbalance: stage 1 is 1.5x; one layer's share there is 60 / 2 ms, holding 3 layers an F takes 90 ms;
    # sleeps only overshoot, by the scheduling noise of a loaded machine: the bounds are loose
    assert 1.2 < moved["forward"][1] / even["forward"][1] < 1.8
    assert 1.4 < even["forward"][0] / moved["forward"][0] < 2.5
    assert sorted(moved["costs"]) == [0, 1, 2, 3]
    assert all(c.param_bytes == 1000 for c in moved["costs"].values())
    assert 1.2 < moved["costs"][1].forward_ms / even["costs"][1].forward_ms < 2.5  # layer 1 moved onto stage 1
    assert all(probe > 0 for probe in even["probe"].values())


def test_the_synthetic_probe_emulates_each_device_at_its_speed_in_the_trace() -> None:
    trace = generate(scenario="imbalance", stages=2, microbatches=2, chunks=1, seed=0, t_f=10.0)
    layout = PipelineConfig(stages=2, microbatches=2, policy="1f1b").layout
    speeds = [device_speed(trace=trace, layout=layout, stage=s) for s in (0, 1)]
    assert speeds == pytest.approx([1 / 1.25, 1.5 / 1.25])  # the last stage 1.5x, over their mean


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2:0.5", "finite factor >= 1"), ("x", "stage:factor pairs"), ("1:fast", "stage:factor pairs"), ("-1:2", ">= 0")],
)
def test_bad_slow_devices_are_refused_naming_the_field(value: str, expected: str) -> None:
    with pytest.raises(ValidationError, match=expected):
        VariabilityConfig(slow_devices=value)


def test_slow_devices_read_as_text() -> None:
    assert VariabilityConfig(slow_devices="2:1.5, 3:2").slow_devices == {2: 1.5, 3: 2.0}


@pytest.mark.parametrize(
    ("job", "argv", "expected"),
    [
        (train_gpt.parse, ["--slow-device", "1:0.5"], "--slow-device"),
        (train_gpt.parse, ["--slow-device", "9:2"], "not among the pipeline's 4 stages"),
        (bench_runtime.parse, ["--layers", "0"], "--layers must be >= 1"),
        (bench_runtime.parse, ["--layer-mb", "-1"], "--layer-mb must be >= 0"),
        (bench_runtime.parse, ["--stages", "2", "--split", "2,1"], "--split"),
        (bench_measure.parse, ["--slow-device", "0:1,x"], "--slow-device"),
        (bench_measure.parse, ["--measure-every", "0"], "--measure-every"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(job, argv: list[str], expected: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        job(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_turns_measure_every_period_over_their_common_iteration_count() -> None:
    pipeline = PipelineConfig(stages=2, microbatches=2, policy="1f1b", timeout_s=60)
    trace = generate(scenario="none", stages=2, microbatches=2, chunks=1, seed=0, t_f=1.0)
    runs = {name: (pipeline.resolved_policy(name), pipeline.cap) for name in ("1f1b", "bf")}
    with LocalBackend.over(layout=pipeline.layout) as local:
        local.group.set_workload(workload=SyntheticWorkload(trace=trace))
        reports = local.group.take_turns(
            runs=runs,
            rounds=2,
            first_iteration=0,
            buffer_limit=None,
            tp_protocol=pipeline.tp_protocol,
            measure_period=3,
        )
    measured = sorted(r.iteration for rs in reports.values() for r in rs if r.stages[0].layer_costs)
    assert measured == [0, 3]
