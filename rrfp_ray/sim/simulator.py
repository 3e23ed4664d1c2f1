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

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rrfp_ray.observe.telemetry import IterationReport, OpEvent, stage_stats
from rrfp_ray.policy.arbiter import Arbiter, Cap
from rrfp_ray.policy.pickers import Policy
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.deps import Layout, Link, Message
from rrfp_ray.sim.variability import Trace


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


def simulate(
    *,
    policy: Policy,
    trace: Trace,
    cap: Cap,
    buffer_limit: int | None = None,
    iteration: int = 0,
    transport: TransportModel | None = None,
) -> IterationReport:
    layout = layout_for(policy=policy, trace=trace)
    arbiters = [
        Arbiter(layout=layout, stage=s, policy=policy, cap=cap, buffer_limit=buffer_limit) for s in range(layout.stages)
    ]
    duration = _duration_of(trace=trace)
    events: list[list[OpEvent]] = [[] for _ in arbiters]
    busy = [False] * layout.stages
    ready_at: dict[Action, float] = {}
    waiting: list[dict[Link, deque[Message]]] = [{} for _ in arbiters]  # per receiving stage
    clock: list[tuple[float, int, Action | Message | Link]] = []  # a Link: its sender is done with a message
    outgoing: dict[Link, list[tuple[float, int, Message]]] = {}  # with transport: per link, by release time
    carrying: set[Link] = (
        set()
    )  # with transport: links busy with a message (till the receiver took it, or the sender is done)
    seq = 0

    def push(at: float, item: Action | Message | Link) -> None:
        nonlocal seq
        heapq.heappush(clock, (at, seq, item))
        seq += 1

    def deliver(message: Message, now: float) -> None:
        dst = layout.dst(message)
        # A stage with room has nothing waiting: every pick drains its links right away.
        # A local hand-off (the V's turn) is not held by the receive buffer, as in the runtime.
        if layout.is_local(message) or arbiters[dst].has_room():
            arrive(message, arbiter=arbiters[dst], now=now)
        else:
            waiting[dst].setdefault(layout.link(message), deque()).append(message)

    def arrive(message: Message, *, arbiter: Arbiter, now: float) -> None:
        arbiter.on_arrival(message)
        ready_at[layout.consumer(message)] = now
        if transport is not None and transport.send_ms is None and not layout.is_local(message):
            free(layout.link(message), now)

    def send(message: Message, now: float) -> None:
        if transport is None or layout.is_local(message):
            push(now + (0.0 if layout.is_local(message) else trace.latency(message)), message)
            return
        nonlocal seq
        link = layout.link(message)
        heapq.heappush(outgoing.setdefault(link, []), (now + trace.latency(message), seq, message))
        seq += 1
        if link not in carrying:
            carry(link, now)

    def carry(link: Link, now: float) -> None:
        release, _, message = heapq.heappop(outgoing[link])
        carrying.add(link)
        push(max(now, release) + transport.message_ms, message)
        if transport.send_ms is not None:
            push(max(now, release) + transport.send_ms, link)

    def free(link: Link, now: float) -> None:
        carrying.discard(link)
        if outgoing.get(link):
            carry(link, now)

    now = 0.0
    touched = set(range(layout.stages))
    while True:
        for stage in sorted(touched):
            if busy[stage]:
                continue
            arbiter = arbiters[stage]
            chosen = arbiter.next_action()
            if chosen is None:
                continue
            action, overtook = chosen
            end = now + duration(action)
            events[stage].append(
                OpEvent(
                    stage=stage,
                    action=str(action),
                    start_ms=now,
                    end_ms=end,
                    ready_ms=ready_at.pop(action, 0.0),
                    hint_pos=arbiter.hint_position(action),
                    overtook=overtook,
                )
            )
            busy[stage] = True
            push(end, action)
            for queue in waiting[stage].values():
                while queue and arbiter.has_room():
                    arrive(queue.popleft(), arbiter=arbiter, now=now)
        touched = set()
        if not clock:
            break
        now = clock[0][0]
        while clock and clock[0][0] == now:
            item = heapq.heappop(clock)[2]
            if isinstance(item, Link):
                free(item, now)
                continue
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
                send(message, now)
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


