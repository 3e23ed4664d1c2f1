"""TcpGather: the TP agreement's all-gather over direct TCP connections (threads, one process)."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from rrfp_ray.runtime.tcp_gather import Secret, TcpGather

HOST = "127.0.0.1"


def _ranks(size: int, *, timeout_s: float, secret: Secret | None = None) -> list[TcpGather]:
    secret = secret or Secret.generate()
    return [TcpGather(rank=r, size=size, host=HOST, secret=secret, timeout_s=timeout_s) for r in range(size)]


def _group(size: int, *, timeout_s: float = 10.0) -> list[TcpGather]:
    ranks = _ranks(size, timeout_s=timeout_s)
    addresses = [g.address for g in ranks]
    with ThreadPoolExecutor(max_workers=size) as pool:  # highest rank first: dials precede accepts
        list(pool.map(lambda g: g.connect(addresses=addresses), reversed(ranks)))
    return ranks


def _gather_all(group: list[TcpGather], values: list[list[int]]) -> list[list[list[int]]]:
    with ThreadPoolExecutor(max_workers=len(group)) as pool:
        return list(pool.map(lambda gv: gv[0].all_gather(gv[1]), zip(group, values)))


def test_every_rank_gets_every_list_in_rank_order_round_after_round() -> None:
    group = _group(3)
    try:
        for round_ in range(20):
            values = [[round_, 10 * r, -1, 2**40 + r] for r in range(3)]
            assert _gather_all(group, values) == [values] * 3
    finally:
        for g in group:
            g.close()


def test_a_group_of_one_gathers_its_own_list() -> None:
    (only,) = _group(1)
    assert only.all_gather([7, -1]) == [[7, -1]]


def test_lists_of_different_lengths_are_refused() -> None:
    group = _group(2)
    with pytest.raises(ValueError, match="rank 1 gathered 3 values, this rank 2"):
        _gather_all(group, [[1, 2], [1, 2, 3]])


def test_a_silent_peer_times_out_naming_what_was_awaited() -> None:
    group = _group(2, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="TP rank 0: waited 0.2 s for TP rank 1's list"):
        group[0].all_gather([1])


def test_a_closed_peer_fails_the_round_naming_it() -> None:
    group = _group(2)
    group[1].close()
    with pytest.raises(ConnectionError, match="TP rank 0: connection closed while waiting for TP rank 1's list"):
        group[0].all_gather([1])


def test_a_rank_that_never_connects_is_named() -> None:
    group = _ranks(3, timeout_s=0.3)
    addresses = [g.address for g in group]
    with (
        pytest.raises(TimeoutError, match=r"TP rank 0: ranks \[2\] did not connect within 0.3 s"),
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        list(pool.map(lambda g: g.connect(addresses=addresses), group[:2]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "size": 2}, r"rank must be in \[0, 2\), got 2"),
        ({"rank": 0, "size": 0}, "size must be >= 1, got 0"),
        ({"rank": 0, "size": 2, "timeout_s": 0}, "timeout_s must be > 0, got 0"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TcpGather(host=HOST, secret=Secret.generate(), **{"timeout_s": 1.0, **kwargs})


def test_gather_before_connect_and_a_wrong_address_count_are_named() -> None:
    (rank, _) = _ranks(2, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="all_gather before connect"):
        rank.all_gather([1])
    with pytest.raises(ValueError, match="addresses must hold 2 entries"):
        rank.connect(addresses=[rank.address])


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"closed after {len(data)} of {size} bytes"
        data += chunk
    return data


def _closed_by_peer(sock: socket.socket) -> bool:
    """True once the peer closes; what it sent before (its nonce) is skipped, and must be short."""
    sock.settimeout(10.0)
    received = 0
    try:
        while chunk := sock.recv(64):
            received += len(chunk)
    except ConnectionResetError:
        pass
    return received <= 16


def _record_a_legit_hello(*, secret: Secret) -> bytes:
    """What a legitimate rank 1 answers a listener's nonce with (the listener here only records)."""
    with socket.create_server((HOST, 0)) as recorder, ThreadPoolExecutor(max_workers=1) as pool:
        legit = TcpGather(rank=1, size=2, host=HOST, secret=secret, timeout_s=10.0)
        host, port = recorder.getsockname()
        dialing = pool.submit(legit.connect, addresses=[f"{host}:{port}", legit.address])
        conn, _ = recorder.accept()
        conn.sendall(os.urandom(16))
        hello = conn.recv(1024)
        conn.close()
        with pytest.raises(ConnectionError, match="connection closed while waiting for rank 0's handshake proof"):
            dialing.result()
        legit.close()
    return hello


