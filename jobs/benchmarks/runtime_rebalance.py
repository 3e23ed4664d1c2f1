"""`jobs/bench_runtime.py --rebalance`: the rebalancer on Ray, over the synthetic workload's layers.

Each policy runs on its own pipeline (the one driver's stages, given the even split again), its
iterations one after another, measured every `balance.measure_period` and moved by the Trainer's
rebalancing (`rrfp_ray.train.rebalancing`) at the group level: a move gives every stage the workload of
the new split. Then the same pipeline runs on the best contiguous split for the scenario's true costs
(the trace's device speeds, its layers all alike). Per policy:

- `before_ms`: the median iteration before the first move (all of them without one), the first
  iteration left out as a warm-up;
- `after_ms`: the median over the iterations after the last move, at least `AFTER` of them (the run goes
  on until it has them); `before_ms` without a move;
- `balanced_ms`: the median over `AFTER` iterations on the best split;
- `moves` (`rrfp_ray.train.rebalancing.Move`, as dicts) and `move_s`, their seconds in all;
- with a `plain` driver (the same pipeline without --rebalance: no measuring, no rebalancer, the even
  split throughout), whose iterations take turns with the rebalanced run's: `wall_ms` and `plain_wall_ms`,
  the median wall-clock time of an iteration (the first left out) with and without --rebalance, the
  rebalancer's decisions and moves included, and `with_over_without`, their ratio. Without an imbalance
  it is what --rebalance costs; with one, below 1 is what it gains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rrfp_ray.plan.rebalance import best_split
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.schedule.grad_ready import even_split
from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.rebalancing import Rebalancing

AFTER = 10  # iterations after the last move that after_ms, and on the best split that balanced_ms, take


def true_speeds(trace: Trace) -> list[float]:
    """Per stage, its device's mean op time over the microbatches (F + B + W): the scenario's speed."""
    return [
        statistics.fmean(f + b + w for f, b, w in zip(*(rows[s] for rows in (trace.F, trace.B, trace.W))))
        for s in range(trace.stages)
    ]


def balanced_split(*, trace: Trace, layers: int) -> tuple[int, ...]:
    """The least-bottleneck contiguous split of `layers` equal layers for the trace's device speeds."""
    split = best_split(costs=[1.0] * layers, speeds=true_speeds(trace), current=even_split(layers, parts=trace.stages))
    if split is None:
        raise RuntimeError("a split without memory limits always exists")
    return split


def run(
    *,
    driver: Any,
    pipeline: PipelineConfig,
    workload: SyntheticWorkload,
    names: list[str],
    iterations: int,
    plain: Any | None = None,
) -> dict[str, dict[str, Any]]:
    """Per policy, what `--rebalance` writes (see the module's docstring)."""
    import ray

    layers = workload.layers * pipeline.stages
    even, best = tuple(even_split(layers, parts=pipeline.stages)), balanced_split(trace=workload.trace, layers=layers)
    out = {}
    for name in names:
        policy = pipeline.resolved_policy(name)

        def reshape(*, layer_split: tuple[int, ...]) -> float:
            started = time.perf_counter()
            ray.get(driver.set_workload.remote(workload=replace(workload, layer_split=tuple(layer_split))))
            return time.perf_counter() - started

        reshape(layer_split=even)
        rebalancing = Rebalancing(pipeline=pipeline, policy=policy, device="cpu", reshape=reshape)
        makespans: list[float] = []
        walls: list[float] = []
        plain_walls: list[float] = []
        k = 0
        while k < iterations or (rebalancing.moves and k - 1 - rebalancing.moves[-1].iteration < AFTER):
            started = time.perf_counter()
            report = ray.get(driver.run_iteration.remote(iteration=k, policy=policy))
            rebalancing.after(report)
            walls.append((time.perf_counter() - started) * 1e3)
            makespans.append(report.makespan_ms)
            if plain is not None:
                started = time.perf_counter()
                ray.get(plain.run_iteration.remote(iteration=k, policy=policy))
                plain_walls.append((time.perf_counter() - started) * 1e3)
            k += 1
        moves = rebalancing.moves
        first = moves[0].iteration + 1 if moves else len(makespans)
        before = statistics.median(makespans[1:first] or makespans[:1])  # the first: a warm-up
        after = statistics.median(makespans[moves[-1].iteration + 1 :]) if moves else before
        reshape(layer_split=best)
        balanced = [
            ray.get(driver.run_iteration.remote(iteration=k + i, policy=policy)).makespan_ms for i in range(AFTER)
        ]
        out[name] = {
            "rebalance": {
                "before_ms": before,
                "after_ms": after,
                "balanced_ms": statistics.median(balanced),
                "moves": [asdict(move) for move in moves],
                "move_s": sum(move.seconds for move in moves),
                "split": list(moves[-1].after if moves else even),
                "balanced_split": list(best),
                "iterations": len(makespans),
            }
        }
        if plain is not None:
            wall, plain_wall = statistics.median(walls[1:]), statistics.median(plain_walls[1:])
            out[name]["rebalance"] |= {
                "wall_ms": wall,
                "plain_wall_ms": plain_wall,
                "with_over_without": wall / plain_wall,
            }
    return out


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The lines `--rebalance` prints, one per policy."""
    lines = [
        f"{'policy':<12} {'before ms':>9} {'after ms':>9} {'balanced':>9} {'after/bal':>9} {'gain':>6} "
        f"{'moves':>5} {'move s':>6}  split (balanced)"
    ]
    for name, figures in results.items():
        r = figures["rebalance"]
        lines.append(
            f"{name:<12} {r['before_ms']:9.1f} {r['after_ms']:9.1f} {r['balanced_ms']:9.1f} "
            f"{r['after_ms'] / r['balanced_ms']:9.3f} {r['before_ms'] / r['after_ms']:6.3f} {len(r['moves']):5d} "
            f"{r['move_s']:6.2f}  {','.join(map(str, r['split']))} ({','.join(map(str, r['balanced_split']))})"
        )
    for name, figures in results.items():
        r = figures["rebalance"]
        if "with_over_without" in r:
            lines.append(
                f"{name}: wall-clock iteration with --rebalance {r['wall_ms']:.1f} ms, without (the same pipeline, "
                f"taking turns) {r['plain_wall_ms']:.1f} ms: with / without {r['with_over_without']:.4f}"
            )
    return lines


def job(*, driver, pipeline: PipelineConfig, workload, names: list[str], args: argparse.Namespace) -> dict:
    """The job's --rebalance: each policy rebalanced on its own pipeline beside `driver`'s plain one, and on the
    best split; prints the table and writes --json."""
    import ray

    from actors.driver import PipelineDriver
    from actors.teardown import end_actors

    plain = PipelineDriver.remote(pipeline=pipeline.replaced(rebalance=False, measure_every=None), workload=workload)
    try:
        results = run(
            driver=driver, pipeline=pipeline, workload=workload, names=names, iterations=args.iterations, plain=plain
        )
        for each in (driver, plain):
            ray.get(each.shutdown.remote())
        end_actors([driver, plain], timeout_s=30.0)
    finally:
        ray.kill(plain)
    print(
        f"P={pipeline.stages} M={pipeline.microbatches} cap={pipeline.cap} scenario={args.scenario} "
        f"{args.layers} layers a stage at the start, measured every {pipeline.balance.measure_period}, "
        f"threshold {pipeline.balance.rebalance_threshold:g}, window {pipeline.balance.rebalance_window}"
    )
    print("\n".join(table(results)))
    summary = {"policies": results}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    return summary
