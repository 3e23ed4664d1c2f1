"""Pipeline links over direct TCP connections (`LinkTransport.TCP`), for CPU stages.

Each directed link is one TCP connection from its sender to its receiver, authenticated when it
forms (`rrfp_ray.runtime.tcp_pair`; the link's name is bound into the proofs). A frame goes out
with one `sendall` of the frame's own buffer and comes in with `recv_into` the receiver's, so
a message costs two system calls and the receiving compute thread's wake-up from its `poll`
(`fileno`, `rrfp_ray.runtime.polled`), where a gloo pair's send
and receive pass through gloo's worker threads and wait for the peer to post its receive
(`jobs/bench_runtime.py --backend tcp` against `--backend gloo` compares them on one trace).
Unlike gloo, a send returns once the kernel holds the bytes, not once the receiver has taken them.

Setup is two-phase, so a driver can wire every stage at once: each stage binds a listener per
inbound link (`TcpLinks`, its `addresses`), then every stage calls `connect` with the addresses
of its outbound links' receivers, all at once (one actor each); `connect` accepts on its
listeners while it dials, so no order of the calls can deadlock.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from rrfp_ray.runtime.tcp_pair import Listener, Member, Secret, block_with_deadline, dial, read_into
from rrfp_ray.schedule.layout import Link

_RECEIVER, _SENDER = 0, 1  # the ranks of a link's two ends


class TcpChannel:
    """One direction of one link over a connected socket (the `Channel` protocol)."""

    def __init__(self, *, name: str, sock: socket.socket, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.name = name
        self.device = "cpu"
        self.takes_arrays = True  # host frames come as their numpy arrays, no tensor around them
        self.copies_on_send = True  # a send returns once the kernel holds the bytes: the frame may be reused
        self._who = f"channel {name}"
        self.timeout_s = timeout_s
        self._sock = sock
        block_with_deadline(sock, timeout_s=timeout_s)

    def send(self, tensor: torch.Tensor | np.ndarray) -> None:
        try:
            self._sock.sendall(_buffer(tensor))
        except (TimeoutError, BlockingIOError):
            raise TimeoutError(f"channel {self.name}: the receiver took nothing for {self.timeout_s:g} s") from None
        except OSError as error:
            raise ConnectionError(f"channel {self.name}: send failed (the receiver is gone?): {error}") from error

    def try_send(self, tensor: torch.Tensor | np.ndarray) -> int:
        """What of the frame the kernel takes at once (`MSG_DONTWAIT`): a full socket buffer waits for nothing."""
        try:
            return self._sock.send(_buffer(tensor), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as error:
            raise ConnectionError(f"channel {self.name}: send failed (the receiver is gone?): {error}") from error

    def recv(self, tensor: torch.Tensor | np.ndarray) -> None:
        """Fill `tensor` in place; TimeoutError naming the channel if nothing comes in time, ConnectionError if
        the sender is gone."""
        read_into(self._sock, _buffer(tensor), who=self._who, what="a frame", timeout_s=self.timeout_s)

    def fileno(self) -> int:
        """The socket's descriptor, for a `poll` (`rrfp_ray.runtime.polled`)."""
        return self._sock.fileno()

    def close(self) -> None:
        """Close the connection; a thread blocked in `recv` on it returns with a ConnectionError."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        self._sock.close()


class TcpLinks:
    """One stage's TCP link ends: a listener per inbound link from the start, then (`connect`)
    the channels of both directions."""

    def __init__(
        self, *, inbound: Sequence[Link], host: str, secret: Secret, timeout_s: float, link_timeout_s: float
    ) -> None:
        self._secret, self._timeout_s, self._link_timeout_s = secret, timeout_s, link_timeout_s
        self._listeners = {link: Listener(member=self._member(link, rank=_RECEIVER), host=host) for link in inbound}
        self._channels: list[TcpChannel] = []

    @property
    def addresses(self) -> dict[Link, str]:
        """Where each inbound link's sender dials."""
        return {link: listener.address for link, listener in self._listeners.items()}

    def connect(self, *, outbound: Mapping[Link, str]) -> tuple[dict[Link, TcpChannel], dict[Link, TcpChannel]]:
        """Dial every outbound link's receiver (`outbound`: its address) while accepting every inbound
        link's sender; the channels, inbound and outbound. The first failure is raised once every
        dial and accept has ended (their connections closed)."""
        with ThreadPoolExecutor(max_workers=max(1, len(self._listeners) + len(outbound))) as pool:
            accepting = {
                link: pool.submit(listener.accept, ranks=[_SENDER]) for link, listener in self._listeners.items()
            }
            dialing = {
                link: pool.submit(dial, member=self._member(link, rank=_SENDER), peer=_RECEIVER, address=address)
                for link, address in outbound.items()
            }
        failures = [f.exception() for f in [*accepting.values(), *dialing.values()] if f.exception() is not None]
        received = {
            link: self._channel(link, f.result()[_SENDER]) for link, f in accepting.items() if f.exception() is None
        }
        sent = {link: self._channel(link, f.result()) for link, f in dialing.items() if f.exception() is None}
        if failures:
            self.close()
            raise failures[0]
        return received, sent

    def close(self) -> None:
        """Close every listener and channel; threads blocked on a channel return with a ConnectionError."""
        for listener in self._listeners.values():
            listener.close()
        for channel in self._channels:
            channel.close()
        self._channels = []

    def _member(self, link: Link, *, rank: int) -> Member:
        end = "receiving" if rank == _RECEIVER else "sending"
        return Member(
            rank=rank,
            size=2,
            secret=self._secret,
            name=f"link {link} ({end} end)",
            timeout_s=self._timeout_s,
            label=str(link),
        )

    def _channel(self, link: Link, sock: socket.socket) -> TcpChannel:
        channel = TcpChannel(name=str(link), sock=sock, timeout_s=self._link_timeout_s)
        self._channels.append(channel)
        return channel


def _buffer(tensor: torch.Tensor | np.ndarray) -> memoryview:
    """The bytes of a frame (a contiguous uint8 CPU tensor, or a host frame's array), shared with it."""
    if type(tensor) is np.ndarray and tensor.dtype == np.uint8 and tensor.flags.c_contiguous:
        return memoryview(tensor)
    if tensor.device.type != "cpu" or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
        raise ValueError(
            f"a TCP channel carries frames, contiguous uint8 CPU tensors; got a {tensor.dtype} one on {tensor.device}"
        )
    return memoryview(tensor.numpy())
