"""Packing the samples of a global batch into microbatches whose predicted costs balance.

A microbatch's predicted cost on every stage is linear in the sum of its samples' cost features
(`rrfp_ray.plan.costs`: intercept + slope x feature), so balancing those sums balances every
stage at once. `pack` places the samples by falling cost, each into the lightest bin (LPT), then
moves or swaps samples between the heaviest and the lightest bin while that narrows them. With `shares`, each bin
aims at its share of the total instead (the lightest and heaviest bins: those furthest below and above their aim):
`light_ends` makes a few bins light on purpose, for the pipeline to fill and drain on.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

from rrfp_ray.plan.costs import padded_size

log = logging.getLogger(__name__)

Packing = tuple[tuple[int, ...], ...]  # per microbatch, the indexes of the samples it holds
LIGHT = 0.7  # a light microbatch's share of the mean cost, where a plan packs some light on purpose


def pack(*, costs: Sequence[float], bins: int, shares: Sequence[float] | None = None) -> Packing:
    """The samples 0..len(costs)-1 in `bins` non-empty microbatches of balanced total cost (with `shares`, bin b
    aims at shares[b] of the total, shares summing to 1); deterministic."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if len(costs) < bins:
        raise ValueError(f"cannot pack {len(costs)} samples into {bins} non-empty microbatches")
    if shares is not None and (len(shares) != bins or min(shares) <= 0):
        raise ValueError(f"shares must give each of the {bins} bins a share > 0")
    groups: list[list[int]] = [[] for _ in range(bins)]
    load = [0.0] * bins  # the bin's cost less its aim (its cost where the aim is even)
    if shares is not None:
        total = sum(costs)
        load = [-total * share / sum(shares) for share in shares]
    # each sample, heaviest first, to the bin first by (non-empty, load, count, index): a heap of those keys
    order = [(False, load[b], 0, b) for b in range(bins)]
    heapq.heapify(order)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = order[0][3]
        groups[b].append(i)
        load[b] += costs[i]
        heapq.heapreplace(order, (True, load[b], len(groups[b]), b))
    for _ in range(4 * len(costs)):
        heavy = max(range(bins), key=lambda b: (load[b], -b))
        light = min(range(bins), key=lambda b: (load[b], b))
        gap = load[heavy] - load[light]
        best, move = 0.0, None
        for i in groups[heavy]:
            if len(groups[heavy]) > 1 and 0 < costs[i] < gap:  # move i: the gap shrinks to |gap - 2 c|
                gain = gap - abs(gap - 2 * costs[i])
                if gain > best:
                    best, move = gain, (i, None)
            for j in groups[light]:
                d = costs[i] - costs[j]
                if 0 < d < gap and (gain := gap - abs(gap - 2 * d)) > best:
                    best, move = gain, (i, j)
        if move is None or best <= 1e-12 * max(1.0, gap):
            break
        i, j = move
        groups[heavy].remove(i)
        groups[light].append(i)
        load[heavy] -= costs[i]
        load[light] += costs[i]
        if j is not None:
            groups[light].remove(j)
            groups[heavy].append(j)
            load[light] -= costs[j]
            load[heavy] += costs[j]
    return tuple(tuple(sorted(g)) for g in groups)


def light_ends(*, bins: int, light: int, weight: float) -> list[float]:
    """Shares for `pack`: `light` bins (at most half of them) at `weight` x the mean, the others even."""
    light = min(light, bins // 2)
    rest = (bins - light * weight) / (bins - light)
    return [weight / bins] * light + [rest / bins] * (bins - light)


def loads(*, costs: Sequence[float], packing: Packing) -> list[float]:
    return [sum(costs[i] for i in group) for group in packing]


def spread(values: Sequence[float]) -> float:
    """max / min of microbatch costs (1 = balanced)."""
    low = min(values)
    return float("inf") if low <= 0 else max(values) / low


def packed(
    *,
    samples: Sequence[Sequence[float]],
    costs: Sequence[float],
    microbatches: int,
    shares: Sequence[float] | None = None,
) -> tuple[Packing, list[float]]:
    """The packing of `samples` (per microbatch, its samples' features) into `microbatches` by their `costs`
    (one per sample, flat; `shares`: as `pack` takes them), and the features of the packed microbatches."""
    packing = pack(costs=costs, bins=microbatches, shares=shares)
    width = [len(row) for row in samples]
    before = [sum(costs[sum(width[:m]) : sum(width[: m + 1])]) for m in range(len(samples))]
    log.debug(
        "packing: microbatch cost spread (max/min) %.3f -> %.3f",
        spread(before),
        spread(loads(costs=costs, packing=packing)),
    )
    return packing, loads(costs=[x for row in samples for x in row], packing=packing)


def packed_padded(*, samples: Sequence[Sequence[float]], packing: Packing) -> list[float]:
    """Per microbatch of `packing`, its padded size (`padded_size`) over `samples` (per microbatch, its features)."""
    flat = [x for row in samples for x in row]
    return [padded_size([flat[i] for i in group]) for group in packing]


def packing_shares(*, blocks: int, microbatches: int) -> list[list[float] | None]:
    """The packings a plan tries: balanced (None), then with as many light microbatches as virtual stages (`blocks`)
    at `LIGHT` x the mean, for the pipeline to fill and drain on while the heavier ones overlap."""
    return [None, light_ends(bins=microbatches, light=blocks, weight=LIGHT)]


def packings(
    *, samples: Sequence[Sequence[float]], costs: Sequence[float], microbatches: int, blocks: int
) -> list[tuple[Packing, list[float], list[float]]]:
    """Each packing a plan tries (`packing_shares`) with the features and padded sizes of its microbatches."""
    out = []
    for shares in packing_shares(blocks=blocks, microbatches=microbatches):
        packing, features = packed(samples=samples, costs=costs, microbatches=microbatches, shares=shares)
        out.append((packing, features, packed_padded(samples=samples, packing=packing)))
    return out
