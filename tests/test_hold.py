"""Holding an overtake for the first unstarted hint action's message (`TransportModel.hold_messages`,
`Arbiter`'s grace) in the simulator."""

from __future__ import annotations

import pytest

from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.simulator import TransportModel, simulate
from rrfp_ray.sim.variability import generate

P, M = 4, 16


def _makespan(name: str, *, hold: float, scenario: str = "none") -> float:
    trace = generate(scenario=scenario, stages=P, microbatches=M, chunks=1, seed=2, t_f=2.0)
    policy = make_policy(name=name, stages=P, chunks=1, microbatches=M)
    transport = TransportModel(message_ms=0.1, hold_messages=hold)
    return simulate(policy=policy, trace=trace, cap=Cap.parse("1x"), transport=transport).makespan_ms


def test_with_steady_timings_a_hold_of_three_messages_takes_back_what_overtaking_with_a_w_loses() -> None:
    fixed = _makespan("zb-h1", hold=0)
    assert _makespan("bfw", hold=0) > 1.03 * fixed  # overtaken while its input was in flight
    assert _makespan("bfw", hold=3) <= 1.01 * fixed
    assert _makespan("ready-zb-h1", hold=3) <= 1.01 * fixed


def test_a_hold_leaves_a_fixed_list_alone_and_every_trace_finishes() -> None:
    assert _makespan("zb-h1", hold=3) == _makespan("zb-h1", hold=0)
    for scenario in ("lognormal", "straggler"):
        assert _makespan("bfw", hold=3, scenario=scenario) > 0


def test_a_negative_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="hold_messages must be >= 0"):
        TransportModel(message_ms=0.1, hold_messages=-1)
