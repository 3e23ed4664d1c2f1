"""TCP links in one process (threads): frames round-trip through the framing, failures name the
channel, only a holder of the secret connects, and two stage workers over TCP close cleanly."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.breakdown import Phase
from rrfp_ray.runtime.errors import PipelineError
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.polled import PolledLinks
from rrfp_ray.runtime.streams import Handoff
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.runtime.tcp_channel import TcpChannel, TcpLinks
from rrfp_ray.runtime.tcp_pair import Secret
from rrfp_ray.runtime.transport import Header, MessageReader, MessageWriter
from rrfp_ray.runtime.worker import StageWorker
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Layout, Link, Message
from rrfp_ray.sim.variability import generate

HOST = "127.0.0.1"
LINK = Link(src=0, dst=1, kind=Kind.F)


def _connect(
    ends: dict[int, TcpLinks], outbound: dict[int, dict[Link, str]]
) -> dict[int, tuple[dict[Link, TcpChannel], dict[Link, TcpChannel]]]:
    """Every stage's `connect` at once, as the driver issues them."""
    with ThreadPoolExecutor(max_workers=len(ends)) as pool:
        futures = {s: pool.submit(end.connect, outbound=outbound[s]) for s, end in ends.items()}
        return {s: future.result() for s, future in futures.items()}


def _pair(*, link_timeout_s: float = 10.0, dialer_secret: Secret | None = None, timeout_s: float = 10.0):
    """`LINK`'s two ends: the sending stage's links, the receiving one's, and the two channels."""
    secret = Secret.generate()
    receiving = TcpLinks(inbound=[LINK], host=HOST, secret=secret, timeout_s=timeout_s, link_timeout_s=link_timeout_s)
    sending = TcpLinks(
        inbound=[], host=HOST, secret=dialer_secret or secret, timeout_s=timeout_s, link_timeout_s=link_timeout_s
    )
    channels = _connect({0: sending, 1: receiving}, {0: receiving.addresses, 1: {}})
    return sending, receiving, channels[0][1][LINK], channels[1][0][LINK]


def test_frames_of_changing_size_round_trip_through_the_framing() -> None:
    sending, receiving, out, into = _pair()
    shapes = [(4, 8), (4, 8), (1000,), (3, 5, 7), (3, 5, 7), ()]
    sent = [torch.randn(shape) for shape in shapes] + [
        {"x": torch.arange(6).view(2, 3), "mask": torch.ones(5, dtype=torch.bool)}
    ]
    writer, reader = MessageWriter(channel=out), MessageReader(channel=into)

    def send_all() -> None:
        for mb, payload in enumerate(sent):
            writer.send(
                header=Header.for_payload(
                    message=Message(kind=Kind.F, virtual_stage=0, microbatch=mb), iteration=3, payload=payload
                ),
                payload=payload,
            )
        writer.send(header=Header(message=None), payload=None)

    thread = threading.Thread(target=send_all)
    thread.start()
    try:
        for mb, payload in enumerate(sent):
            header, got = reader.recv()
            assert (header.message.microbatch, header.iteration) == (mb, 3)
            if isinstance(payload, dict):
                assert got.keys() == payload.keys()
                for key in payload:
                    torch.testing.assert_close(got[key], payload[key])
            else:
                torch.testing.assert_close(got, payload)
        assert reader.recv()[0].is_stop
    finally:
        thread.join(timeout=10)
        sending.close()
        receiving.close()


def test_a_silent_sender_times_out_naming_the_channel() -> None:
    sending, receiving, _, into = _pair(link_timeout_s=0.2)
    with pytest.raises(TimeoutError, match="channel activations 0->1: waited 0.2 s for a frame"):
        into.recv(torch.empty(16, dtype=torch.uint8))
    sending.close()
    receiving.close()


def test_a_sender_that_closes_mid_frame_fails_the_receive_naming_the_channel() -> None:
    sending, receiving, out, into = _pair()
    out.send(torch.ones(100, dtype=torch.uint8))  # a tenth of the frame the receiver waits for
    sending.close()
    with pytest.raises(ConnectionError, match="channel activations 0->1: connection closed while waiting for a frame"):
        into.recv(torch.empty(1000, dtype=torch.uint8))
    receiving.close()


