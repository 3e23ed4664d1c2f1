"""Discrete-event simulation of one iteration: one Arbiter per stage over a duration trace.

Virtual clock; each stage runs one action at a time; sends never block; a message is
delivered `trace.latency` after its sender finishes; all events of one instant are
applied before any stage decides. A delivery into a stage whose receive buffer is full
waits, in order, on its link until the stage consumes a message.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from rrfp_ray.actions import Action, Kind
from rrfp_ray.arbiter import Arbiter, Cap
from rrfp_ray.deps import Layout, Link, Message
from rrfp_ray.policy import Policy
from rrfp_ray.telemetry import IterationReport, OpEvent, stage_stats
from rrfp_ray.variability import Trace


@dataclass(frozen=True)
class Bounds:
    max_stage_work_ms: float
    critical_path_ms: float
    stage_window_ms: float

    @property
    def best_ms(self) -> float:
        return max(self.max_stage_work_ms, self.critical_path_ms, self.stage_window_ms)


class DeadlockError(RuntimeError):
    pass


def layout_for(*, policy: Policy, trace: Trace) -> Layout:
    return Layout(stages=trace.stages, chunks=trace.chunks, microbatches=trace.microbatches, split=policy.split)


def simulate(
    *, policy: Policy, trace: Trace, cap: Cap, buffer_limit: int | None = None, iteration: int = 0
) -> IterationReport:
    layout = layout_for(policy=policy, trace=trace)
    arbiters = [
        Arbiter(layout=layout, stage=s, policy=policy, cap=cap, buffer_limit=buffer_limit) for s in range(layout.stages)
    ]
    events: list[list[OpEvent]] = [[] for _ in arbiters]
    busy = [False] * layout.stages
    ready_at: dict[Action, float] = {}
    waiting: dict[Link, deque[Message]] = {}
    clock: list[tuple[float, int, Action | Message]] = []
    seq = 0

    def push(at: float, item: Action | Message) -> None:
        nonlocal seq
        heapq.heappush(clock, (at, seq, item))
        seq += 1

    def deliver(message: Message, now: float) -> None:
        link = layout.link(message)
        queue = waiting.setdefault(link, deque())
        queue.append(message)
        drain(link, now)

    def drain(link: Link, now: float) -> None:
        arbiter, queue = arbiters[link.dst], waiting[link]
        while queue and arbiter.has_room():
            message = queue.popleft()
            arbiter.on_arrival(message)
            ready_at[layout.consumer(message)] = now

    now = 0.0
    touched = set(range(layout.stages))
    while True:
        for stage in sorted(touched):
            if busy[stage]:
                continue
            chosen = arbiters[stage].next_action()
            if chosen is None:
                continue
            action, overtook = chosen
            end = now + trace.duration(action, split=layout.split)
            events[stage].append(
                OpEvent(
                    stage=stage,
                    action=str(action),
                    start_ms=now,
                    end_ms=end,
                    ready_ms=ready_at.get(action, 0.0),
                    hint_pos=arbiters[stage].hint_position(action),
                    overtook=overtook,
                )
            )
            busy[stage] = True
            push(end, action)
            for link in waiting:
                if link.dst == stage:
                    drain(link, now)
        touched = set()
        if not clock:
            break
        now = clock[0][0]
        while clock and clock[0][0] == now:
            item = heapq.heappop(clock)[2]
            if isinstance(item, Message):
                deliver(item, now)
                touched.add(layout.dst(item))
                continue
            stage = item.stage
            busy[stage] = False
            touched.add(stage)
            message = arbiters[stage].on_done(item)
            for follower in layout.local_followers(item):
                ready_at[follower] = max(ready_at.get(follower, 0.0), now)
            if message is not None:
                push(now + trace.latency(message), message)
    stuck = [a.waiting_for() for a in arbiters if not a.finished]
    if stuck:
        raise DeadlockError(f"simulation of {policy.name} stopped at {now:.1f} ms:\n" + "\n".join(stuck))
    stats = []
    for arbiter, stage_events in zip(arbiters, events):
        s = stage_stats(stage=arbiter.stage, events=stage_events, wall_ms=now)
        s.peak_inflight, s.peak_buffered = arbiter.peak_inflight, arbiter.peak_buffered
        stats.append(s)
    return IterationReport(
        iteration=iteration,
        policy=policy.name,
        makespan_ms=now,
        stages=stats,
        events=[e for stage_events in events for e in stage_events],
    )


def bounds(*, trace: Trace, split: bool) -> Bounds:
    """Lower bounds on any schedule's makespan for this trace.

    - max stage work: no stage can finish before it has run all its actions;
    - critical path: the longest dependency chain of one microbatch (F down the
      virtual stages, B back up, with latencies, and its W on virtual stage 0 if split);
    - stage window: per stage, the earliest its first F can start + all its work + the
      shortest chain that must still run after its last action (none if that can be a W).
    """
    layout = Layout(stages=trace.stages, chunks=trace.chunks, microbatches=trace.microbatches, split=split)
    V, M = layout.virtual_stages, layout.microbatches

    def dur(kind: Kind, vs: int, m: int) -> float:
        return trace.duration(layout.action(kind=kind, virtual_stage=vs, microbatch=m), split=split)

    def lat(kind: Kind, vs: int, m: int) -> float:
        return trace.latency(Message(kind=kind, virtual_stage=vs, microbatch=m))

    def head(vs: int, m: int) -> float:  # earliest start of F(vs, m)
        return sum(dur(Kind.F, u, m) + lat(Kind.F, u + 1, m) for u in range(vs))

    def tail(vs: int, m: int) -> float:  # what must run after B(vs, m) ends
        rest = sum(lat(Kind.B, u, m) + dur(Kind.B, u, m) for u in range(vs))
        return rest + (dur(Kind.W, 0, m) if split else 0.0)

    work = [
        sum(trace.duration(a, split=split) for a in layout.actions(stage=s)) for s in range(layout.stages)
    ]
    critical = max(head(V - 1, m) + dur(Kind.F, V - 1, m) + dur(Kind.B, V - 1, m) + tail(V - 1, m) for m in range(M))
    window = max(
        min(head(s, m) for m in range(M)) + work[s] + (0.0 if split else min(tail(s, m) for m in range(M)))
        for s in range(layout.stages)
    )
    return Bounds(max_stage_work_ms=max(work), critical_path_ms=critical, stage_window_ms=window)
