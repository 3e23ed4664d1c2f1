"""All-gather of short int lists over direct TCP connections: the TP agreement's rendezvous.

Every pair of ranks holds one TCP connection; a round sends this rank's list to each peer
and reads each peer's. On Ray on the 2-core development machine a round costs 0.13-0.2 ms
this way (`jobs/bench_runtime.py --stages 2 --tp 2`, its ms/round column); as a gloo
all-reduce, which passes through its process group's worker threads, it cost about 1.7 ms.

Setup is two-phase, so a driver can form every group at once: each rank binds a listener
(`address`), then every rank calls `connect` with all ranks' addresses. A rank dials the
lower ranks and accepts the higher ones; the kernel completes a dial before the peer
accepts it, so the order of the `connect` calls does not matter.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

_INT = struct.Struct("<q")


class TcpGather:
    """One rank of a group that all-gathers int lists (every rank passes the same length)."""

    def __init__(self, *, rank: int, size: int, host: str, timeout_s: float) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._listener = socket.create_server((host, 0), backlog=size)
        self._listener.settimeout(timeout_s)
        self._peers: dict[int, socket.socket] = {}

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

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
            sock.sendall(_INT.pack(self.rank))
            self._add(peer=peer, sock=sock)
        for _ in range(self.rank + 1, self.size):
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                missing = sorted(set(range(self.rank + 1, self.size)) - set(self._peers))
                raise TimeoutError(
                    f"TP rank {self.rank}: ranks {missing} did not connect within {self.timeout_s:g} s"
                ) from None
            sock.settimeout(self.timeout_s)
            (peer,) = _INT.unpack(self._read(sock=sock, size=_INT.size, what="the rank of a connecting peer"))
            if not self.rank < peer < self.size or peer in self._peers:
                sock.close()
                raise ConnectionError(
                    f"TP rank {self.rank}: a peer announced rank {peer}, expected one of the ranks above"
                )
            self._add(peer=peer, sock=sock)
        self._listener.close()

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
