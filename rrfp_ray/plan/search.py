"""The search for a plan: heuristic orders first (the last plan's pattern among them), then the hint, then local
moves, under a budget of simulations.

The local search scores a batch of `NEIGHBOURS` random orders one move from the best so far (a swap of
two slots, or a block of consecutive microbatches moved elsewhere) and moves to the batch's best when it
is better, until the budget is spent.

Every candidate is scored by `rrfp_ray.plan.scoring.score` over the same samples (common random
numbers), so two candidates differ only by their plans. The budget counts simulated iterations
(candidates x samples), which keeps a search deterministic under its seed; a wall-clock deadline
only stops it early, and then it reports no plan (the caller keeps its last one).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from rrfp_ray.plan.plans import Plan
from rrfp_ray.plan.scoring import LimitsCache, score
from rrfp_ray.policy.caps import Cap
from rrfp_ray.sim.trace import Trace

log = logging.getLogger(__name__)

Order = tuple[int, ...]
NEIGHBOURS = 8  # orders scored together, in one batch, around the best so far


@dataclass(frozen=True)
class Found:
    plan: Plan
    score_ms: float  # mean simulated makespan over the samples
    simulations: int  # simulated iterations spent
    ranks: tuple[int, ...]  # per slot, the rank of its microbatch by predicted cost (`by_cost`)


def predicted_cost(samples: Sequence[Trace]) -> np.ndarray:
    """Per virtual stage and data microbatch, its predicted work (F + B + W) summed over the samples."""
    first = samples[0]
    work = np.zeros((first.virtual_stages, first.microbatches))
    for t in samples:
        work += np.array(t.F) + np.array(t.B) + np.array(t.W)
    return work


def by_cost(work: np.ndarray) -> list[int]:
    """The data microbatches by rising predicted cost (`predicted_cost`'s columns; the lower index first on ties)."""
    cost = work.sum(axis=0)
    return sorted(range(len(cost)), key=lambda j: (cost[j], j))


def heuristic_orders(samples: Sequence[Trace], *, previous: Sequence[int] | None = None) -> list[Order]:
    """Candidate orders from the predicted cost of each data microbatch, identity first.

    Then the last plan's pattern (`previous`, its `Found.ranks`): slot i holds this iteration's microbatch of the
    rank the last plan's slot i held, so what the last search learned of where heavy and light microbatches go
    carries over to new data. Then light at both ends and heavy in the middle (the pipeline fills and drains on
    light ones, and the heavy ones overlap while it is full), smoothed (`smoothed`: about the mean load in every
    stretch of slots, with light ones at the ends, as many as half to twice the virtual stages, the pipeline's fill
    and drain), and Johnson's rule over the front and back halves of the virtual stages (microbatches heavier
    at the back go first, by rising front cost; the others last, by falling back cost), as for a
    two-machine flow shop.
    """
    work = predicted_cost(samples)
    V, M = work.shape
    cost, front, back = work.sum(axis=0), work[: (V + 1) // 2].sum(axis=0), work[(V + 1) // 2 :].sum(axis=0)
    rising = by_cost(work)
    early = sorted((j for j in range(M) if front[j] < back[j]), key=lambda j: (front[j], j))
    late = sorted((j for j in range(M) if front[j] >= back[j]), key=lambda j: (-back[j], j))
    smooth = [smoothed(cost, ends=math.ceil(share * V)) for share in (1 / 2, 1, 3 / 2, 2)]
    ends = [light_ends(rising, front=share) for share in (1 / 2, 1 / 3, 2 / 3)]
    learned = [] if previous is None or len(previous) != M else [tuple(rising[r] for r in previous)]
    candidates = [tuple(range(M)), *learned, *ends, *smooth, tuple(early + late)]
    return list(dict.fromkeys(candidates))


def smoothed(cost: np.ndarray, *, ends: int) -> Order:
    """The `ends` lightest microbatches dealt to the two ends (lightest outermost), and between them the others
    in the order that keeps their running cost closest to its even share at every slot (the heavier first
    on ties): every stretch of consecutive slots carries about the mean load, so the stages that a heavy
    microbatch slows catch up on the light ones next to it."""
    M, each = len(cost), cost.tolist()  # the same floats, without numpy's overhead per scalar
    rising = sorted(range(M), key=lambda j: (each[j], j))
    light, left = rising[: min(ends, M)], sorted(rising[min(ends, M) :], key=lambda j: (-each[j], j))
    share = float(np.mean(cost[left])) if left else 0.0
    middle, total = [], 0.0
    for i in range(len(left)):
        j = min(left, key=lambda j: abs(total + each[j] - (i + 1) * share))
        left.remove(j)
        middle.append(j)
        total += each[j]
    return tuple(light[0::2] + middle + light[1::2][::-1])


def light_ends(rising: Sequence[int], *, front: float) -> Order:
    """Microbatches by rising cost dealt to the two ends, lightest outermost: a `front` share of them
    to the front, the rest to the back, so the heaviest meet in between."""
    head, tail = [], []
    for i, j in enumerate(rising):
        (head if int((i + 1) * front) > int(i * front) else tail).append(j)
    return tuple(head + tail[::-1])


def neighbours(order: Order, *, rng: np.random.Generator, count: int) -> list[Order]:
    """`count` random orders one move from `order`: a swap of two slots, or a block of one to four
    consecutive microbatches moved elsewhere (one moved by one slot is an adjacent swap)."""
    M, out = len(order), []
    for _ in range(count):
        moved = list(order)
        if rng.random() < 0.5:
            i, j = (int(x) for x in rng.choice(M, size=2, replace=False))
            moved[i], moved[j] = moved[j], moved[i]
        else:
            size = int(rng.integers(1, min(4, M - 1) + 1))
            start = int(rng.integers(0, M - size + 1))
            block, rest = moved[start : start + size], moved[:start] + moved[start + size :]
            at = int(rng.integers(0, len(rest)))
            at += at >= start  # anywhere but back in its place
            moved = rest[:at] + block + rest[at:]
        out.append(tuple(moved))
    return out


def search(
    *,
    samples: Sequence[Trace],
    hints: Sequence[str],
    cap: Cap,
    simulations: int,
    seed: int,
    deadline: float | None = None,
    reorder: bool = True,
    basis: Trace | None = None,
    previous: Sequence[int] | None = None,
) -> Found | None:
    """The best plan found within `simulations` simulated iterations; None when `deadline`
    (a `time.monotonic()` instant) passed first. `reorder` False: the hints and the cap only, the data
    microbatches in their order. `basis`: the data before packing, on which the cap is measured (`score`).
    `previous`: the last plan's `Found.ranks`, a candidate order (`heuristic_orders`). The orders are scored under
    the first hint, then every hint under the best order (so a caller lists first the hint it expects to win)."""
    if not hints:
        raise ValueError("the search needs at least one hint")
    cost = len(samples)
    if simulations < cost:
        raise ValueError(f"a budget of {simulations} simulations cannot score one plan over {cost} samples")
    seen: dict[Plan, float] = {}
    best: list[Plan] = []
    limits: LimitsCache = {}

    def tried(plans: Sequence[Plan]) -> bool:
        """Score the new plans among `plans` in one batch, as many as the budget allows; False when it ran out."""
        new = list(dict.fromkeys(p for p in plans if p not in seen))
        room = simulations // cost - len(seen)
        if new and room > 0:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            for plan, value in zip(new[:room], score(plans=new[:room], samples=samples, basis=basis, limits=limits)):
                seen[plan] = value
                if not best or value < seen[best[0]]:
                    best[:] = [plan]
        return len(new) <= room

    try:
        orders = heuristic_orders(samples, previous=previous) if reorder else [tuple(range(samples[0].microbatches))]
        if tried([Plan(order=order, hint=hints[0], cap=cap) for order in orders]):
            order = best[0].order
            if tried([Plan(order=order, hint=hint, cap=cap) for hint in hints[1:]]) and reorder:
                rng = np.random.default_rng(seed)
                M, misses = len(order), 0
                while M > 1 and misses < 4 * M * M:
                    plans = [replace(best[0], order=o) for o in neighbours(best[0].order, rng=rng, count=NEIGHBOURS)]
                    misses = misses + len(plans) if all(p in seen for p in plans) else 0
                    if not tried(plans):
                        break
    except TimeoutError:
        log.warning("plan search stopped at its deadline after %d candidates; keeping the last plan", len(seen))
        return None
    rank = {j: r for r, j in enumerate(by_cost(predicted_cost(samples)))}
    ranks = tuple(rank[j] for j in best[0].order)
    return Found(plan=best[0], score_ms=seen[best[0]], simulations=len(seen) * cost, ranks=ranks)


def budgets(*, simulations: int, samples: int, count: int) -> list[int]:
    """The simulations of each of `count` searches of one plan (one per packing tried): a quarter of `simulations`
    for each after the first (none where a quarter cannot score one plan over the `samples`), the rest to the first."""
    extra = simulations // 4
    if count == 1 or extra < samples or simulations - extra * (count - 1) < samples:
        return [simulations]
    return [simulations - extra * (count - 1), *([extra] * (count - 1))]