def test_closing_a_channel_ends_a_receive_blocked_on_it() -> None:
    sending, receiving, _, into = _pair()
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            into.recv(torch.empty(8, dtype=torch.uint8))
        except ConnectionError as error:
            failed.append(error)

    thread = threading.Thread(target=receive)
    thread.start()
    receiving.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and len(failed) == 1
    sending.close()


def test_a_dialer_with_the_wrong_secret_is_refused_and_the_receiver_names_the_link(caplog) -> None:
    with pytest.raises((ConnectionError, TimeoutError)) as raised:
        _pair(dialer_secret=Secret.generate(), timeout_s=0.5)
    # the first failure raised is the accept's or the dial's; both name the link
    assert "link activations 0->1" in str(raised.value)
    assert "link activations 0->1 (receiving end): refused a connection from 127.0.0.1:" in caplog.text
    assert "it failed to prove it holds the group's secret" in caplog.text


def test_a_proof_for_one_link_is_refused_by_another_links_listener(caplog) -> None:
    secret = Secret.generate()
    other = Link(src=1, dst=0, kind=Kind.B)
    receiving = TcpLinks(inbound=[LINK], host=HOST, secret=secret, timeout_s=0.5, link_timeout_s=10)
    sending = TcpLinks(inbound=[], host=HOST, secret=secret, timeout_s=0.5, link_timeout_s=10)
    with pytest.raises((ConnectionError, TimeoutError)):
        _connect({0: sending, 1: receiving}, {0: {other: receiving.addresses[LINK]}, 1: {}})
    assert "it failed to prove it holds the group's secret" in caplog.text


def test_two_stage_workers_over_tcp_run_an_iteration_and_close_without_waiting_out_the_timeout() -> None:
    policy = make_policy(name="1f1b", stages=2, chunks=1, microbatches=4)
    workload = SyntheticWorkload(
        trace=generate(scenario="none", stages=2, microbatches=4, chunks=1, seed=1, t_f=1.0), payload_elems=64
    )
    before = set(threading.enumerate())
    # a close that sat out its 60 s timeout would fail the result() wait, or leave threads alive below
    workers, ends, layout = _workers(microbatches=4, timeout_s=60)
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [
            pool.submit(
                w.run_iteration,
                args=IterationArgs(iteration=0, layout=layout, policy=policy, cap=Cap.parse("2x")),
                executor=workload.executor(stage=w.stage, layout=layout),
            )
            for w in workers
        ]
        events = [run.result(timeout=60)[0] for run in runs]
        assert sorted(e.action for stage in events for e in stage) == sorted(
            str(a) for s in range(2) for a in layout.actions(stage=s)
        )
        closing = [pool.submit(w.close) for w in workers]
        for future in closing:
            future.result(timeout=30)
    for end in ends.values():
        end.close()
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


def _workers(*, microbatches: int, timeout_s: float) -> tuple[list[StageWorker], dict[int, TcpLinks], Layout]:
    layout = Layout(stages=2, chunks=1, microbatches=microbatches)
    secret = Secret.generate()
    ends = {
        s: TcpLinks(
            inbound=[link for link in layout.links() if link.dst == s],
            host=HOST,
            secret=secret,
            timeout_s=10,
            link_timeout_s=10,
        )
        for s in range(2)
    }
    addresses = {link: address for end in ends.values() for link, address in end.addresses.items()}
    channels = _connect(
        ends, {s: {link: addresses[link] for link in layout.links() if link.src == s} for s in range(2)}
    )
    workers = [
        StageWorker(stage=s, inbound=channels[s][0], outbound=channels[s][1], timeout_s=timeout_s) for s in range(2)
    ]
    return workers, ends, layout


