"""All stages of a pipeline in one process, one thread per stage (per TP rank), over in-memory channels.

Same stage hosts, workers, arbiters, telemetry and orchestration (`rrfp_ray.runtime.group`) as
on Ray; for tests and debugging. `ThreadFabric` is the in-process `Fabric`, `ThreadStage` its
`StageHandle`; `rrfp_ray.train.backend.LocalBackend` runs the `StageGroup` over them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from rrfp_ray.runtime.executor import Workload
from rrfp_ray.runtime.host import GroupSums, RoundCollectives, StageHost, TensorSum, tie_sum
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.mesh import Mesh
from rrfp_ray.runtime.reduce import DPSpec
from rrfp_ray.runtime.thread_collectives import ThreadAllGather, ThreadAllReduce, tensor_all_reduce, tensor_reduce_to
from rrfp_ray.runtime.transport import Channel, local_channels
from rrfp_ray.runtime.waits import Outcome, wait_named
from rrfp_ray.schedule.layout import Layout

logger = logging.getLogger(__name__)


@dataclass
class _Round:
    """What the workers of one iteration share: the float all-reduce of the optimizer step and
    each stage's TP agreement all-gather (fresh each iteration: a failed one leaves them broken)."""

    all_reduce: ThreadAllReduce
    agree: list[ThreadAllGather]  # per TP group (`Mesh.tp_groups`)
    joined: set[int] = field(default_factory=set)


class ThreadStage:
    """One stage (one TP rank of it, in one DP replica) as a `StageHandle`: its host's calls run in
    order on a thread of its own and return futures."""

    def __init__(self, *, host: StageHost, fabric: ThreadFabric) -> None:
        self.host = host
        self.label = host.label
        self._fabric = fabric
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=host.label)

    def set_workload(self, *, workload: Workload, layout: Layout) -> Future:
        """Built at once in the caller's thread: models built in parallel threads would race for torch's global RNG."""
        done: Future = Future()
        try:
            self.host.set_workload(workload=workload, layout=layout)
            done.set_result(None)
        except Exception as error:  # reported by the fabric's wait, naming this stage
            done.set_exception(error)
        return done

    def run_iteration(self, *, args: IterationArgs) -> Future:
        collectives = self._fabric.join_round(self.host.index)
        return self._thread.submit(self.host.run_iteration, args=args, collectives=collectives)

    def evaluate(self, *, chunk: int, inputs: Future | None, index: int) -> Future:
        def forward() -> Tensor:
            given = None if inputs is None else inputs.result(timeout=self.host.worker.timeout_s)
            return self.host.evaluate(chunk=chunk, inputs=given, index=index)

        return self._thread.submit(forward)

    def save(self, *, directory: str, iteration: int) -> Future:
        return self._thread.submit(self.host.save, directory=directory, iteration=iteration)

    def load(self, *, directory: str, manifest: Any) -> Future:
        return self._thread.submit(self.host.load, directory=directory, manifest=manifest)

    def chunk_states(self) -> Future:
        return self._thread.submit(self.host.chunk_states)

    def close(self) -> None:
        self.host.close()
        self._thread.shutdown(wait=True)


