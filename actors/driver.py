"""The driver actor: runs the pipeline's `StageGroup` (iterations, evaluation, checkpoints,
restarts: `rrfp_ray.runtime.group`) over `RayStages`, the Ray `Fabric`, which owns
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
from rrfp_ray.policy.agreement import TPGather
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import Policy
from rrfp_ray.runtime.errors import PipelineError, joint_exit_code
from rrfp_ray.runtime.executor import Workload
from rrfp_ray.runtime.group import StageGroup, stage_label
from rrfp_ray.runtime.tcp_pair import Secret
from rrfp_ray.runtime.transport import LinkBackend
from rrfp_ray.schedule.deps import Link
from rrfp_ray.train.backend import run_iteration
from rrfp_ray.train.checkpoint import Manifest, StageFile
from rrfp_ray.train.config import PipelineConfig

logger = logging.getLogger(__name__)

_GRACE_S = 1.0  # how long to wait for the other stages' errors once one has failed
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
        ties = tuple(dict.fromkeys(tie.stages for tie in getattr(workload, "ties", ())))
        fabric = RayStages(pipeline=pipeline, placement=placement or StagePlacement(), ties=ties, run=run)
        self.group: StageGroup | None = None
        # raised to the caller by startup_seconds: out of __init__ it would arrive as this actor's death alone
        self.startup_error: RrfpError | None = None
        try:
            self.group = StageGroup(
                fabric=fabric, layout=pipeline.layout, tp=pipeline.tp, dp=pipeline.dp, zero=bool(pipeline.zero)
            )
            self.group.set_workload(workload=workload)
        except RrfpError as error:  # placement that timed out, stages that failed to start
            self.startup_error = error
        self.startup_s = time.perf_counter() - started

    def set_workload(self, *, workload: Workload) -> None:
        """Give every stage its (fresh) workload: model weights start again from their seed."""
        self.group.set_workload(workload=workload)

    def run_iteration(self, *, iteration: int, policy: Policy, cap: Cap | None = None) -> IterationReport:
        """One iteration under `cap` (None: the pipeline's)."""
        return run_iteration(group=self.group, pipeline=self.pipeline, iteration=iteration, policy=policy, cap=cap)

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
        )

    def evaluate(self, *, microbatches: int) -> float:
        """Mean validation loss; activations pass stage to stage as object refs, not through the driver."""
        return self.group.evaluate(microbatches=microbatches)

    def save(self, *, directory: str, iteration: int) -> dict[int, StageFile]:
        """Every stage writes its checkpoint file; the caller commits the manifest."""
        return self.group.save(directory=directory, iteration=iteration)

    def load(self, *, directory: str, manifest: Manifest) -> None:
        self.group.load(directory=directory, files=manifest.files)

    def chunk_states(self) -> list[dict]:
        """Every stage actor's chunk weights (CPU tensors), in actor order (stage * tp + rank)."""
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

    def link_backend(self) -> LinkBackend:
        """What carries the links, as the stages resolved it."""
        return self.group.fabric.backend

    def rss_bytes(self) -> int:
        """This driver actor's resident memory."""
        return rss_bytes()

    def stage_actors(self) -> list[ray.actor.ActorHandle]:
        """The stage actors' handles, in stage order (for inspection and fault-injection tests)."""
        return [handle.actor for handle in self.group.handles]

    def shutdown(self) -> None:
        """Stop the stages: gracefully unless an iteration failed."""
        if self.group is not None:
            self.group.close()


