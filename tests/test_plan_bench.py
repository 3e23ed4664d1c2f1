"""jobs/bench_planning.py and jobs/bench_plan_wait.py: a tiny run prints its table or its ratio, and bad flags exit 2
naming the flag."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.planning import ratios

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


@pytest.mark.parametrize(
    ("args", "flag"),
    [
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
