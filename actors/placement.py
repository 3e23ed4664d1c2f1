"""Placement of the stage actors: a placement group per (replica, stage) holding its TP ranks
on one node (STRICT_PACK), asked for at once and waited on while an autoscaler adds the
nodes that hold them.

On an autoscaling cluster the GPUs do not exist yet when the job starts (`cluster.yaml`'s
GPU node types have `min_workers: 0`), so what the cluster holds now says nothing; what
matters is whether some node the cluster has or could add fits a group (`actors.capacity`):
- node types an autoscaler publishes in the GCS (autoscaler v2, KubeRay) and the alive nodes;
- with Ray's v1 autoscaler (`ray up`), which publishes no node types, nothing is known up
  front: placement waits up to its timeout, and its progress names what the autoscaler
  is launching;
- without an autoscaler, the alive nodes are all there will be.

Each group is named after the driver actor that asked for it (`rrfp-placement-<actor id>: stage 0`):
a group created inside an actor lives as long as its job, not its creator, so when a driver
actor is killed its groups stay, holding their CPUs, until `remove_orphans` frees them.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import ray
import ray._private.state
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray._private import state  # the GCS's view of an actor: whether a group's owner is dead
from ray.experimental import internal_kv
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from actors.capacity import CapacityError, Demand, check_capacity, stage_bundle
from rrfp_ray.errors import PlacementError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0  # a cloud GPU node takes minutes to boot and run its setup commands
_PROGRESS_S = 15.0  # between progress messages
_AUTOSCALER_STATUS_KEY = "__autoscaling_status"  # what Ray's v1 autoscaler reports each round (`ray status` reads it)
_NAME = "rrfp-placement-"  # + "<owner actor id>: <label>"


class StagePlacement(BaseModel):
    """What every stage actor's bundle asks for, and how long placement may wait."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpus_per_stage: float = Field(0.0, ge=0, description="GPUs per stage actor; a fraction shares one GPU")
    resources: dict[str, float] = Field(
        default_factory=dict, description="extra Ray resources per stage, e.g. {'accelerator_type:A10G': 0.001}"
    )
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0, description="seconds placement may wait for nodes")

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{name!r}: every stage asks 1 CPU, and GPUs come from gpus_per_stage")
            if not amount > 0:
                raise ValueError(f"{name!r}: amounts must be > 0, got {amount:g}")
        return value

    def demand(self, *, dp: int, stages: int, tp: int) -> Demand:
        return Demand(
            bundle=stage_bundle(gpus=self.gpus_per_stage, resources=self.resources), dp=dp, stages=stages, tp=tp
        )


def check(demand: Demand) -> None:
    """A CapacityError at once when the cluster can never hold `demand` (what it knows of the
    nodes it has or could add says so); nothing when an autoscaler says nothing of what it can add."""
    nodes = ray.nodes()
    alive = [dict(node["Resources"]) for node in nodes if node["Alive"]]
    node_types = _published_node_types()
    if node_types is not None:
        check_capacity(
            demand=demand,
            nodes=alive + node_types,
            grows=True,
            source="the alive nodes and the autoscaler's node types",
        )
    elif _v1_autoscaler_status(nodes=nodes) is None:
        check_capacity(demand=demand, nodes=alive, grows=False, source="the alive nodes (no autoscaler runs)")


