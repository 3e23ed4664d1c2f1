"""The collective transport: group wiring, channels, TP collectives (gloo on CPU)."""

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

from actors import collective
from actors.collective import GLOO_BACKEND, Channel
from rrfp_ray.runtime.transport import LinkTransport

TIMEOUT_S = 20.0
HANG_GUARD_S = 60.0


@ray.remote
class Peer:
    """A stand-in stage actor: joins groups, moves tensors from its own threads."""

    def __init__(self):
        torch.set_num_threads(1)
        collective.register_backends()

    def host(self, name: str) -> str:
        return collective.host_group(name=name)

    def join(self, name: str, address: str, rank: int, world_size: int) -> None:
        collective.join_group(
            name=name,
            address=address,
            rank=rank,
            world_size=world_size,
            library=LinkTransport.GLOO,
            timeout_s=TIMEOUT_S,
        )

    def duplex(self, *, out_group: str, in_group: str, count: int, base: int) -> list[list[int]]:
        """Send ``base + i`` on out_group while receiving ``count`` messages on in_group."""
        out = Channel(group=out_group, peer=1, timeout_s=TIMEOUT_S, name="out")
        inc = Channel(group=in_group, peer=0, timeout_s=TIMEOUT_S, name="in")

        def send_all():
            for i in range(count):
                out.send(torch.full((64,), base + i, dtype=torch.int64))

        def recv_all():
            received = []
            buffer = torch.empty(64, dtype=torch.int64)
            for _ in range(count):
                inc.recv(buffer)
                received.append(sorted(set(buffer.tolist())))
            return received

        with ThreadPoolExecutor(2) as pool:
            sent = pool.submit(send_all)
            received = pool.submit(recv_all)
            sent.result()
            return received.result()

    def leave(self, name: str) -> None:
        collective.destroy_group(name=name)

    def group_ops(self, name: str, rank: int) -> list[float]:
        tensor = torch.full((5,), float(rank + 1))
        collective.all_reduce_sum(group=name, tensor=tensor)
        return tensor.tolist()

    def recv_error(self, *, group: str, peer: int, timeout_s: float, name: str):
        channel = Channel(group=group, peer=peer, timeout_s=timeout_s, name=name)
        start = time.monotonic()
        try:
            channel.recv(torch.empty(64, dtype=torch.int64))
        except Exception as error:  # returned to the driver to be checked there
            return type(error).__name__, str(error), time.monotonic() - start
        return None, "", time.monotonic() - start

    def ping(self, *, count: int, numel: int) -> list[float]:
        """Round trips: send on 'ab', wait for the echo on 'ba'."""
        out = Channel(group="ab", peer=1, timeout_s=TIMEOUT_S, name="ping out")
        inc = Channel(group="ba", peer=0, timeout_s=TIMEOUT_S, name="ping in")
        message = torch.arange(numel, dtype=torch.int64)
        echo = torch.empty_like(message)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            out.send(message)
            inc.recv(echo)
            times.append(time.perf_counter() - start)
        assert torch.equal(message, echo)
        return times

    def pong(self, *, count: int, numel: int) -> None:
        inc = Channel(group="ab", peer=0, timeout_s=TIMEOUT_S, name="pong in")
        out = Channel(group="ba", peer=1, timeout_s=TIMEOUT_S, name="pong out")
        buffer = torch.empty(numel, dtype=torch.int64)
        for _ in range(count):
            inc.recv(buffer)
            out.send(buffer)

    def stream(self, *, count: int, numel: int) -> float:
        """Send ``count`` float32 tensors on 'ab', then wait for one ack on 'ba'."""
        out = Channel(group="ab", peer=1, timeout_s=TIMEOUT_S, name="stream out")
        inc = Channel(group="ba", peer=0, timeout_s=TIMEOUT_S, name="stream ack")
        payload = torch.ones(numel)
        start = time.perf_counter()
        for _ in range(count):
            out.send(payload)
        inc.recv(torch.empty(1, dtype=torch.int64))
        return time.perf_counter() - start

    def sink(self, *, count: int, numel: int) -> float:
        inc = Channel(group="ab", peer=0, timeout_s=TIMEOUT_S, name="sink in")
        out = Channel(group="ba", peer=1, timeout_s=TIMEOUT_S, name="sink ack")
        buffer = torch.empty(numel)
        total = 0.0
        for _ in range(count):
            inc.recv(buffer)
            total += float(buffer.sum())
        out.send(torch.ones(1, dtype=torch.int64))
        return total


