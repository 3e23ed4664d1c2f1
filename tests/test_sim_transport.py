"""The simulator's transport model: a per-message cost, and a link that carries one message at a time,
until the receiver takes it (collectives) or for the sender's own cost (TCP)."""

from __future__ import annotations

import pytest

from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.simulator import TransportModel, simulate
from rrfp_ray.sim.variability import generate


@pytest.mark.parametrize("name", ["1f1b", "bf", "bfw"])
def test_a_free_transport_with_an_unbounded_buffer_changes_nothing(name):
    trace = generate(scenario="lognormal", stages=4, microbatches=8, chunks=1, seed=3, t_f=2.0)
    policy = make_policy(name=name, stages=4, chunks=1, microbatches=8)
    plain = simulate(policy=policy, trace=trace, cap=Cap.parse("2x"))
    modelled = simulate(policy=policy, trace=trace, cap=Cap.parse("2x"), transport=TransportModel(message_ms=0.0))
    assert modelled.makespan_ms == plain.makespan_ms
    assert sorted(modelled.events, key=str) == sorted(plain.events, key=str)


def test_a_message_cost_below_the_op_time_acts_as_a_latency():
    """1F1B at constant durations: each link carries a message at most every t_f, so a 1 ms cost never queues."""
    policy = make_policy(name="1f1b", stages=4, chunks=1, microbatches=8)
    trace = generate(scenario="none", stages=4, microbatches=8, chunks=1, seed=0, t_f=5.0)
    modelled = simulate(policy=policy, trace=trace, cap=Cap.parse("1x"), transport=TransportModel(message_ms=1.0))
    latency = generate(scenario="none", stages=4, microbatches=8, chunks=1, seed=0, t_f=5.0, comm_ms=1.0)
    assert modelled.makespan_ms == pytest.approx(
        simulate(policy=policy, trace=latency, cap=Cap.parse("1x")).makespan_ms
    )


def test_a_link_carries_one_message_at_a_time():
    """GPipe, P=2, F = 1 ms, 3 ms a message: activation k reaches stage 1 at 1 + 3 (k + 1), not k + 4."""
    M = 6
    policy = make_policy(name="gpipe", stages=2, chunks=1, microbatches=M)
    trace = generate(scenario="none", stages=2, microbatches=M, chunks=1, seed=0, t_f=1.0)
    report = simulate(policy=policy, trace=trace, cap=Cap.parse("inf"), transport=TransportModel(message_ms=3.0))
    ready = {e.action: e.ready_ms for e in report.events if e.stage == 1}
    assert [ready[f"1F{m}"] for m in range(M)] == [1 + 3 * (m + 1) for m in range(M)]


@pytest.mark.parametrize(("send_ms", "spacing"), [(1.0, 1.0), (2.0, 2.0)])
def test_a_sender_that_does_not_wait_for_the_receiver_holds_its_link_for_its_send_alone(send_ms, spacing):
    """GPipe, P=2, F = 1 ms, 3 ms a message of which the send takes send_ms: activation k leaves once
    F k is done and the link has sent the one before, so it arrives 3 ms after max(1 + k, 1 + k * send_ms)."""
    M = 6
    policy = make_policy(name="gpipe", stages=2, chunks=1, microbatches=M)
    trace = generate(scenario="none", stages=2, microbatches=M, chunks=1, seed=0, t_f=1.0)
    report = simulate(
        policy=policy, trace=trace, cap=Cap.parse("inf"), transport=TransportModel(message_ms=3.0, send_ms=send_ms)
    )
    ready = {e.action: e.ready_ms for e in report.events if e.stage == 1}
    assert [ready[f"1F{m}"] for m in range(M)] == [1 + spacing * m + 3 for m in range(M)]


@pytest.mark.parametrize(
    ("message_ms", "send_ms", "named"), [(-1.0, None, "message_ms"), (1.0, 2.0, "send_ms"), (1.0, -0.5, "send_ms")]
)
def test_a_bad_transport_model_is_refused_naming_the_field(message_ms, send_ms, named):
    with pytest.raises(ValueError, match=named):
        TransportModel(message_ms=message_ms, send_ms=send_ms)
