"""All-gather of short int lists over direct TCP connections: the TP agreement's rendezvous.

Every pair of ranks holds one TCP connection, authenticated with the group's `Secret` when it
forms (`rrfp_ray.runtime.tcp_pair`); a round sends this rank's list to each peer and reads each
peer's. `jobs/bench_runtime.py --stages 2 --tp 2` prints what a round costs (its ms/round
column; on 2 CPUs 0.13-0.2 ms), and with `--tp-gather collective` what the gloo all-gather costs,
which passes through its process group's worker threads and takes longer.

Setup is two-phase, so a driver can form every group at once: each rank binds a listener
(`address`), then every rank calls `connect` with all ranks' addresses, all at once (one
thread or actor each). A rank dials the lower ranks, then accepts the higher ones; a dial
completes once its peer has accepted it, which rank 0 does straight away, so every rank gets
through whatever order the calls start in.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from rrfp_ray.runtime.tcp_pair import Listener, Member, Secret, dial, read_exactly

_INT = struct.Struct("<q")
_LABEL = "tp-agreement"


class TcpGather:
    """One rank of a group that all-gathers int lists (every rank passes the same length)."""

    def __init__(self, *, rank: int, size: int, host: str, secret: Secret, timeout_s: float) -> None:
        self._member = Member(
            rank=rank, size=size, secret=secret, name=f"TP rank {rank}", timeout_s=timeout_s, label=_LABEL
        )
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._listener = Listener(member=self._member, host=host)
        self.address = self._listener.address  # where the higher ranks dial this one
        self._peers: dict[int, socket.socket] = {}

    @property
    def refused(self) -> int:
        """Connections closed for failing the handshake."""
        return self._listener.refused

    def connect(self, *, addresses: Sequence[str]) -> None:
        """Open a connection to every other rank; `addresses` lists every rank's `address`."""
        if len(addresses) != self.size:
            raise ValueError(f"addresses must hold {self.size} entries (one per rank), got {len(addresses)}")
        for peer in range(self.rank):
            self._peers[peer] = dial(member=self._member, peer=peer, address=addresses[peer])
        self._peers |= self._listener.accept(ranks=range(self.rank + 1, self.size))

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
            (count,) = _INT.unpack(self._read(peer=peer, size=_INT.size, what=what))
            if count != len(values):
                raise ValueError(f"TP rank {self.rank}: rank {peer} gathered {count} values, this rank {len(values)}")
            body = self._read(peer=peer, size=count * _INT.size, what=what)
            rows.append(list(struct.unpack(f"<{count}q", body)))
        return rows

    def close(self) -> None:
        self._listener.close()
        for sock in self._peers.values():
            sock.close()
        self._peers.clear()

    def _read(self, *, peer: int, size: int, what: str) -> bytes:
        return read_exactly(
            self._peers[peer], size=size, who=f"TP rank {self.rank}", what=what, timeout_s=self.timeout_s
        )