def _wrong_secret(address: str, secret: Secret) -> socket.socket | None:
    impostor = TcpGather(rank=1, size=2, host=HOST, secret=Secret.generate(), timeout_s=10.0)
    with pytest.raises(ConnectionError, match="connection closed while waiting for rank 0's handshake proof"):
        impostor.connect(addresses=[address, impostor.address])
    impostor.close()
    return None


def _bare_rank(address: str, secret: Secret) -> socket.socket:
    sock = socket.create_connection(address.rsplit(":", 1))
    sock.sendall(struct.pack("<q", 1))  # the rank number alone, as before the handshake
    return sock


def _replayed(address: str, secret: Secret) -> socket.socket:
    hello = _record_a_legit_hello(secret=secret)
    sock = socket.create_connection(address.rsplit(":", 1))
    _recv_exactly(sock, 16)  # a fresh nonce, which the recorded answer does not fit
    sock.sendall(hello)
    return sock


def _garbage(address: str, secret: Secret) -> socket.socket:
    sock = socket.create_connection(address.rsplit(":", 1))
    sock.sendall(os.urandom(200))
    return sock


def _silent(address: str, secret: Secret) -> socket.socket:
    return socket.create_connection(address.rsplit(":", 1))


@pytest.mark.parametrize("rogue", [_wrong_secret, _bare_rank, _replayed, _garbage, _silent])
def test_a_rogue_connection_is_refused_and_the_group_still_forms(
    rogue: Callable[[str, Secret], socket.socket | None], caplog: pytest.LogCaptureFixture
) -> None:
    secret = Secret.generate()
    group = _ranks(2, timeout_s=10.0, secret=secret)
    addresses = [g.address for g in group]
    with ThreadPoolExecutor(max_workers=1) as pool:
        accepting = pool.submit(group[0].connect, addresses=addresses)
        rogue_sock = rogue(addresses[0], secret)  # it connects before the legitimate rank 1
        group[1].connect(addresses=addresses)
        accepting.result()
    try:
        assert _gather_all(group, [[1, 2], [3, 4]]) == [[[1, 2], [3, 4]]] * 2
        assert group[0].refused == 1
        assert "TP rank 0: refused a connection from 127.0.0.1:" in caplog.text
        if rogue_sock is not None:
            assert _closed_by_peer(rogue_sock)
            rogue_sock.close()
    finally:
        for g in group:
            g.close()


def test_a_listener_that_cannot_prove_the_secret_is_refused_by_the_dialer() -> None:
    with socket.create_server((HOST, 0)) as fake, ThreadPoolExecutor(max_workers=1) as pool:
        (_, dialer) = _ranks(2, timeout_s=10.0)
        host, port = fake.getsockname()
        dialing = pool.submit(dialer.connect, addresses=[f"{host}:{port}", dialer.address])
        conn, _ = fake.accept()
        conn.sendall(os.urandom(16))
        _recv_exactly(conn, struct.calcsize("<q16s32s"))
        conn.sendall(bytes(32))
        with pytest.raises(
            ConnectionError, match="the listener for rank 0 failed to prove it holds the group's secret"
        ):
            dialing.result()
        conn.close()
        dialer.close()


def test_a_secret_never_shows_in_its_repr() -> None:
    secret = Secret.generate()
    assert secret.value.hex() not in repr(secret) and str(secret.value) not in repr(secret)
    assert repr(secret) == str(secret) == "Secret()"
    with pytest.raises(ValueError, match="at least 16 bytes, got 4"):
        Secret(value=b"abcd")


def test_the_listener_closes_once_the_group_has_formed() -> None:
    group = _group(2)
    host, port = group[0].address.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5.0)
    for g in group:
        g.close()
