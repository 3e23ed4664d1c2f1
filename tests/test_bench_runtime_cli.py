"""jobs/bench_runtime.py's flags: bad ones are named before Ray starts; --rank-comm draws a trace per TP rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
import bench_runtime  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rank-comm"], "--rank-comm needs --tp >= 2"),
        (["--tp", "2", "--rank-comm", "--trace", "t.json"], "not with --trace"),
        (["--tp", "2", "--tp-protocol", "vote"], "--tp-protocol"),
        (["--iterations", "0"], "--iterations must be >= 1"),
    ],
)
def test_bad_flags_exit_with_the_flag_named(argv: list[str], expected: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_runtime.parse(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_rank_comm_gives_each_tp_rank_the_same_compute_and_its_own_latencies() -> None:
    argv = ["--stages", "2", "--tp", "2", "--microbatches", "4", "--scenario", "comm", "--comm-ms", "2"]
    _, pipeline, traces, _ = bench_runtime.parse([*argv, "--rank-comm"])
    assert (pipeline.tp, len(traces)) == (2, 2)
    assert (traces[0].F, traces[0].B) == (traces[1].F, traces[1].B)
    assert traces[0].commF != traces[1].commF
    _, _, shared, _ = bench_runtime.parse(argv)
    assert shared == traces[:1]
