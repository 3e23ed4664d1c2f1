"""The rebalancer: moves layers (contiguous split points) off a stage that stays slow.

One chunk per stage (v = 1): stage s holds layers ``offset(s) .. offset(s) + split[s] - 1``. From
every measured iteration (`StageStats.layer_costs`, `StageStats.probe_ms`) it keeps, in the planner's
cost model (`rrfp_ray.plan.costs`), each layer's intrinsic forward and backward cost (its measured ms
over the probe of the device that ran it) and each device's probe, robust over the last `window`
measured iterations. A layer's predicted cost on stage s is its intrinsic cost x stage s's probe.

- **detect**: a stage whose measured work (the sum of its layers' forward and backward) is above the
  mean by `threshold` for `window` consecutive measured iterations is a persistent bottleneck;
- **split**: the contiguous split that minimizes the largest predicted stage work (exact dynamic
  programming over layers x stages), within each stage's memory (its layers' parameter state plus their
  activation bytes x the microbatches the stage keeps in flight under the policy and cap); among the
  optimal ones, the one whose split points move least;
- **predict**: both splits' iterations simulated (`rrfp_ray.sim.simulator`) with per-stage F and B from
  the summed layer costs, the same policy and cap; the move is taken only if its predicted gain over the
  next `window` iterations beats the cost of moving (the last move's measured seconds; before the first,
  an estimate from the parameter state to move) and shortens the predicted iteration by more than half
  the threshold (less is the measurements' noise, not worth chasing);
- **hysteresis**: a bottleneck once judged (moved or not) restarts every stage's count, so no move
  follows within `window` measured iterations of the last: a stage just relieved is not moved back
  within the window, and a bottleneck the best split cannot remove (layers come whole) is judged again
  only once a window, not chased.

Plain data in and out: the caller runs the move (`Trainer.reshape`) and reports its seconds
(`Rebalancer.applied`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise

import numpy as np

from rrfp_ray.observe.telemetry import StageStats
from rrfp_ray.plan.costs import PROBE, CostModel
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.generators import peak_inflight
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.trace import Trace

log = logging.getLogger(__name__)

STATE_COPIES = 4  # a parameter's bytes held on its stage: the weight, its gradient and AdamW's two moments
_TIE = 1e-9  # relative: stage works equal up to rounding tie for the bottleneck


@dataclass(frozen=True)
class RebalanceSettings:
    """`threshold`: a bottleneck's work above the mean, as a fraction; `window`: measured iterations a
    bottleneck must last (and so at least between two moves), and iterations of gain a move must pay
    for; `memory_bytes`: each stage's memory (inf: none); `move_setup_s` and `move_bytes_per_s`: the
    estimated cost of the first move (later ones cost what the last one measured)."""

    threshold: float
    window: int
    memory_bytes: float = math.inf
    move_setup_s: float = 0.25  # an estimate too low is corrected by the first move; one too high never is
    move_bytes_per_s: float = 200e6

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"rebalance_threshold must be a fraction > 0, got {self.threshold!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"rebalance_window must be an integer >= 1, got {self.window!r}")
        if not self.memory_bytes > 0:
            raise ValueError(f"stage_memory_mb must be > 0, got {self.memory_bytes / 2**20!r} MB")
        if not (self.move_setup_s >= 0 and self.move_bytes_per_s > 0):
            raise ValueError("move_setup_s must be >= 0 and move_bytes_per_s > 0")


@dataclass(frozen=True)
class Decision:
    """What one measured iteration decided: `split` the new split (None: stay on `current`), the
    predicted iteration ms on the current split and on the new one, the move cost it had to beat."""

    iteration: int
    current: tuple[int, ...]
    split: tuple[int, ...] | None
    reason: str
    before_ms: float | None = None
    after_ms: float | None = None
    move_s: float | None = None

    @property
    def moves(self) -> bool:
        return self.split is not None


@dataclass(frozen=True)
class Layers:
    """Per layer, in model order: intrinsic forward and backward cost (ms on a device of probe 1),
    parameter bytes and activation bytes per microbatch."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    param_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]

    @property
    def cost(self) -> tuple[float, ...]:
        return tuple(f + b for f, b in zip(self.forward, self.backward))