def wire(groups: list[tuple[str, list]]) -> None:
    """Host every group, then issue every join at once, in one order for all actors."""
    addresses = ray.get([members[0].host.remote(name) for name, members in groups])
    joins = [
        member.join.remote(name, address, rank, len(members))
        for (name, members), address in zip(groups, addresses)
        for rank, member in enumerate(members)
    ]
    ray.get(joins, timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def pair(ray_session):
    a, b = Peer.remote(), Peer.remote()
    wire([("ab", [a, b]), ("ba", [b, a])])
    yield a, b
    for actor in (a, b):
        ray.kill(actor)


def test_resolve_transport_keeps_an_explicit_choice(monkeypatch):
    assert collective.resolve_transport(transport=LinkTransport.GLOO) is LinkTransport.GLOO
    assert collective.resolve_transport(transport=LinkTransport.TCP) is LinkTransport.TCP
    monkeypatch.setattr(collective, "nccl_missing", lambda: None)
    assert collective.resolve_transport(transport=LinkTransport.NCCL) is LinkTransport.NCCL


def test_explicit_nccl_without_cuda_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="backend nccl: no CUDA device is visible"):
        collective.resolve_transport(transport=LinkTransport.NCCL)


def test_stages_must_agree_on_the_backend():
    same = {"stage 0": LinkTransport.GLOO, "stage 1": LinkTransport.GLOO}
    assert collective.agree_on_transport(choices=same) is LinkTransport.GLOO
    mixed = {"stage 0": LinkTransport.NCCL, "stage 1": LinkTransport.GLOO, "stage 2": LinkTransport.NCCL}
    with pytest.raises(RuntimeError, match=r"gloo on stage 1; nccl on stage 0, stage 2"):
        collective.agree_on_transport(choices=mixed)


