"""Packing the samples of a global batch into microbatches whose predicted costs balance.

A microbatch's predicted cost on every stage is linear in the sum of its samples' cost features
(`rrfp_ray.plan.costs`: intercept + slope x feature), so balancing those sums balances every
stage at once. `pack` places the samples by falling cost, each into the lightest bin (LPT), then
moves or swaps samples between the heaviest and the lightest bin while that narrows them.
"""

from __future__ import annotations

from collections.abc import Sequence

Packing = tuple[tuple[int, ...], ...]  # per microbatch, the indexes of the samples it holds


def pack(*, costs: Sequence[float], bins: int) -> Packing:
    """The samples 0..len(costs)-1 in `bins` non-empty microbatches of balanced total cost; deterministic."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if len(costs) < bins:
        raise ValueError(f"cannot pack {len(costs)} samples into {bins} non-empty microbatches")
    groups: list[list[int]] = [[] for _ in range(bins)]
    load = [0.0] * bins
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min(range(bins), key=lambda b: (load[b], len(groups[b]), b))
        groups[b].append(i)
        load[b] += costs[i]
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


def loads(*, costs: Sequence[float], packing: Packing) -> list[float]:
    return [sum(costs[i] for i in group) for group in packing]


def spread(values: Sequence[float]) -> float:
    """max / min of microbatch costs (1 = balanced)."""
    low = min(values)
    return float("inf") if low <= 0 else max(values) / low
