"""One telemetry format for the simulator and the runtime.

Times are milliseconds from the iteration's start. A stage's wall time runs from the
iteration's start to the end of its optimizer step, and splits into compute (running ops),
tp (TP agreement), step (the executor's `finish`: gradient clipping with the all-reduce of
the global norm, and the optimizer step) and blocked (nothing eligible). The simulator has
no optimizer step: its step is 0, and its makespan is the op schedule alone.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LayerCost:
    """One layer's measured cost on the stage that holds it: the unit a split can move."""

    layer: int  # index into the model's layer list
    forward_ms: float  # one microbatch's forward
    backward_ms: float  # its whole backward (input and weight gradients)
    param_bytes: int
    activation_bytes: int  # what one microbatch keeps from its forward for its backward


@dataclass(frozen=True)
class OpEvent:
    stage: int
    action: str  # compact form, e.g. "2F0"
    start_ms: float
    end_ms: float
    ready_ms: float  # when its last need was met
    hint_pos: int  # its position in the stage's hint list (-1: not in it)
    overtook: bool  # started while an earlier hint action had not


@dataclass
class StageStats:
    stage: int
    wall_ms: float
    compute_ms: float
    blocked_ms: float
    tp_ms: float = 0.0
    step_ms: float = 0.0  # the optimizer step after the stage's last op (included in wall_ms)
    send_busy_ms: float = 0.0
    recv_busy_ms: float = 0.0
    overhead_us: dict[str, list[int]] = field(default_factory=dict)  # runtime only: `rrfp_ray.runtime.breakdown`
    cpu: dict[str, float] = field(default_factory=dict)  # runtime only: `rrfp_ray.runtime.cpu.CpuUse`, its fields
    overtakes: int = 0
    peak_inflight: int = 0
    peak_buffered: int = 0
    peak_bytes: int = 0  # the most activation bytes held for backward work at once
    # per chunk, per microbatch slot: the activation bytes its forward kept (empty: not measured)
    activation_bytes: list[list[int]] = field(default_factory=list)
    # runtime only: per microbatch slot, the bytes the arbiter's gate counted it holding (empty: it counted
    # microbatches), and its (F->B, F->W) limits (None: no limit)
    gate_bytes: list[float] = field(default_factory=list)
    gate_limits: list[float | None] = field(default_factory=list)
    optim_bytes: int = 0  # optimizer state the stage holds after its step (ZeRO-1: its shard)
    tp_disagreements: int = 0  # TP agreement rounds that decided nothing although some rank offered an op
    tp_rounds: int = 0  # TP agreement rounds, decided or not
    tp_conflicts: int = 0  # disagreements where every TP rank had an op to offer
    started_at: float = 0.0  # unix seconds; aligns stages of one iteration
    loss: float | None = None  # the iteration's mean training loss, on the stage that computes it
    replica: int = 0  # the data-parallel replica this stage belongs to
    last_op_ms: float = 0.0  # when the stage's last op ended (set with data parallelism)
    reduce_ms: float = 0.0  # time in the DP gradient reductions
    reduce_bytes: int = 0  # gradient bytes the stage contributed to sums over the DP group
    reduce_received_bytes: int = 0  # bytes of those sums it received (all of them; with ZeRO-1 its own share)
    reduce_end_ms: float = 0.0  # when the last bucket was summed
    reduce_exposed_ms: float = 0.0  # reduce time after every stage's last op: what it adds to the iteration
    reduce_exposed_own_ms: float = 0.0  # reduce time after this stage's own last op
    skipped_step: bool = False  # the global gradient norm was inf or NaN: the optimizer step was skipped
    layer_costs: list[LayerCost] = field(default_factory=list)  # measured this iteration (empty: not measured)
    probe_ms: float | None = None  # the device's time for the fixed reference computation, measured with layer_costs


