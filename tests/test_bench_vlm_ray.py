"""jobs/bench_vlm_planner.py --ray: on stage actors, the plans the planned trainer made, handed in to a second trainer,
train as they did on the first."""

from __future__ import annotations

import pytest

import bench_vlm_planner


@pytest.mark.slow
def test_on_ray_the_plans_handed_in_train_as_the_planned_trainer_did(
    ray_session, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--seeds", "1", "--iterations", "2", "--warmup", "1", "--microbatches", "4", "--image-size", "24"]
    result = bench_vlm_planner.main([*args, "--max-images", "4", "--ray"])
    planned, handed = result["losses"]["planned"], result["losses"]["handed in"]
    assert len(planned) == 3 and handed == pytest.approx(planned, rel=1e-5)  # same weights, data, plans: same losses
    assert all(len(v) == 1 and v[0] > 0 for v in result["medians_ms"].values()) and result["planning_ms"] > 0
    assert "on 2 stage actors a trainer" in capsys.readouterr().out
