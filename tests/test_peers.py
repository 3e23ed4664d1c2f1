"""benchmarks/peers/torch_pipelining.py: PyTorch's own schedules replaying a duration trace; and
jobs/bench_peers.py, its command, refusing bad flags before any rank starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.peers.sleep_module import stage_costs
from benchmarks.peers.torch_pipelining import KEYS, measure, measure_all
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import make_policy
from rrfp_ray.schedule.actions import Placement
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))
import bench_peers


def test_pytorch_schedules_run_our_order_and_no_faster_than_its_makespan() -> None:
    trace = generate(scenario="lognormal", stages=2, microbatches=4, chunks=1, seed=3, t_f=5.0)
    results = measure_all(schedules=["1f1b", "zb-h1"], trace=trace, iterations=1)
    assert list(results) == ["1f1b", "zb-h1"]
    for name, r in results.items():
        assert tuple(r) == KEYS
        assert (r["schedule"], r["stages"], r["chunks"], r["microbatches"], r["iterations"]) == (name, 2, 1, 4, 1)
        # zb-h1's order has the W of stage 1 one backward late: it matches only if W slept in PyTorch's weight pass
        assert r["order_matches"] is True, name
        ours = make_policy(name=name, stages=2, chunks=1, microbatches=4)
        assert r["ideal_ms"] == pytest.approx(simulate(policy=ours, trace=trace, cap=Cap.parse("inf")).makespan_ms)
        assert len(r["runs_ms"]) == 1
        assert r["measured_ms"] == r["runs_ms"][0] >= r["ideal_ms"] > 0, name
        assert r["ratio"] == pytest.approx(r["measured_ms"] / r["ideal_ms"])
        assert 0 < r["rank0_ms"] <= r["measured_ms"]


def test_pytorch_runs_the_v_schedules_in_our_order() -> None:
    """ZBV and DualPipeV (V placement: rank s holds virtual stages s and 2P-1-s) on the same sleep
    trace: what PyTorch's runtime executed is our imported order (DualPipeV's overlapped F&B as F then B)."""
    trace = generate(scenario="lognormal", stages=2, microbatches=4, chunks=2, seed=3, t_f=5.0)
    results = measure_all(schedules=["zbv", "dualpipev"], trace=trace, iterations=1, warmup=0)
    for name, r in results.items():
        assert r["order_matches"] is True, name
        ours = make_policy(name=name, stages=2, chunks=2, microbatches=4)
        assert r["ideal_ms"] == pytest.approx(simulate(policy=ours, trace=trace, cap=Cap.parse("inf")).makespan_ms)
        assert r["measured_ms"] >= r["ideal_ms"] > 0, name


def test_v_stage_costs_sleep_no_latency_at_the_turn() -> None:
    """Under V virtual stages P-1 and P share a rank: the turn between them is a local hand-off."""
    trace = generate(scenario="lognormal+comm", stages=2, microbatches=3, chunks=2, seed=1, t_f=10.0)
    turn_in = stage_costs(trace=trace, virtual_stage=2, placement=Placement.V)
    turn_out = stage_costs(trace=trace, virtual_stage=1, placement=Placement.V)
    for m in range(3):
        assert turn_in.forward_s[m] == pytest.approx(trace.F[2][m] / 1000)
        assert turn_out.input_grad_s[m] == pytest.approx(trace.B[1][m] / 1000)
        assert stage_costs(trace=trace, virtual_stage=2).forward_s[m] > turn_in.forward_s[m]


def test_stage_costs_add_the_incoming_message_latency() -> None:
    trace = generate(scenario="lognormal+comm", stages=2, microbatches=3, chunks=2, seed=1, t_f=10.0)
    last = trace.virtual_stages - 1
    for vs in range(trace.virtual_stages):
        costs = stage_costs(trace=trace, virtual_stage=vs)
        for m in range(3):
            comm_f = trace.commF[vs - 1][m] if vs > 0 else 0.0
            comm_b = trace.commB[vs][m] if vs < last else 0.0
            assert costs.forward_s[m] == pytest.approx((trace.F[vs][m] + comm_f) / 1000)
            assert costs.input_grad_s[m] == pytest.approx((trace.B[vs][m] + comm_b) / 1000)
            assert costs.weight_grad_s[m] == pytest.approx(trace.W[vs][m] / 1000)
    with pytest.raises(ValueError, match="virtual_stage"):
        stage_costs(trace=trace, virtual_stage=4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"schedule": "pipedream"}, "unknown schedule"),
        ({"schedule": "interleaved"}, "chunks"),
        ({"schedule": "zbv"}, "chunks"),
        ({"schedule": "1f1b", "iterations": 0}, "iterations"),
        ({"schedule": "1f1b", "payload_elems": 0}, "payload_elems"),
        ({"schedule": "1f1b", "microbatches": 1}, "microbatches"),
    ],
)
def test_bad_input_is_refused_before_any_process_starts(kwargs: dict, field: str) -> None:
    trace = generate(scenario="none", stages=2, microbatches=kwargs.pop("microbatches", 4), chunks=1, seed=0)
    with pytest.raises(ValueError, match=field):
        measure(trace=trace, **{"iterations": 1, **kwargs})


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--schedule", "interleaved", "--chunks", "1"], "--schedule"),
        (["--variability-seed", "-1"], "--variability-seed"),
        (["--seed", "1"], "--seed"),  # the trace seed is --variability-seed, as in the other jobs
    ],
)
def test_bench_peers_names_the_bad_flag_before_any_rank_starts(
    flags: list[str], named: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_ranks(**_: object) -> None:
        raise AssertionError("the ranks started")

    monkeypatch.setattr(bench_peers, "measure_all", no_ranks)
    with pytest.raises(SystemExit) as exited:
        bench_peers.main(flags)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and named in err, err
    assert "Traceback" not in err