def test_resolve_auto_falls_back_to_tcp_links_beside_gloo_groups(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA" in collective.nccl_missing()
    assert collective.resolve_transport(transport=LinkTransport.AUTO) is LinkTransport.TCP
    assert collective.group_library(links=LinkTransport.TCP) is LinkTransport.GLOO
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails
    assert "cupy" in collective.nccl_missing()
    assert collective.resolve_transport(transport=LinkTransport.AUTO) is LinkTransport.TCP


def test_bad_arguments_name_the_field():
    with pytest.raises(TypeError, match="transport"):
        collective.resolve_transport(transport="gloo")
    with pytest.raises(ValueError, match="library"):
        collective.join_group(name="g", address="h:1", rank=0, world_size=2, library=LinkTransport.AUTO, timeout_s=1.0)
    with pytest.raises(ValueError, match="rank"):
        collective.join_group(name="g", address="h:1", rank=2, world_size=2, library=LinkTransport.GLOO, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        Channel(group="g", peer=1, timeout_s=0.0, name="activations 0->1")


def test_register_backends_is_idempotent():
    collective.register_backends()
    collective.register_backends()
    assert ray.util.collective.is_backend_available(GLOO_BACKEND)


def test_two_links_both_directions_at_once(pair):
    a, b = pair
    count = 50
    from_b, from_a = ray.get(
        [
            a.duplex.remote(out_group="ab", in_group="ba", count=count, base=1000),
            b.duplex.remote(out_group="ba", in_group="ab", count=count, base=2000),
        ],
        timeout=HANG_GUARD_S,
    )
    assert from_b == [[2000 + i] for i in range(count)]
    assert from_a == [[1000 + i] for i in range(count)]


def test_three_rank_all_reduce(pair):
    a, b = pair
    c = Peer.remote()
    members = [a, b, c]

    def check():
        results = ray.get(
            [m.group_ops.remote("abc", rank) for rank, m in enumerate(members)],
            timeout=HANG_GUARD_S,
        )
        assert results == [[6.0] * 5] * 3

    wire([("abc", members)])
    check()
    ray.get([m.leave.remote("abc") for m in members])
    wire([("abc", members)])  # the name is free again after destroy_group
    check()
    ray.kill(c)


def test_recv_without_message_times_out_naming_the_channel(pair):
    a, b = pair
    wire([("quiet", [b, a])])
    timeout_s = 1.0
    kind, message, elapsed = ray.get(
        a.recv_error.remote(group="quiet", peer=0, timeout_s=timeout_s, name="activations 1->2"),
        timeout=timeout_s + HANG_GUARD_S,
    )
    print(f"\nrecv timeout {timeout_s}s returned after {elapsed:.3f}s")
    assert kind == "TimeoutError"
    assert "activations 1->2" in message


def test_peer_killed_mid_recv_is_an_error_not_a_timeout(pair):
    a, _ = pair
    doomed = Peer.remote()
    wire([("doomed", [doomed, a])])
    pending = a.recv_error.remote(group="doomed", peer=0, timeout_s=TIMEOUT_S, name="gradients 2->1")
    time.sleep(0.5)
    ray.kill(doomed)
    kind, message, elapsed = ray.get(pending, timeout=HANG_GUARD_S)
    print(f"\npeer killed: {kind} after {elapsed:.3f}s: {message[:120]}")
    assert kind == "ConnectionError"
    assert "gradients 2->1" in message


def test_measure_latency_and_bandwidth(pair):
    a, b = pair
    count, numel = 300, 64
    times, _ = ray.get(
        [a.ping.remote(count=count, numel=numel), b.pong.remote(count=count, numel=numel)],
        timeout=HANG_GUARD_S,
    )
    steady = times[20:]
    print(
        f"\nround trip, {numel} int64: median {statistics.median(steady) * 1e6:.0f} us, "
        f"p90 {statistics.quantiles(steady, n=10)[-1] * 1e6:.0f} us ({len(steady)} trips)"
    )
    count, numel = 20, 1 << 20  # 4 MiB of float32 per message
    elapsed, total = ray.get(
        [a.stream.remote(count=count, numel=numel), b.sink.remote(count=count, numel=numel)],
        timeout=HANG_GUARD_S,
    )
    assert total == float(count * numel)
    print(f"bandwidth, {count} x 4 MiB: {count * 4 / 1024 / elapsed:.2f} GiB/s")


def test_a_communicator_refuses_a_second_thread():
    import threading

    from actors.nccl_channel import OneThread

    guard = OneThread(what="channel 'F0->1'")
    guard.check()
    guard.check()  # the same thread again
    failures = []

    def other() -> None:
        try:
            guard.check()
        except RuntimeError as error:
            failures.append(str(error))

    thread = threading.Thread(target=other, name="intruder")
    thread.start()
    thread.join()
    assert failures and "channel 'F0->1': ops from a second thread (intruder)" in failures[0]


def test_the_nccl_path_is_pinned_to_the_ray_it_was_written_against(monkeypatch):
    from actors import nccl_channel

    nccl_channel.check_ray_version()  # this machine's Ray is the one
    monkeypatch.setattr(nccl_channel.ray, "__version__", "2.61.0")
    with pytest.raises(RuntimeError, match=r"Ray 2.60's NCCL group internals; this is Ray 2.61.0: pin ray==2.60"):
        nccl_channel.check_ray_version()