class RayStages:
    """The Ray `Fabric`: a placement group per (replica, stage) holding its T TP ranks on one node
    (STRICT_PACK), one stage actor per (replica, stage, TP rank), their links."""

    def __init__(
        self,
        *,
        pipeline: PipelineConfig,
        placement: StagePlacement,
        ties: tuple[tuple[int, ...], ...] = (),
        run: str | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.run = run or run_tag()  # the tag in the stage actors' names (actors.names)
        self._starts = 0  # how many sets of stage actors it has started
        self.ties = ties  # each a set of stages holding a tied parameter: a collective group of them per TP rank
        self.timeout_s = pipeline.timeout_s
        self.layout = pipeline.layout
        self.backend = pipeline.backend  # each stage resolves `auto` where it runs (`start`)
        self.placement = placement  # a GPU fraction lets stages share one GPU (TCP or gloo links then)
        self.stages: list[ray.actor.ActorHandle] = []
        self.pids: dict[str, int] = {}  # actor id -> process, once the stage actors are up
        self._pgs: list = []  # a placement group per (replica, stage)

    def start(self) -> list[RayStageHandle]:
        """Placement (waiting for an autoscaler to add nodes), stage actors, their backend and links."""
        stages = self.pipeline.actors  # one actor per (replica, stage, TP rank)
        per_replica = self.pipeline.stages * self.pipeline.tp
        tp = self.pipeline.tp
        demand = self.placement.demand(dp=self.pipeline.dp, stages=self.pipeline.stages, tp=tp)
        labels = [self._label(g * tp) for g in range(demand.groups)]
        self._pgs = place(
            demand=demand, timeout_s=self.placement.timeout_s, labels=labels
        )  # logs its waiting and its end
        spawn_s = max(self.timeout_s, _SPAWN_S)
        waited = time.perf_counter()
        run = replacement(self.run, mark="r", count=self._starts)  # a restart's old actors may hold their names
        self._starts += 1
        self.stages = [
            StageActor.options(
                name=stage_name(
                    run=run,
                    stage=s % per_replica // tp,
                    tp_rank=s % tp if tp > 1 else None,
                    dp_rank=s // per_replica if self.pipeline.dp > 1 else None,
                ),
                runtime_env={"env_vars": STAGE_ENV},
                num_cpus=1,
                num_gpus=self.placement.gpus_per_stage,
                resources=dict(self.placement.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pgs[s // tp], placement_group_bundle_index=s % tp
                ),
            ).remote(
                stage=s % per_replica // self.pipeline.tp,
                tp_rank=s % self.pipeline.tp,
                tp_size=self.pipeline.tp,
                replica=s // per_replica,
                index=s,
                dp=self.pipeline.dp_spec,
                timeout_s=self.timeout_s,
                link_timeout_s=self.pipeline.link_timeout_s,
                layout=self.layout,
            )
            for s in range(stages)
        ]
        self.pids = dict(
            self.wait([a.process.remote() for a in self.stages], what="stage actors to start", timeout_s=spawn_s)
        )
        logger.info(
            "%d stage actors up in %.1f s (pids %s)", stages, time.perf_counter() - waited, list(self.pids.values())
        )
        choices = self.wait(
            [a.resolve_backend.remote(backend=self.pipeline.backend) for a in self.stages], what="link backends"
        )
        try:
            self.backend = collective.agree_on_backend(choices={self._label(i): c for i, c in enumerate(choices)})
        except RuntimeError:
            self.stop(graceful=False)
            raise
        self._wire()
        logger.info("%d stage actors linked (%s)", stages, self.backend)
        return [RayStageHandle(actor=a, label=self._label(i)) for i, a in enumerate(self.stages)]

    def _wire(self) -> None:
        """A link per directed stage pair, TP rank and replica (a 2-rank group, or with TCP links a
        connection its receiver listens for), a TP group per stage and replica (T > 1) with its
        agreement connections, a DP group per (stage, TP rank) across the replicas (D > 1), a group
        per set of stages holding tied parameters (per TP rank and replica), and one group of all
        actors. The TCP connections (links, agreement) prove themselves with one secret, fresh for
        every wiring; it travels only in Ray's authenticated calls."""
        prefix, tp, dp, stages = uuid.uuid4().hex[:8], self.pipeline.tp, self.pipeline.dp, self.layout.stages
        tcp_links = self.backend is LinkBackend.TCP
        secret = Secret.generate()

        def actor(replica: int, stage: int, rank: int) -> int:
            return (replica * stages + stage) * tp + rank

        links = {
            (link, t, d): f"{prefix}-{link.kind.value}{link.src}-{link.dst}-t{t}-d{d}"
            for link in self.layout.links()
            for t in range(tp)
            for d in range(dp)
        }
        ends = {name: (actor(d, link.src, t), actor(d, link.dst, t)) for (link, t, d), name in links.items()}
        members = {} if tcp_links else dict(ends)
        tp_groups = {g: f"{prefix}-tp{g}" for g in range(dp * stages)} if tp > 1 else {}  # g: replica * stages + stage
        members |= {name: tuple(range(g * tp, (g + 1) * tp)) for g, name in tp_groups.items()}
        dp_groups = {(s, t): f"{prefix}-dp{s}-t{t}" for s in range(stages) for t in range(tp)} if dp > 1 else {}
        members |= {name: tuple(actor(d, s, t) for d in range(dp)) for (s, t), name in dp_groups.items()}
        everyone = f"{prefix}-all"
        members[everyone] = tuple(range(len(self.stages)))
        ties = {
            (owners, t, d): f"{prefix}-tie{'-'.join(map(str, owners))}-t{t}-d{d}"
            for owners in self.ties
            for t in range(tp)
            for d in range(dp)
        }
        members |= {name: tuple(actor(d, s, t) for s in owners) for (owners, t, d), name in ties.items()}
        addresses = self.wait(
            [self.stages[ranks[0]].host_group.remote(name=name) for name, ranks in members.items()],
            what="group stores",
            labels=[self._label(ranks[0]) for ranks in members.values()],
        )
        joins, labels = [], []
        backend = collective.group_backend(links=self.backend)
        for (name, ranks), address in zip(members.items(), addresses):
            for rank, actor in enumerate(ranks):
                joins.append(
                    self.stages[actor].join_group.remote(
                        name=name, address=address, rank=rank, world_size=len(ranks), backend=backend
                    )
                )
                labels.append(f"{self._label(actor)} (group {name})")
        self.wait(joins, what="collective groups to form", labels=labels)
        agreement = []
        tcp = tp > 1 and self.pipeline.tp_gather is TPGather.TCP  # else the agreement gathers over the TP group
        if tcp:
            listens = [a.listen_agreement.remote(secret=secret) for a in self.stages]
            agreement = self.wait(listens, what="agreement listeners")
        dialed: list[dict[Link, str]] = [{} for _ in self.stages]  # per actor: its outbound TCP links' receivers
        if tcp_links:
            inbound: list[list[Link]] = [[] for _ in self.stages]
            for (link, _, _), name in links.items():
                inbound[ends[name][1]].append(link)
            listens = [a.listen_links.remote(links=inbound[i], secret=secret) for i, a in enumerate(self.stages)]
            heard = self.wait(listens, what="link listeners")
            for (link, _, _), name in links.items():
                sender, receiver = ends[name]
                dialed[sender][link] = heard[receiver][link]
        self.wait(
            [
                a.connect.remote(
                    groups={}
                    if tcp_links
                    else {link: name for (link, t, d), name in links.items() if (t, d) == (i % tp, i // tp // stages)},
                    tcp_links=dialed[i],
                    everyone=everyone,
                    tp_group=tp_groups.get(i // tp),
                    dp_group=dp_groups.get((i // tp % stages, i % tp)),
                    chunks=self.layout.chunks,
                    tie_groups={
                        owners: name for (owners, t, d), name in ties.items() if (t, d) == (i % tp, i // tp // stages)
                    },
                    agreement=agreement[i - i % tp : i - i % tp + tp] if tcp else None,
                )
                for i, a in enumerate(self.stages)
            ],
            what="channels to open",
        )

    def _label(self, actor: int) -> str:
        group, rank = divmod(actor, self.pipeline.tp)
        replica, stage = divmod(group, self.pipeline.stages)
        return stage_label(stage=stage, rank=rank, replica=replica, tp=self.pipeline.tp, dp=self.pipeline.dp)

    def stop(self, *, graceful: bool) -> None:
        """Stop the threads, end the actors, free the placement group.

        Gracefully (not after a failure), the actors exit on their own after their last call
        and only then goes their placement group (actors.teardown says why); otherwise they are killed.
        """
        if graceful:
            closes = [a.close.remote() for a in self.stages]
            ray.wait(closes, num_returns=len(closes), timeout=self.timeout_s)
            end_actors(self.stages, timeout_s=_EXIT_S)
        else:
            for actor in self.stages:
                ray.kill(actor)
        for pg in self._pgs:
            remove_placement_group(pg)
        logger.info("%d stage actors stopped%s", len(self.stages), "" if graceful else " (after a failure)")
        self.stages = []

    def wait(
        self, refs: list[ray.ObjectRef], *, what: str, labels: list[str] | None = None, timeout_s: float | None = None
    ) -> list:
        """ray.get with a deadline; a dead or hung stage is named in the error.

        After the first failure, others that follow within `_GRACE_S` are reported too, dead
        actors first: a killed stage also breaks its neighbours' links, and the dead one is the cause.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        labels = labels or [self._label(i) for i in range(len(refs))]
        owners = dict(zip(refs, labels))
        deadline = time.monotonic() + timeout_s + 5.0
        pending = list(refs)
        # (not died, message, culprit, the stage's error: None if it died): dead actors sort first
        failures: list[tuple[bool, str, str, BaseException | None]] = []
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break
            try:
                ray.get(done[0])
            except RayActorError as error:
                pid = f" (pid {self.pids[error.actor_id]})" if error.actor_id in self.pids else ""
                failures.append(
                    (False, f"{owners[done[0]]} died during {what}: {error}", f"{owners[done[0]]}{pid} died", None)
                )
            except RayError as error:
                cause = getattr(error, "cause", None)
                text = cause if isinstance(cause, RrfpError) else error  # ours: its message; else with its traceback
                failures.append(
                    (True, f"{owners[done[0]]} failed during {what}: {text}", f"{owners[done[0]]} failed", cause)
                )
            if failures:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if pending:  # a stalled stage is named beside the errors its neighbours ran into
            waited = f"{timeout_s:g} s" if not failures else f"{_GRACE_S:g} s of the first failure"
            silent = ", ".join(owners[r] for r in pending)
            failures.append((True, f"{what}: no answer within {waited} from {silent}", f"{silent} stalled", None))
        if failures:
            failures.sort(key=lambda f: f[0])
            raise PipelineError(
                "\n".join(f[1] for f in failures),
                culprit=failures[0][2],
                exit_code=joint_exit_code([f[3] for f in failures]),
            )
        return ray.get(refs)
