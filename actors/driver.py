"""The driver actor: runs the pipeline's `StageGroup` (iterations, evaluation, checkpoints,
restarts: `rrfp_ray.runtime.group`) over `RayFabric`, the Ray `Fabric`, which owns
placement, the stage actors and their collective groups, waits on them with deadlines
that name the stage, and shuts them down."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import collective
from actors.names import replacement, run_tag, stage_name
from actors.placement import StagePlacement, place
from actors.stage_actor import STAGE_ENV, RayStageHandle, StageActor, rss_bytes
from actors.teardown import end_actors
from rrfp_ray.errors import RrfpError
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.packing import Packing
from rrfp_ray.policy.agreement import TPGather
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.runtime.executor import Workload
from rrfp_ray.runtime.group import StageGroup
from rrfp_ray.runtime.mesh import Mesh
from rrfp_ray.runtime.tcp_pair import Secret
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.runtime.waits import Outcome, wait_named
from rrfp_ray.schedule.layout import Link
from rrfp_ray.sim.memory import DataBytes
from rrfp_ray.train.backend import IterationSettings
from rrfp_ray.train.checkpoint import Manifest, StageFile
from rrfp_ray.train.config import PipelineConfig

logger = logging.getLogger(__name__)

_SPAWN_S = 120.0  # the least time placement and actor processes get to start, whatever timeout_s is
_EXIT_S = 10.0  # how long stages get to exit on their own before they are killed


@ray.remote(num_cpus=0)
class PipelineDriver:
    """Hands out the policy and collects each iteration's telemetry; the group does the driving."""

    def __init__(
        self,
        *,
        pipeline: PipelineConfig,
        workload: Workload,
        placement: StagePlacement | None = None,
        run: str | None = None,
    ) -> None:
        """`placement`: what each stage's bundle asks (default: 1 CPU, no GPU) and how long placement waits;
        `run`: the tag in the stages' names, the driver's own (`actors.names`; default: a fresh one)."""
        collective.register_backends()
        self.pipeline = pipeline
        started = time.perf_counter()
        ties = tuple(dict.fromkeys(tie.stages for tie in workload.ties))
        mesh = Mesh(stages=pipeline.stages, tp=pipeline.tp, dp=pipeline.dp, ties=ties)
        fabric = RayFabric(pipeline=pipeline, placement=placement or StagePlacement(), mesh=mesh, run=run)
        self.group: StageGroup | None = None
        # raised to the caller by startup_seconds: out of __init__ it would arrive as this actor's death alone
        self.startup_error: RrfpError | None = None
        try:
            self.group = StageGroup(fabric=fabric, layout=pipeline.layout, zero=bool(pipeline.zero))
            self.group.set_workload(workload=workload)
        except RrfpError as error:  # placement that timed out, stages that failed to start
            self.startup_error = error
        self.startup_s = time.perf_counter() - started

    def set_workload(self, *, workload: Workload) -> None:
        """Give every stage its (fresh) workload: model weights start again from their seed."""
        self.group.set_workload(workload=workload)

    def run_iteration(
        self,
        *,
        iteration: int,
        policy: Policy,
        cap: Cap | None = None,
        order: tuple[int, ...] | None = None,
        packing: Packing | None = None,
        data_bytes: DataBytes | None = None,
    ) -> IterationReport:
        """One iteration under `cap` (None: the pipeline's), slot s reading data microbatch `order[s]`, made of
        the samples `packing[order[s]]` (None: the data's own microbatch); `data_bytes`: `StageGroup.run_iteration`."""
        return IterationSettings.of(self.pipeline).run(
            group=self.group,
            iteration=iteration,
            policy=policy,
            cap=cap,
            order=order,
            packing=packing,
            data_bytes=data_bytes,
        )

    def take_turns(
        self, *, runs: Mapping[str, tuple[Policy, Cap | None]], rounds: int, first_iteration: int = 0
    ) -> dict[str, list[IterationReport]]:
        """`StageGroup.take_turns` (a run's cap None: the pipeline's)."""
        return self.group.take_turns(
            runs={label: (policy, self.pipeline.cap if cap is None else cap) for label, (policy, cap) in runs.items()},
            rounds=rounds,
            first_iteration=first_iteration,
            buffer_limit=self.pipeline.buffer_limit,
            tp_protocol=self.pipeline.tp_protocol,
            measure_period=self.pipeline.balance.measure_period,
        )

    def evaluate(self, *, microbatches: int) -> float:
        """Mean validation loss; activations pass stage to stage as object refs, not through the driver."""
        return self.group.evaluate(microbatches=microbatches)

    def save(self, *, directory: str, iteration: int) -> dict[int, StageFile]:
        """Every stage writes its checkpoint file; the caller commits the manifest."""
        return self.group.save(directory=directory, iteration=iteration)

    def load(self, *, directory: str, manifest: Manifest) -> None:
        self.group.load(directory=directory, manifest=manifest)

    def chunk_states(self) -> list[dict]:
        """Every stage actor's chunk weights (CPU tensors), in `Mesh` index order."""
        return self.group.chunk_states()

    def restart(self) -> None:
        """Tear every stage down, whatever state it is in, and bring a fresh pipeline up."""
        self.group.restart()

    def __repr__(self) -> str:
        layout, tp = self.pipeline.layout, self.pipeline.tp
        return (
            f"PipelineDriver({layout.stages} stages x {layout.chunks} chunks, {layout.microbatches} microbatches"
            + (f", TP {tp}" if tp > 1 else "")
            + ")"
        )

    def startup_seconds(self) -> float:
        if self.startup_error is not None:
            raise self.startup_error
        return self.startup_s

    def link_transport(self) -> LinkTransport:
        """What carries the links, as the stages resolved it."""
        return self.group.fabric.transport

    def rss_bytes(self) -> int:
        """This driver actor's resident memory."""
        return rss_bytes()

    def placed_groups(self) -> int:
        """How many (replica, stage) placement groups its stages hold now (0 while they are down)."""
        return self.group.fabric.placed_groups if self.group is not None else 0

    def stage_actors(self) -> list[ray.actor.ActorHandle]:
        """The stage actors' handles, in stage order (for inspection and fault-injection tests)."""
        return [handle.actor for handle in self.group.handles]

    def shutdown(self) -> None:
        """Stop the stages: gracefully unless an iteration failed."""
        if self.group is not None:
            self.group.close()


