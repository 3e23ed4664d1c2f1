"""Bad input to jobs/train_gpt.py is a clear error naming the flag, before Ray starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rrfp_ray.runtime.transport import LinkBackend

JOB = Path(__file__).resolve().parent.parent / "jobs" / "train_gpt.py"
sys.path.insert(0, str(JOB.parent))
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
        (["--dp", "0"], "--dp: Input should be greater than or equal to 1"),
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


def _job(*flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # no cluster: the stages would run here
    return subprocess.run(
        [sys.executable, str(JOB), *flags], env=env, cwd=JOB.parent.parent, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--backend", "nccl"], "--backend nccl: no CUDA device is visible"),
        (["--gpus-per-stage", "-1"], "--gpus-per-stage must be >= 0, got -1"),  # it used to hang
    ],
)
def test_gpu_flags_without_cuda_fail_before_ray_starts(flags, expected):
    done = _job(*flags)
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr
    assert "Ray" not in done.stdout  # start_ray prints what it started or attached to


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--gpu"], "--gpu: no CUDA device is visible"),
        (["--gpus-per-stage", "0.5"], "--gpus-per-stage 0.5: no CUDA device is visible"),
        (["--gpu", "--gpus-per-stage", "2"], "--gpu means --gpus-per-stage 1; it contradicts --gpus-per-stage 2"),
    ],
)
def test_gpus_without_cuda_are_named(flags, expected, monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse(flags)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_flags_pass_when_attaching_to_a_cluster(monkeypatch):
    """Under RAY_ADDRESS the stages run on the cluster's nodes, not here: nothing to check locally."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    _, run = train_gpt.parse(["--backend", "nccl", "--gpu"])
    assert run.pipeline.backend is LinkBackend.NCCL and run.train.device == "cuda"
