"""Authenticated TCP connections between the ranks of a small group (the TP agreement's
all-gather, `tcp_gather`; the pipeline's TCP links, `tcp_channel`).

A rank that others dial binds a `Listener` on the node's address; a rank that dials calls
`dial`. Every connection is authenticated once, when it forms, with the group's `Secret`
(which the driver hands every rank through Ray): the listener sends a fresh nonce, the dialer
answers with its rank, a nonce of its own and an HMAC-SHA256 over both nonces, both ranks, the
group's size and its label (`Member.label`: a connection meant for one group proves nothing to
another's listener), and the listener proves itself back the same way. A connection that fails
the proof, or stays silent past the handshake timeout, is closed, counted in `refused` and
logged with its peer's address; the listener keeps accepting meanwhile, so a stray client cannot
take a rank's slot or hold the group up. What travels later goes unauthenticated on the
authenticated connections.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

_LOG = logging.getLogger(__name__)
_NONCE = 16
_PROOF = hashlib.sha256().digest_size
_HELLO = struct.Struct(f"<q{_NONCE}s{_PROOF}s")  # the dialer's rank, its nonce, its proof
_HANDSHAKE_S = 5.0  # the most a connection may take to prove itself once accepted


@dataclass(frozen=True)
class Secret:
    """A group's shared key. Its repr hides the value, so no log of call arguments can show it."""

    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.value) < 16:
            raise ValueError(f"a Secret needs at least 16 bytes, got {len(self.value)}")

    @classmethod
    def generate(cls) -> Secret:
        return cls(value=secrets.token_bytes(32))

    def proof(self, *parts: bytes) -> bytes:
        return hmac.new(self.value, b"".join(parts), hashlib.sha256).digest()


@dataclass(frozen=True)
class Member:
    """One rank's place in a group: what it proves and how its errors name it (`name`, e.g. "TP rank 1")."""

    rank: int
    size: int
    secret: Secret
    name: str
    timeout_s: float
    label: str = ""  # the group's, bound into every proof

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    def transcript(self, *, listener_nonce: bytes, dialer_nonce: bytes, dialer: int, listener: int) -> bytes:
        return listener_nonce + dialer_nonce + struct.pack("<qqq", dialer, listener, self.size) + self.label.encode()