def offsets(split: Sequence[int]) -> list[int]:
    """The first layer of each stage, and the layer count at the end."""
    return [0, *accumulate(split)]


def stage_work(*, split: Sequence[int], costs: Sequence[float], speeds: Sequence[float]) -> list[float]:
    """Per stage, the summed cost of its layers x its device's speed."""
    return [speed * sum(costs[a:b]) for speed, (a, b) in zip(speeds, pairwise(offsets(split)))]


def in_flight(*, policy: Policy, cap: Cap, microbatches: int) -> list[int]:
    """Per stage, the most microbatches whose activations it keeps at once under `policy` and `cap`
    (a fixed list is its own cap)."""
    counts = []
    for stage in range(len(policy.order)):
        peak = peak_inflight(policy.order, stage=stage)
        limit = peak if policy.fixed else cap.limit(peak=peak)
        counts.append(int(min(microbatches, limit)))
    return counts


def stage_bytes(*, split: Sequence[int], layers: Layers, inflight: Sequence[int]) -> list[float]:
    """Per stage, the memory its layers need: parameter state, and activations x microbatches in flight."""
    return [
        STATE_COPIES * sum(layers.param_bytes[a:b]) + held * sum(layers.activation_bytes[a:b])
        for held, (a, b) in zip(inflight, pairwise(offsets(split)))
    ]


def best_split(
    *,
    costs: Sequence[float],
    speeds: Sequence[float],
    current: Sequence[int],
    need: Sequence[Sequence[float]] | None = None,
    memory: float = math.inf,
) -> tuple[int, ...] | None:
    """The contiguous split of `costs` (one per layer) over len(speeds) stages, each >= 1 layer, that
    minimizes the largest `speed x summed cost`, and among those the one whose split points move least
    from `current`'s. `need[s]`: per layer, the bytes it needs on stage s (within `memory` per stage).
    None where no split fits."""
    L, P = len(costs), len(speeds)
    if not 1 <= P <= L:
        raise ValueError(f"cannot split {L} layers over {P} stages")
    cost = np.concatenate([[0.0], np.cumsum(costs)])
    ends = offsets(current)[1:]
    summed = cost[None, :] - cost[:, None]  # [a, b]: the cost of layers a..b-1 (rows a, columns b)
    ordered = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)  # a < b: at least one layer
    need_of = None if need is None else [np.concatenate([[0.0], np.cumsum(row)]) for row in need]

    def work(s: int) -> np.ndarray:
        """[a, b]: the work of layers a..b-1 on stage s (inf where they are none or do not fit)."""
        fits = ordered
        if need_of is not None:
            fits = fits & (need_of[s][None, :] - need_of[s][:, None] <= memory * (1 + _TIE))
        return np.where(fits, speeds[s] * summed, np.inf)

    works = [work(s) for s in range(P)]
    # pass 1: the least bottleneck of stages 0..s-1 over layers 0..b-1 (inf: unreachable)
    worst = np.full((P + 1, L + 1), np.inf)
    worst[0, 0] = 0.0
    for s in range(P):
        worst[s + 1] = np.maximum(worst[s][:, None], works[s]).min(axis=0)
    bound = worst[P, L]
    if not math.isfinite(bound):
        return None
    # pass 2: within that bottleneck, the split whose stage ends move least
    limit = bound * (1 + _TIE) + 1e-12
    moved = np.full((P + 1, L + 1), np.inf)
    moved[0, 0] = 0.0
    start_of = np.zeros((P + 1, L + 1), dtype=int)
    columns = np.arange(L + 1)
    for s in range(P):
        total = np.where(works[s] <= limit, moved[s][:, None], np.inf)
        start_of[s + 1] = np.argmin(total, axis=0)
        moved[s + 1] = total[start_of[s + 1], columns] + np.abs(columns - ends[s])
    split, b = [], L
    for s in range(P, 0, -1):
        a = int(start_of[s, b])
        split.append(b - a)
        b = a
    return tuple(reversed(split))


