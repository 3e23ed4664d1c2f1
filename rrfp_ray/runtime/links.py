"""A stage's outbound links: one send thread per link.

A link's messages leave one at a time, in the order they become due (an injected latency
delays its message's release); a collective send returns once the receiver has taken the
frame, so a slow receiver holds back its own link only, never another. Each link has its
own lock, so posting wakes that link's thread alone.

Over a channel that can write without waiting (`NonBlockingChannel`: TCP, in memory), a small
message due at once on an idle link goes out from the posting (compute) thread itself, with no
hop to the send thread: whatever the kernel does not take at once (a full socket buffer, as when
two stages send to each other faster than they read) is left to the send thread, so posting
never blocks. Collective channels (gloo, NCCL) keep to their one thread per communicator.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterable

import torch

from rrfp_ray.runtime.breakdown import Breakdown, Phase
from rrfp_ray.runtime.cpu import ThreadClock
from rrfp_ray.runtime.streams import Fence, Handoff
from rrfp_ray.runtime.timers import tighten_timer_slack
from rrfp_ray.runtime.transport import Channel, Header, MessageWriter
from rrfp_ray.runtime.tree import Tree
from rrfp_ray.schedule.layout import Link

_STOP = Header(message=None)
DIRECT_BYTES = 64 * 1024  # the largest payload the posting thread frames and writes itself
_Frames = list[torch.Tensor] | None  # what is left to write of a message framed already; None: frame it


class LinkSender:
    def __init__(
        self, *, link: Link, channel: Channel, handoff: Handoff, on_error: Callable[[BaseException], None]
    ) -> None:
        self.link = link
        self._writer = MessageWriter(channel=channel)
        self._handoff = handoff
        self._on_error = on_error
        self._lock = threading.RLock()  # `post` takes it bare (a C call), not via `_cond`
        self._cond = threading.Condition(self._lock)
        self._channel = channel
        self._direct = hasattr(channel, "try_send")  # a `NonBlockingChannel`
        # (release, seq, header, payload, fence, frames left)
        self._queue: list[tuple[float, int, Header, Tree | None, Fence, _Frames]] = []
        self._seq = itertools.count()
        self._sending = False
        self._busy_s = 0.0
        self._start_breakdown()
        self.clock = ThreadClock()  # the send thread's CPU
        self._thread = threading.Thread(target=self._loop, name=f"send {link}", daemon=True)
        self._thread.start()

    def post(self, *, header: Header, payload: Tree, release: float, fence: Fence = None) -> None:
        """Queue a message; it leaves at `release` (perf_counter seconds) or later, once `fence` is passed;
        written at once from this thread where it can be (see the module's doc)."""
        written = False
        with self._lock:
            rest = None
            if self._direct and fence is None and not self._queue and not self._sending and _small(header):
                taken = time.perf_counter()
                if release <= taken:
                    rest = self._write_now(header=header, payload=payload, release=release, taken=taken)
                    written = not rest  # all of it went (or the failure is reported)
            if not written:
                heapq.heappush(self._queue, (release, next(self._seq), header, payload, fence, rest))
                self._cond.notify()
        if written:
            os.sched_yield()  # the receiver the write woke may wait on this core for it: it runs now

    def _write_now(self, *, header: Header, payload: Tree, release: float, taken: float) -> _Frames:
        """Under the lock, on the posting thread: the message's frames, written as far as they go without
        waiting; what is left of them (None: all went, or the channel failed and the failure is reported)."""
        try:
            frames = self._writer.frames(header=header, payload=payload)
            while frames:
                wrote = self._channel.try_send(frames[0])
                if wrote < len(frames[0]):
                    frames[0] = frames[0][wrote:]
                    return frames
                frames.pop(0)
        except (OSError, ValueError) as error:  # as the send thread's: reported to the compute thread
            self._on_error(error)
            return None
        sent = time.perf_counter()
        self._busy_s += sent - taken
        self._handoffs.append(taken - release)
        self._sends.append(sent - taken)
        return None

    def wait_idle(self, *, timeout_s: float) -> bool:
        """Whether every posted message left within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=left)
        return True

    def take_stats(self, *, into: Breakdown) -> float:
        """Seconds spent sending since the last call; its hand-off and send samples go `into`. Starts afresh."""
        with self._cond:
            busy, self._busy_s = self._busy_s, 0.0
            into.extend(self._breakdown)
            self._start_breakdown()
        return busy

    def _start_breakdown(self) -> None:
        """Under the lock (or before the thread starts): a fresh `Breakdown`, its hand-off and send samples at hand."""
        self._breakdown = Breakdown()
        self._handoffs, self._sends = self._breakdown.samples(Phase.HANDOFF), self._breakdown.samples(Phase.SEND)

    def close(self, *, timeout_s: float) -> None:
        """Send STOP after whatever is queued, and end the thread."""
        with self._cond:
            last = max((release for release, *_ in self._queue), default=0.0)
        self.post(header=_STOP, payload=None, release=last)
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        tighten_timer_slack()
        while True:
            self.clock.mark()
            with self._cond:
                while not self._queue or self._queue[0][0] > time.perf_counter():
                    self._cond.wait(timeout=None if not self._queue else self._queue[0][0] - time.perf_counter())
                release, _, header, payload, fence, rest = heapq.heappop(self._queue)
                self._sending = True
                taken = time.perf_counter()
            try:
                if rest is None:
                    self._handoff.send(writer=self._writer, header=header, payload=payload, fence=fence)
                for frame in rest or ():  # the frames the posting thread could not write at once
                    self._channel.send(frame)
            except BaseException as error:  # reported to the compute thread
                self._on_error(error)
            sent = time.perf_counter()
            self.clock.mark()
            with self._cond:
                self._sending = False
                if not header.is_stop:
                    self._busy_s += sent - taken
                    self._handoffs.append(taken - release)
                    self._sends.append(sent - taken)
                self._cond.notify_all()
            if header.is_stop:
                return


def wait_idle(senders: Iterable[LinkSender], *, timeout_s: float) -> Link | None:
    """The first link whose posted messages did not all leave within `timeout_s` (shared), or None."""
    deadline = time.monotonic() + timeout_s
    for sender in senders:
        if not sender.wait_idle(timeout_s=max(0.0, deadline - time.monotonic())):
            return sender.link
    return None


def _small(header: Header) -> bool:
    """A message the posting thread may write itself (never STOP: it ends the send thread)."""
    if header.message is None:
        return False
    nbytes = 0
    for leaf in header.leaves:
        nbytes += leaf.dtype.itemsize * math.prod(leaf.shape)
    return nbytes <= DIRECT_BYTES
