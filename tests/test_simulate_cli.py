"""jobs/simulate.py, run as a user would: `python jobs/simulate.py ...` from the repo root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rrfp_ray.sim.variability import Trace

ROOT = Path(__file__).resolve().parents[1]


def simulate_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "jobs/simulate.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_json_at_constant_durations(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    run = simulate_cli("--stages", "4", "--microbatches", "8", "--t-f", "10", "--cap", "1x", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "speedup vs fixed 1f1b" in run.stdout
    data = json.loads(out.read_text())
    assert data["baseline"] == "1f1b"
    assert list(data["policies"]) == ["gpipe", "1f1b", "zb-h1", "bf", "bfw"]
    for name, r in data["policies"].items():
        assert set(r) == {"makespan_ms", "speedup_vs_1f1b", "bubble", "peak_inflight", "lb_ms"}
        assert r["makespan_ms"] >= r["lb_ms"] > 0, name
    one_f_one_b = data["policies"]["1f1b"]
    assert one_f_one_b["makespan_ms"] == pytest.approx((8 + 4 - 1) * 30.0)
    assert one_f_one_b["speedup_vs_1f1b"] == 1.0
    assert one_f_one_b["bubble"] == pytest.approx(3 / 11)
    assert (one_f_one_b["peak_inflight"], data["policies"]["gpipe"]["peak_inflight"]) == (4, 8)
    zb = data["policies"]["zb-h1"]
    assert zb["makespan_ms"] == pytest.approx(8 * 30.0 + 3 * 10.0)
    assert zb["speedup_vs_1f1b"] == pytest.approx(330.0 / 270.0)


def test_saved_trace_replays_to_the_same_numbers(tmp_path: Path) -> None:
    saved, first, second = tmp_path / "trace.json", tmp_path / "a.json", tmp_path / "b.json"
    args = ("--policies", "1f1b,bf", "--cap", "2x")
    run = simulate_cli(
        "--stages", "3", "--chunks", "2", "--microbatches", "6", "--scenario", "multimodal+comm", "--sigma", "0.8",
        "--seed", "5", "--save-trace", str(saved), "--json", str(first), "--policies", "interleaved,bf",
    )
    assert run.returncode == 0, run.stderr
    assert "speedup vs fixed interleaved" in run.stdout
    trace = Trace.load(saved)
    assert (trace.stages, trace.chunks, trace.microbatches) == (3, 2, 6)
    run = simulate_cli("--trace", str(saved), "--json", str(second), "--policies", "interleaved,bf")
    assert run.returncode == 0, run.stderr
    assert json.loads(first.read_text()) == json.loads(second.read_text())
    assert simulate_cli("--trace", str(saved), *args).returncode == 2  # 1f1b needs one chunk


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
def test_bad_flags_are_named(args: list[str], flag: str) -> None:
    run = simulate_cli(*args)
    assert run.returncode == 2
    assert f"argument {flag}" in run.stderr
    assert run.stdout == ""
