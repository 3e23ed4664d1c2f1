"""One stage (one TP rank of it, in one replica) built in one place for either fabric: its
workload wrapped for TP, DP and tied weights, its gradient reducer, its worker on its links.

The fabrics differ only in how a stage is hosted (a thread in-process, a stage actor on Ray)
and how its groups are made: each hands the host the links and `GroupSums` it made, and each
iteration the `RoundCollectives` of that iteration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor

from rrfp_ray.observe.telemetry import OpEvent, StageStats
from rrfp_ray.policy.agreement import TPContext
from rrfp_ray.runtime.executor import Executor, Workload
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.mesh import Mesh
from rrfp_ray.runtime.reduce import DPContext, DPSpec, GradReducer
from rrfp_ray.runtime.transport import Channel
from rrfp_ray.runtime.worker import StageWorker
from rrfp_ray.schedule.grad_ready import reduce_order
from rrfp_ray.schedule.layout import Layout, Link

logger = logging.getLogger(__name__)

TensorSum = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class GroupSums:
    """The groups a fabric made for one actor, each a sum over its members (None where the mesh has none)."""

    tp_sum: TensorSum | None = None  # over its stage's TP ranks (the TP layers')
    dp_sum: TensorSum | None = None  # over its (stage, TP rank) in every replica (the gradients')
    dp_reduce_to: Callable[[Tensor, int], Tensor | None] | None = None  # ZeRO-1: the DP sum at one replica alone
    tie_sum: Callable[[tuple[int, ...], Tensor], Tensor] | None = None  # over the stages of a tie (`Mesh.ties`)


@dataclass(frozen=True)
class RoundCollectives:
    """The collectives one iteration's workers share (in-process they are fresh every iteration)."""

    all_reduce: Callable[[float], float]  # a float's sum over every actor (the optimizer step's)
    tp_all_gather: Callable[[list[int]], list[list[int]]] | None = None  # the TP agreement's, in rank order


def tie_sum(sums: Mapping[tuple[int, ...], TensorSum], *, label: str) -> Callable[[tuple[int, ...], Tensor], Tensor]:
    """`GroupSums.tie_sum` over one sum per tie (its owning stages) that actor `label` is in."""

    def total(owners: tuple[int, ...], tensor: Tensor) -> Tensor:
        if owners not in sums:
            raise RuntimeError(f"{label}: no group for the tie of stages {owners} (it has {sorted(sums)})")
        return sums[owners](tensor)

    return total


class StageHost:
    """Actor `index` of `mesh`: `chunks` its layout's chunks (the DP reduction's order), `k` the ops each
    TP rank offers per agreement round; `profile` wraps the executor for each iteration's arguments (e.g. spans
    on a timeline naming its policy)."""

    def __init__(
        self,
        *,
        mesh: Mesh,
        index: int,
        inbound: dict[Link, Channel],
        outbound: dict[Link, Channel],
        groups: GroupSums,
        chunks: int,
        timeout_s: float,
        dp: DPSpec | None = None,
        k: int = 4,
        profile: Callable[[Executor, IterationArgs], Executor] | None = None,
    ) -> None:
        self.mesh = mesh
        self.index = index
        self.coord = mesh.coord(index)
        self.label = mesh.label(index)
        self.groups = groups
        self.executor: Executor | None = None
        self.latency: Callable | None = None
        self._k = k
        self._profile = profile
        self._dp: DPContext | None = None
        if dp is not None:
            if groups.dp_sum is None:
                raise ValueError(f"{self.label}: data parallelism without a DP group")
            reducer = GradReducer(
                all_reduce=groups.dp_sum,
                reduce_to=groups.dp_reduce_to if dp.zero else None,
                order=reduce_order(chunks=chunks),
                bucket_bytes=dp.bucket_bytes,
                timeout_s=timeout_s,
                name=self.label,
            )
            self._dp = DPContext(reducer=reducer, overlap=dp.overlap, zero_sum=groups.dp_sum if dp.zero else None)
        self.worker = StageWorker(stage=self.coord.stage, inbound=inbound, outbound=outbound, timeout_s=timeout_s)

    def set_workload(self, *, workload: Workload, layout: Layout) -> None:
        """The workload as this actor runs it: its TP rank's share, its replica's data, its ties summed."""
        replica, stage, rank = self.coord
        if self.mesh.tp > 1:
            workload = workload.with_tp(rank=rank, size=self.mesh.tp, all_reduce=self._needs(self.groups.tp_sum))
        if self._dp is not None:
            workload = workload.with_dp(rank=replica, zero_sum=self._dp.zero_sum)
        if workload.ties:  # parameters shared between stages (`rrfp_ray.train.ties`)
            workload = workload.with_ties(reduce=self._needs(self.groups.tie_sum))
        executor = workload.executor(stage=stage, layout=layout)
        self.executor = executor
        self.latency = workload.latency

    def run_iteration(self, *, args: IterationArgs, collectives: RoundCollectives) -> tuple[list[OpEvent], StageStats]:
        tp = None
        if self.mesh.tp > 1:
            tp = TPContext(
                rank=self.coord.rank,
                size=self.mesh.tp,
                all_gather=self._needs(collectives.tp_all_gather),
                all_reduce=self._needs(self.groups.tp_sum),
                protocol=args.tp_protocol,
                k=self._k,
            )
        executor = self._executor()
        events, stats = self.worker.run_iteration(
            args=args,
            executor=executor if self._profile is None else self._profile(executor, args),
            latency=None if self.latency is None else partial(self.latency, iteration=args.iteration),
            all_reduce=collectives.all_reduce,
            tp=tp,
            dp=self._dp,
        )
        stats.replica = self.coord.replica
        return events, stats

    def evaluate(self, *, chunk: int, inputs: Tensor | None, index: int) -> Tensor:
        return self._executor().evaluate(chunk=chunk, inputs=inputs, index=index)

    def save(self, *, directory: str, iteration: int) -> Any:
        return self._executor().save(directory=Path(directory), iteration=iteration, shard=self.index)

    def load(self, *, directory: str, manifest: Any) -> None:
        self._executor().load(directory=Path(directory), manifest=manifest)

    def chunk_states(self) -> dict[int, dict[str, Tensor]]:
        return self._executor().chunk_states()

    def close(self) -> None:
        self.worker.close()
        if self._dp is not None:
            self._dp.reducer.close()

    def _executor(self) -> Executor:
        if self.executor is None:
            raise RuntimeError(f"{self.label}: no workload yet (set_workload first)")
        return self.executor

    def _needs(self, group: Any) -> Any:
        if group is None:
            raise RuntimeError(f"{self.label}: the fabric made no group for it (mesh {self.mesh})")
        return group
