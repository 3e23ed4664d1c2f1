"""A pipeline stage as a Ray actor (a thin shell around `StageWorker`), and its `StageHandle`
face for the driver's `StageGroup`."""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from actors import collective, nccl_channel
from actors.dashboard import ProfiledExecutor, StageMetrics
from rrfp_ray.observe.telemetry import OpEvent, StageStats
from rrfp_ray.runtime.executor import Workload
from rrfp_ray.runtime.host import GroupSums, RoundCollectives, StageHost, tie_sum
from rrfp_ray.runtime.interval import STAGE_INTERVAL_S
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.mesh import Mesh
from rrfp_ray.runtime.reduce import DPSpec
from rrfp_ray.runtime.tcp_channel import TcpLinks
from rrfp_ray.runtime.tcp_gather import TcpGather
from rrfp_ray.runtime.tcp_pair import Secret
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.schedule.layout import Layout, Link
from rrfp_ray.train.checkpoint import Manifest, StageFile

logger = logging.getLogger(__name__)

# In the stage actors' own runtime env, whatever the job's: RAY_PROFILING puts their op spans on
# the Ray timeline (the dashboard's Task Timeline) however the cluster was started.
STAGE_ENV = {"RAY_PROFILING": "1"}


@ray.remote
class StageActor:
    """Actor `index` of `mesh` (with `dp`, its data parallelism), hosting its `StageHost` once `connect` made its
    groups."""

    def __init__(
        self,
        *,
        mesh: Mesh,
        index: int,
        timeout_s: float,
        link_timeout_s: float,
        dp: DPSpec | None = None,
        layout: Layout | None = None,
    ) -> None:
        torch.set_num_threads(1)
        sys.setswitchinterval(STAGE_INTERVAL_S)  # for the process's life (`rrfp_ray.runtime.interval`)
        collective.register_backends()
        self.mesh = mesh
        self.index = index
        self.replica, self.stage, self.tp_rank = mesh.coord(index)
        self.label = mesh.label(index)
        self.layout = layout  # for __repr__; set_workload brings the one it runs
        self._dp_spec = dp
        self._tp_group: str | None = None
        self._agreement: TcpGather | None = None  # None with --tp-gather collective
        self._tcp_links: TcpLinks | None = None  # None unless the links are TCP
        self._group_device = "cpu"
        self.timeout_s = timeout_s
        self.link_timeout_s = link_timeout_s
        self._host: StageHost | None = None
        self._everyone = ""
        self._metrics = StageMetrics(stage=self.stage)
        # The TP, tie and all-stages groups' collectives: on the compute thread only (a DP group's
        # on the reduction thread, its only user).
        self._compute_thread = nccl_channel.OneThread(what=f"{self.label}: the TP, tie and all-stages groups")
        logger.info("%s of %s: actor started", self.label, mesh)

    def resolve_transport(self, *, transport: LinkTransport) -> LinkTransport:
        """What carries the links, as this actor sees it, where its GPU (if any) is visible."""
        try:
            return collective.resolve_transport(transport=transport)
        except RuntimeError as error:
            raise RuntimeError(f"{self.label}: {error}") from None

    def host_group(self, *, name: str) -> str:
        return collective.host_group(name=name)

    def join_group(self, *, name: str, address: str, rank: int, world_size: int, library: LinkTransport) -> None:
        """Join collective group `name` over `library` (gloo or NCCL: `collective.group_library`)."""
        self._group_device = "cuda" if library is LinkTransport.NCCL else "cpu"  # where the groups' tensors live
        collective.join_group(
            name=name, address=address, rank=rank, world_size=world_size, library=library, timeout_s=self.timeout_s
        )

    def listen_agreement(self, *, secret: Secret) -> str:
        """Open this TP rank's end of its stage's agreement connections, admitting only ranks
        that hold `secret`; returns its address."""
        self._agreement = TcpGather(
            rank=self.tp_rank,
            size=self.mesh.tp,
            host=ray.util.get_node_ip_address(),
            secret=secret,
            timeout_s=self.timeout_s,
        )
        return self._agreement.address

    def listen_links(self, *, links: list[Link], secret: Secret) -> dict[Link, str]:
        """With TCP links: listen for the senders of this actor's inbound `links`, admitting only
        holders of `secret`; where each dials."""
        self._tcp_links = TcpLinks(
            inbound=links,
            host=ray.util.get_node_ip_address(),
            secret=secret,
            timeout_s=self.timeout_s,
            link_timeout_s=self.link_timeout_s,
        )
        return self._tcp_links.addresses

    def connect(
        self,
        *,
        groups: dict[Link, str],
        everyone: str,
        tp_group: str | None,
        agreement: list[str] | None,
        dp_group: str | None = None,
        chunks: int = 1,
        tie_groups: dict[tuple[int, ...], str] | None = None,
        tcp_links: dict[Link, str] | None = None,
    ) -> None:
        """Open a channel on every link this stage sends or receives on (over its 2-rank group in
        `groups`, or with TCP links, dialing each outbound link's receiver at its `tcp_links`
        address while accepting the inbound ones) and, with TP, the agreement connections to the
        other ranks (`agreement`: every rank's address); with DP, the gradient reduction over
        `dp_group` (its `chunks` in the replicas' common order); start the stage host's threads."""

        def channel(link: Link) -> collective.Channel:
            peer = 1 if link.src == self.stage else 0
            return collective.Channel(group=groups[link], peer=peer, timeout_s=self.link_timeout_s, name=str(link))

        self._everyone = everyone
        self._tp_group = tp_group
        if agreement is not None:
            if self._agreement is None:
                raise RuntimeError(f"{self.label}: connect() with agreement addresses before listen_agreement()")
            self._agreement.connect(addresses=agreement)
        if dp_group is not None and self._dp_spec is None:
            raise RuntimeError(f"{self.label}: a DP group given to an actor started without dp")
        if tcp_links and self._tcp_links is None:
            raise RuntimeError(f"{self.label}: connect() with TCP link addresses before listen_links()")
        if self._tcp_links is not None:
            inbound, outbound = self._tcp_links.connect(outbound=tcp_links or {})
        else:
            inbound = {link: channel(link) for link in groups if link.dst == self.stage}
            outbound = {link: channel(link) for link in groups if link.src == self.stage}
        sums = {owners: functools.partial(self._tie_sum, group=name) for owners, name in (tie_groups or {}).items()}
        self._host = StageHost(
            mesh=self.mesh,
            index=self.index,
            inbound=inbound,
            outbound=outbound,
            groups=GroupSums(
                tp_sum=None if tp_group is None else self._tp_all_reduce,
                dp_sum=None if dp_group is None else functools.partial(_group_sum, group=dp_group),
                dp_reduce_to=None if dp_group is None else functools.partial(_reduce_to, group=dp_group),
                tie_sum=tie_sum(sums, label=self.label) if self.mesh.ties else None,
            ),
            chunks=chunks,
            timeout_s=self.timeout_s,
            dp=self._dp_spec,
            profile=lambda executor, args: ProfiledExecutor(executor, stage=self.stage, policy=args.policy.name),
        )

    def set_workload(self, *, workload: Workload, layout: Layout) -> None:
        self._hosted().set_workload(workload=workload, layout=layout)

    def run_iteration(self, *, args: IterationArgs) -> tuple[list[OpEvent], StageStats]:
        gather = None
        if self._tp_group is not None:
            gather = self._agreement.all_gather if self._agreement is not None else self._tp_all_gather
        collectives = RoundCollectives(all_reduce=self._all_reduce, tp_all_gather=gather)
        events, stats = self._hosted().run_iteration(args=args, collectives=collectives)
        self._metrics.record(stats)
        return events, stats

    def _hosted(self) -> StageHost:
        if self._host is None:
            raise RuntimeError(f"{self.label}: called before connect()")
        return self._host

    def _all_reduce(self, value: float) -> float:
        self._compute_thread.check()
        tensor = torch.tensor([value], dtype=torch.float64)
        collective.all_reduce_sum(group=self._everyone, tensor=tensor)
        return float(tensor)

    def _tie_sum(self, tensor: torch.Tensor, *, group: str) -> torch.Tensor:
        self._compute_thread.check()
        return _group_sum(tensor, group=group)

    def _tp_all_gather(self, values: list[int]) -> list[list[int]]:
        """The agreement's all-gather over the stage's TP group (`--tp-gather collective`)."""
        self._compute_thread.check()
        return collective.all_gather_ints(group=self._tp_group, values=values, device=self._group_device)

    def _tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._compute_thread.check()
        return _group_sum(tensor, group=self._tp_group)

    def evaluate(self, *, chunk: int, inputs: torch.Tensor | None, index: int) -> torch.Tensor:
        return self._hosted().evaluate(chunk=chunk, inputs=inputs, index=index)

    def save(self, *, directory: str, iteration: int) -> StageFile:
        return self._hosted().save(directory=directory, iteration=iteration)

    def chunk_states(self) -> dict[int, dict[str, torch.Tensor]]:
        return self._hosted().chunk_states()

    def load(self, *, directory: str, manifest: Manifest) -> None:
        self._hosted().load(directory=directory, manifest=manifest)

    def rss_bytes(self) -> int:
        """This actor process's resident memory."""
        return rss_bytes()

    def ping(self) -> int:
        return self.stage

    def process(self) -> tuple[str, int]:
        """This actor's id and pid (the driver names a dead stage's process)."""
        return ray.get_runtime_context().get_actor_id(), os.getpid()

    def __repr__(self) -> str:
        """The dashboard's Repr column: which stage, which layers (virtual stages), which TP rank."""
        text = f"StageActor(stage {self.stage}"
        if self.layout is not None:
            chunks = [vs for vs in range(self.layout.virtual_stages) if self.layout.locate(vs)[0] == self.stage]
            text += f" of {self.layout.stages}, virtual stages {', '.join(map(str, chunks))}"
        if self.mesh.tp > 1:
            text += f", TP rank {self.tp_rank} of {self.mesh.tp}"
        if self._dp_spec is not None:
            text += f", DP replica {self.replica}"
        return text + ")"

    def listening(self) -> tuple[int, list[str]]:
        """This actor's process id and the addresses its process listens on (Ray's own among them)."""
        import psutil  # Ray vendors it; importable once ray is imported

        process = psutil.Process()
        sockets = process.net_connections(kind="tcp")
        return process.pid, sorted(f"{s.laddr.ip}:{s.laddr.port}" for s in sockets if s.status == psutil.CONN_LISTEN)

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
        if self._tcp_links is not None:
            self._tcp_links.close()
            self._tcp_links = None
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None


