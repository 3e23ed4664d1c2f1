"""jobs/bench_planning.py and jobs/bench_plan_wait.py: a tiny run prints its table or its ratio, and bad flags exit 2
naming the flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.planning import COLUMNS, FIXED, ratios, targets
from rrfp_ray.plan.planner import HINTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
import bench_plan_wait
import bench_planning


def test_a_tiny_run_prints_and_writes_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, data = tmp_path / "t.md", tmp_path / "t.json"
    args = ["--stages", "2", "--seeds", "2", "--iterations", "3", "--simulations", "4", "--scenarios", "none"]
    bench_planning.main([*args, "--out", str(out), "--json", str(data)])
    text = capsys.readouterr().out
    assert "| none | 2 |" in text and out.read_text().strip() == text.strip()
    cells = json.loads(data.read_text())["cells"]["none P=2"]
    assert len(cells) == 2
    for ms in cells:  # nothing varies: planned is what its best choice gives
        assert ratios(ms)["choice"] == pytest.approx(1.0, abs=1e-3)


def test_per_iteration_prints_a_row_per_column_with_a_cell_per_iteration(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--stages", "2", "--seeds", "1", "--iterations", "3", "--simulations", "4", "--scenarios", "none"]
    bench_planning.main([*args, "--per-iteration"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| none | 2 | ")]
    by_column = {line.split(" | ")[2]: line.split(" | ")[3:] for line in lines if "x (" not in line}
    assert set(by_column) == {"planned", "expected", "oracle"}
    for cells in by_column.values():  # nothing varies: every iteration at 1.000x
        assert [c.strip(" |") for c in cells] == ["1.000x"] * 3


def _cell(*, planned: float, bound: float) -> dict[str, float]:
    """A cell whose fixed schedules and hints take 100 ms, planned `planned` and the lower bound `bound`."""
    ms = {name: 100.0 for name in (*FIXED, *HINTS, *COLUMNS)}
    ms.update(planned=planned, bound=bound)
    return ms


def test_targets_judge_the_featured_rows_whose_room_reaches_the_target() -> None:
    rows = {
        ("multimodal+jitter", 8): [_cell(planned=100 / 1.2, bound=100 / 1.3)] * 2,
        ("multimodal+persistent", 8): [_cell(planned=100 / 1.01, bound=100 / 1.02)] * 2,
        ("none", 8): [_cell(planned=100.0, bound=100.0)] * 2,  # not featured: not judged
    }
    every, reachable = targets(rows, target={8: 1.10})
    assert "featured rows, 2 rows, 4 runs: planned 1.101x" in every and every.endswith("1.10x reached")
    assert "1.10x (left out: multimodal+persistent, room 1.020x), 1 rows, 2 runs: planned 1.200x" in reachable
    every, _ = targets(rows, target={8: 1.15})
    assert every.endswith("1.15x not reached")
    (only,) = targets(rows, target={8: 1.01})  # no row left out: one line
    assert "featured rows, 2 rows, 4 runs" in only and only.endswith("1.01x reached")
    _, none_left = targets(rows, target={8: 1.5})
    assert none_left.endswith("room 1.020x): none")


def test_a_tiny_run_prints_its_targets(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--stages", "2", "--seeds", "1", "--iterations", "3", "--simulations", "4"]
    bench_planning.main([*args, "--scenarios", "multimodal+persistent,none", "--target", "5"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("- P=2")]
    assert len(lines) == 2 and "featured rows, 1 rows, 1 runs" in lines[0] and "5.00x not reached" in lines[0]
    assert "left out: multimodal+persistent" in lines[1] and lines[1].endswith("): none")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--target", "1"], "--target"),
        (["--stages", "8,16", "--target", "1.1,1.2,1.3"], "--target"),
        (["--stages", "8,x"], "--stages"),
        (["--stages", "8,16", "--iterations", "2,3,4"], "--iterations"),
        (["--scenarios", "bogus"], "--scenarios"),
        (["--simulations", "1", "--samples", "2"], "--simulations"),
        (["--first-seed", "-1"], "--first-seed"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_planning.main(args)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_tiny_plan_wait_run_prints_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    bench_plan_wait.main(["--iterations", "2"])
    text = capsys.readouterr().out
    assert "wait / iteration" in text and "2 plans made; 0 iterations ran the last plan" in text


@pytest.mark.parametrize(
    ("args", "flag"), [(["--iterations", "1"], "--iterations"), (["--layers", "1", "--stages", "4"], "--stages")]
)
def test_bad_plan_wait_flags_exit_2_naming_the_flag(
    args: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_plan_wait.main(args)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
