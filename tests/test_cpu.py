"""CPU per op: the clocks a stage reads and the arithmetic that turns them into microseconds per op."""

from __future__ import annotations

import threading
import time

import pytest

from rrfp_ray.runtime.breakdown import Breakdown, MessageClock, Phase
from rrfp_ray.runtime.cpu import CpuUse, Meter, OpClock, ThreadClock, per_op_us
from rrfp_ray.runtime.transport import Header
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Message


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_thread_clock_holds_what_its_thread_spent_up_to_its_last_mark():
    clock = ThreadClock()

    def work() -> None:
        _spin(0.02)
        clock.mark()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert 0.02 <= clock.cpu_s < 5.0  # a fresh thread's clock: its own CPU only


def test_a_meter_splits_the_process_clock_into_its_parts():
    send, receive, op = ThreadClock(), ThreadClock(), OpClock()
    meter = Meter(idle=0.5)
    meter.start(send=[send], receive=[receive])
    began = OpClock.now()
    _spin(0.01)
    op.add(since=began)
    send.cpu_s += 0.002  # as if the send thread marked 2 ms more
    use = meter.stop(ops=4, op=op, send=[send], receive=[receive])
    assert (
        use.op_s >= 0.01 and use.compute_s >= use.op_s and use.process_s >= use.compute_s - 1e-3
    )  # read one after the other
    assert use.send_s == pytest.approx(0.002) and use.receive_s == 0.0
    assert use.idle_s == pytest.approx(0.5 * use.wall_s)


def test_cpu_per_op_pools_each_stage_then_takes_the_median_over_stages():
    def use(process: float, ops: int) -> dict[str, float]:
        return CpuUse(
            ops=ops, wall_s=1.0, process_s=process, idle_s=0.1, op_s=0.2, compute_s=0.3, send_s=0.1, receive_s=0.05
        ).to_dict()

    stages = [[use(1.0, 10), use(1.0, 10)], [use(2.0, 10)], [use(3.0, 10)]]
    figures = per_op_us(stages)
    assert figures["all"] == pytest.approx((2.0 - 0.1 - 0.2) * 1e6 / 10)  # the middle stage
    assert figures["compute"] == pytest.approx(0.1 * 1e6 / 10)
    assert figures["other"] == pytest.approx((1.7 - 0.1 - 0.1 - 0.05) * 1e6 / 10)
    assert per_op_us([[use(1.0, 0)]]) == {}


def test_one_message_ends_when_the_compute_thread_can_start_its_op():
    clock, samples, cond = MessageClock(), Breakdown(), threading.Condition()
    message = Message(kind=Kind.F, virtual_stage=0, microbatch=0)
    sent = time.time()
    clock.delivered(header=Header(message=message, released_at=sent - 0.5, sent_at=sent), received=sent, into=samples)
    [busy] = samples.to_us()[Phase.MESSAGE.value]  # the compute thread was busy: usable at its delivery
    assert 500_000 <= busy < 600_000

    def deliver() -> None:
        with cond:
            header = Header(message=message, released_at=time.time(), sent_at=time.time())
            clock.delivered(header=header, received=time.time(), into=samples)
            cond.notify_all()

    with cond:
        threading.Timer(0.05, deliver).start()
        clock.wait(cond, timeout_s=5.0, into=samples)
    assert len(samples.to_us()[Phase.MESSAGE.value]) == 2 and not clock.waiting
