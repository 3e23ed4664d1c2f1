"""jobs/benchmarks/peers/torch_pipelining.py: PyTorch's own schedules replaying a duration trace; and
jobs/bench_peers.py, its command, refusing bad flags before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bench_peers
from benchmarks.peers.sleep_module import delivery_wait_s, stage_costs
from benchmarks.peers.torch_pipelining import KEYS, measure, measure_all
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.schedule.actions import Placement
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate

ROOT = Path(__file__).resolve().parents[1]


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


def test_v_stage_costs_have_no_latency_at_the_turn() -> None:
    """Under V virtual stages P-1 and P share a rank: the turn between them is a local hand-off."""
    trace = generate(scenario="lognormal+comm", stages=2, microbatches=3, chunks=2, seed=1, t_f=10.0)
    turn_in = stage_costs(trace=trace, virtual_stage=2, placement=Placement.V)
    turn_out = stage_costs(trace=trace, virtual_stage=1, placement=Placement.V)
    looped = stage_costs(trace=trace, virtual_stage=2)
    for m in range(3):
        assert turn_in.activation_latency_s[m] == turn_out.gradient_latency_s[m] == 0.0
        assert looped.activation_latency_s[m] == pytest.approx(trace.commF[1][m] / 1000)
        assert looped.activation_latency_s[m] > 0


def test_stage_costs_keep_the_op_times_and_the_incoming_latencies_apart() -> None:
    trace = generate(scenario="lognormal+comm", stages=2, microbatches=3, chunks=2, seed=1, t_f=10.0)
    last = trace.virtual_stages - 1
    for vs in range(trace.virtual_stages):
        split, whole = (
            stage_costs(trace=trace, virtual_stage=vs),
            stage_costs(trace=trace, virtual_stage=vs, split=False),
        )
        for m in range(3):
            assert split.forward_s[m] == whole.forward_s[m] == pytest.approx(trace.F[vs][m] / 1000)
            assert split.input_grad_s[m] == pytest.approx(trace.B[vs][m] / 1000)
            assert split.weight_grad_s[m] == pytest.approx(trace.W[vs][m] / 1000)
            assert whole.input_grad_s[m] == pytest.approx((trace.B[vs][m] + trace.W[vs][m]) / 1000)
            assert whole.weight_grad_s[m] == 0.0  # the gradient leaves when the whole backward is done
            assert split.activation_latency_s[m] == pytest.approx(trace.commF[vs - 1][m] / 1000 if vs > 0 else 0.0)
            assert split.gradient_latency_s[m] == pytest.approx(trace.commB[vs][m] / 1000 if vs < last else 0.0)
    with pytest.raises(ValueError, match="virtual_stage"):
        stage_costs(trace=trace, virtual_stage=4)


def test_a_message_is_usable_its_latency_after_its_sender_ended_and_not_before() -> None:
    assert delivery_wait_s(sent_at=10.0, latency_s=0.5, now=10.2) == pytest.approx(0.3)  # still on its way
    assert delivery_wait_s(sent_at=10.0, latency_s=0.5, now=11.0) == 0.0  # overlapped with other work
    assert delivery_wait_s(sent_at=0.0, latency_s=0.5, now=11.0) == 0.0  # no sender: the data or the loss


class _Clock:
    """Stands in for the sleep module's `time`: a clock that only moves when slept on."""

    CLOCK_MONOTONIC = 1

    def __init__(self, now: float) -> None:
        self.now = now
        self.slept: list[float] = []

    def clock_gettime(self, clock: int) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_stage_waits_only_for_what_is_left_of_a_latency_and_stamps_what_it_sends(monkeypatch) -> None:
    import benchmarks.peers.sleep_module as sleep_module

    trace = generate(scenario="comm", stages=2, microbatches=2, chunks=1, seed=0, t_f=20.0, comm_ms=40.0)
    costs = stage_costs(trace=trace, virtual_stage=1, split=False)
    clock = _Clock(now=100.0)
    monkeypatch.setattr(sleep_module, "time", clock)
    stage = sleep_module.SleepStage(costs=costs, virtual_stage=1, log=[])
    x = sleep_module.microbatch_inputs(microbatches=2, payload_elems=4)[1:].requires_grad_(True)
    x.data[:, sleep_module.SENT_AT] = 99.99  # sent 10 ms ago
    y = stage(x)
    left = max(0.0, costs.activation_latency_s[1] - 0.01)
    assert clock.slept == [pytest.approx(left + costs.forward_s[1])]  # what is left of the latency, then F
    assert y[0, sleep_module.SENT_AT].item() == pytest.approx(clock.now)  # stamped when F ended
    clock.now += 1.0  # the gradient comes back long after its latency: no wait
    grad = torch.zeros_like(y)
    grad[:, sleep_module.SENT_AT] = clock.now - 0.5
    y.backward(grad)
    assert sorted(clock.slept[1:]) == [0.0, pytest.approx(costs.input_grad_s[1])]  # B + W in the input path
    assert x.grad[0, sleep_module.SENT_AT].item() == pytest.approx(clock.now)


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