def place(*, demand: Demand, timeout_s: float, labels: list[str]) -> list[PlacementGroup]:
    """Ask for every (replica, stage) group (`labels` name them) and wait until all are placed,
    logging progress that names the pending demand; a `PlacementError` after `timeout_s`, a
    `CapacityError` at once when they can never be held. Called in an actor, the groups carry
    its id in their names (`remove_orphans`)."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s:g}")
    check(demand)
    owner = ray.get_runtime_context().get_actor_id()  # None in a job's own driver process: its groups end with it
    # a stage's T ranks on one node (their all-reduces run every layer); stages and replicas free to spread
    groups = [
        placement_group(
            [dict(demand.bundle)] * demand.tp, strategy="STRICT_PACK", name=f"{_NAME}{owner}: {label}" if owner else ""
        )
        for _, label in zip(range(demand.groups), labels, strict=True)
    ]
    logger.info("waiting up to %.0f s for placement: %s", timeout_s, demand)
    started = time.monotonic()
    try:
        pending = {group.ready(): label for group, label in zip(groups, labels)}
        while pending:
            left = timeout_s - (time.monotonic() - started)
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=max(0.0, min(_PROGRESS_S, left)))
            for ref in ready:
                del pending[ref]
            if not pending:
                break
            waited = time.monotonic() - started
            line = progress(groups=groups, demand=demand, pending=list(pending.values()))
            if waited >= timeout_s:
                raise PlacementError(f"placement timed out after {timeout_s:g} s {line}")
            logger.warning("after %.0f s %s", waited, line)
    except BaseException:
        for group in groups:
            remove_placement_group(group)
        raise
    logger.info("placement ready in %.1f s: %s", time.monotonic() - started, demand)
    return groups


def can_place(*, demand: Demand, timeout_s: float) -> bool:
    """Whether the cluster holds `demand`'s groups within `timeout_s`: they are asked for (so an
    autoscaler sees the demand and may start adding nodes for it) and removed again either way."""
    try:
        check(demand)
    except CapacityError:
        return False
    groups = [placement_group([dict(demand.bundle)] * demand.tp, strategy="STRICT_PACK") for _ in range(demand.groups)]
    try:
        ready, _ = ray.wait([group.ready() for group in groups], num_returns=len(groups), timeout=timeout_s)
        return len(ready) == len(groups)
    finally:
        for group in groups:
            remove_placement_group(group)


def remove_orphans() -> list[str]:
    """Remove every placement group of this job whose owner actor is dead (killed before its
    teardown ran); returns their names. The groups of live drivers are left alone."""
    job = ray.get_runtime_context().get_job_id()
    removed = []
    for group_id, group in placement_group_table().items():
        name = group["name"]
        if group["state"] == "REMOVED" or not name.startswith(_NAME):
            continue
        owner = name.removeprefix(_NAME).split(":")[0]
        # an owner the GCS no longer knows has long been dead
        if (
            ray.ActorID.from_hex(owner).job_id.hex() != job
            or state.actors(actor_id=owner).get("State", "DEAD") != "DEAD"
        ):
            continue
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
        removed.append(name)
    if removed:
        logger.info("removed %d placement groups of dead drivers: %s", len(removed), ", ".join(removed))
    return removed


def progress(*, groups: list[PlacementGroup], demand: Demand, pending: list[str]) -> str:
    """`waiting for 8 x {CPU: 1, GPU: 1}: 3 placed (pending: stage 1, ...); the autoscaler is adding ...; see ray
    status`."""
    placed = sum(
        1 for group in groups for node in placement_group_table(group).get("bundles_to_node_id", {}).values() if node
    )
    line = f"waiting for {demand}: {placed} placed (pending: {', '.join(pending)})"
    status = _v1_autoscaler_status(nodes=ray.nodes())
    if status is not None:
        report = status.get("autoscaler_report") or {}
        launching = report.get("pending_launches") or {}
        booting = [node_type for _, node_type, _ in report.get("pending_nodes") or []]
        if launching or booting:
            counts = {t: launching.get(t, 0) + booting.count(t) for t in {*launching, *booting}}
            line += "; the autoscaler is adding " + ", ".join(f"{n} x {t}" for t, n in sorted(counts.items()))
        else:
            line += "; the autoscaler is adding no node for it (no node type fits, or max_workers is reached)"
    return line + "; see ray status"


def _published_node_types() -> list[dict[str, float]] | None:
    """Node types with room to add a node, as an autoscaler publishes them in the GCS (v2 and KubeRay do)."""
    config = ray._private.state.state.get_cluster_config()  # Ray 2.60: a ClusterConfig proto, or None
    if config is None or not config.node_group_configs:
        return None
    return [dict(group.resources) for group in config.node_group_configs if group.max_count != 0]


def _v1_autoscaler_status(*, nodes: list[dict]) -> dict[str, Any] | None:
    """The v1 autoscaler's last report, if one runs that can add nodes. Every Ray head runs
    the v1 monitor; without an autoscaling config it only reads, and its node types are the
    alive nodes' own (`node_<id>`)."""
    raw = internal_kv._internal_kv_get(_AUTOSCALER_STATUS_KEY)
    if raw is None:
        return None
    status = json.loads(raw)
    report = status.get("autoscaler_report") or {}
    types = {*(report.get("active_nodes") or {}), *(report.get("pending_launches") or {})}
    types |= set((report.get("node_type_mapping") or {}).values())
    readonly = {f"node_{node['NodeID']}" for node in nodes}
    return status if types - readonly else None
