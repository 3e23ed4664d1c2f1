"""Rebalancing over a run of simulated iterations, as the Trainer does it: measure, decide, move.

A pipeline of equal layers (intrinsic forward `layer_ms`, backward 2x) runs a scenario's iterations.
Each iteration's trace (`rrfp_ray.sim.variability`, generated with t_f = 1) gives, per stage and op,
the factor its device runs that op at: the device's slowdown and the scenario's noise, which belong to
the device, not to the layers. On a split an op of stage s costs the summed intrinsic costs of the
stage's layers x that factor. What the rebalancer is shown as measured: each layer's forward (backward)
is its intrinsic cost x the mean factor of the stage's F (B and W) ops in that iteration, and the probe
is the device's true speed (the scenario without its noise) x a lognormal of `PROBE_SIGMA`. A move
takes effect from the next iteration and costs what the rebalancer estimated from the bytes it moves.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rrfp_ray.observe.telemetry import LayerCost, StageStats
from rrfp_ray.plan.rebalance import Decision, Rebalancer, best_split, offsets
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.trace import Trace

PROBE_SIGMA = 0.02  # the probe's own noise: a short fixed computation timed on the device


@dataclass(frozen=True)
class Pipeline:
    """The simulated model: `layers` equal layers of `layer_ms` forward each, `param_bytes` and
    `activation_bytes` each."""

    layers: int
    layer_ms: float
    param_bytes: int = 0
    activation_bytes: int = 0


@dataclass(frozen=True)
class Moved:
    """One move: the decision, and the median makespan over the `window` iterations before it and over
    the iterations after it (up to the next move)."""

    decision: Decision
    achieved_before_ms: float
    achieved_after_ms: float


@dataclass(frozen=True)
class Rebalanced:
    """A run: per iteration the makespan on the split it ran, and on the best split for its true costs;
    per measured iteration the wall ms the rebalancer took to decide (this machine's)."""

    makespans: tuple[float, ...]
    balanced: tuple[float, ...]
    splits: tuple[tuple[int, ...], ...]
    moves: tuple[Moved, ...]
    decide_ms: tuple[float, ...]

    @property
    def before_ms(self) -> float:
        """Median iteration before the first move (all of them without one)."""
        first = self.moves[0].decision.iteration + 1 if self.moves else len(self.makespans)
        return statistics.median(self.makespans[:first])

    def after_slice(self, *, least: int) -> slice:
        """The iterations after the last move (at least `least` of them, from the end, where fewer);
        without a move, all of them."""
        if not self.moves:
            return slice(None)
        start = self.moves[-1].decision.iteration + 1
        return slice(max(0, min(start, len(self.makespans) - least)), None)

    def after_ms(self, *, least: int = 10) -> float:
        """Median over the iterations after the last move (before_ms without one)."""
        if not self.moves:
            return self.before_ms
        return statistics.median(self.makespans[self.after_slice(least=least)])

    def balanced_ms(self, *, least: int = 10) -> float:
        """Median over the same iterations, each on the best contiguous split for its true costs."""
        return statistics.median(self.balanced[self.after_slice(least=least)])

    @property
    def move_s(self) -> float:
        return sum(m.decision.move_s or 0.0 for m in self.moves)


def on_split(trace: Trace, *, split: Sequence[int], layer_ms: float) -> Trace:
    """The iteration of `trace` (t_f = 1) run by `split`: each stage's ops x its layers' summed cost."""
    scale = [layer_ms * n for n in split]

    def scaled(rows):
        return [[x * scale[s] for x in row] for s, row in enumerate(rows)]

    return Trace(
        stages=trace.stages,
        microbatches=trace.microbatches,
        chunks=1,
        F=scaled(trace.F),
        B=scaled(trace.B),
        W=scaled(trace.W),
        commF=trace.commF,
        commB=trace.commB,
    )


def measured_stats(
    *, trace: Trace, speeds: Sequence[float], split: Sequence[int], pipeline: Pipeline, rng: np.random.Generator
) -> list[StageStats]:
    """What one measured iteration on `split` reports: per stage its layers' costs and its probe."""
    stats = []
    for s, (a, b) in enumerate(zip(offsets(split), offsets(split)[1:])):
        forward = pipeline.layer_ms * statistics.fmean(trace.F[s])
        backward = pipeline.layer_ms * statistics.fmean(x + y for x, y in zip(trace.B[s], trace.W[s]))
        costs = [
            LayerCost(
                layer=layer,
                forward_ms=forward,
                backward_ms=backward,
                param_bytes=pipeline.param_bytes,
                activation_bytes=pipeline.activation_bytes,
            )
            for layer in range(a, b)
        ]
        probe = speeds[s] * float(np.exp(rng.standard_normal() * PROBE_SIGMA))
        stats.append(
            StageStats(stage=s, wall_ms=0.0, compute_ms=0.0, blocked_ms=0.0, layer_costs=costs, probe_ms=probe)
        )
    return stats


def run(
    *,
    traces: Sequence[Trace],
    speeds: Sequence[Sequence[float]],
    rebalancer: Rebalancer,
    pipeline: Pipeline,
    measure_every: int,
    seed: int,
) -> Rebalanced:
    """Every iteration of `traces` (t_f = 1; `speeds[k][s]`: stage s's true device speed in iteration k)
    on the rebalancer's split, measured every `measure_every` iterations, moved where it decides."""
    policy, cap = rebalancer.policy, rebalancer.cap
    rng = np.random.default_rng(seed)
    even = rebalancer.split
    makespans, balanced, splits, decisions, decide_ms = [], [], [], [], []
    for k, (trace, speed) in enumerate(zip(traces, speeds)):
        split = rebalancer.split
        splits.append(split)
        makespans.append(
            simulate(policy=policy, trace=on_split(trace, split=split, layer_ms=pipeline.layer_ms), cap=cap).makespan_ms
        )
        best = best_split(costs=[1.0] * pipeline.layers, speeds=speed, current=even)  # equal layers
        balanced.append(
            simulate(policy=policy, trace=on_split(trace, split=best, layer_ms=pipeline.layer_ms), cap=cap).makespan_ms
        )
        if k % measure_every:
            continue
        stats = measured_stats(trace=trace, speeds=speed, split=split, pipeline=pipeline, rng=rng)
        started = time.perf_counter()
        decision = rebalancer.observe(iteration=k, stages=stats)
        decide_ms.append((time.perf_counter() - started) * 1e3)
        if decision is not None and decision.moves:
            rebalancer.applied(split=decision.split, seconds=decision.move_s)
            decisions.append(decision)
    window = rebalancer.settings.window
    moves = []
    for i, decision in enumerate(decisions):
        end = decisions[i + 1].iteration + 1 if i + 1 < len(decisions) else len(makespans)
        k = decision.iteration
        moves.append(
            Moved(
                decision=decision,
                achieved_before_ms=statistics.median(makespans[max(0, k + 1 - window) : k + 1]),
                achieved_after_ms=statistics.median(makespans[k + 1 : end]) if end > k + 1 else float("nan"),
            )
        )
    return Rebalanced(
        makespans=tuple(makespans),
        balanced=tuple(balanced),
        splits=tuple(splits),
        moves=tuple(moves),
        decide_ms=tuple(decide_ms),
    )
