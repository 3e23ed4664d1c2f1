"""jobs/bench_framing.py prints its table (slow tier: it starts two processes a row) and refuses bad
flags by name. That host frames give up no GIL is tested without a clock: tests/test_frames.py."""

from __future__ import annotations

import pytest

import bench_framing


@pytest.mark.slow
def test_the_framing_benchmark_prints_every_row(capsys) -> None:
    bench_framing.main(["--payload-elems", "16", "--messages", "5", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [row[2] for row in rows] == ["host", "torch"]
    assert all(float(value) > 0 for row in rows for value in row[-4:])


@pytest.mark.parametrize(
    ("flag", "value"), [("--payload-elems", "x"), ("--payload-elems", "0"), ("--messages", "0"), ("--repeats", "0")]
)
def test_bad_flags_are_named(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        bench_framing.main([flag, value])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err
