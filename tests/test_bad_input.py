"""A table of bad invocations of the jobs: each fails at once with a non-zero exit, no
traceback, and a message naming the flag, before any actor starts (in-process through each
job's parse/main; a few as real processes)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench_runtime
import simulate
import train_gpt

JOBS = Path(__file__).resolve().parent.parent / "jobs"

ENTRY = {"train_gpt": train_gpt.parse, "simulate": simulate.main, "bench_runtime": bench_runtime.parse}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "truncated-hint.json").write_text('{"0": ["0F0", ')
    (d / "prose-hint.json").write_text("not json at all")
    (d / "truncated-trace.json").write_text('{"stages": 2, "F": [[1.0')
    (d / "list-trace.json").write_text("[1, 2, 3]")
    return d


CASES = [
    ("train_gpt", ["--stages", "0"], "--stages"),
    ("train_gpt", ["--microbatches", "-1"], "--microbatches"),
    ("train_gpt", ["--iterations", "0"], "--iterations"),
    ("train_gpt", ["--tp", "0"], "--tp"),
    ("train_gpt", ["--timeout", "0"], "--timeout"),
    ("train_gpt", ["--lr", "-1"], "--lr"),
    ("train_gpt", ["--micro-batch-size", "0"], "--micro-batch-size"),
    ("train_gpt", ["--gpus-per-stage", "-1"], "--gpus-per-stage"),
    ("train_gpt", ["--gpu", "--gpus-per-stage", "0.5"], "--gpu means --gpus-per-stage 1"),
    ("train_gpt", ["--backend", "carrier-pigeon"], "--backend"),
    ("train_gpt", ["--tp-protocol", "vote"], "--tp-protocol"),
    ("train_gpt", ["--policy", "fastest"], "unknown policy 'fastest'"),
    ("train_gpt", ["--scenario", "gremlins"], "unknown scenario"),
    ("train_gpt", ["--policy", "ready-hint", "--hint", "{d}/truncated-hint.json"], "--hint"),
    ("train_gpt", ["--policy", "hint", "--hint", "{d}/prose-hint.json"], "not an action"),
    ("train_gpt", ["--policy", "hint", "--hint", "{d}/missing.json"], "--hint"),
    ("train_gpt", ["--trace", "{d}/truncated-trace.json"], "--trace"),
    ("train_gpt", ["--trace", "{d}/list-trace.json"], "--trace"),
    ("train_gpt", ["--data", "{d}/missing.txt"], "--data"),
    ("train_gpt", ["--out", "/proc/rrfp-out"], "argument --out: /proc/rrfp-out"),
    ("train_gpt", ["--checkpoint-every", "-2"], "--checkpoint-every"),
    ("train_gpt", ["--max-restarts", "-1"], "--max-restarts"),
    ("train_gpt", ["--resume", "--compare"], "--compare trains the fixed baselines"),
    ("train_gpt", ["--seq-len", "100"], "--seq-len 100 is over --block-size 64"),
    ("train_gpt", ["--arrange", "sideways"], "--arrange"),
    ("train_gpt", ["--plan-simulations", "0"], "--plan-simulations"),
    ("train_gpt", ["--plan-simulations", "2", "--plan-samples", "3"], "--plan-samples"),
    ("train_gpt", ["--policy", "planned", "--arrange", "packing"], "changes a per-microbatch mean loss"),
    ("train_gpt", ["--policy", "planned", "--arrange", "both", "--dp", "2", "--varlen"], "samples of one replica"),
    ("train_gpt", ["--split", "2,2,1"], "--split"),
    ("train_gpt", ["--rebalance", "--rebalance-threshold", "0"], "--rebalance-threshold"),
    ("train_gpt", ["--rebalance", "--rebalance-window", "0"], "--rebalance-window"),
    ("train_gpt", ["--resize-after", "-1"], "--resize-after"),
    ("train_gpt", ["--resize-after", "30"], "--resize-after 30 resizes when a lost stage's restart"),
    ("simulate", ["--stages", "0"], "--stages"),
    ("simulate", ["--microbatches", "-3"], "--microbatches"),
    ("simulate", ["--policies", "nope"], "unknown policy 'nope'"),
    ("simulate", ["--scenario", "gremlins"], "unknown scenario 'gremlins'"),
    ("simulate", ["--trace", "{d}/truncated-trace.json"], "--trace"),
    ("simulate", ["--trace", "{d}/list-trace.json"], "--trace"),
    ("simulate", ["--policies", "hint", "--hint", "{d}/truncated-hint.json"], "--hint"),
    ("simulate", ["--cap", "-1"], "--cap"),
    ("simulate", ["--json", "/nonexistent-dir/x.json"], "--json"),
    ("simulate", ["--out", "/proc/rrfp-out"], "argument --out: /proc/rrfp-out"),
    ("simulate", ["--plan-simulations", "1", "--plan-samples", "2"], "--plan-simulations"),
    ("bench_runtime", ["--stages", "0"], "--stages"),
    ("bench_runtime", ["--iterations", "0"], "--iterations"),
    ("bench_runtime", ["--policies", "nope"], "unknown policy 'nope'"),
    ("bench_runtime", ["--tp", "-1"], "--tp"),
    ("bench_runtime", ["--trace", "{d}/truncated-trace.json"], "--trace"),
    ("bench_runtime", ["--payload-elems", "0"], "--payload-elems"),
    ("bench_runtime", ["--rank-comm"], "--rank-comm needs --tp >= 2"),
    ("bench_runtime", ["--out", "/proc/rrfp-out"], "argument --out: /proc/rrfp-out"),
    ("bench_runtime", ["--json", "/nonexistent-dir/x.json"], "--json"),
    ("bench_runtime", ["--timeout", "-5"], "--timeout"),
    ("bench_runtime", ["--cap", "zero"], "--cap"),
]


@pytest.mark.parametrize(("job", "argv", "named"), CASES, ids=[f"{j} {' '.join(a)}" for j, a, _ in CASES])
def test_a_bad_invocation_fails_at_once_naming_the_flag(files, job, argv, named, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default outputs land here, not in the tree
    argv = [a.format(d=files) for a in argv]
    stderr = io.StringIO()
    with (
        contextlib.redirect_stderr(stderr),
        contextlib.redirect_stdout(io.StringIO()),
        pytest.raises(SystemExit) as exited,
    ):
        ENTRY[job](argv)
    assert exited.value.code not in (0, None)
    assert named in stderr.getvalue()
    assert "Traceback" not in stderr.getvalue()


@pytest.mark.parametrize(
    ("job", "argv", "named"),
    [
        ("train_gpt.py", ["--gpus-per-stage", "-1"], "--gpus-per-stage must be >= 0"),
        ("simulate.py", ["--trace", "{d}/truncated-trace.json"], "--trace"),
        ("bench_peers.py", ["--seed", "1"], "--seed"),  # its other bad flags: tests/test_peers.py, in-process
    ],
)
def test_a_bad_invocation_as_a_process_exits_non_zero_within_30_s(files, job, argv, named, tmp_path):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(JOBS / job), *[a.format(d=files) for a in argv]],
        capture_output=True, text=True, timeout=30, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert named in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 30