class ThreadFabric:
    """The in-process `Fabric`: a thread per actor of `mesh`; rank t of a stage talks to rank t of its
    neighbours; `k`: ops each rank offers per agreement round (`TPContext.k`). With `dp`, the actors
    of one (stage, TP rank) sum their gradients. `wrap(rank, channel)` wraps every inbound channel of
    TP rank `rank` (tests delay one rank's receives with it)."""

    def __init__(
        self,
        *,
        layout: Layout,
        mesh: Mesh,
        timeout_s: float = 60.0,
        link_timeout_s: float = 600.0,
        k: int = 4,
        wrap: Callable[[int, Channel], Channel] | None = None,
        dp: DPSpec | None = None,
    ) -> None:
        if mesh.dp != (1 if dp is None else dp.size):
            raise ValueError(f"the mesh has {mesh.dp} replicas, data parallelism {dp}")
        self.layout = layout
        self.mesh = mesh
        self.dp = dp
        self.timeout_s = timeout_s
        self.link_timeout_s = link_timeout_s
        self.k = k
        self.wrap = wrap
        self.handles: list[ThreadStage] = []
        self._tp_gathers: list[ThreadAllGather] = []
        self._round: _Round | None = None
        self._lock = threading.Lock()

    def start(self) -> list[ThreadStage]:
        mesh, layout = self.mesh, self.layout
        channels = {
            (d, t): local_channels(layout=layout, timeout_s=self.link_timeout_s)
            for d in range(mesh.dp)
            for t in range(mesh.tp)
        }
        self._tp_gathers = self._tp_groups("the TP all-reduce")
        dp_gathers = [
            self._gather(members, name=f"the DP reduction of {mesh.name(stage=c.stage, rank=c.rank)}", by="replica")
            for members in (mesh.dp_groups() if self.dp is not None else [])
            for c in [mesh.coord(members[0])]
        ]
        tie_gathers = {
            (owners, t, d): self._gather(
                members, name=f"the tied-weight all-reduce of {mesh.label(members[0])}", by="stage"
            )
            for (owners, t, d), members in mesh.tie_groups().items()
        }
        self._round = None
        wrap = self.wrap or (lambda _, channel: channel)
        self.handles = []
        for i in range(mesh.size):
            replica, stage, rank = mesh.coord(i)
            links = channels[replica, rank]
            dp_sum = dp_reduce_to = None
            if self.dp is not None:
                member = dp_gathers[mesh.dp_group(i)].member(replica)
                dp_sum, dp_reduce_to = tensor_all_reduce(member), tensor_reduce_to(member, rank=replica)
            sums = {
                owners: tensor_all_reduce(group.member(owners.index(stage)))
                for (owners, t, d), group in tie_gathers.items()
                if (t, d) == (rank, replica) and stage in owners
            }
            groups = GroupSums(
                tp_sum=self.tp_sum(i) if mesh.tp > 1 else None,
                dp_sum=dp_sum,
                dp_reduce_to=dp_reduce_to,
                tie_sum=tie_sum(sums, label=mesh.label(i)) if mesh.ties else None,
            )
            host = StageHost(
                mesh=mesh,
                index=i,
                inbound={link: wrap(rank, ch) for link, ch in links.items() if link.dst == stage},
                outbound={link: ch for link, ch in links.items() if link.src == stage},
                groups=groups,
                chunks=layout.chunks,
                timeout_s=self.timeout_s,
                dp=self.dp,
                k=self.k,
            )
            self.handles.append(ThreadStage(host=host, fabric=self))
        logger.info(
            "%d stage threads up (%d replicas x %d stages x %d TP ranks)", mesh.size, mesh.dp, mesh.stages, mesh.tp
        )
        return list(self.handles)

    def wait(self, pending: list[Future], *, labels: list[str], what: str) -> list:
        wait_named(
            pending,
            labels=labels,
            what=what,
            timeout_s=self.timeout_s,
            wait_some=lambda left, timeout: wait_futures(left, timeout=timeout, return_when=FIRST_COMPLETED).done,
            outcome=_outcome,
        )
        return [future.result() for future in pending]

    def stop(self, *, graceful: bool) -> None:
        """All at once (a worker's receive threads end on its neighbours' STOP); the threads end either
        way: after a failure, on broken links, within their timeout."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.handles))) as pool:
            list(pool.map(ThreadStage.close, self.handles))
        self.handles = []

    def tp_sum(self, index: int) -> TensorSum:
        """The tensor sum over the TP group of actor `index`, as it calls it (for `rrfp_ray.models.tp`)."""
        return tensor_all_reduce(self._tp_gathers[self.mesh.tp_group(index)].member(self.mesh.coord(index).rank))

    def join_round(self, index: int) -> RoundCollectives:
        """The collectives of the iteration actor `index` is starting: an actor asking again opens the next round."""
        with self._lock:
            if self._round is None or index in self._round.joined:
                self._round = _Round(
                    all_reduce=ThreadAllReduce(parties=self.mesh.size, timeout_s=self.timeout_s),
                    agree=self._tp_groups("the TP agreement"),
                )
            self._round.joined.add(index)
            shared = self._round
        gather = shared.agree[self.mesh.tp_group(index)].member(self.mesh.coord(index).rank) if shared.agree else None
        return RoundCollectives(all_reduce=shared.all_reduce, tp_all_gather=gather)

    def _tp_groups(self, what: str) -> list[ThreadAllGather]:
        """An all-gather per TP group (none without TP)."""
        mesh = self.mesh
        return [
            self._gather(members, name=f"{what} of {mesh.name(stage=c.stage, replica=c.replica)}", by="rank")
            for members in (mesh.tp_groups() if mesh.tp > 1 else [])
            for c in [mesh.coord(members[0])]
        ]

    def _gather(self, members: tuple[int, ...], *, name: str, by: str) -> ThreadAllGather:
        """Its members labelled `by` what tells them apart: their TP rank, replica or stage."""
        word = {"rank": "TP rank", "replica": "replica", "stage": "stage"}[by]
        labels = [f"{word} {getattr(self.mesh.coord(i), by)}" for i in members]
        return ThreadAllGather(parties=len(members), timeout_s=self.timeout_s, name=name, labels=labels)


def _outcome(future: Future) -> Outcome | None:
    error = future.exception()
    return None if error is None else Outcome(died=False, error=str(error) or type(error).__name__, cause=error)