def dial(*, member: Member, peer: int, address: str) -> socket.socket:
    """Connect to `peer`'s listener at `address` and prove this rank; `peer` must prove itself back."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=member.timeout_s)
    except OSError as error:
        raise ConnectionError(f"{member.name}: could not reach rank {peer} at {address}: {error}") from error
    configure(sock, timeout_s=member.timeout_s)
    try:
        theirs = read_exactly(
            sock, size=_NONCE, who=member.name, what=f"rank {peer}'s handshake nonce", timeout_s=member.timeout_s
        )
        mine = secrets.token_bytes(_NONCE)
        transcript = member.transcript(listener_nonce=theirs, dialer_nonce=mine, dialer=member.rank, listener=peer)
        sock.sendall(_HELLO.pack(member.rank, mine, member.secret.proof(b"dial", transcript)))
        answer = read_exactly(
            sock, size=_PROOF, who=member.name, what=f"rank {peer}'s handshake proof", timeout_s=member.timeout_s
        )
    except BaseException:
        sock.close()
        raise
    if not hmac.compare_digest(answer, member.secret.proof(b"accept", transcript)):
        sock.close()
        raise ConnectionError(
            f"{member.name}: the listener for rank {peer} failed to prove it holds the group's secret"
        )
    return sock


def configure(sock: socket.socket, *, timeout_s: float) -> None:
    """Blocking with a timeout, no Nagle delay: what every connection of a group runs with."""
    sock.settimeout(timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def block_with_deadline(sock: socket.socket, *, timeout_s: float) -> None:
    """A blocking socket whose every send and receive fails after `timeout_s` (the kernel's SO_SNDTIMEO and
    SO_RCVTIMEO, raised as BlockingIOError): one system call a read or write, where a socket timeout polls first."""
    configure(sock, timeout_s=timeout_s)
    sock.settimeout(None)
    seconds = int(timeout_s)
    limit = struct.pack("ll", seconds, int((timeout_s - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)


def read_into(sock: socket.socket, view: memoryview, *, who: str, what: str, timeout_s: float) -> None:
    """Fill `view` from `sock`; TimeoutError or ConnectionError naming `who` and `what` it waited for."""
    got, size = 0, len(view)
    while got < size:
        try:
            n = sock.recv_into(view[got:] if got else view)
        except (TimeoutError, BlockingIOError):
            raise TimeoutError(f"{who}: waited {timeout_s:g} s for {what}") from None
        except OSError as error:
            raise ConnectionError(f"{who}: connection failed while waiting for {what}: {error}") from error
        if n == 0:
            raise ConnectionError(f"{who}: connection closed while waiting for {what}")
        got += n


def read_exactly(sock: socket.socket, *, size: int, who: str, what: str, timeout_s: float) -> bytes:
    data = bytearray(size)
    read_into(sock, memoryview(data), who=who, what=what, timeout_s=timeout_s)
    return bytes(data)


@dataclass
class _Arrival:
    """An accepted connection that has not yet proven itself."""

    sock: socket.socket
    peer_address: str
    nonce: bytes
    deadline: float
    hello: bytearray = field(default_factory=bytearray)


class Listener:
    """Where the ranks that dial `member` connect: bound at once (`address`), accepting in `accept`."""

    def __init__(self, *, member: Member, host: str) -> None:
        self.member = member
        self.refused = 0  # connections closed for failing the handshake
        self._sock = socket.create_server((host, 0), backlog=member.size + 16)
        host, port = self._sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._peers: dict[int, socket.socket] = {}

    def accept(self, *, ranks: Iterable[int]) -> dict[int, socket.socket]:
        """Accept and authenticate `ranks`, then stop listening; a silent or failing connection
        holds up no other. The selector watches the listener (no data) and every arrival still
        proving itself (its data)."""
        awaited = set(ranks)
        name, timeout_s = self.member.name, self.member.timeout_s
        deadline = time.monotonic() + timeout_s
        self._sock.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            try:
                while missing := sorted(awaited - set(self._peers)):
                    now = time.monotonic()
                    for arrival in _arrivals(selector):
                        if arrival.deadline <= now:
                            self._refuse(arrival, selector=selector, reason="it did not finish the handshake in time")
                    if now >= deadline:
                        refused = f" ({self.refused} connections refused at the handshake)" if self.refused else ""
                        raise TimeoutError(f"{name}: ranks {missing} did not connect within {timeout_s:g} s{refused}")
                    wake = min([deadline, *(a.deadline for a in _arrivals(selector))])
                    for key, _ in selector.select(timeout=max(0.0, wake - now)):
                        if key.data is None:
                            self._greet(selector=selector)
                        else:
                            self._hear(key.data, selector=selector, awaited=awaited)
            except BaseException:
                for sock in self._peers.values():
                    sock.close()
                self._peers = {}
                raise
            finally:
                for arrival in _arrivals(selector):
                    self._refuse(arrival, selector=selector, reason="it had not proven itself when accepting ended")
                self.close()
        peers, self._peers = self._peers, {}
        return peers

    def close(self) -> None:
        """Stop listening (the connections `accept` returned stay open)."""
        self._sock.close()

    def _greet(self, *, selector: selectors.BaseSelector) -> None:
        """Accept a connection and send it a fresh nonce to prove itself with."""
        try:
            sock, (host, port, *_) = self._sock.accept()
        except BlockingIOError:
            return
        nonce = secrets.token_bytes(_NONCE)
        try:
            sock.settimeout(self.member.timeout_s)
            sock.sendall(nonce)
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        deadline = time.monotonic() + min(_HANDSHAKE_S, self.member.timeout_s)
        arrival = _Arrival(sock=sock, peer_address=f"{host}:{port}", nonce=nonce, deadline=deadline)
        selector.register(sock, selectors.EVENT_READ, arrival)

    def _hear(self, arrival: _Arrival, *, selector: selectors.BaseSelector, awaited: set[int]) -> None:
        """Read what `arrival` sent so far; once its hello is whole, admit it as its rank or refuse it."""
        try:
            chunk = arrival.sock.recv(_HELLO.size - len(arrival.hello))
        except BlockingIOError:
            return
        except OSError as error:
            self._refuse(arrival, selector=selector, reason=f"it failed: {error}")
            return
        if not chunk:
            self._refuse(arrival, selector=selector, reason="it closed before proving itself")
            return
        arrival.hello += chunk
        if len(arrival.hello) < _HELLO.size:
            return
        peer, nonce, proof = _HELLO.unpack(arrival.hello)
        member = self.member
        transcript = member.transcript(
            listener_nonce=arrival.nonce, dialer_nonce=nonce, dialer=peer, listener=member.rank
        )
        if not hmac.compare_digest(proof, member.secret.proof(b"dial", transcript)):
            self._refuse(arrival, selector=selector, reason="it failed to prove it holds the group's secret")
        elif peer not in awaited or peer in self._peers:
            self._refuse(arrival, selector=selector, reason=f"it announced rank {peer}, not one this rank awaits")
        else:
            selector.unregister(arrival.sock)
            configure(arrival.sock, timeout_s=member.timeout_s)
            self._peers[peer] = arrival.sock
            arrival.sock.sendall(member.secret.proof(b"accept", transcript))

    def _refuse(self, arrival: _Arrival, *, selector: selectors.BaseSelector, reason: str) -> None:
        selector.unregister(arrival.sock)
        arrival.sock.close()
        self.refused += 1
        _LOG.warning("%s: refused a connection from %s: %s", self.member.name, arrival.peer_address, reason)


def _arrivals(selector: selectors.BaseSelector) -> list[_Arrival]:
    return [key.data for key in list(selector.get_map().values()) if key.data is not None]