@dataclass(frozen=True)
class RayStageHandle:
    """A stage actor as the group's `StageHandle`: every call returns its ObjectRef; the fabric
    (`actors.driver.RayFabric`) waits on them."""

    actor: ray.actor.ActorHandle
    label: str

    def set_workload(self, *, workload: Workload, layout: Layout) -> ray.ObjectRef:
        return self.actor.set_workload.remote(workload=workload, layout=layout)

    def run_iteration(self, *, args: IterationArgs) -> ray.ObjectRef:
        return self.actor.run_iteration.remote(args=args)

    def evaluate(self, *, chunk: int, inputs: ray.ObjectRef | None, index: int) -> ray.ObjectRef:
        """`inputs` travels as a ref: Ray hands the previous stage's output to this actor directly."""
        return self.actor.evaluate.remote(chunk=chunk, inputs=inputs, index=index)

    def save(self, *, directory: str, iteration: int) -> ray.ObjectRef:
        return self.actor.save.remote(directory=directory, iteration=iteration)

    def load(self, *, directory: str, manifest: Any) -> ray.ObjectRef:
        return self.actor.load.remote(directory=directory, manifest=manifest)

    def chunk_states(self) -> ray.ObjectRef:
        return self.actor.chunk_states.remote()


def _group_sum(tensor: torch.Tensor, *, group: str) -> torch.Tensor:
    total = tensor.detach().clone()
    collective.all_reduce_sum(group=group, tensor=total)
    return total


def _reduce_to(tensor: torch.Tensor, dst: int, *, group: str) -> torch.Tensor | None:
    total = tensor.detach().clone()
    return total if collective.reduce_sum(group=group, tensor=total, dst=dst) else None


def rss_bytes() -> int:
    """This process's resident memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (not Linux?)")