@dataclass
class IterationReport:
    iteration: int
    policy: str
    makespan_ms: float
    stages: list[StageStats]
    events: list[OpEvent] = field(default_factory=list)
    loss: float | None = None
    step_ms: float = 0.0  # what the optimizer step adds to the makespan, after the last op of any stage
    restart: int = 0  # k: the first iteration run after restart k restored the pipeline; 0: no restart before it
    order: list[int] | None = None  # the data microbatch each event's microbatch slot read (None: the slot's own)
    shape: str | None = None  # the shape it ran at when the job had resized (rrfp_ray.train.resize); None: its own
    packing: list[list[int]] | None = None  # the samples each data microbatch held (None: the data's own)

    @classmethod
    def deferred(cls, *, events: Callable[[], list[OpEvent]], **fields: Any) -> IterationReport:
        """A report whose `events` are built by `events()` when first read: the simulator's, whose
        callers mostly read makespans and stage stats only."""
        report = cls(**fields)
        del report.events
        report._build_events = events
        return report

    def __getattr__(self, name: str) -> Any:
        # Reached only when `name` is not set: a deferred report's events before their first read.
        build = self.__dict__.pop("_build_events", None) if name == "events" else None
        if build is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.events = build()
        return self.events

    def __getstate__(self) -> dict:
        return {**{k: v for k, v in vars(self).items() if k != "_build_events"}, "events": self.events}

    @property
    def schedule_ms(self) -> float:
        """The makespan of the op schedule alone (without the optimizer step): what the simulator models."""
        return self.makespan_ms - self.step_ms

    @property
    def bubble(self) -> float:
        compute = sum(s.compute_ms for s in self.stages)
        return 1.0 - compute / (len(self.stages) * self.makespan_ms) if self.makespan_ms > 0 else 0.0

    @property
    def blocked_fraction(self) -> float:
        wall = sum(s.wall_ms for s in self.stages)
        return sum(s.blocked_ms for s in self.stages) / wall if wall > 0 else 0.0

    @property
    def tp_fraction(self) -> float:
        """TP-coordination time (agreement rounds) over the stages' wall time."""
        wall = sum(s.wall_ms for s in self.stages)
        return sum(s.tp_ms for s in self.stages) / wall if wall > 0 else 0.0

    @property
    def skipped_step(self) -> bool:
        """The iteration's gradients were not finite, so no stage stepped (one global decision)."""
        return any(s.skipped_step for s in self.stages)

    @property
    def peak_inflight(self) -> int:
        return max(s.peak_inflight for s in self.stages)

    def to_json(self, *, with_events: bool = False) -> dict:
        data = asdict(self)
        if not with_events:
            del data["events"]
        data.update(bubble=self.bubble, blocked_fraction=self.blocked_fraction)
        return data

    @classmethod
    def from_json(cls, data: dict) -> IterationReport:
        return cls(
            iteration=data["iteration"],
            policy=data["policy"],
            makespan_ms=data["makespan_ms"],
            stages=[
                StageStats(**{**s, "layer_costs": [LayerCost(**c) for c in s.get("layer_costs", [])]})
                for s in data["stages"]
            ],
            events=[OpEvent(**e) for e in data.get("events", [])],
            loss=data.get("loss"),
            step_ms=data.get("step_ms", 0.0),
            restart=data.get("restart", 0),
            order=data.get("order"),
            shape=data.get("shape"),
            packing=data.get("packing"),
        )


def stage_stats(
    *, stage: int, events: list[OpEvent], wall_ms: float, tp_ms: float = 0.0, step_ms: float = 0.0
) -> StageStats:
    return totals_stats(
        stage=stage,
        compute_ms=sum(e.end_ms - e.start_ms for e in events),
        overtakes=sum(e.overtook for e in events),
        wall_ms=wall_ms,
        tp_ms=tp_ms,
        step_ms=step_ms,
    )


def totals_stats(
    *, stage: int, compute_ms: float, overtakes: int, wall_ms: float, tp_ms: float = 0.0, step_ms: float = 0.0
) -> StageStats:
    """A stage's stats from its totals over its events: `compute_ms`, the sum of their end_ms - start_ms
    in their order, and `overtakes`, how many overtook."""
    return StageStats(
        stage=stage,
        wall_ms=wall_ms,
        compute_ms=compute_ms,
        blocked_ms=max(0.0, wall_ms - compute_ms - tp_ms - step_ms),
        tp_ms=tp_ms,
        step_ms=step_ms,
        overtakes=overtakes,
    )


