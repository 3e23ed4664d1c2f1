"""A stage's inbound side (`StageReceiving`, mixed into `rrfp_ray.runtime.worker.StageWorker`): the
receive threads of the links the compute thread cannot poll, the compute thread's own reads of the
polled ones (`rrfp_ray.runtime.polled`), and every message's delivery into the arbiter's ready set.
All of it runs under the worker's lock (`_cond`) unless it says otherwise; see the worker's doc.
"""

from __future__ import annotations

import threading
import time

import torch

from rrfp_ray.policy.arbiter import Arbiter
from rrfp_ray.runtime.breakdown import Breakdown, MessageClock, Phase
from rrfp_ray.runtime.cpu import StageCpu
from rrfp_ray.runtime.errors import PipelineError
from rrfp_ray.runtime.polled import PolledLinks, unlocked
from rrfp_ray.runtime.stage_ops import StageOps
from rrfp_ray.runtime.streams import Fence, Handoff
from rrfp_ray.runtime.transport import Channel, Header, MessageReader
from rrfp_ray.runtime.tree import Tree
from rrfp_ray.schedule.layout import Link


class StageReceiving:
    """The worker's state this side uses (set by `StageWorker`)."""

    stage: int
    timeout_s: float
    _cond: threading.Condition
    _handoff: Handoff
    _arbiter: Arbiter | None
    _iteration: int
    _ops: StageOps | None
    _inbox: dict[int, tuple[torch.Tensor, Fence]]
    _expected: dict[Link, int]
    _ready_at: list[float]
    _error: BaseException | None
    _recv_busy: float
    _breakdown: Breakdown
    _notified_at: float
    _messages: MessageClock
    _cpu: StageCpu
    _stopping: bool
    _polled: PolledLinks | None
    _start: float  # perf_counter of the running iteration's start

    def _now(self) -> float:
        """Milliseconds since the running iteration started."""
        return (time.perf_counter() - self._start) * 1e3

    def _receive_loop(self, link: Link, channel: Channel) -> None:
        reader = MessageReader(channel=channel)
        clock = self._cpu.receiver()
        while True:
            clock.mark()
            with self._cond:
                # only what the running iteration expects (or STOP): an idle link never times out
                while not self._stopping and not (
                    self._expected.get(link) and self._arbiter is not None and self._arbiter.has_room()
                ):
                    self._cond.wait(timeout=self.timeout_s)
                if not self._stopping:
                    self._expected[link] -= 1
            clock.mark()
            try:
                header, payload, fence = self._handoff.receive(reader=reader)
            except TimeoutError as error:
                if not self._stopping:
                    self._fail(error)  # a link silent past its own timeout is closed (gloo) and cannot recover
                return
            except BaseException as error:
                self._fail(error)
                return
            if header.is_stop:
                return
            arrived, received = time.perf_counter(), time.time()
            with self._cond:
                if not self._wait_to_deliver(link=link, header=header):
                    return
                self._deliver(header=header, payload=payload, fence=fence, arrived=arrived, received=received)
                self._notified_at = time.perf_counter()
                self._cond.notify_all()
            if self._polled is not None:  # the compute thread may wait in its poll
                self._polled.wake()

    def _deliver(
        self, *, header: Header, payload: Tree | None, fence: Fence, arrived: float, received: float, timed: bool = True
    ) -> None:
        """Under the lock: a received message into the inbox and the arbiter's ready set."""
        began = time.perf_counter()
        consumer = self._ops.consumer(header.message)
        self._arbiter.on_arrival_slot(consumer)
        self._inbox[consumer] = (payload, fence)
        now = (began - self._start) * 1e3  # ms into the iteration, as `_now`
        if self._ready_at[consumer] < now:
            self._ready_at[consumer] = now
        done = time.perf_counter()
        self._recv_busy += done - began
        self._breakdown.add(Phase.ARRIVAL, done - arrived)
        if timed:
            self._messages.delivered(header=header, received=received, into=self._breakdown)

    def _await_arrival(self, *, timeout_s: float) -> None:
        """Under the lock, on the compute thread: wait up to `timeout_s` for a message (or a failure)."""
        if self._polled is None:
            self._messages.wait(self._cond, timeout_s=timeout_s, into=self._breakdown)
        else:  # the lock released meanwhile: a send thread reports its failure (and wakes the poll)
            self._take_polled(timeout_s=timeout_s, timed=True)

    def _take_polled(self, *, timeout_s: float = 0.0, timed: bool = False) -> None:
        """Under the lock, on the compute thread: what the polled links hold, while the iteration expects it and
        the buffer has room. `timed`: waited for, so each message's phases are sampled (see `MessageClock`)."""
        if self._polled is None:
            return

        polled = self._polled
        woke_at = polled.woke_at

        def deliver(header: Header, payload: Tree | None, fence: Fence) -> None:
            nonlocal woke_at
            arrived, received = time.perf_counter(), time.time()
            if timed and polled.woke_at != woke_at:  # the first message read since this call's wait returned
                woke_at = polled.woke_at
                self._breakdown.add(Phase.READ, arrived - woke_at)
            self._deliver(header=header, payload=payload, fence=fence, arrived=arrived, received=received, timed=timed)

        try:
            self._polled.take(
                has_room=self._arbiter.has_room,
                iteration=self._iteration,
                deliver=deliver,
                handoff=self._handoff,
                timeout_s=timeout_s,
                unlocked=unlocked(self._cond) if timeout_s else None,
            )
        except (TimeoutError, ConnectionError, OSError) as error:
            self._error = error  # a link that failed mid-message cannot recover
            raise PipelineError(f"stage {self.stage}: {error}") from error

    def _wait_to_deliver(self, *, link: Link, header: Header) -> bool:
        """Under the lock: wait until the message's iteration runs and its receive buffer has room;
        False (the error recorded) if that takes past the timeout or the worker stops."""
        deadline = time.monotonic() + self.timeout_s
        while self._arbiter is None or header.iteration != self._iteration or not self._arbiter.has_room():
            left = deadline - time.monotonic()
            if self._stopping or left <= 0:
                if self._arbiter is not None and header.iteration == self._iteration:
                    why = f"the receive buffer stayed full ({self._arbiter.buffer_limit} messages)"
                else:
                    why = f"this stage ran iteration {self._iteration}, which did not change"
                self._error = PipelineError(
                    f"{link}: message {header.message} of iteration "
                    f"{header.iteration} came while {why} for {self.timeout_s:g} s"
                )
                self._cond.notify_all()
                return False
            self._cond.wait(timeout=left)
        return True

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()
        if self._polled is not None:
            self._polled.wake()