def predicted_ms(
    *,
    split: Sequence[int],
    layers: Layers,
    speeds: Sequence[float],
    policy: Policy,
    cap: Cap,
    microbatches: int,
) -> float:
    """The simulated iteration on `split`: each stage's F and B the summed layer costs x its speed (a
    split backward's input and weight halves equal), no message latency."""
    forward = stage_work(split=split, costs=layers.forward, speeds=speeds)
    backward = stage_work(split=split, costs=layers.backward, speeds=speeds)
    P, M = len(split), microbatches
    half = [[b / 2] * M for b in backward]
    zero = [[0.0] * M for _ in range(P - 1)]
    trace = Trace(
        stages=P, microbatches=M, chunks=1, F=[[f] * M for f in forward], B=half, W=half, commF=zero, commB=zero
    )
    return simulate(policy=policy, trace=trace, cap=cap).makespan_ms


def moved_bytes(*, before: Sequence[int], after: Sequence[int], layers: Layers) -> int:
    """Parameter state of the layers that change stage."""
    home = [s for s, n in enumerate(before) for _ in range(n)]
    away = [s for s, n in enumerate(after) for _ in range(n)]
    return sum(STATE_COPIES * p for p, a, b in zip(layers.param_bytes, home, away) if a != b)


def layers_moved(*, before: Sequence[int], after: Sequence[int]) -> int:
    """How many layers change stage."""
    home = [s for s, n in enumerate(before) for _ in range(n)]
    away = [s for s, n in enumerate(after) for _ in range(n)]
    return sum(a != b for a, b in zip(home, away))


