"""jobs/bench_runtime.py's flags: bad ones are named before Ray starts; --rank-comm draws a trace per TP rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_runtime


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rank-comm"], "--rank-comm needs --tp >= 2"),
        (["--tp", "2", "--rank-comm", "--trace", "t.json"], "not with --trace"),
        (["--tp", "2", "--tp-protocol", "vote"], "--tp-protocol"),
        (["--iterations", "0"], "--iterations must be >= 1"),
        (["--chunks", "2", "--policies", "zbv,bf"], "--policies: zbv runs on the V placement and bf on the looped one"),
        (["--policies", "dualpipev"], "--policies: chunks (--chunks) must be 2"),
        (["--dp", "0"], "--dp: Input should be greater than or equal to 1"),
        (["--dp", "2", "--dp-bucket-mb", "0"], "--dp-bucket-mb: Input should be greater than 0"),
        (["--dp", "2", "--grad-mb", "0"], "--grad-mb must be > 0"),
        (["--dp", "2", "--grad-layers", "0"], "--grad-layers must be >= 1"),
        (["--rebalance"], "--rebalance starts each policy evenly split: give it --layers 2 or more"),
        (["--rebalance", "--layers", "2", "--split", "3,2,2,1"], "and no --split"),
        (["--policies", "1f1b,planned", "--dp", "2"], "planned on Ray replays a generated run of iterations"),
        (["--policies", "1f1b,planned", "--tp", "2"], "planned on Ray replays a generated run of iterations"),
        (["--policies", "1f1b,planned", "--seeds", "0"], "--seeds must be >= 1"),
        (
            ["--rebalance", "--layers", "2", "--chunks", "2"],
            "--rebalance moves layers between --stages of one chunk each: it needs --chunks 1",
        ),
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


def _trace_file(tmp_path: Path) -> str:
    from rrfp_ray.sim.variability import generate

    path = tmp_path / "trace.json"
    trace = generate(scenario="lognormal", stages=2, microbatches=6, chunks=2, seed=3, t_f=5.0, sigma=0.3)
    path.write_text(json.dumps(trace.to_json()))
    return str(path)


def test_a_trace_file_sets_the_pipeline_shape(tmp_path: Path) -> None:
    path = _trace_file(tmp_path)
    _, pipeline, traces, names = bench_runtime.parse(["--trace", path])
    assert (pipeline.stages, pipeline.microbatches, pipeline.chunks) == (2, 6, 2)
    assert (traces[0].stages, traces[0].microbatches, traces[0].chunks) == (2, 6, 2)
    assert names[0] == "interleaved"  # the baseline follows the trace's v
    _, agreeing, _, _ = bench_runtime.parse(["--trace", path, "--stages", "2", "--chunks", "2"])
    assert agreeing == pipeline


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--stages", "4"], "--stages 4 disagrees with --trace {path}, whose P is 2"),
        (["--microbatches", "16"], "--microbatches 16 disagrees with --trace {path}, whose M is 6"),
        (["--chunks", "1"], "--chunks 1 disagrees with --trace {path}, whose v is 2"),
    ],
)
def test_a_flag_that_contradicts_the_trace_names_both(tmp_path: Path, flags: list[str], expected: str, capsys) -> None:
    path = _trace_file(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        bench_runtime.parse(["--trace", path, *flags])
    assert exit_info.value.code == 2
    assert expected.format(path=path) in capsys.readouterr().err


def test_an_unreadable_trace_is_named(tmp_path: Path, capsys) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        bench_runtime.parse(["--trace", str(tmp_path / "bad.json")])
    assert exit_info.value.code == 2
    assert f"--trace {tmp_path / 'bad.json'}:" in capsys.readouterr().err


def test_v_policies_share_a_v_pipeline_with_the_zbv_baseline() -> None:
    _, pipeline, _, names = bench_runtime.parse(
        ["--chunks", "2", "--microbatches", "8", "--policies", "ready-zbv,dualpipev"]
    )
    assert names == ["zbv", "ready-zbv", "dualpipev"]
    assert pipeline.layout.placement.value == "v" and pipeline.layout.loss_stage == 0
    _, looped, _, names = bench_runtime.parse(["--chunks", "2", "--policies", "zb-interleaved,bf"])
    assert names == ["interleaved", "zb-interleaved", "bf"] and looped.layout.placement.value == "looped"


def test_the_dp_table_prints_the_bytes_summed_and_received_beside_the_exposed_share() -> None:
    from benchmarks.runtime import table

    figures = dict.fromkeys(
        ["measured_ms", "step_ms", "sim_ms", "ratio", "sim_transport_ms", "ratio_transport", "speedup_measured"], 1.0
    )
    figures |= {
        "speedup_predicted": 1.0,
        "dp_reduce_ms": 40.0,
        "dp_exposed_fraction": 0.125,
        "dp_exposed_own_fraction": 0.5,
    }
    figures |= {"sim_dp_exposed_fraction": 0.25, "dp_reduce_bytes": 4 * 2**20, "dp_received_bytes": 2 * 2**20}
    header, row = table(results={"bfw": figures}, tp=False, dp=True)
    assert header.endswith("sim exp  sum MB recv MB")
    assert row.split()[-6:] == ["40.0", "12.5%", "50.0%", "25.0%", "4.0", "2.0"]