def test_tcp_links_are_read_by_the_compute_thread_within_the_buffer_bound() -> None:
    before = {t.name for t in threading.enumerate()}
    workers, ends, layout = _workers(microbatches=6, timeout_s=60)
    assert not [t for t in threading.enumerate() if t.name.startswith("recv") and t.name not in before]
    policy = make_policy(name="bf", stages=2, chunks=1, microbatches=6)
    workload = SyntheticWorkload(
        trace=generate(scenario="lognormal", stages=2, microbatches=6, chunks=1, seed=3, t_f=1.0, sigma=0.6),
        payload_elems=64,
    )
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [
            pool.submit(
                w.run_iteration,
                args=IterationArgs(iteration=0, layout=layout, policy=policy, cap=Cap.parse("inf"), buffer_limit=1),
                executor=workload.executor(stage=w.stage, layout=layout),
            )
            for w in workers
        ]
        stats = [run.result(timeout=60)[1] for run in runs]
        for future in [pool.submit(w.close) for w in workers]:
            future.result(timeout=30)
    assert max(s.peak_buffered for s in stats) == 1
    for end in ends.values():
        end.close()


def test_a_message_the_compute_thread_waited_for_has_its_read_timed_from_the_poll_s_return() -> None:
    workers, ends, layout = _workers(microbatches=2, timeout_s=60)
    policy = make_policy(name="1f1b", stages=2, chunks=1, microbatches=2)
    workload = SyntheticWorkload(
        trace=generate(scenario="none", stages=2, microbatches=2, chunks=1, seed=0, t_f=1.0), payload_elems=64
    )
    args = IterationArgs(iteration=0, layout=layout, policy=policy, cap=Cap.parse("1x"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        waiting = pool.submit(workers[1].run_iteration, args=args, executor=workload.executor(stage=1, layout=layout))
        time.sleep(0.05)  # stage 1 is in its wait for stage 0's first output before stage 0 starts
        sending = pool.submit(workers[0].run_iteration, args=args, executor=workload.executor(stage=0, layout=layout))
        phases = waiting.result(timeout=60)[1].overhead_us
        sending.result(timeout=60)
        for future in [pool.submit(w.close) for w in workers]:
            future.result(timeout=30)
    for end in ends.values():
        end.close()
    read, transit = phases[Phase.READ.value], phases[Phase.TRANSIT.value]
    assert 1 <= len(read) <= len(transit)  # one a wait that brought messages, the first it read
    assert 0 <= read[0] <= 60e6


def test_a_neighbour_gone_mid_iteration_fails_the_polling_stage_at_once_naming_the_link() -> None:
    workers, ends, layout = _workers(microbatches=2, timeout_s=60)
    policy = make_policy(name="1f1b", stages=2, chunks=1, microbatches=2)
    workload = SyntheticWorkload(
        trace=generate(scenario="none", stages=2, microbatches=2, chunks=1, seed=0, t_f=1.0), payload_elems=64
    )
    ends[0].close()  # stage 0 never runs: its connections close under stage 1's poll
    began = time.monotonic()
    with pytest.raises(PipelineError, match=r"stage 1: channel activations 0->1: connection"):
        workers[1].run_iteration(
            args=IterationArgs(iteration=0, layout=layout, policy=policy, cap=Cap.parse("1x")),
            executor=workload.executor(stage=1, layout=layout),
        )
    assert time.monotonic() - began < 10  # not its 60 s timeout
    ends[1].close()


def test_polled_links_take_only_the_messages_an_iteration_expects_and_leave_the_next_ones_in_the_socket() -> None:
    sending, receiving, out, inbound = _pair()
    polled = PolledLinks(channels={LINK: inbound})
    writer = MessageWriter(channel=out)
    for iteration, microbatch in ((0, 0), (0, 1), (1, 0)):
        header = Header(message=Message(kind=Kind.F, virtual_stage=1, microbatch=microbatch), iteration=iteration)
        writer.send(header=header, payload=torch.full((4,), float(microbatch)))
    taken: list[tuple[int, int]] = []

    def take(iteration: int, *, timeout_s: float) -> None:
        polled.take(
            has_room=lambda: True,
            iteration=iteration,
            deliver=lambda header, payload, fence: taken.append((header.iteration, header.message.microbatch)),
            handoff=Handoff(),
            timeout_s=timeout_s,
        )

    polled.expect({LINK: 2})
    while len(taken) < 2:
        take(0, timeout_s=5.0)
    take(0, timeout_s=0.2)  # the link brings nothing more this iteration: the third message is not read
    assert taken == [(0, 0), (0, 1)]
    polled.expect({LINK: 1})
    take(1, timeout_s=5.0)
    assert taken[2:] == [(1, 0)]
    sending.close()
    receiving.close()
