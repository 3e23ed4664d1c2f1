"""TensorBoardLog writes the scalars a trainer is followed by; read back from the event file."""

from __future__ import annotations

import pytest

from rrfp_ray.observe.telemetry import IterationReport, StageStats

pytest.importorskip("tensorboard", reason="the optional extra tensorboard is not installed")


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_every_iteration_writes_loss_time_bubble_and_each_stage_blocked_share(tmp_path):
    from rrfp_ray.observe.tensorboard import TensorBoardLog

    log = TensorBoardLog(directory=tmp_path, run="bf")
    for iteration in range(3):
        stages = [
            StageStats(stage=0, wall_ms=100.0, compute_ms=80.0, blocked_ms=20.0),
            StageStats(stage=1, wall_ms=100.0, compute_ms=50.0, blocked_ms=50.0),
        ]
        log.iteration(
            IterationReport(iteration=iteration, policy="bf", makespan_ms=100.0, stages=stages, loss=3.0 - iteration),
            tokens=1000,
        )
    log.validation(iteration=2, loss=2.5)
    log.close()
    got = scalars(tmp_path / "bf")
    assert got["loss/train"] == [(0, 3.0), (1, 2.0), (2, 1.0)]
    assert got["loss/val"] == [(2, 2.5)]
    assert got["time/iteration_ms"] == [(i, 100.0) for i in range(3)]
    assert got["time/tokens_per_s"] == [(i, 10_000.0) for i in range(3)]
    assert got["pipeline/bubble"] == [(i, pytest.approx(0.35)) for i in range(3)]
    assert got["pipeline/blocked_stage_0"] == [(i, pytest.approx(0.2)) for i in range(3)]
    assert got["pipeline/blocked_stage_1"] == [(i, pytest.approx(0.5)) for i in range(3)]
