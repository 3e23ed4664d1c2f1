"""The driver actor: owns placement, the stage actors and their groups; runs iterations,
hands out the policy, gathers telemetry, and shuts the pipeline down."""

from __future__ import annotations

import time
import uuid

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import collective
from actors.stage_actor import StageActor
from rrfp_ray.observe.telemetry import IterationReport, merge_stage_reports
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import Policy
from rrfp_ray.runtime.tcp_gather import Secret
from rrfp_ray.runtime.worker import PipelineError, Workload
from rrfp_ray.schedule.actions import place
from rrfp_ray.schedule.deps import Layout
from rrfp_ray.train.checkpoint import Manifest, StageFile
from rrfp_ray.train.config import PipelineConfig

_GRACE_S = 1.0  # how long to wait for the other stages' errors once one has failed
_SPAWN_S = 120.0  # the least time placement and actor processes get to start, whatever timeout_s is


@ray.remote(num_cpus=0)
class PipelineDriver:
    def __init__(self, *, pipeline: PipelineConfig, workload: Workload, gpus_per_stage: float = 0.0) -> None:
        collective.register_backends()
        self.pipeline = pipeline
        self.timeout_s = pipeline.timeout_s
        self.layout = pipeline.layout
        self.backend = collective.resolve_backend(backend=pipeline.backend)
        self.gpus_per_stage = gpus_per_stage  # a fraction lets stages share one GPU (gloo links then)
        self.workload = workload
        started = time.perf_counter()
        self._start()
        self.startup_s = time.perf_counter() - started

    def _start(self) -> None:
        """Placement, stage actors, their links and their workload."""
        self._failed = False  # an iteration failed: links are broken, stages may still be blocked in it
        gpus = self.gpus_per_stage
        bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
        stages = self.pipeline.stages * self.pipeline.tp  # one actor per (stage, TP rank)
        if gpus and ray.cluster_resources().get("GPU", 0) < stages * gpus:
            raise ValueError(
                f"{stages} stages x {gpus:g} GPU each need {stages * gpus:g} GPUs; "
                f"the cluster has {ray.cluster_resources().get('GPU', 0):g}"
            )
        self._pg = placement_group([bundle] * stages, strategy="PACK")
        spawn_s = max(self.timeout_s, _SPAWN_S)
        self._await(self._pg.ready(), what=f"a placement group of {stages} x {bundle}", timeout_s=spawn_s)
        self.stages = [
            StageActor.options(
                num_cpus=1,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=s
                ),
            ).remote(
                stage=s // self.pipeline.tp,
                tp_rank=s % self.pipeline.tp,
                tp_size=self.pipeline.tp,
                timeout_s=self.timeout_s,
                link_timeout_s=self.pipeline.link_timeout_s,
            )
            for s in range(stages)
        ]
        self._gather([a.ping.remote() for a in self.stages], what="stage actors to start", timeout_s=spawn_s)
        self._wire()
        self.set_workload(workload=self.workload)

    def restart(self) -> None:
        """Tear every stage down, whatever state it is in, and bring a fresh pipeline up."""
        self._failed = True
        self.shutdown()
        self._start()

    def save(self, *, directory: str, iteration: int) -> dict[int, StageFile]:
        """Every stage writes its checkpoint file; the caller commits the manifest."""
        files = self._gather([a.save.remote(directory=directory, iteration=iteration) for a in self.stages], what="checkpoint")
        return dict(enumerate(files))

    def load(self, *, directory: str, manifest: Manifest) -> None:
        self._gather(
            [a.load.remote(directory=directory, file=manifest.files[s]) for s, a in enumerate(self.stages)],
            what="checkpoint load",
        )

    def set_workload(self, *, workload: Workload) -> None:
        """Give every stage its (fresh) workload: model weights start again from their seed."""
        self.workload = workload
        self._gather([a.set_workload.remote(workload=workload, layout=self.layout) for a in self.stages], what="set_workload")

    def _wire(self) -> None:
        """A 2-rank group per link and TP rank, a TP group per stage (T > 1) with its agreement
        connections, and one group of all actors."""
        prefix, tp = uuid.uuid4().hex[:8], self.pipeline.tp
        links = {
            (link, t): f"{prefix}-{link.kind.value}{link.src}-{link.dst}-t{t}" for link in self.layout.links() for t in range(tp)
        }
        members = {name: (link.src * tp + t, link.dst * tp + t) for (link, t), name in links.items()}
        tp_groups = {s: f"{prefix}-tp{s}" for s in range(self.layout.stages)} if tp > 1 else {}
        members |= {name: tuple(range(s * tp, (s + 1) * tp)) for s, name in tp_groups.items()}
        everyone = f"{prefix}-all"
        members[everyone] = tuple(range(len(self.stages)))
        addresses = self._gather(
            [self.stages[ranks[0]].host_group.remote(name=name) for name, ranks in members.items()],
            what="group stores",
            labels=[self._label(ranks[0]) for ranks in members.values()],
        )
        joins, labels = [], []
        for (name, ranks), address in zip(members.items(), addresses):
            for rank, actor in enumerate(ranks):
                joins.append(
                    self.stages[actor].join_group.remote(
                        name=name, address=address, rank=rank, world_size=len(ranks), backend=self.backend
                    )
                )
                labels.append(f"{self._label(actor)} (group {name})")
        self._gather(joins, what="collective groups to form", labels=labels)
        agreement = []
        if tp > 1:
            secret = Secret.generate()  # fresh for every wiring; it travels only in Ray's authenticated calls
            listens = [a.listen_agreement.remote(secret=secret) for a in self.stages]
            agreement = self._gather(listens, what="agreement listeners")
        self._gather(
            [
                a.connect.remote(
                    groups={link: name for (link, t), name in links.items() if t == i % tp},
                    everyone=everyone,
                    tp_group=tp_groups.get(i // tp),
                    agreement=agreement[i - i % tp : i - i % tp + tp] if tp > 1 else None,
                )
                for i, a in enumerate(self.stages)
            ],
            what="channels to open",
        )

    def _label(self, actor: int) -> str:
        stage, rank = divmod(actor, self.pipeline.tp)
        return f"stage {stage}" + (f" TP rank {rank}" if self.pipeline.tp > 1 else "")

    def run_iteration(self, *, iteration: int, policy: Policy, cap: Cap | None = None) -> IterationReport:
        layout = Layout(
            stages=self.layout.stages, chunks=self.layout.chunks, microbatches=self.layout.microbatches, split=policy.split
        )
        refs = [
            a.run_iteration.remote(
                iteration=iteration,
                layout=layout,
                policy=policy,
                cap=cap or self.pipeline.cap,
                buffer_limit=self.pipeline.buffer_limit,
                tp_protocol=self.pipeline.tp_protocol,
            )
            for a in self.stages
        ]
        try:
            results = self._gather(refs, what=f"iteration {iteration}")
        except PipelineError:
            self._failed = True
            raise
        # TP ranks of a stage run the same actions in the same order: rank 0 reports for its stage
        return merge_stage_reports(iteration=iteration, policy=policy.name, results=results[:: self.pipeline.tp])

    def evaluate(self, *, microbatches: int) -> float:
        """Mean validation loss; activations pass stage to stage as object refs, not through the driver."""
        finals, tp = [], self.pipeline.tp
        for index in range(microbatches):
            for rank in range(tp):
                ref = None
                for vs in range(self.layout.virtual_stages):
                    stage, chunk = place(virtual_stage=vs, stages=self.layout.stages)
                    ref = self.stages[stage * tp + rank].evaluate.remote(chunk=chunk, inputs=ref, index=index)
                finals.append(ref)
        labels = [f"validation microbatch {i // tp}" for i in range(len(finals))]
        losses = self._gather(finals, what="validation", labels=labels)[::tp]
        return float(sum(float(loss) for loss in losses) / len(losses))

    def startup_seconds(self) -> float:
        return self.startup_s

    def stage_actors(self) -> list[ray.actor.ActorHandle]:
        """The stage actors' handles, in stage order (for inspection and fault-injection tests)."""
        return list(self.stages)

    def shutdown(self) -> None:
        """Stop the threads gracefully (not after a failed iteration), kill the actors, free the placement group."""
        if not self._failed:
            closes = [a.close.remote() for a in self.stages]
            ray.wait(closes, num_returns=len(closes), timeout=self.timeout_s)
        for actor in self.stages:
            ray.kill(actor)
        remove_placement_group(self._pg)

    def _await(self, ref: ray.ObjectRef, *, what: str, timeout_s: float) -> object:
        try:
            return ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            raise PipelineError(f"timed out after {timeout_s:g} s waiting for {what}") from None

    def _gather(
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
        failures: list[tuple[bool, str]] = []  # (not died, message): dead actors sort first
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break
            try:
                ray.get(done[0])
            except RayActorError as error:
                failures.append((False, f"{owners[done[0]]} died during {what}: {error}"))
            except RayError as error:
                failures.append((True, f"{owners[done[0]]} failed during {what}: {error}"))
            if failures:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
        if failures:
            raise PipelineError("\n".join(message for _, message in sorted(failures, key=lambda f: f[0])))
        if pending:
            raise PipelineError(f"{what}: no answer within {timeout_s:g} s from {', '.join(owners[r] for r in pending)}")
        return ray.get(refs)
