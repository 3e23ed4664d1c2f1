"""Inbound links that a stage's compute thread reads itself (TCP: a channel with a file descriptor).

A receive thread per link costs a message two wake-ups (the kernel wakes the receive thread, which
wakes the compute thread) and its own Python beside the compute thread's. Where a link's channel is
a socket, the compute thread instead looks at its sockets before each decision (a `poll` that does
not wait) and, with nothing eligible, waits in one `poll` on every socket that can bring a message
it may take, plus a wake-up pipe (a send thread's failure), with the deadline of its own wait. The
kernel then wakes the thread that runs the op. A message the running iteration does not expect, or
that the receive buffer has no room for, stays in the kernel's buffer: the worker polls only the
links it may read.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Protocol

from rrfp_ray.runtime.streams import Fence, Handoff
from rrfp_ray.runtime.transport import Channel, Header, MessageReader
from rrfp_ray.runtime.tree import Tree
from rrfp_ray.schedule.layout import Link

_LOG = logging.getLogger(__name__)
_READABLE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


class PolledChannel(Channel, Protocol):
    """A channel whose incoming bytes a `poll` can wait for (`rrfp_ray.runtime.tcp_channel.TcpChannel`)."""

    def fileno(self) -> int: ...


def polled(channel: Channel) -> bool:
    """Whether the compute thread can read `channel` itself (see the module's doc)."""
    return hasattr(channel, "fileno")


class PolledLinks:
    """A stage's polled inbound links; the compute thread uses them, `wake` any thread."""

    def __init__(self, *, channels: Mapping[Link, PolledChannel]) -> None:
        self._readers = {link: MessageReader(channel=channel) for link, channel in channels.items()}
        self.links = tuple(channels)
        self._by_index = [self._readers[link] for link in self.links]
        self._fd = [channel.fileno() for channel in channels.values()]
        self._index_of = {fd: i for i, fd in enumerate(self._fd)}
        self._left = [0] * len(self.links)  # per link, the messages the running iteration has yet to bring
        self._open: list[int] = []  # the links (indices) whose `_left` is not 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll = select.poll()
        self._poll.register(self._wake_r, select.POLLIN)
        self._watched: list[int] = []  # the links (indices) the poll object holds, as `readable` last got them
        self.woke_at = 0.0  # perf_counter when the last wait (`take` with a timeout) returned with bytes to read

    def expect(self, counts: Mapping[Link, int]) -> None:
        """How many messages the next iteration brings on each link (set while no `take` runs)."""
        self._left = [counts.get(link, 0) for link in self.links]
        self._open = [i for i, n in enumerate(self._left) if n]

    def readable(self, links: list[int], *, timeout_s: float) -> list[int]:
        """Those of `links` (indices into `links`) with bytes to read, waiting up to `timeout_s` (0: a look) for
        one, or for `wake`."""
        if links is not self._watched and links != self._watched:
            for i in self._watched:
                if i not in links:
                    self._poll.unregister(self._fd[i])
            for i in links:
                if i not in self._watched:
                    self._poll.register(self._fd[i], _READABLE)
            self._watched = links
        ready = self._poll.poll(math.ceil(timeout_s * 1e3) if timeout_s > 0 else 0)
        if not ready:
            return ready
        links_ready = []
        for fd, _ in ready:
            if fd == self._wake_r:
                _drain(self._wake_r)
            else:
                links_ready.append(self._index_of[fd])
        return links_ready

    def take(
        self,
        *,
        has_room: Callable[[], bool],
        iteration: int,
        deliver: Callable[[Header, Tree | None, Fence], None],
        handoff: Handoff,
        timeout_s: float = 0.0,
        unlocked: AbstractContextManager[object] | None = None,
    ) -> None:
        """Wait up to `timeout_s` (inside `unlocked`) for bytes on a link that the iteration brings more messages
        on (`expect`) while there is room (`has_room`), then read and `deliver` such links' messages, one a link
        in turn, while they hold some. A STOP or a message of another iteration fails."""
        left = self._left
        links = self._open if has_room() else []
        if unlocked is None:
            ready = self.readable(links, timeout_s=timeout_s) if links or timeout_s else []
        else:
            with unlocked:
                ready = self.readable(links, timeout_s=timeout_s)
                if ready:
                    self.woke_at = time.perf_counter()
        while ready:
            for i in ready:
                if not (left[i] and has_room()):
                    continue
                header, payload, fence = handoff.receive(reader=self._by_index[i])
                left[i] -= 1
                if not left[i]:
                    self._open = [j for j, n in enumerate(left) if n]
                if header.message is None or header.iteration != iteration:
                    what = "STOP" if header.is_stop else f"a message of iteration {header.iteration}"
                    raise ConnectionError(f"{self.links[i]}: {what} came during iteration {iteration}")
                deliver(header, payload, fence)
            links = self._open if has_room() else []
            ready = self.readable(links, timeout_s=0.0) if links else []

    def read(self, link: Link, *, handoff: Handoff) -> tuple[Header, Tree | None, Fence]:
        """One message of `link` (its first bytes are in: the rest comes within the channel's own deadline)."""
        return handoff.receive(reader=self._readers[link])

    def wake(self) -> None:
        """End the compute thread's `readable` wait now."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake is pending) or closed

    def close(self, *, handoff: Handoff, timeout_s: float) -> None:
        """Take every link's STOP (the neighbours close at the same time), within `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        for link in self._readers:
            while time.monotonic() < deadline:
                try:
                    header, _, _ = self.read(link, handoff=handoff)
                except (TimeoutError, ConnectionError, OSError) as error:
                    _LOG.debug("%s: no STOP at close: %s", link, error)
                    break
                if header.is_stop:
                    break
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass


@contextlib.contextmanager
def unlocked(lock: threading.Condition) -> Iterator[None]:
    """`lock` (held) released for a wait, taken back after."""
    lock.release()
    try:
        yield
    finally:
        lock.acquire()
