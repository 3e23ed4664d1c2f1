"""Rebalancing in the simulator: a persistently slow stage, the rebalancer's moves, and the best split.

Per scenario, pipeline depth P (M = 4P, v = 1, cap 1x, `layers` equal layers per stage, evenly split at
the start) and policy, a run of iterations (`rrfp_ray.plan.rebalance_loop`) is measured every
iteration and rebalanced from what it measured:

- `before`: the median iteration before the first move; `after`: the median over the iterations after
  the last move (at least 10); `balanced`: the same iterations, each on the best contiguous split for
  its true device speeds (what a rebalancer that knew them would run);
- `moves`, their estimated seconds, and for the first move its predicted iteration before and after
  against the medians achieved before and after it;
- `decide ms`: the wall time the rebalancer took per measured iteration, median and most (the only
  column that depends on the machine).

Scenarios (`rrfp_ray/sim/variability.py`), each with independent per-op lognormal noise (sigma 0.1):
`imbalance` (the last stage's device 1.5x slow), `persistent` (one device 2x slow, moving to another
after `span` iterations), `none` (noise only: the rebalancer must not move).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rrfp_ray.plan.rebalance import Rebalancer, RebalanceSettings
from rrfp_ray.plan.rebalance_loop import Pipeline, run
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.variability import generate_iterations

NOISE = 0.1  # sigma of the per-op lognormal noise every scenario runs with


@dataclass(frozen=True)
class Scenario:
    label: str
    slowdown: str  # the scenario that slows devices (its trace without noise: the true speeds)
    params: Mapping[str, float]


SCENARIOS = (
    Scenario("imbalance", "imbalance", {"rho": 1.5}),
    Scenario("persistent", "persistent", {"k": 2.0}),
    Scenario("none", "none", {}),
)


def cell(
    *,
    scenario: Scenario,
    stages: int,
    policy: str,
    layers: int,
    iterations: int,
    span: int,
    threshold: float,
    window: int,
    layer_mb: float,
    seed: int,
) -> dict[str, Any]:
    """One (scenario, P, policy): the run's before, after and balanced medians, its moves."""
    shape = {"stages": stages, "chunks": 1, "microbatches": 4 * stages}
    params = dict(scenario.params)
    if scenario.slowdown == "persistent":
        params["span"] = float(span)
    kwargs = {"iterations": iterations, **shape, "seed": seed, "t_f": 1.0}
    noisy = generate_iterations(scenario=f"{scenario.slowdown}+lognormal", sigma=NOISE, **kwargs, **params)
    truth = generate_iterations(scenario=scenario.slowdown, **kwargs, **params)
    speeds = [[row[0] for row in t.F] for t in truth]
    rebalancer = Rebalancer(
        settings=RebalanceSettings(threshold=threshold, window=window),
        split=(layers,) * stages,
        policy=make_policy(name=policy, **shape),
        cap=Cap.parse("1x"),
        microbatches=shape["microbatches"],
    )
    pipeline = Pipeline(layers=layers * stages, layer_ms=20.0 / layers, param_bytes=int(layer_mb * 2**20))
    done = run(traces=noisy, speeds=speeds, rebalancer=rebalancer, pipeline=pipeline, measure_every=1, seed=seed)
    first = done.moves[0] if done.moves else None
    return {
        "before_ms": done.before_ms,
        "after_ms": done.after_ms(),
        "balanced_ms": done.balanced_ms(),
        "moves": len(done.moves),
        "move_s": done.move_s,
        "splits": [list(m.decision.split) for m in done.moves],
        "move_iterations": [m.decision.iteration for m in done.moves],
        "predicted": [[m.decision.before_ms, m.decision.after_ms] for m in done.moves],
        "achieved": [[m.achieved_before_ms, m.achieved_after_ms] for m in done.moves],
        "first_predicted_gain": None if first is None else first.decision.before_ms / first.decision.after_ms,
        "first_achieved_gain": None if first is None else first.achieved_before_ms / first.achieved_after_ms,
        "decide_ms_median": statistics.median(done.decide_ms),
        "decide_ms_max": max(done.decide_ms),
    }


def table(rows: Mapping[tuple[str, int, str], Mapping[str, Any]]) -> list[str]:
    """Markdown: one row per (scenario, P, policy)."""
    head = [
        "scenario",
        "P",
        "policy",
        "before ms",
        "after ms",
        "balanced ms",
        "after / balanced",
        "gain (before / after)",
        "moves",
        "move s (est.)",
        "1st move: predicted gain",
        "achieved gain",
        "decide ms (median / most)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (label, stages, policy), r in rows.items():
        predicted, achieved = r["first_predicted_gain"], r["first_achieved_gain"]
        lines.append(
            f"| {label} | {stages} | {policy} | {r['before_ms']:.0f} | {r['after_ms']:.0f} | {r['balanced_ms']:.0f} | "
            f"{r['after_ms'] / r['balanced_ms']:.3f} | {r['before_ms'] / r['after_ms']:.3f}x | {r['moves']} | "
            f"{r['move_s']:.1f} | {_x(predicted)} | {_x(achieved)} | "
            f"{r['decide_ms_median']:.2f} / {r['decide_ms_max']:.1f} |"
        )
    return lines


def worst_gap(rows: Mapping[Any, Mapping[str, Any]]) -> float:
    """The largest after / balanced over the rows: the target is within 1.05."""
    return max(r["after_ms"] / r["balanced_ms"] for r in rows.values())


def _x(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}x"