def merge_stage_reports(
    *, iteration: int, policy: str, results: list[tuple[list[OpEvent], StageStats]]
) -> IterationReport:
    """One iteration's report from every stage's events and stats, on a common clock. The
    makespan runs from the first stage's start to the last stage's optimizer step's end."""
    origin = min(stats.started_at for _, stats in results)
    events, stages = [], []
    for stage_events, stats in results:
        shift = (stats.started_at - origin) * 1e3
        events += [
            replace(e, start_ms=e.start_ms + shift, end_ms=e.end_ms + shift, ready_ms=e.ready_ms + shift)
            for e in stage_events
        ]
        stages.append(stats)
    makespan = max((s.started_at - origin) * 1e3 + s.wall_ms for s in stages)
    ops_end = max((s.started_at - origin) * 1e3 + s.wall_ms - s.step_ms for s in stages)
    stages = with_exposed_reduce(stages, origin=origin)
    losses = [s.loss for s in stages if s.loss is not None]  # one per replica, each the mean of its microbatches
    loss = sum(losses) / len(losses) if losses else None
    return IterationReport(
        iteration=iteration,
        policy=policy,
        makespan_ms=makespan,
        stages=stages,
        events=events,
        loss=loss,
        step_ms=makespan - ops_end,
    )


def with_exposed_reduce(stages: list[StageStats], *, origin: float) -> list[StageStats]:
    """Each stage's DP reduce time past the last op of every stage (on the common clock: the step
    needs every stage's gradients, so only that part can delay it) and past its own last op."""
    if not any(s.reduce_bytes for s in stages):
        return stages
    last_op = max((s.started_at - origin) * 1e3 + s.last_op_ms for s in stages)
    exposed = []
    for s in stages:
        end = (s.started_at - origin) * 1e3 + s.reduce_end_ms
        exposed.append(
            replace(
                s,
                reduce_exposed_ms=min(s.reduce_ms, max(0.0, end - last_op)),
                reduce_exposed_own_ms=min(s.reduce_ms, max(0.0, s.reduce_end_ms - s.last_op_ms)),
            )
        )
    return exposed


def dp_summary(reports: list[IterationReport]) -> dict[str, float]:
    """What the DP reduction cost: exposed over total reduce time, the median over stages and
    iterations (`dp_exposed_fraction`: past every stage's last op; `_own`: past the stage's own),
    the median reduce ms, bytes contributed and bytes of sums received per stage, the share of
    the sums received (1 with plain all-reduces, about 1/D with ZeRO-1's reduce to each owner),
    and the most optimizer-state bytes one actor held."""
    stages = [s for r in reports for s in r.stages if s.reduce_ms > 0]
    if not stages:
        return {}
    return {
        "dp_exposed_fraction": statistics.median(s.reduce_exposed_ms / s.reduce_ms for s in stages),
        "dp_exposed_own_fraction": statistics.median(s.reduce_exposed_own_ms / s.reduce_ms for s in stages),
        "dp_reduce_ms": statistics.median(s.reduce_ms for s in stages),
        "dp_exposed_ms": statistics.median(s.reduce_exposed_ms for s in stages),
        "dp_reduce_bytes": statistics.median(s.reduce_bytes for s in stages),
        "dp_received_bytes": statistics.median(s.reduce_received_bytes for s in stages),
        "dp_received_share": sum(s.reduce_received_bytes for s in stages) / max(1, sum(s.reduce_bytes for s in stages)),
        "optim_bytes_per_actor": max(s.optim_bytes for r in reports for s in r.stages),  # ZeRO-1: about 1/D
    }


def tp_summary(reports: list[IterationReport]) -> dict[str, float]:
    """What TP agreement cost over some iterations: each iteration summed over its stages, then
    the median (coordination share) or mean (counts) over iterations; per-round figures pooled."""

    def per_iteration(key: str) -> list[float]:
        return [sum(getattr(s, key) for s in r.stages) for r in reports]

    rounds, disagreements = sum(per_iteration("tp_rounds")), sum(per_iteration("tp_disagreements"))
    return {
        "tp_coord_fraction": statistics.median(r.tp_fraction for r in reports),
        "tp_rounds": statistics.mean(per_iteration("tp_rounds")),
        "tp_ms_per_round": sum(per_iteration("tp_ms")) / max(1, rounds),
        "tp_disagreements": statistics.mean(per_iteration("tp_disagreements")),
        "disagreements_per_round": disagreements / max(1, rounds),
        "tp_conflicts": statistics.mean(per_iteration("tp_conflicts")),
    }


def append_jsonl(*, path: Path, report: IterationReport) -> None:
    with path.open("a") as f:
        f.write(json.dumps(report.to_json(with_events=True)) + "\n")
