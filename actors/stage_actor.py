"""A pipeline stage as a Ray actor (a thin shell around `StageWorker`), and its `StageHandle`
face for the driver's `StageGroup`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from actors import collective, nccl_channel
from actors.dashboard import ProfiledExecutor, StageMetrics
from rrfp_ray.observe.telemetry import OpEvent, StageStats
from rrfp_ray.policy.agreement import TPContext, TPProtocol
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import Policy
from rrfp_ray.runtime.executor import Executor, Workload
from rrfp_ray.runtime.reduce import DPContext, DPSpec, GradReducer
from rrfp_ray.runtime.tcp_channel import TcpLinks
from rrfp_ray.runtime.tcp_gather import TcpGather
from rrfp_ray.runtime.tcp_pair import Secret
from rrfp_ray.runtime.transport import LinkBackend
from rrfp_ray.runtime.worker import StageWorker
from rrfp_ray.schedule.deps import Layout, Link
from rrfp_ray.schedule.grad_ready import reduce_order
from rrfp_ray.train.checkpoint import StageFile

logger = logging.getLogger(__name__)

# In the stage actors' own runtime env, whatever the job's: RAY_PROFILING puts their op spans on
# the Ray timeline (the dashboard's Task Timeline) however the cluster was started.
STAGE_ENV = {"RAY_PROFILING": "1"}


@ray.remote
class StageActor:
    def __init__(
        self,
        *,
        stage: int,
        tp_rank: int,
        tp_size: int,
        timeout_s: float,
        link_timeout_s: float,
        replica: int = 0,
        index: int | None = None,
        dp: DPSpec | None = None,
        layout: Layout | None = None,
    ) -> None:
        torch.set_num_threads(1)
        collective.register_backends()
        self.stage = stage
        self.layout = layout  # for __repr__; set_workload brings the one it runs
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.replica = replica
        self.index = stage * tp_size + tp_rank if index is None else index  # (replica x stages + stage) x tp + rank
        self._dp_spec = dp
        self._dp: DPContext | None = None
        self._tp_group: str | None = None
        self._agreement: TcpGather | None = None  # None with --tp-gather collective
        self._tcp_links: TcpLinks | None = None  # None unless the links are TCP
        self._group_device = "cpu"
        self.timeout_s = timeout_s
        self.link_timeout_s = link_timeout_s
        self._worker: StageWorker | None = None
        self._workload: Workload | None = None
        self._executor: Executor | None = None
        self._everyone = ""
        self._tie_groups: dict[tuple[int, ...], str] = {}
        self._metrics = StageMetrics(stage=stage)
        # The TP, tie and all-stages groups' collectives: on the compute thread only (a DP group's
        # on the reduction thread, its only user).
        self._compute_thread = nccl_channel.OneThread(
            what=f"stage {stage} TP rank {tp_rank}: the TP, tie and all-stages groups"
        )
        logger.info("replica %d stage %d TP rank %d of %d: actor started", replica, stage, tp_rank, tp_size)

    def resolve_backend(self, *, backend: LinkBackend) -> LinkBackend:
        """The link backend as this actor sees it, where its GPU (if any) is visible."""
        try:
            return collective.resolve_backend(backend=backend)
        except RuntimeError as error:
            raise RuntimeError(f"stage {self.stage} TP rank {self.tp_rank}: {error}") from None

    def host_group(self, *, name: str) -> str:
        return collective.host_group(name=name)

    def join_group(self, *, name: str, address: str, rank: int, world_size: int, backend: LinkBackend) -> None:
        self._group_device = "cuda" if backend is LinkBackend.NCCL else "cpu"  # where the groups' tensors live
        collective.join_group(
            name=name, address=address, rank=rank, world_size=world_size, backend=backend, timeout_s=self.timeout_s
        )

    def listen_agreement(self, *, secret: Secret) -> str:
        """Open this TP rank's end of its stage's agreement connections, admitting only ranks
        that hold `secret`; returns its address."""
        self._agreement = TcpGather(
            rank=self.tp_rank,
            size=self.tp_size,
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
        `dp_group` (its `chunks` in the replicas' common order); start the threads."""

        def channel(link: Link) -> collective.Channel:
            peer = 1 if link.src == self.stage else 0
            return collective.Channel(group=groups[link], peer=peer, timeout_s=self.link_timeout_s, name=str(link))

        self._everyone = everyone
        self._tp_group = tp_group
        self._tie_groups = dict(tie_groups or {})
        if agreement is not None:
            if self._agreement is None:
                raise RuntimeError(f"stage {self.stage}: connect() with agreement addresses before listen_agreement()")
            self._agreement.connect(addresses=agreement)
        if dp_group is not None:
            if self._dp_spec is None:
                raise RuntimeError(f"stage {self.stage}: a DP group given to an actor started without dp")

            def group_sum(tensor: torch.Tensor) -> torch.Tensor:
                return self._group_sum(group=dp_group, tensor=tensor)

            def reduce_to(tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
                total = tensor.detach().clone()
                return total if collective.reduce_sum(group=dp_group, tensor=total, dst=dst) else None

            reducer = GradReducer(
                all_reduce=group_sum,
                reduce_to=reduce_to if self._dp_spec.zero else None,
                order=reduce_order(chunks=chunks),
                bucket_bytes=self._dp_spec.bucket_bytes,
                timeout_s=self.timeout_s,
                name=f"replica {self.replica} stage {self.stage} TP rank {self.tp_rank}",
            )
            zero_sum = group_sum if self._dp_spec.zero else None
            self._dp = DPContext(reducer=reducer, overlap=self._dp_spec.overlap, zero_sum=zero_sum)
        if tcp_links and self._tcp_links is None:
            raise RuntimeError(f"stage {self.stage}: connect() with TCP link addresses before listen_links()")
        if self._tcp_links is not None:
            inbound, outbound = self._tcp_links.connect(outbound=tcp_links or {})
        else:
            inbound = {link: channel(link) for link in groups if link.dst == self.stage}
            outbound = {link: channel(link) for link in groups if link.src == self.stage}
        self._worker = StageWorker(stage=self.stage, inbound=inbound, outbound=outbound, timeout_s=self.timeout_s)

    def set_workload(self, *, workload: Workload, layout: Layout) -> None:
        if self._tp_group is not None:
            workload = workload.with_tp(rank=self.tp_rank, size=self.tp_size, all_reduce=self._tp_all_reduce)
        if self._dp is not None:
            workload = workload.with_dp(rank=self.replica, zero_sum=self._dp.zero_sum)
        if getattr(workload, "ties", ()):
            workload = workload.with_ties(reduce=self._tie_reduce)
        self._workload = workload
        self._executor = workload.executor(stage=self.stage, layout=layout)

    def run_iteration(
        self, *, iteration: int, layout: Layout, policy: Policy, cap: Cap, buffer_limit: int, tp_protocol: TPProtocol
    ) -> tuple[list[OpEvent], StageStats]:
        if self._worker is None or self._workload is None or self._executor is None:
            raise RuntimeError(f"stage {self.stage}: run_iteration before connect() and set_workload()")
        events, stats = self._worker.run_iteration(
            iteration=iteration,
            layout=layout,
            policy=policy,
            cap=cap,
            executor=ProfiledExecutor(self._executor, stage=self.stage, policy=policy.name),
            buffer_limit=buffer_limit,
            latency=self._workload.latency,
            all_reduce=self._all_reduce,
            tp=None if self._tp_group is None else self._tp_context(protocol=tp_protocol),
            dp=self._dp,
        )
        stats.replica = self.replica
        self._metrics.record(stats)
        return events, stats

    def _all_reduce(self, value: float) -> float:
        self._compute_thread.check()
        tensor = torch.tensor([value], dtype=torch.float64)
        collective.all_reduce_sum(group=self._everyone, tensor=tensor)
        return float(tensor)

    def _tp_context(self, *, protocol: TPProtocol) -> TPContext:
        return TPContext(
            rank=self.tp_rank,
            size=self.tp_size,
            all_gather=self._agreement.all_gather if self._agreement is not None else self._tp_all_gather,
            all_reduce=self._tp_all_reduce,
            protocol=protocol,
        )

    def _tie_reduce(self, stages: tuple[int, ...], tensor: torch.Tensor) -> torch.Tensor:
        self._compute_thread.check()
        total = tensor.detach().clone()
        collective.all_reduce_sum(group=self._tie_groups[stages], tensor=total)
        return total

    def _tp_all_gather(self, values: list[int]) -> list[list[int]]:
        """The agreement's all-gather over the stage's TP group (`--tp-gather collective`)."""
        self._compute_thread.check()
        return collective.all_gather_ints(group=self._tp_group, values=values, device=self._group_device)

    def _tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._compute_thread.check()
        return self._group_sum(group=self._tp_group, tensor=tensor)

    @staticmethod
    def _group_sum(*, group: str, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.detach().clone()
        collective.all_reduce_sum(group=group, tensor=total)
        return total

    def evaluate(self, *, chunk: int, inputs: torch.Tensor | None, index: int) -> torch.Tensor:
        return self._executor.evaluate(chunk=chunk, inputs=inputs, index=index)

    def save(self, *, directory: str, iteration: int) -> StageFile:
        return self._executor.save(directory=Path(directory), iteration=iteration, shard=self.index)

    def chunk_states(self) -> dict[int, dict[str, torch.Tensor]]:
        return self._executor.chunk_states()

    def load(self, *, directory: str, file: StageFile) -> None:
        self._executor.load(directory=Path(directory), file=file)

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
        if self.tp_size > 1:
            text += f", TP rank {self.tp_rank} of {self.tp_size}"
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
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._tcp_links is not None:
            self._tcp_links.close()
            self._tcp_links = None
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None
        if self._dp is not None:
            self._dp.reducer.close()
            self._dp = None


@dataclass(frozen=True)
class RayStageHandle:
    """A stage actor as the group's `StageHandle`: every call returns its ObjectRef; the fabric
    (`actors.driver.RayStages`) waits on them."""

    actor: ray.actor.ActorHandle
    label: str

    def set_workload(self, *, workload: Workload, layout: Layout) -> ray.ObjectRef:
        return self.actor.set_workload.remote(workload=workload, layout=layout)

    def run_iteration(
        self,
        *,
        iteration: int,
        layout: Layout,
        policy: Policy,
        cap: Cap,
        buffer_limit: int | None,
        tp_protocol: TPProtocol,
    ) -> ray.ObjectRef:
        return self.actor.run_iteration.remote(
            iteration=iteration,
            layout=layout,
            policy=policy,
            cap=cap,
            buffer_limit=buffer_limit,
            tp_protocol=tp_protocol,
        )

    def evaluate(self, *, chunk: int, inputs: ray.ObjectRef | None, index: int) -> ray.ObjectRef:
        """`inputs` travels as a ref: Ray hands the previous stage's output to this actor directly."""
        return self.actor.evaluate.remote(chunk=chunk, inputs=inputs, index=index)

    def save(self, *, directory: str, iteration: int) -> ray.ObjectRef:
        return self.actor.save.remote(directory=directory, iteration=iteration)

    def load(self, *, directory: str, file: Any) -> ray.ObjectRef:
        return self.actor.load.remote(directory=directory, file=file)

    def chunk_states(self) -> ray.ObjectRef:
        return self.actor.chunk_states.remote()


def rss_bytes() -> int:
    """This process's resident memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (not Linux?)")
