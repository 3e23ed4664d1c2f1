"""The runtime side of one stage: a compute thread, one send thread per outbound link
(`rrfp_ray.runtime.links`), and one receive thread per inbound link whose channel the compute
thread cannot poll (gloo, NCCL, in memory); which thread uses which communicator and how tensors
cross threads: `rrfp_ray.runtime.streams`.

The compute thread (the caller of `run_iteration`) arbitrates, executes, and hands each
output to its link's send thread. It reads polled links (TCP) itself, before each decision and
while it waits (`rrfp_ray.runtime.polled`; the whole inbound side: `rrfp_ray.runtime.receiving`).
Receive threads route each message into the arbiter's ready set and wake it. A message is taken
off its link only while the receive buffer has room, and a receive thread delivers it only while
it still has: a message received as another link's filled the last place waits on its own link,
so the buffer never holds more than its limit.
Every wait is bounded by `timeout_s` and fails naming what it awaited.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from rrfp_ray.observe.telemetry import OpEvent, StageStats, stage_stats
from rrfp_ray.policy.agreement import Agreement, TPContext
from rrfp_ray.policy.arbiter import Arbiter
from rrfp_ray.runtime.breakdown import Breakdown, MessageClock, Phase
from rrfp_ray.runtime.cpu import StageCpu
from rrfp_ray.runtime.errors import PipelineError
from rrfp_ray.runtime.executor import Executor
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.links import LinkSender, wait_idle
from rrfp_ray.runtime.polled import PolledLinks, polled
from rrfp_ray.runtime.receiving import StageReceiving
from rrfp_ray.runtime.reduce import DPContext, ReduceStats
from rrfp_ray.runtime.stage_ops import StageOps, stage_ops
from rrfp_ray.runtime.streams import Fence, Handoff
from rrfp_ray.runtime.timers import tighten_timer_slack
from rrfp_ray.runtime.transport import Channel, Header
from rrfp_ray.schedule.grad_ready import reduce_order
from rrfp_ray.schedule.layout import Link, Message


class StageWorker(StageReceiving):
    def __init__(
        self,
        *,
        stage: int,
        inbound: dict[Link, Channel],
        outbound: dict[Link, Channel],
        timeout_s: float,
        handoff: Handoff | None = None,
    ) -> None:
        self.stage = stage
        self._handoff = handoff or Handoff()
        self.timeout_s = timeout_s
        self._inbound = inbound
        self._senders = {
            link: LinkSender(link=link, channel=channel, handoff=self._handoff, on_error=self._fail)
            for link, channel in outbound.items()
        }
        self._lock = threading.RLock()  # the compute thread's per-op path takes it bare (a C call), not via `_cond`
        self._cond = threading.Condition(self._lock)
        self._arbiter: Arbiter | None = None
        self._iteration = -1
        self._start = 0.0
        self._ops: StageOps | None = None
        self._sender_of: list[LinkSender | None] = []  # per slot of the running iteration, its message's link
        self._delay_s: list[float] = []  # per slot of the running iteration, its message's injected latency
        self._inbox: dict[int, tuple[torch.Tensor, Fence]] = {}  # by the slot of the action that takes it
        self._expected: dict[Link, int] = {}  # per link, the messages the iteration has yet to bring (receive threads')
        self._ready_at: list[float] = []  # per slot: when its action became ready (ms into the iteration)
        self._error: BaseException | None = None
        self._recv_busy = 0.0
        self._breakdown = Breakdown()
        self._notified_at = 0.0  # perf_counter of the last arrival that woke the compute thread
        self._messages, self._cpu = MessageClock(), StageCpu()
        self._stopping = False
        by_poll = {link: channel for link, channel in inbound.items() if polled(channel)}
        self._polled = PolledLinks(channels=by_poll) if by_poll else None
        self._threads = [
            threading.Thread(target=self._receive_loop, args=(link, channel), name=f"recv {link}", daemon=True)
            for link, channel in inbound.items()
            if link not in by_poll
        ]
        for thread in self._threads:
            thread.start()

    def run_iteration(
        self,
        *,
        args: IterationArgs,
        executor: Executor,
        latency: Callable[[Message], float] | None = None,
        tp: TPContext | None = None,
        all_reduce: Callable[[float], float] = float,
        dp: DPContext | None = None,
    ) -> tuple[list[OpEvent], StageStats]:
        """Run every action of this stage for one iteration, then the executor's `finish` (the
        optimizer step); returns its events and stats. The stage's wall time covers both; its
        `step_ms` is the finish alone (with the all-reduce of the global gradient norm, which
        waits for the slowest stage).

        With `tp`, this worker is one rank of its stage's TP group, and the ranks agree on
        every op before running it (`rrfp_ray.policy.agreement`), unless the policy is fixed: then
        every rank runs the same list in order already.

        With `dp`, this worker's stage is replicated: during a chunk's last weight-gradient op, its
        gradients go to the DP reduction as they become final (`rrfp_ray.runtime.reduce`; with
        `dp.overlap` off, every chunk's once all stages have run their last op), and the step waits for it.

        With `args.measure`, the executor's `measure` follows the step, on this thread: the stats carry
        its layer costs and probe (outside the stage's wall time)."""
        iteration, layout, policy = args.iteration, args.layout, args.policy
        tighten_timer_slack()
        memory = None if args.memory is None else args.memory[self.stage]
        arbiter = Arbiter(
            layout=layout, stage=self.stage, policy=policy, cap=args.cap, buffer_limit=args.buffer_limit, memory=memory
        )
        ops = stage_ops(layout, self.stage)
        with self._cond:
            self._raise_if_failed()
            if ops is not self._ops:  # the same layout again: the same (cached) ops, the same links
                self._sender_of = [None if link is None else self._senders[link] for link in ops.link]
            self._arbiter, self._iteration, self._ops = arbiter, iteration, ops
            self._expected = dict(ops.arrivals)
            self._delay_s = delays(ops=ops, order=args.order, latency=latency)
            if self._polled is not None:
                self._polled.expect(self._expected)
            self._start = time.perf_counter()
            started_at = time.time()
            self._recv_busy = 0.0
            self._ready_at, self._breakdown = [0.0] * len(ops.actions), Breakdown()
            for sender in self._senders.values():
                sender.take_stats(into=Breakdown())  # what came before this iteration: dropped
            self._cpu.begin(send=[sender.clock for sender in self._senders.values()])
            self._cond.notify_all()
        ran: list[tuple[int, float, float]] = []  # (slot, start ms, end ms) per op, in order: its event's figures
        ready_at, follower_of, actions, local_consumer = self._ready_at, ops.follower, ops.actions, ops.local_consumer
        agreement = None if tp is None or policy.fixed else Agreement(tp=tp)
        tp_ms = 0.0
        weight_ops_left = dict.fromkeys(range(layout.chunks), layout.microbatches)
        executor.begin(args=args)
        if dp is not None:
            dp.reducer.begin()
        try:
            lock, inbox, sends, use, run = self._lock, self._inbox, ops.sends, self._handoff.use, executor.run
            op_clock, origin, perf_counter, thread_time = self._cpu.op, self._start, time.perf_counter, time.thread_time
            while True:
                with lock:
                    if arbiter.finished:
                        break
                    if agreement is None:
                        slot = self._wait_for_slot(arbiter)
                        payload = inbox.pop(slot, None)
                if agreement is not None:
                    slot, coordinating = self._agree_on_slot(arbiter, agreement)
                    tp_ms += coordinating
                    with lock:
                        payload = inbox.pop(slot, None)
                if payload is not None:
                    payload = use(*payload)
                action = actions[slot]
                release = None if dp is None else dp.release(action=action, weight_ops_left=weight_ops_left)
                start, op_cpu = (perf_counter() - origin) * 1e3, thread_time()
                output = run(action=action, iteration=iteration, payload=payload, release=release)
                end = (perf_counter() - origin) * 1e3
                op_clock.cpu_s += thread_time() - op_cpu
                consumer, follower = local_consumer[slot], follower_of[slot]
                with lock:
                    arbiter.on_done_slot(slot)
                    if consumer >= 0:
                        self._hand_over(slot, consumer, output)
                    if follower >= 0 and ready_at[follower] < end:
                        ready_at[follower] = end
                if consumer < 0 and sends[slot] is not None:  # outside the lock: receive threads deliver meanwhile
                    self._post(ops, slot, iteration, output)
                ran.append((slot, start, end))
                if release is not None:
                    dp.reducer.complete(key=action.chunk)
            self._wait_outbox_empty()
            events = self._events(ops=ops, arbiter=arbiter, ran=ran)
            cpu = self._cpu.end(ops=len(events))
        finally:
            with self._cond:
                self._arbiter = None
        ops_done = self._now()
        reduced = (
            None if dp is None else self._reduce(dp=dp, executor=executor, all_reduce=all_reduce, chunks=layout.chunks)
        )
        step = executor.finish(iteration=iteration, all_reduce=all_reduce)
        wall_ms = self._now()  # the stage's iteration ends with its optimizer step
        stats = stage_stats(stage=self.stage, events=events, wall_ms=wall_ms, tp_ms=tp_ms, step_ms=wall_ms - ops_done)
        if reduced is not None:
            stats.reduce_ms, stats.reduce_bytes, stats.reduce_received_bytes = (
                reduced.busy_ms,
                reduced.nbytes,
                reduced.received,
            )
            stats.reduce_end_ms = (reduced.end_s - self._start) * 1e3 if reduced.end_s else 0.0
            stats.last_op_ms = max((e.end_ms for e in events), default=0.0)
        if agreement is not None:
            stats.tp_rounds, stats.tp_disagreements = agreement.rounds, agreement.disagreements
            stats.tp_conflicts = agreement.conflicts
        if step is not None:
            stats.loss, stats.peak_bytes, stats.optim_bytes = step.loss, step.peak_bytes, step.optim_bytes
            stats.skipped_step = step.skipped
            if step.kept:
                stats.activation_bytes = [[0] * layout.microbatches for _ in range(layout.chunks)]
                for chunk, slot, nbytes in step.kept:
                    stats.activation_bytes[chunk][slot] = nbytes
        stats.peak_inflight, stats.peak_buffered = arbiter.peak_inflight, arbiter.peak_buffered
        if memory is not None:
            stats.gate_bytes = list(memory.held)
            stats.gate_limits = [x if math.isfinite(x) else None for x in (memory.limit_fb, memory.limit_fw)]
            if step is None:  # no measured peak: the bytes the gate counted held
                stats.peak_bytes = round(arbiter.peak_bytes)
        stats.started_at = started_at
        stats.cpu = cpu.to_dict()
        with self._cond:
            send_busy = sum(sender.take_stats(into=self._breakdown) for sender in self._senders.values())
            stats.overhead_us = self._breakdown.to_us()
        stats.send_busy_ms, stats.recv_busy_ms = send_busy * 1e3, self._recv_busy * 1e3
        if args.measure:  # after the iteration's own timings: it adds to the iteration, not to the stage's wall time
            costs = executor.measure()
            stats.layer_costs, stats.probe_ms = costs.layers, costs.probe_ms
        return events, stats

    def _reduce(
        self, *, dp: DPContext, executor: Executor, all_reduce: Callable[[float], float], chunks: int
    ) -> ReduceStats:
        """The iteration's DP reduction, done: without overlap, started now, after a barrier over every stage."""
        if not dp.overlap:
            all_reduce(0.0)  # every stage of every replica has run its last op
            for chunk in reduce_order(chunks=chunks):
                dp.reducer.submit(key=chunk, grads=executor.gradients(chunk=chunk))
        try:
            return dp.reducer.wait()
        except (TimeoutError, RuntimeError) as error:
            raise PipelineError(f"stage {self.stage}, iteration {self._iteration}: {error}") from error

    def close(self) -> None:
        """Send STOP on every outbound link and end the threads. The receive threads take their
        links' STOPs first: a neighbour's send of STOP returns only once this side has taken it.
        Neighbours close at the same time (each fabric closes all its stages at once): an idle
        link posts no receive, so one closed after the other waits out its timeout."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for sender in self._senders.values():
            sender.close(timeout_s=self.timeout_s)
        for thread in self._threads:
            thread.join(timeout=self.timeout_s)
        if self._polled is not None:
            self._polled.close(handoff=self._handoff, timeout_s=self.timeout_s)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PipelineError(f"stage {self.stage}: {self._error}") from self._error

    def _events(self, *, ops: StageOps, arbiter: Arbiter, ran: list[tuple[int, float, float]]) -> list[OpEvent]:
        """The iteration's op events, from what each op's run noted (`ran`)."""
        ready_at, texts = self._ready_at, ops.texts
        return [
            OpEvent(
                stage=self.stage,
                action=texts[slot],
                start_ms=start,
                end_ms=end,
                ready_ms=ready_at[slot],
                hint_pos=arbiter.hint_position_of(slot),
                overtook=arbiter.overtook(slot),
            )
            for slot, start, end in ran
        ]

    def _wait_for_slot(self, arbiter: Arbiter) -> int:
        deadline = None  # set by the first wait
        arbitrating, woke, looked = 0.0, None, False
        perf_counter = time.perf_counter
        while True:
            if self._error is not None:
                self._raise_if_failed()
            if not looked and self._polled is not None:  # after a wait, its own last look stands
                self._take_polled()
            began = perf_counter()
            chosen = arbiter.next_slot()
            arbitrating += perf_counter() - began
            if chosen >= 0:
                self._breakdown.add(Phase.ARBITRATION, arbitrating)
                if woke is not None:
                    self._breakdown.add(Phase.WAKEUP, woke)
                if self._threads:
                    self._cond.notify_all()  # a consumed message frees receive-buffer room
                return chosen
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            left = deadline - time.monotonic()
            if left <= 0:
                raise PipelineError(
                    f"iteration {self._iteration}: nothing eligible for {self.timeout_s:g} s; {arbiter.waiting_for()}"
                )
            waited = time.perf_counter()
            self._await_arrival(timeout_s=left)
            looked = True
            woke = time.perf_counter() - self._notified_at if self._notified_at > waited else None

    def _agree_on_slot(self, arbiter: Arbiter, agreement: Agreement) -> tuple[int, float]:
        """Rounds with the other TP ranks until they agree on an action; starts it and returns its slot.

        Also returns the ms the protocol itself cost (`Agreement.cost_ms`); waits for an
        arrival or for a slower rank are blocked time."""
        cost = agreement.cost_ms
        deadline = time.monotonic() + self.timeout_s
        agreed = True  # the last round decided (or none ran yet)
        while True:
            with self._cond:
                self._raise_if_failed()
                self._take_polled()
                candidates = arbiter.candidates(agreement.tp.width)
                if not candidates or not agreed:  # wait for an arrival (an arrival wakes it), then join the round
                    self._await_arrival(timeout_s=agreement.tp.idle_s if not candidates else agreement.tp.poll_s)
                    candidates = arbiter.candidates(agreement.tp.width)
            try:
                action = agreement.round(candidates)
            except (ConnectionError, TimeoutError) as error:
                raise PipelineError(
                    f"stage {self.stage}, iteration {self._iteration}: TP agreement failed: {error}"
                ) from error
            if action is not None:
                with self._cond:
                    arbiter.start(action)
                    self._cond.notify_all()  # a consumed message frees receive-buffer room
                return self._ops.slot(action), agreement.cost_ms - cost
            agreed = False
            if time.monotonic() > deadline:
                with self._cond:
                    raise PipelineError(
                        f"iteration {self._iteration}: TP rank {agreement.tp.rank} agreed on nothing for "
                        f"{self.timeout_s:g} s; {arbiter.waiting_for()}"
                    )

    def _hand_over(self, slot: int, consumer: int, output: torch.Tensor | None) -> None:
        """Under the lock: the V's turn (what `slot`'s action sends), straight into this stage's own inbox for
        `consumer`, no link."""
        if output is None:
            raise PipelineError(
                f"stage {self.stage}: the executor returned nothing to send for {self._ops.sends[slot]}"
            )
        self._inbox[consumer] = (output, None)  # made on this thread's stream: nothing to wait for
        self._arbiter.on_arrival_slot(consumer)
        self._ready_at[consumer] = max(self._ready_at[consumer], self._now())

    def _post(
        self,
        ops: StageOps,
        slot: int,
        iteration: int,
        output: torch.Tensor | None,
    ) -> None:
        """What `slot`'s action sends, to its link."""
        message = ops.sends[slot]
        if output is None:
            raise PipelineError(f"stage {self.stage}: the executor returned nothing to send for {message}")
        delay = self._delay_s[slot]
        header = Header.for_payload(
            message=message, iteration=iteration, payload=output, released_at=time.time() + delay
        )
        self._sender_of[slot].post(
            header=header, payload=output, release=time.perf_counter() + delay, fence=self._handoff.produced(output)
        )

    def _wait_outbox_empty(self) -> None:
        late = wait_idle(self._senders.values(), timeout_s=self.timeout_s)
        with self._cond:
            self._raise_if_failed()
        if late is not None:
            raise PipelineError(f"stage {self.stage}: outgoing messages on {late} not sent within {self.timeout_s:g} s")


def delays(*, ops: StageOps, order: tuple[int, ...] | None, latency: Callable[[Message], float] | None) -> list[float]:
    """Per slot, the seconds `latency` holds its message back: the latency of the data microbatch the slot holds
    (`order[slot]`), as a trace's rows are data microbatches; 0 where the slot sends nothing or no latency is given."""
    if latency is None:
        return [0.0] * len(ops.sends)
    return [
        0.0 if m is None else latency(m if order is None else replace(m, microbatch=order[m.microbatch])) / 1e3
        for m in ops.sends
    ]
