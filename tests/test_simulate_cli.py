"""jobs/simulate.py: once as a user runs it (`python jobs/simulate.py ...` from the repo root),
the rest through its main(argv) in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import simulate
from rrfp_ray.sim.trace import Trace

ROOT = Path(__file__).resolve().parents[1]


def simulate_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "jobs/simulate.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def simulate_main(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The job's exit code, stdout and stderr, run in this process."""
    try:
        simulate.main(list(args))
        code = 0
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return code, out, err


def test_json_at_constant_durations(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    run = simulate_cli("--stages", "4", "--microbatches", "8", "--t-f", "10", "--cap", "1x", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "speedup vs fixed 1f1b" in run.stdout
    data = json.loads(out.read_text())
    assert data["baseline"] == "1f1b"
    assert list(data["policies"]) == ["gpipe", "1f1b", "zb-h1", "bf", "bfw"]
    for name, r in data["policies"].items():
        assert set(r) == {"makespan_ms", "iteration_ms", "speedup_vs_1f1b", "bubble", "peak_inflight", "lb_ms"}
        assert r["makespan_ms"] >= r["lb_ms"] > 0, name
    one_f_one_b = data["policies"]["1f1b"]
    assert one_f_one_b["makespan_ms"] == pytest.approx((8 + 4 - 1) * 30.0)
    assert one_f_one_b["speedup_vs_1f1b"] == 1.0
    assert one_f_one_b["bubble"] == pytest.approx(3 / 11)
    assert (one_f_one_b["peak_inflight"], data["policies"]["gpipe"]["peak_inflight"]) == (4, 8)
    zb = data["policies"]["zb-h1"]
    assert zb["makespan_ms"] == pytest.approx(8 * 30.0 + 3 * 10.0)
    assert zb["speedup_vs_1f1b"] == pytest.approx(330.0 / 270.0)


def test_saved_trace_replays_to_the_same_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], job_logging: None
) -> None:
    saved, first, second = tmp_path / "trace.json", tmp_path / "a.json", tmp_path / "b.json"
    args = ("--policies", "1f1b,bf", "--cap", "2x")
    code, out, err = simulate_main(
        "--stages", "3", "--chunks", "2", "--microbatches", "6", "--scenario", "multimodal+comm", "--sigma", "0.8",
        "--seed", "5", "--save-trace", str(saved), "--json", str(first), "--policies", "interleaved,bf", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "speedup vs fixed interleaved" in out
    trace = Trace.load(saved)
    assert (trace.stages, trace.chunks, trace.microbatches) == (3, 2, 6)
    code, _, err = simulate_main(
        "--trace", str(saved), "--json", str(second), "--policies", "interleaved,bf", capsys=capsys
    )
    assert code == 0, err
    # exact on purpose: one process, and JSON keeps every float (repr), so the replay is bit for bit by construction
    assert json.loads(first.read_text()) == json.loads(second.read_text())
    assert simulate_main("--trace", str(saved), *args, capsys=capsys)[0] == 2  # 1f1b needs one chunk


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--stages", "0"], "--stages"),
        (["--scenario", "lognormal", "--sigma", "-1"], "--sigma"),
        (["--scenario", "lognormal", "--rho", "2"], "--rho"),
        (["--scenario", "straggler+nope"], "--scenario"),
        (["--policies", "1f1b,fifo"], "--policies"),
        (["--cap", "0x"], "--cap"),
        (["--microbatches", "2"], "--microbatches"),
        (["--t-f", "-5"], "--t-f"),
        (["--comm-ms", "-1"], "--comm-ms"),
        (["--trace", "/nonexistent/trace.json"], "--trace"),
        (["--json", "/nonexistent/out.json"], "--json"),
        (["--log-level", "loud"], "--log-level"),
    ],
)
def test_bad_flags_are_named(args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = simulate_main(*args, capsys=capsys)
    assert code == 2
    assert f"argument {flag}" in err
    assert "Traceback" not in err
    assert out == ""
