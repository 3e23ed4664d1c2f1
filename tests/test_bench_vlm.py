"""jobs/bench_vlm.py: a tiny in-process run measures every policy on the VLM and prints its targets;
bad flags exit 2 naming the flag. jobs/bench_vlm_planner.py hands the planned trainer's plans to a second trainer;
jobs/bench_vlm_gil.py times the encoder beside busy threads and leaves the switch interval as it found it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.vlm import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
import bench_vlm
import bench_vlm_costs
import bench_vlm_gil
import bench_vlm_planner


def test_a_tiny_run_measures_every_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "vlm.json"
    args = ["--seeds", "1", "--iterations", "2", "--warmup", "0", "--microbatches", "4", "--image-size", "24"]
    found = sys.getswitchinterval()
    bench_vlm.main([*args, "--max-images", "4", "--json", str(data), "--switch-interval-ms", "1"])
    text = capsys.readouterr().out
    assert "switch interval 1 ms" in text and sys.getswitchinterval() == found
    for name in POLICIES:
        assert f"| {name} |" in text
    assert (
        "target planned >= 1.05x the best fixed at equal peak activation bytes:" in text
        and "target replayed within 5%:" in text
    )
    assert "best fixed packed:" in text and "| planned (both) |" in text and "| 1f1b packed |" in text
    assert "exact-duration oracle over the best fixed" in text
    result = json.loads(data.read_text())
    assert set(result["medians_ms"]) == set(POLICIES) and all(len(v) == 1 for v in result["medians_ms"].values())
    assert result["encoder_p95_p5"] >= 1.0 and result["planning_ms"] > 0
    assert result["oracle_over_best_fixed"] > 0
    # replayed / measured is a measurement (a first, unwarmed iteration runs well above its ops): only its form here
    assert set(result["replayed_over_measured"]) == set(POLICIES)
    assert all(r is None or 0 < r < float("inf") for r in result["replayed_over_measured"].values())


@pytest.mark.parametrize(("args", "flag"), [(["--seeds", "0"], "--seeds"), (["--stages", "x"], "--stages")])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_vlm.main(args)
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_costs_are_measured_per_stage_with_and_without_packing(capsys: pytest.CaptureFixture[str]) -> None:
    result = bench_vlm_costs.main(
        ["--iterations", "1", "--microbatches", "4", "--micro-batch-size", "4", "--image-size", "24"]
    )
    assert set(result) == {"own", "packed"} and all(len(stages) == 2 for stages in result.values())
    assert all(c["ms_per_iteration"] > 0 and c["max_min"] >= c["p95_p5"] >= 1 for s in result.values() for c in s)
    assert "packed:" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "flag"), [(["--stages", "99"], "--stages"), (["--image-size", "7"], "patch_size")])
def test_bad_cost_flags_exit_2_naming_what_is_wrong(
    args: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_vlm_costs.main(args)
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_the_plans_handed_in_train_as_the_planned_trainer_did(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--seeds", "1", "--iterations", "2", "--warmup", "1", "--microbatches", "4", "--image-size", "24"]
    found = sys.getswitchinterval()
    result = bench_vlm_planner.main([*args, "--max-images", "4", "--switch-interval-ms", "0.5"])
    planned, handed = result["losses"]["planned"], result["losses"]["handed in"]
    assert len(planned) == 3 and handed == pytest.approx(planned, rel=1e-5)  # same weights, data, plans: same losses
    assert all(len(v) == 1 and v[0] > 0 for v in result["medians_ms"].values()) and result["planning_ms"] > 0
    text = capsys.readouterr().out
    assert "handed in over planned:" in text and "switch interval 0.5 ms" in text
    assert sys.getswitchinterval() == found


@pytest.mark.parametrize(
    ("job", "args", "flag"),
    [
        (bench_vlm_planner, ["--switch-interval-ms", "0"], "--switch-interval-ms"),
        (bench_vlm_planner, ["--ray", "--switch-interval-ms", "1"], "--switch-interval-ms"),
        (bench_vlm, ["--ray", "--switch-interval-ms", "1"], "--switch-interval-ms"),
        (bench_vlm, ["--switch-interval-ms", "-1"], "--switch-interval-ms"),
        (bench_vlm_gil, ["--intervals-ms", "1", "-2"], "--intervals-ms"),
        (bench_vlm_gil, ["--image-size", "7"], "patch_size"),
    ],
)
def test_bad_switch_flags_exit_2_naming_what_is_wrong(
    job: object, args: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        job.main(args)
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_the_encoder_is_timed_alone_and_beside_each_busy_thread(capsys: pytest.CaptureFixture[str]) -> None:
    found = sys.getswitchinterval()
    args = ["--images", "1", "--image-size", "24", "--reps", "2", "--rounds", "1", "--intervals-ms", "2", "0.5"]
    result = bench_vlm_gil.main(args)
    assert set(result) == {f"{ms} ms, {beside.value}" for ms in ("2", "0.5") for beside in bench_vlm_gil.Beside}
    assert all(ratio > 0 for ratio in result.values()) and result["2 ms, nothing"] == 1.0
    assert "beside pure Python" in capsys.readouterr().out and sys.getswitchinterval() == found


def test_a_split_run_takes_its_seeds_from_the_first_seed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_vlm.main(["--first-seed", "-1"])
    assert exit_info.value.code == 2 and "--first-seed" in capsys.readouterr().err
