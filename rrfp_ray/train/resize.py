"""The shape a job runs at when the cluster cannot hold the one it asked for.

A job asks for a target shape: D replicas of P stages of v chunks, T TP ranks per stage,
M microbatches per replica (D x M an iteration), a layer split. When a node is lost and no
replacement comes (`BalanceConfig.resize_after`), it runs at the first shape of `shapes`
the cluster can hold, and goes back to the target once the cluster can hold it again:

1. the target;
2. fewer replicas, one at a time: D' replicas of M' = D x M / D' microbatches, so an
   iteration trains the same D x M microbatches (a D' that does not divide D x M is skipped);
3. at one replica, fewer stages, one at a time, over the same layers: P' stages of v chunks
   (one chunk at P' = 1), a split the user set spread evenly again (the larger parts first).

The floor is one replica of one stage (its T TP ranks unchanged: they are one node's);
TP never shrinks. A shape its config refuses (a policy or a hint that does not fit it) is
skipped. ZeRO-1 shards over replicas, so a single replica runs without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.partition import partition

logger = logging.getLogger(__name__)


def shapes(*, target: PipelineConfig) -> list[PipelineConfig]:
    """Every shape `target` may run at, the most preferred (the target itself) first."""
    total = target.global_microbatches
    found = [target]
    for dp in range(target.dp - 1, 0, -1):
        if total % dp == 0:
            found.extend(_valid(target, stages=target.stages, dp=dp, microbatches=total // dp))
    for stages in range(target.stages - 1, 0, -1):
        found.extend(_valid(target, stages=stages, dp=1, microbatches=total))
    return found


def choose(*, target: PipelineConfig, placeable: Callable[[PipelineConfig], bool]) -> PipelineConfig | None:
    """The first of `shapes(target)` that `placeable` says the cluster can hold now; None if none."""
    for shape in shapes(target=target):
        if placeable(shape):
            return shape
    return None


def _valid(target: PipelineConfig, *, stages: int, dp: int, microbatches: int) -> list[PipelineConfig]:
    """The shape with these numbers (as a list: empty when its config refuses it)."""
    chunks = target.chunks if stages > 1 else 1
    split = target.layer_split
    if split is not None and stages != target.stages:
        split = tuple(len(part) for part in partition(n_layers=sum(split), parts=stages * chunks))
    try:
        return [
            target.replaced(
                stages=stages,
                chunks=chunks,
                layer_split=split,
                dp=dp,
                microbatches=microbatches,
                zero=target.zero if dp > 1 else 0,
            )
        ]
    except ValueError as error:
        logger.debug("shape D %d x P %d skipped: %s", dp, stages, error)
        return []
