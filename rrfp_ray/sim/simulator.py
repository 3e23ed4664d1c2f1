"""Discrete-event simulation of one iteration: one Arbiter per stage over a duration trace.

Virtual clock; each stage runs one action at a time; sends never block; a message is
delivered `trace.latency` after its sender finishes; all events of one instant are
applied before any stage decides. A delivery into a stage whose receive buffer is full
waits, in order, on its link until the stage consumes a message.

With a `TransportModel` (off by default) a message also costs what the runtime's transport
takes, and a link carries one message at a time: the next one leaves once the receiver
has taken the last into its buffer, as a collective send (gloo, NCCL) returns only then, or,
with `send_ms` (TCP, whose send returns once the kernel holds the bytes), once the sender
has spent that long on the last.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heappop, heappush, heapreplace
from operator import add, itemgetter

from rrfp_ray.observe.telemetry import IterationReport, OpEvent, totals_stats
from rrfp_ray.policy.arbiter import Arbiter
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.schedule.slots import DELIVERY, DONE, LINK_FREE, Slots, slots_of
from rrfp_ray.sim.memory import Limits, memories
from rrfp_ray.sim.trace import Trace


class DeadlockError(RuntimeError):
    pass


@dataclass(frozen=True)
class TransportModel:
    """`message_ms`: from the end of a message's sending op (plus its trace latency) to its
    consuming action being ready, on a free link (measured by `jobs/bench_runtime.py`).
    `send_ms`: how long a message holds its link, for a sender that does not wait for the
    receiver (at most `message_ms`); None: until the receiver has taken it."""

    message_ms: float
    send_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.message_ms >= 0:
            raise ValueError(f"message_ms must be >= 0, got {self.message_ms}")
        if self.send_ms is not None and not 0 <= self.send_ms <= self.message_ms:
            raise ValueError(f"send_ms must be between 0 and message_ms = {self.message_ms}, got {self.send_ms}")


def layout_for(*, policy: Policy, trace: Trace) -> Layout:
    return Layout(
        stages=trace.stages,
        chunks=trace.chunks,
        microbatches=trace.microbatches,
        split=policy.split,
        placement=policy.placement,
    )


@dataclass(frozen=True)
class Case:
    """One iteration to simulate in a batch (`simulate_many`); the arguments of `simulate`."""

    policy: Policy
    trace: Trace
    cap: Cap
    buffer_limit: int | None = None
    transport: TransportModel | None = None
    byte_limits: Limits | None = None  # None: the cap over the policy's own list on this trace (`sim.memory`)


def simulate(
    *,
    policy: Policy,
    trace: Trace,
    cap: Cap,
    buffer_limit: int | None = None,
    iteration: int = 0,
    transport: TransportModel | None = None,
    byte_limits: Limits | None = None,
) -> IterationReport:
    case = Case(
        policy=policy, trace=trace, cap=cap, buffer_limit=buffer_limit, transport=transport, byte_limits=byte_limits
    )
    slots = slots_of(layout_for(policy=policy, trace=trace))
    run = _Run(case=case, slots=slots, timings=_timings(trace=trace, slots=slots), record=True)
    return run.report(iteration=iteration)


def simulate_many(*, cases: Sequence[Case]) -> list[float]:
    """The makespan of each case, as `simulate(...).makespan_ms` gives it, without building reports.

    Tables per layout, per policy and per (trace, layout) are built once for the whole batch.
    A case that deadlocks raises `DeadlockError`, as `simulate` does."""
    timings: dict[tuple[int, Layout], tuple[list[float], list[float | None]]] = {}
    makespans = []
    for case in cases:
        slots = slots_of(layout_for(policy=case.policy, trace=case.trace))
        key = (id(case.trace), slots.layout)
        if key not in timings:
            timings[key] = _timings(trace=case.trace, slots=slots)
        makespans.append(_Run(case=case, slots=slots, timings=timings[key], record=False).makespan_ms)
    return makespans


def _timings(*, trace: Trace, slots: Slots) -> tuple[list[float], list[float | None]]:
    """Per op of `slots`, its duration (`Trace.duration`), and per op that waits for a delivery, its
    latency (`Trace.latency`; None for the V's local turn, which uses no link, and where a link's
    latencies are all 0: the simulator tells those apart without reading a number)."""
    layout = slots.layout
    C, M, V, S = layout.chunks, layout.microbatches, layout.virtual_stages, slots.per_stage
    durations: list[float] = [0.0] * slots.ops
    latencies: list[float | None] = [None] * slots.ops
    for stage in range(layout.stages):
        for chunk in range(C):
            vs = slots.virtual_stage[stage][chunk]
            forward, backward, weight = (stage * S + slots.slot(row=row, chunk=chunk, microbatch=0) for row in range(3))
            durations[forward : forward + M] = trace.F[vs]
            if layout.split:
                durations[backward : backward + M] = trace.B[vs]
                durations[weight : weight + M] = trace.W[vs]
            else:
                durations[backward : backward + M] = [b + w for b, w in zip(trace.B[vs], trace.W[vs])]
            if vs > 0 and slots.link[forward] >= 0 and any(trace.commF[vs - 1]):
                latencies[forward : forward + M] = trace.commF[vs - 1]
            if vs < V - 1 and slots.link[backward] >= 0 and any(trace.commB[vs]):
                latencies[backward : backward + M] = trace.commB[vs]
    return durations, latencies


class _Run:
    """One simulated iteration, run at construction: the makespan, and with `record` the report's data."""

    def __init__(
        self, *, case: Case, slots: Slots, timings: tuple[list[float], list[float | None]], record: bool
    ) -> None:
        layout = slots.layout
        self.case, self.slots, self.durations = case, slots, timings[0]
        memory = memories(cap=case.cap, policy=case.policy, trace=case.trace, layout=layout, limits=case.byte_limits)
        self.arbiters = [
            Arbiter(layout=layout, stage=s, policy=case.policy, cap=case.cap, buffer_limit=case.buffer_limit, memory=m)
            for s, m in enumerate(memory)
        ]
        # With `record`, per op: when its delivery arrived (None if taken as its sender ended: `_events` works
        # that out), and when it started (an end is its start plus its duration, as the loop adds them);
        # per stage, the sum of its ops' end - start in their order
        self.ready_at: list[float | None] = [None] * slots.ops if record else []
        self.started_at = [0.0] * slots.ops if record else []
        self.compute_ms = [0.0] * layout.stages if record else []
        self.makespan_ms = self._run(latencies=timings[1], record=record)
        stuck = [a.waiting_for() for a in self.arbiters if not a.finished]
        if stuck:
            raise DeadlockError(
                f"simulation of {case.policy.name} stopped at {self.makespan_ms:.1f} ms:\n" + "\n".join(stuck)
            )

    def _run(self, *, latencies: list[float | None], record: bool) -> float:
        slots, durations, ready_at = self.slots, self.durations, self.ready_at
        started_at, compute, arbiters, transport = self.started_at, self.compute_ms, self.arbiters, self.case.transport
        S, completions, deliveries = slots.per_stage, slots.completions, slots.deliveries
        # called as functions of `arbiters[stage]`: no bound method per stage to bring in from memory
        next_slot, on_done, on_arrival = Arbiter.next_slot, Arbiter.on_done_slot, Arbiter.on_arrival_slot
        bounded = self.case.buffer_limit is not None
        delayed = latencies.count(None) < len(latencies)  # False: every delivery is due at once
        at_once = transport is None and not delayed and not bounded  # every message is taken as it is sent
        # per receiving stage, per link: deliveries held while its receive buffer is full
        waiting: list[dict[int, deque[tuple[int, int]]]] = [{} for _ in arbiters]  # (slot, consumer)
        busy = [False] * len(arbiters)
        # The clock: the times of pending events in a heap and, per time, its events in the order they
        # were scheduled. An event is a tuple of 7 whose first item is its kind: an op done (`Slots.completions`),
        # a delivery (`Slots.deliveries`) or, with a transport's `send_ms`, the sender done with a link.
        times: list[float] = []
        due: dict[float, list[tuple]] = {}
        setdefault = due.setdefault
        instant: list[tuple] | None = None  # the events of `now` while they are applied, out of `due`

        def schedule(time: float, event: tuple, now: float) -> None:
            if time == now and instant is not None:  # due at once: it joins the instant being applied
                instant.append(event)
                return
            if not (events := setdefault(time, [])):
                heappush(times, time)
            events.append(event)

        # with a transport: per link, its messages by release time, and whether it carries one
        outgoing: list[list[tuple[float, int, tuple[int, ...]]]] = [[] for _ in slots.links]
        carrying = [False] * len(slots.links)
        link_free = [(LINK_FREE, -1, -1, -1, -1, -1, link) for link in range(len(slots.links))]
        frees_on_take = transport is not None and transport.send_ms is None
        sent = 0  # messages queued on links so far: orders messages released at one time

        def carry(link: int, now: float) -> None:
            release, _, delivery = heappop(outgoing[link])
            carrying[link] = True
            schedule(max(now, release) + transport.message_ms, delivery, now)
            if transport.send_ms is not None:
                schedule(max(now, release) + transport.send_ms, link_free[link], now)

        def free(link: int, now: float) -> None:
            carrying[link] = False
            if outgoing[link]:
                carry(link, now)

        now = 0.0
        # `now` stays the heap's root while its instant is applied and decided; the first new time replaces it
        times.append(now)
        touched = list(range(len(arbiters)))
        while True:
            if (count := len(touched)) == 2:  # the common instant: an op done and the stage its message made ready
                first, second = touched
                if first >= second:
                    touched = (first,) if first == second else (second, first)
            elif count > 2:
                touched = sorted(set(touched))
            root = True  # `times[0]` is `now`
            for stage in touched:  # all idle: a stage is touched only while it is
                slot = next_slot(arbiters[stage])
                if slot < 0:
                    continue
                op = stage * S + slot
                busy[stage] = True
                end = now + durations[op]
                if record:
                    started_at[op] = now
                    compute[stage] += end - now
                if not (events := setdefault(end, [])):
                    if root:
                        heapreplace(times, end)
                        root = False
                    else:
                        heappush(times, end)
                events.append(completions[op])
                if bounded and waiting[stage]:
                    arbiter = arbiters[stage]
                    for link, queue in waiting[stage].items():
                        while queue and arbiter.has_room():
                            slot, consumer = queue.popleft()
                            on_arrival(arbiter, slot)
                            if record:
                                ready_at[consumer] = now
                            if frees_on_take:
                                free(link, now)
            if root:
                heappop(times)
            if not times:
                return now
            now = times[0]
            touched = []
            # Events due at `now` that these schedule join this list (`schedule`, and the bounded deliveries
            # below), so that all of the instant is applied before any stage decides.
            instant = current = due.pop(now)
            for kind, stage, slot, receiver, taken, consumer, link in current:
                if kind == DONE:
                    busy[stage] = False
                    touched.append(stage)
                    on_done(arbiters[stage], slot)
                    if receiver < 0:
                        continue
                    if not at_once:
                        consumer = receiver * S + taken
                        if transport is not None and link >= 0:
                            latency = latencies[consumer]
                            delivery = deliveries[consumer]
                            heappush(outgoing[link], (now if latency is None else now + latency, sent, delivery))
                            sent += 1
                            if not carrying[link]:
                                carry(link, now)
                            continue
                        if (
                            delayed
                            and (latency := latencies[consumer]) is not None
                            and (arrival := now + latency) != now
                        ):
                            if not (events := setdefault(arrival, [])):
                                heappush(times, arrival)
                            events.append(deliveries[consumer])
                            continue
                        if bounded:
                            current.append(deliveries[consumer])
                            continue
                    # unbounded, the arrivals of one instant commute with all else in it: take it now
                    on_arrival(arbiters[receiver], taken)
                    if not busy[receiver]:
                        touched.append(receiver)
                elif kind == DELIVERY:
                    # A stage with room has nothing waiting: every pick drains its links right away.
                    # A local hand-off (the V's turn) is not held by the receive buffer, as in the runtime.
                    if not bounded or link < 0 or arbiters[stage].has_room():
                        on_arrival(arbiters[stage], slot)
                        if record:
                            ready_at[consumer] = now
                        if frees_on_take and link >= 0:
                            free(link, now)
                    else:
                        waiting[stage].setdefault(link, deque()).append((slot, consumer))
                    if not busy[stage]:  # a busy stage decides when its op is done
                        touched.append(stage)
                else:  # a sender is done with its link
                    free(link, now)
            instant = None

    @functools.cached_property
    def _stage_times(self) -> list[tuple[Sequence[float], list[float]]]:
        """Per stage, the start and end times of its ops in the order they started (`Arbiter.started_slots`)."""
        return [self._times(stage) for stage in range(len(self.arbiters))]

    def _times(self, stage: int) -> tuple[Sequence[float], list[float]]:
        begun, size = self.arbiters[stage].started_slots, self.slots.per_stage
        ops = slice(stage * size, (stage + 1) * size)
        starts, durations = self.started_at[ops], self.durations[ops]
        if len(begun) > 1:
            pick = itemgetter(*begun)
            starts, durations = pick(starts), pick(durations)
        else:
            starts, durations = [starts[slot] for slot in begun], [durations[slot] for slot in begun]
        return starts, list(map(add, starts, durations))

    def report(self, *, iteration: int) -> IterationReport:
        stats = []
        for stage, arbiter in enumerate(self.arbiters):
            s = totals_stats(
                stage=stage,
                compute_ms=self.compute_ms[stage],
                overtakes=arbiter.overtakes,
                wall_ms=self.makespan_ms,
            )
            s.peak_inflight, s.peak_buffered = arbiter.peak_inflight, arbiter.peak_buffered
            s.peak_bytes = round(arbiter.peak_bytes)
            stats.append(s)
        return IterationReport.deferred(
            iteration=iteration,
            policy=self.case.policy.name,
            makespan_ms=self.makespan_ms,
            stages=stats,
            events=self._events,
        )

    def _events(self) -> list[OpEvent]:
        texts, follower, starts, durations = self.slots.texts, self.slots.follower, self.started_at, self.durations
        ready_at = self.ready_at.copy()
        for sender, consumer in enumerate(self.slots.sends):  # a delivery taken at once arrived as its sender ended
            if consumer >= 0 and ready_at[consumer] is None:
                ready_at[consumer] = starts[sender] + durations[sender]
        ready_at = [0.0 if at is None else at for at in ready_at]  # the ops that wait for no message
        # an op is ready when its delivery has arrived and the op before it on its stage is done
        times = self._stage_times
        for stage, arbiter in enumerate(self.arbiters):
            base = stage * self.slots.per_stage
            for slot, end in zip(arbiter.started_slots, times[stage][1]):
                after = follower[base + slot]
                if after >= 0 and ready_at[after] < end:
                    ready_at[after] = end
        events = []
        for stage, arbiter in enumerate(self.arbiters):
            base = stage * self.slots.per_stage
            hint_position, overtook = arbiter.hint_position_of, arbiter.overtook
            events += [
                OpEvent(
                    stage, texts[base + slot], start, end, ready_at[base + slot], hint_position(slot), overtook(slot)
                )
                for slot, start, end in zip(arbiter.started_slots, *times[stage])
            ]
        return events
