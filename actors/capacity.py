"""Whether a cluster can ever hold a pipeline's D x P x T stage actors, checked before any starts.

The pipeline asks one placement group per (replica, stage): its T TP ranks' bundles on one
node (STRICT_PACK). It can never be held when no node the cluster has or could add holds one
such group; on a cluster without an autoscaler, also when its nodes together hold too little.
A cluster with an autoscaler grows on demand, so its present size refuses nothing (placement
waits for the nodes). Arithmetic on node resources only: `actors.placement` reads them from Ray.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rrfp_ray.errors import BadInput


class CapacityError(BadInput):
    """The cluster can never hold the pipeline's placement groups."""


@dataclass(frozen=True)
class Demand:
    """`dp` x `stages` placement groups, each of `tp` copies of `bundle` on one node."""

    bundle: Mapping[str, float]
    dp: int = 1
    stages: int = 1
    tp: int = 1

    @property
    def groups(self) -> int:
        return self.dp * self.stages

    @property
    def actors(self) -> int:
        return self.groups * self.tp

    def group(self) -> dict[str, float]:
        """What one (replica, stage) group asks of its node."""
        return {name: amount * self.tp for name, amount in self.bundle.items()}

    def __str__(self) -> str:
        """`8 x {CPU: 1, GPU: 1}`, or with TP 2 `4 x (2 x {CPU: 1, GPU: 1} on one node)`."""
        bundle = shape(self.bundle)
        return f"{self.groups} x {bundle}" if self.tp == 1 else f"{self.groups} x ({self.tp} x {bundle} on one node)"


def stage_bundle(*, gpus: float, resources: Mapping[str, float]) -> dict[str, float]:
    """One CPU, `gpus` GPUs and the user's extra resources (`--stage-resources`)."""
    return {"CPU": 1.0} | ({"GPU": gpus} if gpus else {}) | dict(resources)


def shape(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"


def fits(need: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(node.get(name, 0.0) >= amount for name, amount in need.items() if amount > 0)


def check_capacity(*, demand: Demand, nodes: Sequence[Mapping[str, float]], grows: bool, source: str) -> None:
    """CapacityError naming the demand when none of `nodes` (each node the cluster has or could
    add, as `source` says) holds one (replica, stage) group, or, on a cluster that does not
    `grow`, when `nodes` together hold too little of a resource."""
    group = demand.group()
    if not any(fits(group, node) for node in nodes):
        offered = sorted({json.dumps(_shown(node), sort_keys=True) for node in nodes})
        what = (
            f"a stage's bundle {shape(group)}" if demand.tp == 1 else f"a stage's {demand.tp} TP ranks ({shape(group)})"
        )
        raise CapacityError(f"no node can ever hold {what}: {source} offer {'; '.join(offered) or 'nothing'}")
    if grows:
        return
    total = {name: sum(node.get(name, 0.0) for node in nodes) for name in demand.bundle}
    short = {
        name: demand.actors * amount for name, amount in demand.bundle.items() if demand.actors * amount > total[name]
    }
    if short:
        need = ", ".join(f"{amount:g} {name}" for name, amount in short.items())
        have = ", ".join(f"{total[name]:g} {name}" for name in short)
        raise CapacityError(
            f"dp x stages x tp = {demand.dp} x {demand.stages} x {demand.tp} = {demand.actors} stage actors of "
            f"{shape(demand.bundle)} need {need}; the cluster has {have} and no autoscaler is configured"
        )


def _shown(node: Mapping[str, float]) -> dict[str, float]:
    """A node's resources without Ray's bookkeeping ones (node:..., memory, object store, placement groups')."""
    hidden = ("node:", "memory", "object_store_memory", "bundle_group_")
    return {k: v for k, v in node.items() if not k.startswith(hidden) and "_group_" not in k}