class RayFabric:
    """The Ray `Fabric`: a placement group per (replica, stage) holding its T TP ranks on one node
    (STRICT_PACK), one stage actor per actor of `mesh`, their links and groups."""

    def __init__(
        self, *, pipeline: PipelineConfig, placement: StagePlacement, mesh: Mesh, run: str | None = None
    ) -> None:
        self.pipeline = pipeline
        self.mesh = mesh
        self.run = run or run_tag()  # the tag in the stage actors' names (actors.names)
        self._starts = 0  # how many sets of stage actors it has started
        self.timeout_s = pipeline.timeout_s
        self.layout = pipeline.layout
        self.transport = pipeline.backend  # what carries the links: each stage resolves `auto` where it runs (`start`)
        self.placement = placement  # a GPU fraction lets stages share one GPU (TCP or gloo links then)
        self.actors: list[ray.actor.ActorHandle] = []
        self.pids: dict[str, int] = {}  # actor id -> process, once the stage actors are up
        self._pgs: list = []  # a placement group per (replica, stage): per TP group

    @property
    def placed_groups(self) -> int:
        return len(self._pgs)

    def start(self) -> list[RayStageHandle]:
        """Placement (waiting for an autoscaler to add nodes), stage actors, their transport and links."""
        mesh = self.mesh
        demand = self.placement.demand(dp=mesh.dp, stages=mesh.stages, tp=mesh.tp)
        labels = [mesh.label(members[0]) for members in mesh.tp_groups()]
        timeout_s = self.placement.timeout_s
        if self._starts and self.pipeline.resize_after is not None:  # a restart: past this the job resizes
            timeout_s = min(timeout_s, self.pipeline.resize_after)
        self._pgs = place(demand=demand, timeout_s=timeout_s, labels=labels)  # logs its waiting and end
        spawn_s = max(self.timeout_s, _SPAWN_S)
        waited = time.perf_counter()
        run = replacement(self.run, mark="r", count=self._starts)  # a restart's old actors may hold their names
        self._starts += 1
        self.actors = []
        for i in range(mesh.size):
            replica, stage, rank = mesh.coord(i)
            name = stage_name(
                run=run,
                stage=stage,
                tp_rank=rank if mesh.tp > 1 else None,
                dp_rank=replica if mesh.dp > 1 else None,
            )
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pgs[mesh.tp_group(i)], placement_group_bundle_index=rank
            )
            self.actors.append(
                StageActor.options(
                    name=name,
                    runtime_env={"env_vars": STAGE_ENV},
                    num_cpus=1,
                    num_gpus=self.placement.gpus_per_stage,
                    resources=dict(self.placement.resources),
                    scheduling_strategy=strategy,
                ).remote(
                    mesh=mesh,
                    index=i,
                    dp=self.pipeline.dp_spec,
                    timeout_s=self.timeout_s,
                    link_timeout_s=self.pipeline.link_timeout_s,
                    layout=self.layout,
                )
            )
        self.pids = dict(
            self.wait([a.process.remote() for a in self.actors], what="stage actors to start", timeout_s=spawn_s)
        )
        logger.info(
            "%d stage actors up in %.1f s (pids %s)", mesh.size, time.perf_counter() - waited, list(self.pids.values())
        )
        choices = self.wait(
            [a.resolve_transport.remote(transport=self.pipeline.backend) for a in self.actors], what="link transports"
        )
        try:
            self.transport = collective.agree_on_transport(choices={mesh.label(i): c for i, c in enumerate(choices)})
        except RuntimeError:
            self.stop(graceful=False)
            raise
        self._wire()
        logger.info("%d stage actors linked (%s)", mesh.size, self.transport)
        return [RayStageHandle(actor=a, label=mesh.label(i)) for i, a in enumerate(self.actors)]

    def _wire(self) -> None:
        """A link per directed stage pair, TP rank and replica (a 2-rank group, or with TCP links a
        connection its receiver listens for), and the mesh's groups: TP (T > 1, with its agreement
        connections), DP (D > 1), ties, and one group of all actors. The TCP connections (links,
        agreement) prove themselves with one secret, fresh for every wiring; it travels only in
        Ray's authenticated calls."""
        mesh, prefix = self.mesh, uuid.uuid4().hex[:8]
        tcp_links = self.transport is LinkTransport.TCP
        secret = Secret.generate()
        ends = mesh.link_ends(self.layout.links())
        links = {(link, t, d): f"{prefix}-{link.kind.value}{link.src}-{link.dst}-t{t}-d{d}" for link, t, d in ends}
        tp_groups = {g: f"{prefix}-tp{g}" for g in range(len(mesh.tp_groups()))} if mesh.tp > 1 else {}
        dp_groups = {g: f"{prefix}-dp{g}" for g in range(len(mesh.dp_groups()))} if mesh.dp > 1 else {}
        ties = {(o, t, d): f"{prefix}-tie{'-'.join(map(str, o))}-t{t}-d{d}" for o, t, d in mesh.tie_groups()}
        everyone = f"{prefix}-all"
        members = {} if tcp_links else {links[key]: pair for key, pair in ends.items()}
        members |= {name: mesh.tp_groups()[g] for g, name in tp_groups.items()}
        members |= {name: mesh.dp_groups()[g] for g, name in dp_groups.items()}
        members |= {name: mesh.tie_groups()[key] for key, name in ties.items()}
        members[everyone] = tuple(range(mesh.size))
        self._join(members)
        agreement = []
        tcp = mesh.tp > 1 and self.pipeline.tp_gather is TPGather.TCP  # else the agreement gathers over the TP group
        if tcp:
            agreement = self.wait(
                [a.listen_agreement.remote(secret=secret) for a in self.actors], what="agreement listeners"
            )
        dialed: list[dict[Link, str]] = [{} for _ in self.actors]  # per actor: its outbound TCP links' receivers
        if tcp_links:
            inbound: list[list[Link]] = [[] for _ in self.actors]
            for (link, _, _), (_, receiver) in ends.items():
                inbound[receiver].append(link)
            listens = [a.listen_links.remote(links=inbound[i], secret=secret) for i, a in enumerate(self.actors)]
            heard = self.wait(listens, what="link listeners")
            for (link, _, _), (sender, receiver) in ends.items():
                dialed[sender][link] = heard[receiver][link]
        connects = []
        for i, a in enumerate(self.actors):
            replica, stage, rank = mesh.coord(i)
            own = (rank, replica)
            tp_members = mesh.tp_groups()[mesh.tp_group(i)]
            connects.append(
                a.connect.remote(
                    groups={} if tcp_links else {link: links[link, t, d] for link, t, d in links if (t, d) == own},
                    tcp_links=dialed[i],
                    everyone=everyone,
                    tp_group=tp_groups.get(mesh.tp_group(i)),
                    dp_group=dp_groups.get(mesh.dp_group(i)),
                    chunks=self.layout.chunks,
                    tie_groups={o: name for (o, t, d), name in ties.items() if (t, d) == own and stage in o},
                    agreement=[agreement[m] for m in tp_members] if tcp else None,
                )
            )
        self.wait(connects, what="channels to open")

    def _join(self, members: dict[str, tuple[int, ...]]) -> None:
        """Every actor joins its collective groups (`members`: group name -> its actors, by group rank)."""
        addresses = self.wait(
            [self.actors[ranks[0]].host_group.remote(name=name) for name, ranks in members.items()],
            what="group stores",
            labels=[self.mesh.label(ranks[0]) for ranks in members.values()],
        )
        joins, labels = [], []
        library = collective.group_library(links=self.transport)
        for (name, ranks), address in zip(members.items(), addresses):
            for rank, actor in enumerate(ranks):
                joins.append(
                    self.actors[actor].join_group.remote(
                        name=name, address=address, rank=rank, world_size=len(ranks), library=library
                    )
                )
                labels.append(f"{self.mesh.label(actor)} (group {name})")
        self.wait(joins, what="collective groups to form", labels=labels)

    def stop(self, *, graceful: bool) -> None:
        """Stop the threads, end the actors, free the placement group.

        Gracefully (not after a failure), the actors exit on their own after their last call
        and only then goes their placement group (actors.teardown says why); otherwise they are killed.
        """
        if graceful:
            closes = [a.close.remote() for a in self.actors]
            ray.wait(closes, num_returns=len(closes), timeout=self.timeout_s)
            end_actors(self.actors, timeout_s=_EXIT_S)
        else:
            for actor in self.actors:
                ray.kill(actor)
        for pg in self._pgs:
            remove_placement_group(pg)
        self._pgs = []
        logger.info("%d stage actors stopped%s", len(self.actors), "" if graceful else " (after a failure)")
        self.actors = []

    def wait(
        self, refs: list[ray.ObjectRef], *, what: str, labels: list[str] | None = None, timeout_s: float | None = None
    ) -> list:
        """ray.get with a deadline; a dead or hung stage is named in the error (`wait_named`)."""
        wait_named(
            refs,
            labels=labels or [self.mesh.label(i) for i in range(len(refs))],
            what=what,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            wait_some=lambda left, timeout: ray.wait(left, num_returns=1, timeout=timeout)[0],
            outcome=self._outcome,
        )
        return ray.get(refs)

    def _outcome(self, ref: ray.ObjectRef) -> Outcome | None:
        try:
            ray.get(ref)
        except RayActorError as error:
            pid = f" (pid {self.pids[error.actor_id]})" if error.actor_id in self.pids else ""
            return Outcome(died=True, error=str(error), process=pid)
        except RayError as error:
            cause = getattr(error, "cause", None)
            ours = isinstance(cause, RrfpError)  # ours: its message; else Ray's, with the traceback
            return Outcome(died=False, error=str(cause if ours else error), cause=cause)
        return None