@dataclass
class Rebalancer:
    """Watches measured iterations of one pipeline (`observe`) and decides when and where to move
    layers; `applied` records a move the caller made."""

    settings: RebalanceSettings
    split: tuple[int, ...]
    policy: Policy
    cap: Cap
    microbatches: int
    model: CostModel = field(init=False)
    measured: int = 0  # measured iterations seen
    streak: list[int] = field(init=False)  # per stage: consecutive measured iterations above the threshold
    move_s: float | None = None  # the last move's measured seconds
    param_bytes: dict[int, int] = field(default_factory=dict)
    activation_bytes: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.split = tuple(self.split)
        if len(self.split) != len(self.policy.order) or min(self.split) < 1:
            raise ValueError(
                f"split {','.join(map(str, self.split))} must give each of the {len(self.policy.order)} stages "
                "at least one layer"
            )
        self.model = CostModel(window=self.settings.window, restart=False)
        self.streak = [0] * len(self.split)

    @property
    def stages(self) -> int:
        return len(self.split)

    def observe(self, *, iteration: int, stages: Sequence[StageStats]) -> Decision | None:
        """Learn from one iteration's stage stats and decide; None where the iteration was not measured."""
        per_stage = self._per_stage(stages)
        if per_stage is None:
            return None
        work = [sum(c.forward_ms + c.backward_ms for c in stats.layer_costs) for stats in per_stage]
        mean = sum(work) / len(work)
        for s, w in enumerate(work):
            self.streak[s] = self.streak[s] + 1 if w > (1 + self.settings.threshold) * mean else 0
        probes = [stats.probe_ms for stats in per_stage]
        known = all(p is not None and p > 0 for p in probes)
        for s, stats in enumerate(per_stage):
            speed = probes[s] if known else 1.0
            if known:
                self.model.add(key=(s, PROBE), iteration=self.measured, samples=[(1.0, speed)])
            for c in stats.layer_costs:
                for kind, ms in ((Kind.F, c.forward_ms), (Kind.B, c.backward_ms)):
                    self.model.add(key=(c.layer, kind.value), iteration=self.measured, samples=[(1.0, ms / speed)])
                self.param_bytes[c.layer], self.activation_bytes[c.layer] = c.param_bytes, c.activation_bytes
        self.measured += 1
        return self._decide(iteration=iteration, work=work, mean=mean)

    def applied(self, *, split: Sequence[int], seconds: float) -> None:
        """The caller moved the pipeline to `split` in `seconds`."""
        self.split, self.move_s = tuple(split), seconds
        self.streak = [0] * self.stages

    def layers(self) -> Layers:
        """The layers as the cost model sees them now."""
        n = sum(self.split)
        return Layers(
            forward=tuple(self.model.level((layer, Kind.F.value)) or 0.0 for layer in range(n)),
            backward=tuple(self.model.level((layer, Kind.B.value)) or 0.0 for layer in range(n)),
            param_bytes=tuple(self.param_bytes.get(layer, 0) for layer in range(n)),
            activation_bytes=tuple(self.activation_bytes.get(layer, 0) for layer in range(n)),
        )

    def speeds(self) -> list[float]:
        """Per stage, its device's probe (1 for all where probes were not measured)."""
        return [self.model.level((s, PROBE)) or 1.0 for s in range(self.stages)]

    def _per_stage(self, stages: Sequence[StageStats]) -> list[StageStats] | None:
        """Per stage index, the measured stats of its slowest replica or TP rank; None: not measured."""
        chosen: dict[int, StageStats] = {}
        for stats in stages:
            if not stats.layer_costs:
                continue
            held = chosen.get(stats.stage)
            work = sum(c.forward_ms + c.backward_ms for c in stats.layer_costs)
            if held is None or work > sum(c.forward_ms + c.backward_ms for c in held.layer_costs):
                chosen[stats.stage] = stats
        if not chosen:
            return None
        if sorted(chosen) != list(range(self.stages)):
            raise ValueError(f"layer costs measured on stages {sorted(chosen)}, expected every one of {self.stages}")
        for s, (a, b) in enumerate(pairwise(offsets(self.split))):
            got = sorted(c.layer for c in chosen[s].layer_costs)
            if got != list(range(a, b)):
                raise ValueError(f"stage {s} measured layers {got}, its split holds layers {a}..{b - 1}")
        return [chosen[s] for s in range(self.stages)]

    def _decide(self, *, iteration: int, work: Sequence[float], mean: float) -> Decision:
        window = self.settings.window
        slow = max(range(self.stages), key=lambda s: self.streak[s])
        stay = {"iteration": iteration, "current": self.split, "split": None}
        if self.streak[slow] < window:
            return Decision(
                **stay,
                reason=f"no persistent bottleneck (stage {slow} above the mean by "
                f"{self.settings.threshold:.0%} for {self.streak[slow]} of {window} measured iterations)",
            )
        streak, self.streak = self.streak[slow], [0] * self.stages  # judged now: again after another window
        layers, speeds = self.layers(), self.speeds()
        inflight = in_flight(policy=self.policy, cap=self.cap, microbatches=self.microbatches)
        need = [
            [STATE_COPIES * p + held * a for p, a in zip(layers.param_bytes, layers.activation_bytes)]
            for held in inflight
        ]
        split = best_split(
            costs=layers.cost, speeds=speeds, current=self.split, need=need, memory=self.settings.memory_bytes
        )
        ratio = work[slow] / mean - 1
        if split is None:
            return Decision(**stay, reason=f"stage {slow} is {ratio:.0%} above the mean, but no split fits memory")
        if split == self.split:
            return Decision(**stay, reason=f"stage {slow} is {ratio:.0%} above the mean; the split is already the best")
        shape = {"layers": layers, "speeds": speeds, "policy": self.policy, "cap": self.cap}
        before = predicted_ms(split=self.split, microbatches=self.microbatches, **shape)
        after = predicted_ms(split=split, microbatches=self.microbatches, **shape)
        move_s = self.move_s
        if move_s is None:
            bytes_ = moved_bytes(before=self.split, after=split, layers=layers)
            move_s = self.settings.move_setup_s + bytes_ / self.settings.move_bytes_per_s
        gain_s = (before - after) * window / 1000
        predicted = {"before_ms": before, "after_ms": after, "move_s": move_s}
        if after > before * (1 - self.settings.threshold / 2):
            return Decision(
                **stay,
                reason=f"stage {slow} is {ratio:.0%} above the mean; {','.join(map(str, split))} would gain "
                f"{1 - after / before:.1%} a predicted iteration, within half the threshold",
                **predicted,
            )
        if gain_s <= move_s:
            return Decision(
                **stay,
                reason=f"stage {slow} is {ratio:.0%} above the mean; {','.join(map(str, split))} would gain "
                f"{gain_s:.2f} s over {window} iterations, less than the {move_s:.2f} s a move costs",
                **predicted,
            )
        return Decision(
            iteration=iteration,
            current=self.split,
            split=split,
            reason=f"stage {slow} is {ratio:.0%} above the mean for {streak} measured iterations; "
            f"{before:.1f} -> {after:.1f} ms predicted, {gain_s:.2f} s over {window} iterations "
            f"against {move_s:.2f} s to move",
            **predicted,
        )
