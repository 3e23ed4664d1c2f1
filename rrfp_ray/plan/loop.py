"""Planning over a run of simulated iterations, as the runtime will: plan k while k-1 runs.

`planned` plans iteration k from k's features and the simulated telemetry of iterations <= k-2;
`planned-fixed` does the same with fixed schedules only as hints (what the order alone buys);
`oracle` searches each iteration with its true durations (the ceiling of the same search).
Where a trace records its samples, every plan first packs them (`rrfp_ray.plan.packing`). Memory
is that of the reference list on the iteration's data as the source gave it (before any packing), in its own
order (`planned_limits`): the bytes a fixed schedule holds on the same batch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.packing import Packing, packings
from rrfp_ray.plan.planner import Planner, PlannerConfig, default_hints
from rrfp_ray.plan.plans import Plan
from rrfp_ray.plan.scoring import planned_limits
from rrfp_ray.plan.search import Found, budgets, search
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.trace import Trace

LAG = 2  # iteration k is planned while k-1 runs, so the newest telemetry it has is k-2's


class Planning(enum.Enum):
    PLANNED = "planned"
    PLANNED_FIXED = "planned-fixed"
    ORACLE = "oracle"

    @classmethod
    def of(cls, name: str) -> Planning | None:
        return next((p for p in cls if p.value == name), None)


def config_for(*, planning: Planning, base: PlannerConfig, chunks: int) -> PlannerConfig:
    """`base` with the hints this planning chooses among. A simulated full backward costs I + W by the trace's
    definition, so the planner has no backward to learn by running it."""
    fixed = planning is Planning.PLANNED_FIXED
    return replace(base, hints=default_hints(chunks=chunks, fixed_only=fixed), learn_backwards=False)


def run(
    *,
    planning: Planning,
    traces: Sequence[Trace],
    config: PlannerConfig,
    plan_on: Sequence[Trace] | None = None,
) -> list[tuple[Plan, IterationReport]]:
    """Every iteration of `traces` in order under `planning`: its plan and its simulated report. `plan_on`: the
    traces the oracle searches (one per iteration, the shape of `traces`; None: `traces` themselves)."""
    if plan_on is not None and len(plan_on) != len(traces):
        raise ValueError(f"plan_on has {len(plan_on)} traces for {len(traces)} iterations")
    first = traces[0]
    shape = {"stages": first.stages, "chunks": first.chunks, "microbatches": first.microbatches}
    config = config_for(planning=planning, base=config, chunks=first.chunks)
    planner = Planner(config=config, **shape)
    done: list[tuple[Plan, IterationReport]] = []
    ran: list[Trace] = []  # each iteration's data as packed by its plan
    last: Found | None = None  # the oracle's last plan, which its next search starts from as the planner's does
    for k, trace in enumerate(traces):
        if planning is Planning.ORACLE:
            last = oracle(trace=trace if plan_on is None else plan_on[k], config=config, iteration=k, last=last)
            plan = last.plan
        else:
            if k >= LAG:
                seen, (plan_seen, report_seen) = ran[k - LAG], done[k - LAG]
                planner.observe(
                    report=report_seen,
                    plan=plan_seen,
                    features=seen.features,
                    activation_bytes=seen.activation_bytes,
                )
            plan = planner.plan(iteration=k, features=trace.features, samples=trace.samples)
        policy = plan.validate(**shape)
        data = trace if plan.packing is None else trace.repacked(plan.packing)
        ran.append(data)
        limits = planned_limits(cap=plan.cap, trace=trace, split=policy.split)
        report = simulate(
            policy=policy, trace=data.reordered(plan.order), cap=plan.cap, iteration=k, byte_limits=limits
        )
        done.append((plan, replace(report, policy=f"{planning.value}:{plan.hint}")))
    return done


def oracle(*, trace: Trace, config: PlannerConfig, iteration: int, last: Found | None = None) -> Found:
    """The best plan the same search finds with the iteration's true durations (the ceiling), after packing
    the samples by their features, in each way `packing_shares` gives, where `config.arrange` packs (the cap measured
    on the data before packing); starting, as the planner does, from the `last` iteration's plan (its hint first,
    its pattern of ranks among the orders)."""
    hints = config.hints if last is None else tuple(sorted(config.hints, key=lambda hint: hint != last.plan.hint))
    tried: list[Packing | None] = [None]
    if trace.samples is not None and config.arrange.packs:
        costs = [x for row in trace.samples for x in row]
        shape = {"microbatches": trace.microbatches, "blocks": trace.virtual_stages}
        tried = [packing for packing, _, _ in packings(samples=trace.samples, costs=costs, **shape)]
    best: Found | None = None
    for packing, budget in zip(
        tried, budgets(simulations=config.simulations, samples=config.samples, count=len(tried))
    ):
        found = search(
            samples=[trace if packing is None else trace.repacked(packing)],
            basis=None if packing is None else trace,
            hints=hints,
            cap=config.cap,
            simulations=budget,
            seed=int(np.random.SeedSequence(config.seed, spawn_key=(iteration, 1)).generate_state(1)[0]),
            reorder=config.arrange.orders,
            previous=None if last is None else last.ranks,
        )
        if found is None:
            raise RuntimeError("a search without a deadline always finds a plan")
        if best is None or found.score_ms < best.score_ms:
            best = replace(found, plan=replace(found.plan, packing=packing))
    if best is None:
        raise RuntimeError("the oracle searched no packing")
    return best
