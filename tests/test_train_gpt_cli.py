"""Bad input to jobs/train_gpt.py is a clear error naming the flag, before Ray starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
import train_gpt  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--stages", "4", "--chunks", "2"], "--stages x --chunks = 8 is more than the model's 6 layers"),
        (["--seq-len", "100"], "--seq-len 100 is over --block-size 64"),
        (["--micro-batch-size", "0"], "--micro-batch-size: Input should be greater than or equal to 1"),
        (["--policy", "fastest"], "unknown policy 'fastest'"),
        (["--cap", "0"], "--cap: cap must be >= 1 microbatch"),
        (["--scenario", "gremlins"], "unknown scenario"),
        (["--n-embd", "30", "--n-head", "4"], "n_embd (30) must be a multiple of n_head (4)"),
    ],
)
def test_bad_flags_exit_with_the_flag_named(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_data_path_without_text_is_named(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit):
        train_gpt.parse(["--data", str(tmp_path / "empty.txt")])
    assert f"--data {tmp_path / 'empty.txt'}: no text found" in capsys.readouterr().err


def test_the_defaults_parse(capsys):
    _, run = train_gpt.parse([])
    assert (run.pipeline.stages, run.pipeline.policy, run.train.iterations) == (4, "bf", 30)


def test_a_hint_that_deadlocks_is_refused_with_the_grid(tmp_path, capsys):
    hint = tmp_path / "hint.json"
    hint.write_text('{"0": ["0F0", "0B0", "0F1", "0B1"], "1": ["1F1", "1B0", "1F0", "1B1"]}')
    with pytest.raises(SystemExit):
        train_gpt.parse(["--stages", "2", "--microbatches", "2", "--policy", "hint", "--hint", str(hint)])
    err = capsys.readouterr().err
    assert "invalid pipeline order" in err and ">1B0<" in err


def test_tp_that_does_not_divide_the_heads_is_named(capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse(["--tp", "3"])
    assert "--tp 3 does not divide --n-head 4" in capsys.readouterr().err