def _duration_of(*, trace: Trace) -> Callable[[Action], float]:
    """`trace.duration` without its per-call checks (the layout only makes valid actions)."""
    full = tuple(tuple(b + w for b, w in zip(*rows)) for rows in zip(trace.B, trace.W))
    rows_of = {Kind.F: trace.F, Kind.I: trace.B, Kind.W: trace.W, Kind.B: full}

    def duration(action: Action) -> float:
        return rows_of[action.kind][action.virtual_stage][action.microbatch]

    return duration


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
    duration = _duration_of(trace=trace)
    backward = [
        [duration(layout.action(kind=layout.backward, virtual_stage=vs, microbatch=m)) for m in range(M)]
        for vs in range(V)
    ]
    # head[vs][m]: earliest start of F(vs, m); chain[vs][m]: what must run after B(vs, m) ends.
    head, chain = [[0.0] * M], [[0.0] * M]
    for u in range(V - 1):
        head.append([h + (f + c) for h, f, c in zip(head[u], trace.F[u], trace.commF[u])])
        chain.append([t + (c + b) for t, c, b in zip(chain[u], trace.commB[u], backward[u])])
    tail = [[t + w for t, w in zip(row, trace.W[0])] for row in chain] if split else chain

    work = [sum(duration(a) for a in layout.actions(stage=s)) for s in range(layout.stages)]
    critical = max(head[V - 1][m] + trace.F[V - 1][m] + backward[V - 1][m] + tail[V - 1][m] for m in range(M))
    window = max(min(head[s]) + work[s] + (0.0 if split else min(tail[s])) for s in range(layout.stages))
    return Bounds(max_stage_work_ms=max(work), critical_path_ms=critical, stage_window_ms=window)


def bf_bound(*, trace: Trace) -> float:
    """The paper's upper bound on BF's makespan C for one chunk per stage (v = 1), no comm latency.

    C <= F + B + sum_{j=1}^{M-1} (F_max^j - F_last^j) + sum_{j=0}^{M-2} (B_max^j - B_last^j), read as:

    - F: makespan of the pure forward pipeline, every stage running the M forwards alone, in
      microbatch order, each as soon as its input is there (a flow shop over stages 0..P-1);
    - B: the same for the backwards alone (B + W: BF does not split), over stages P-1..0;
    - F_max^j, B_max^j: the longest forward / backward of microbatch j over the stages;
      F_last^j, B_last^j: that of the last stage (P-1).

    At constant durations this is 1F1B's makespan (M+P-1)(t_f+t_b), which BF attains.
    Measured (tests/test_simulator.py, and about 29,000 random traces, heavy tails included):
    it holds for BF with the cap at inf (the paper's model, no memory limit) and at 2x, but
    not at the 1x cap (P=2, M=3: 11 > 10, the cap makes stage 0 wait for a backward before its
    third forward). Reading F instead as microbatch 0's forward latency plus the last stage's
    other forwards (B likewise) gives no upper bound, even at cap inf (P=2, M=2: 9 > 8).
    """
    if trace.chunks != 1:
        raise ValueError(f"trace: bf_bound is for one chunk per stage, got chunks={trace.chunks}")
    if any(x != 0.0 for rows in (trace.commF, trace.commB) for row in rows for x in row):
        raise ValueError("trace: bf_bound assumes no communication latency; commF and commB must be 0")
    P, M = trace.stages, trace.microbatches
    backward = [[b + w for b, w in zip(rb, rw)] for rb, rw in zip(trace.B, trace.W)]
    forward_penalty = sum(max(trace.F[s][j] for s in range(P)) - trace.F[P - 1][j] for j in range(1, M))
    backward_penalty = sum(max(backward[s][j] for s in range(P)) - backward[P - 1][j] for j in range(M - 1))
    return _flow_shop(trace.F) + _flow_shop(backward[::-1]) + forward_penalty + backward_penalty


def _flow_shop(rows: Sequence[Sequence[float]]) -> float:
    """Makespan of microbatches 0..M-1 through the stages in row order, each stage in microbatch order."""
    done = [0.0] * len(rows[0])
    for row in rows:
        free = 0.0
        for m, cost in enumerate(row):
            free = done[m] = max(free, done[m]) + cost
    return done[-1]
