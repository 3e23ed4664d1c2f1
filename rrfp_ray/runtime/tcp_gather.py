"""All-gather of short int lists over direct TCP connections: the TP agreement's rendezvous.

Every pair of ranks holds one TCP connection; a round sends this rank's list to each peer
and reads each peer's. On Ray on the 2-core development machine a round costs 0.13-0.2 ms
this way (`jobs/bench_runtime.py --stages 2 --tp 2`, its ms/round column); as a gloo
all-reduce, which passes through its process group's worker threads, it cost about 1.7 ms.

Setup is two-phase, so a driver can form every group at once: each rank binds a listener
(`address`), then every rank calls `connect` with all ranks' addresses, all at once (one
thread or actor each). A rank dials the lower ranks, then accepts the higher ones; a dial
completes once its peer has accepted it, which rank 0 does straight away, so every rank gets
through whatever order the calls start in.

Every connection is authenticated once, when it forms, with the group's `Secret` (which the
driver hands every rank through Ray): the listener sends a fresh nonce, the dialer answers
with its rank, a nonce of its own and an HMAC-SHA256 over both nonces and both ranks, and the
listener proves itself back the same way. A connection that fails the proof, or stays
silent past the handshake timeout, is closed, counted in `refused` and logged with its peer's
address; the listener keeps accepting meanwhile, so a stray client cannot take a rank's slot or
hold the group up. Lists gathered later travel unauthenticated on the authenticated connections.
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
from collections.abc import Sequence
from dataclasses import dataclass, field

_LOG = logging.getLogger(__name__)
_INT = struct.Struct("<q")
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


@dataclass
class _Arrival:
    """An accepted connection that has not yet proven itself."""

    sock: socket.socket
    peer_address: str
    nonce: bytes
    deadline: float
    hello: bytearray = field(default_factory=bytearray)


class TcpGather:
    """One rank of a group that all-gathers int lists (every rank passes the same length)."""

    def __init__(self, *, rank: int, size: int, host: str, secret: Secret, timeout_s: float) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.refused = 0  # connections closed for failing the handshake
        self._secret = secret
        self._listener = socket.create_server((host, 0), backlog=size + 16)
        host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"  # where the higher ranks dial this one
        self._peers: dict[int, socket.socket] = {}

    def connect(self, *, addresses: Sequence[str]) -> None:
        """Open a connection to every other rank; `addresses` lists every rank's `address`."""
        if len(addresses) != self.size:
            raise ValueError(f"addresses must hold {self.size} entries (one per rank), got {len(addresses)}")
        for peer in range(self.rank):
            host, _, port = addresses[peer].rpartition(":")
            try:
                sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            except OSError as error:
                raise ConnectionError(
                    f"TP rank {self.rank}: could not reach rank {peer} at {addresses[peer]}: {error}"
                ) from error
            self._add(peer=peer, sock=sock)
            self._prove(peer=peer, sock=sock)
        self._accept_higher_ranks()
        self._listener.close()

    def _prove(self, *, peer: int, sock: socket.socket) -> None:
        """The dialer's side of the handshake with `peer`, which must prove itself back."""
        theirs = self._read(sock=sock, size=_NONCE, what=f"rank {peer}'s handshake nonce")
        mine = secrets.token_bytes(_NONCE)
        transcript = self._transcript(listener_nonce=theirs, dialer_nonce=mine, dialer=self.rank, listener=peer)
        sock.sendall(_HELLO.pack(self.rank, mine, self._secret.proof(b"dial", transcript)))
        answer = self._read(sock=sock, size=_PROOF, what=f"rank {peer}'s handshake proof")
        if not hmac.compare_digest(answer, self._secret.proof(b"accept", transcript)):
            raise ConnectionError(
                f"TP rank {self.rank}: the listener for rank {peer} failed to prove it holds the group's secret"
            )

    def _accept_higher_ranks(self) -> None:
        """Accept and authenticate the higher ranks; a silent or failing connection holds up no other.

        The selector watches the listener (no data) and every arrival still proving itself (its data).
        """
        deadline = time.monotonic() + self.timeout_s
        self._listener.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            try:
                while missing := sorted(set(range(self.rank + 1, self.size)) - set(self._peers)):
                    now = time.monotonic()
                    for arrival in _arrivals(selector):
                        if arrival.deadline <= now:
                            self._refuse(arrival, selector=selector, reason="it did not finish the handshake in time")
                    if now >= deadline:
                        refused = f" ({self.refused} connections refused at the handshake)" if self.refused else ""
                        raise TimeoutError(
                            f"TP rank {self.rank}: ranks {missing} did not connect within {self.timeout_s:g} s{refused}"
                        )
                    wake = min([deadline, *(a.deadline for a in _arrivals(selector))])
                    for key, _ in selector.select(timeout=max(0.0, wake - now)):
                        if key.data is None:
                            self._greet(selector=selector)
                        else:
                            self._hear(key.data, selector=selector)
            finally:
                for arrival in _arrivals(selector):
                    self._refuse(arrival, selector=selector, reason="it had not proven itself when accepting ended")

    def _greet(self, *, selector: selectors.BaseSelector) -> None:
        """Accept a connection and send it a fresh nonce to prove itself with."""
        try:
            sock, (host, port, *_) = self._listener.accept()
        except BlockingIOError:
            return
        nonce = secrets.token_bytes(_NONCE)
        try:
            sock.settimeout(self.timeout_s)
            sock.sendall(nonce)
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        deadline = time.monotonic() + min(_HANDSHAKE_S, self.timeout_s)
        selector.register(
            sock,
            selectors.EVENT_READ,
            _Arrival(sock=sock, peer_address=f"{host}:{port}", nonce=nonce, deadline=deadline),
        )

    def _hear(self, arrival: _Arrival, *, selector: selectors.BaseSelector) -> None:
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
        transcript = self._transcript(listener_nonce=arrival.nonce, dialer_nonce=nonce, dialer=peer, listener=self.rank)
        if not hmac.compare_digest(proof, self._secret.proof(b"dial", transcript)):
            self._refuse(arrival, selector=selector, reason="it failed to prove it holds the group's secret")
        elif not self.rank < peer < self.size or peer in self._peers:
            self._refuse(arrival, selector=selector, reason=f"it announced rank {peer}, not one this rank awaits")
        else:
            selector.unregister(arrival.sock)
            arrival.sock.setblocking(True)
            self._add(peer=peer, sock=arrival.sock)
            arrival.sock.sendall(self._secret.proof(b"accept", transcript))

    def _refuse(self, arrival: _Arrival, *, selector: selectors.BaseSelector, reason: str) -> None:
        selector.unregister(arrival.sock)
        arrival.sock.close()
        self.refused += 1
        _LOG.warning("TP rank %d: refused a connection from %s: %s", self.rank, arrival.peer_address, reason)

    def _transcript(self, *, listener_nonce: bytes, dialer_nonce: bytes, dialer: int, listener: int) -> bytes:
        return listener_nonce + dialer_nonce + struct.pack("<qqq", dialer, listener, self.size)

    def all_gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's list, in rank order."""
        if len(self._peers) != self.size - 1:
            raise RuntimeError(f"TP rank {self.rank}: all_gather before connect()")
        mine = struct.pack(f"<q{len(values)}q", len(values), *values)
        for sock in self._peers.values():
            sock.sendall(mine)
        rows: list[list[int]] = []
        for peer in range(self.size):
            if peer == self.rank:
                rows.append(list(values))
                continue
            what = f"TP rank {peer}'s list"
            (count,) = _INT.unpack(self._read(sock=self._peers[peer], size=_INT.size, what=what))
            if count != len(values):
                raise ValueError(f"TP rank {self.rank}: rank {peer} gathered {count} values, this rank {len(values)}")
            body = self._read(sock=self._peers[peer], size=count * _INT.size, what=what)
            rows.append(list(struct.unpack(f"<{count}q", body)))
        return rows

    def close(self) -> None:
        self._listener.close()
        for sock in self._peers.values():
            sock.close()
        self._peers.clear()

    def _add(self, *, peer: int, sock: socket.socket) -> None:
        sock.settimeout(self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[peer] = sock

    def _read(self, *, sock: socket.socket, size: int, what: str) -> bytes:
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            try:
                n = sock.recv_into(view[got:])
            except TimeoutError:
                raise TimeoutError(f"TP rank {self.rank}: waited {self.timeout_s:g} s for {what}") from None
            if n == 0:
                raise ConnectionError(f"TP rank {self.rank}: connection closed while waiting for {what}")
            got += n
        return bytes(data)


def _arrivals(selector: selectors.BaseSelector) -> list[_Arrival]:
    return [key.data for key in list(selector.get_map().values()) if key.data is not None]
