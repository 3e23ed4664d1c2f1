"""jobs/bench_rebalance.py: a tiny run moves layers off the slow stage, not without one, and bad flags exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
import bench_rebalance


def test_a_tiny_run_rebalances_the_slow_stage_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, data = tmp_path / "t.md", tmp_path / "t.json"
    args = ["--stages", "4", "--iterations", "20", "--window", "5", "--layer-mb", "0", "--policies", "1f1b"]
    bench_rebalance.main([*args, "--scenarios", "imbalance,none", "--out", str(out), "--json", str(data)])
    text = capsys.readouterr().out
    assert "| imbalance | 4 | 1f1b |" in text and out.read_text().strip() == text.strip()
    cells = json.loads(data.read_text())["cells"]
    slow, even = cells["imbalance P=4 1f1b"], cells["none P=4 1f1b"]
    assert slow["moves"] >= 1 and slow["splits"][0][3] < 4
    assert slow["after_ms"] < slow["before_ms"] and slow["after_ms"] <= 1.05 * slow["balanced_ms"]
    assert even["moves"] == 0 and even["after_ms"] == even["before_ms"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--stages", "8,x"], "--stages"),
        (["--policies", "bogus"], "--policies"),
        (["--scenarios", "bogus"], "--scenarios"),
        (["--iterations", "5", "--window", "5"], "--iterations"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_rebalance.main(args)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
