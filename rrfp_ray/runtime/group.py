"""One orchestration for every fabric: a `StageGroup` drives a pipeline's stages through
iterations, evaluation, checkpoints and restarts (in the spirit of Ray Train's WorkerGroup).

It speaks to each stage (each TP rank of a stage, in each data-parallel replica: the actors of
its `Mesh`) through a `StageHandle`, whose calls return at once with a pending result, and to
the fabric (where the stages run) through a `Fabric`, which brings the handles up and down and
waits on their results with a timeout that names the stage. In-process the handles are threads
(`rrfp_ray.runtime.local`); on Ray they are stage actors and the group runs inside the driver actor (`actors.driver`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rrfp_ray.observe.telemetry import IterationReport, merge_stage_reports
from rrfp_ray.plan.packing import Packing
from rrfp_ray.policy.agreement import TPProtocol
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.runtime.errors import PipelineError
from rrfp_ray.runtime.executor import Workload
from rrfp_ray.runtime.iteration import IterationArgs, measures
from rrfp_ray.runtime.mesh import Mesh
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.memory import DataBytes

logger = logging.getLogger(__name__)

Pending = Any  # a call's result to come: a concurrent.futures.Future in-process, an ObjectRef on Ray


class StageHandle(Protocol):
    """One stage (one TP rank of it) as the group drives it; a stage runs its calls in order."""

    label: str  # names the stage in errors: "stage 1", "stage 1 TP rank 0", "replica 1 stage 1" (`Mesh.label`)

    def set_workload(self, *, workload: Workload, layout: Layout) -> Pending: ...

    def run_iteration(self, *, args: IterationArgs) -> Pending:
        """Pending (events, stats) of the stage's part of the iteration (`StageHost.run_iteration`)."""
        ...

    def evaluate(self, *, chunk: int, inputs: Pending | None, index: int) -> Pending:
        """Forward of validation microbatch `index` through `chunk`; `inputs` is the previous virtual
        stage's pending output (None on the first): activations pass stage to stage, not through the group."""
        ...

    def save(self, *, directory: str, iteration: int) -> Pending:
        """Pending checkpoint file of this stage (`rrfp_ray.train.checkpoint.StageFile`)."""
        ...

    def load(self, *, directory: str, manifest: Any) -> Pending:
        """Load this stage's share of the checkpoint `manifest` records, from whichever files hold it."""
        ...

    def chunk_states(self) -> Pending:
        """Pending weights of this stage's chunks, on the CPU: {chunk: state dict}."""
        ...


class Fabric(Protocol):
    """Where the stages run (threads or actors): they are brought up and down, and their calls waited on."""

    mesh: Mesh  # the actors it hosts

    def start(self) -> list[StageHandle]:
        """Bring every stage up, linked to its neighbours; their handles, in `Mesh` index order."""
        ...

    def wait(self, pending: list[Pending], *, labels: list[str], what: str) -> list:
        """Every result in order, within the fabric's timeout; else a PipelineError naming each stage
        that failed (a dead one first) or did not answer, and `what` it was doing."""
        ...

    def stop(self, *, graceful: bool) -> None:
        """End the stages; not `graceful` after a failure (links may be broken, stages still blocked)."""
        ...


class StageGroup:
    """With `dp` > 1, `dp` replicas of the pipeline train on their own shares of each iteration's
    data; their stages sum gradients before the step, so every replica holds the same weights:
    replica 0 alone evaluates and writes checkpoints, and every replica loads them. With `zero`
    (ZeRO-1), each replica holds its own shard of the optimizer state: every replica writes its
    file, and loads the state of the parameters it owns from whichever files hold it."""

    def __init__(self, *, fabric: Fabric, layout: Layout, zero: bool = False) -> None:
        mesh = fabric.mesh
        if mesh.stages != layout.stages:
            raise ValueError(f"the mesh has {mesh.stages} stages, the layout {layout.stages}")
        self.fabric = fabric
        self.layout = layout
        self.mesh = mesh
        self.zero = zero
        self.workload: Workload | None = None
        self._failed = False  # an iteration failed: links are broken, stages may still be blocked in it
        self.handles: list[StageHandle] = fabric.start()
        if len(self.handles) != mesh.size:
            raise ValueError(
                f"the fabric started {len(self.handles)} stages, the pipeline has {mesh.dp} x {mesh.stages} x {mesh.tp}"
            )

    def set_workload(self, *, workload: Workload) -> None:
        """Give every stage its (fresh) workload: model weights start again from the model as given."""
        self.workload = workload
        self._all(lambda _, h: h.set_workload(workload=workload, layout=self.layout), what="set_workload")

    def run_iteration(
        self,
        *,
        iteration: int,
        policy: Policy,
        cap: Cap,
        buffer_limit: int | None,
        tp_protocol: TPProtocol,
        order: tuple[int, ...] | None = None,
        measure: bool = False,
        packing: Packing | None = None,
        data_bytes: DataBytes | None = None,
    ) -> IterationReport:
        """One iteration; with `measure`, each stage measures its layers' costs after it (`StageStats.layer_costs`).
        With `data_bytes`, each stage's arbiter gates admissions by the activation bytes of the microbatches in its
        slots (a `Kx` cap; a fixed list is its own cap); None: the cap counts microbatches."""
        layout = policy.layout_over(self.layout)
        memory = None if data_bytes is None else data_bytes.memories(cap=cap, policy=policy, layout=layout, order=order)
        args = IterationArgs(
            iteration=iteration,
            layout=layout,
            policy=policy,
            cap=cap,
            buffer_limit=buffer_limit,
            tp_protocol=tp_protocol,
            order=order,
            measure=measure,
            packing=packing,
            memory=memory,
        )
        try:
            results = self._all(lambda _, h: h.run_iteration(args=args), what=f"iteration {iteration}")
        except PipelineError:
            self._failed = True
            raise
        # TP ranks of a stage run the same actions in the same order: rank 0 reports for its stage (in every replica)
        # the events of replica 0 alone: the diagrams and traces show one pipeline
        shown = [
            (events if i in self.mesh.replica_indices(0) else [], stats) for i, (events, stats) in enumerate(results)
        ]
        report = merge_stage_reports(iteration=iteration, policy=policy.name, results=shown[:: self.mesh.tp])
        report.order = None if order is None else list(order)
        report.packing = None if packing is None else [list(group) for group in packing]
        return report

    def take_turns(
        self,
        *,
        runs: Mapping[str, tuple[Policy, Cap]],
        rounds: int,
        first_iteration: int,
        buffer_limit: int | None,
        tp_protocol: TPProtocol,
        measure_period: int = 0,
    ) -> dict[str, list[IterationReport]]:
        """`rounds` iterations of every run (a policy under a cap), the runs taking turns so that
        drift hits all of them alike; iterations are numbered on from `first_iteration`, and measure
        every `measure_period` (`measures`)."""
        reports: dict[str, list[IterationReport]] = {label: [] for label in runs}
        iteration = first_iteration
        for _ in range(rounds):
            for label, (policy, cap) in runs.items():
                reports[label].append(
                    self.run_iteration(
                        iteration=iteration,
                        policy=policy,
                        cap=cap,
                        buffer_limit=buffer_limit,
                        tp_protocol=tp_protocol,
                        measure=measures(iteration=iteration, period=measure_period),
                    )
                )
                iteration += 1
        return reports

    def evaluate(self, *, microbatches: int) -> float:
        """Mean validation loss over the first `microbatches` validation microbatches (forward only).

        Each TP rank chains its own calls (the ranks of a stage meet in their all-reduces); rank 0's losses count."""
        finals, labels, tp = [], [], self.mesh.tp
        for index in range(microbatches):
            for rank in range(tp):
                out = None
                for vs in range(self.layout.virtual_stages):
                    stage, chunk = self.layout.locate(vs)
                    handle = self.handles[self.mesh.index(stage=stage, rank=rank)]
                    out = handle.evaluate(chunk=chunk, inputs=out, index=index)
                finals.append(out)
                labels.append(f"validation microbatch {index}" + (f" (TP rank {rank})" if tp > 1 else ""))
        losses = self.fabric.wait(finals, labels=labels, what="validation")[::tp]
        return sum(float(loss) for loss in losses) / len(losses)

    def save(self, *, directory: str, iteration: int) -> dict[int, Any]:
        """Every stage of replica 0 writes its checkpoint file (the replicas hold the same state; with
        ZeRO-1 every replica's stage writes, for its optimizer shard); returns them by stage index
        (the caller commits the manifest)."""
        files = self._all(
            lambda _, h: h.save(directory=directory, iteration=iteration),
            what="checkpoint",
            replica=None if self.zero else 0,
        )
        logger.info("iteration %d: %d stage files written to %s", iteration, len(files), directory)
        return dict(enumerate(files))

    def load(self, *, directory: str, manifest: Any) -> None:
        """Every stage of every replica loads what it now holds from the files of `manifest`
        (`rrfp_ray.train.checkpoint.Manifest`), whatever shape wrote them (ZeRO-1: the optimizer
        state of the parameters it now steps)."""
        self._all(lambda _, h: h.load(directory=directory, manifest=manifest), what="checkpoint load")
        logger.info("checkpoint of iteration %d loaded from %s", manifest.iteration, directory)

    def chunk_states(self) -> list[Any]:
        """Every stage's chunk weights (CPU), by stage index: what `rrfp_ray.train.export` puts together."""
        return self._all(lambda _, h: h.chunk_states(), what="chunk weights")

    def restart(self) -> None:
        """Tear every stage down, whatever state it is in, and bring fresh ones up with the workload."""
        logger.info("restarting %d stages", len(self.handles))
        self.fabric.stop(graceful=False)
        self.handles = self.fabric.start()
        self._failed = False
        if self.workload is not None:
            self.set_workload(workload=self.workload)

    def close(self) -> None:
        """Stop the stages: gracefully unless an iteration failed."""
        self.fabric.stop(graceful=not self._failed)

    def _all(self, call: Callable[[int, StageHandle], Pending], *, what: str, replica: int | None = None) -> list:
        """`call(index, handle)` on every stage at once (of `replica` only, if given); their results, in stage order."""
        handles = self.handles
        if replica is not None:
            handles = [handles[i] for i in self.mesh.replica_indices(replica)]
        pending = [call(i, h) for i, h in enumerate(handles)]
        return self.fabric.wait(pending, labels=[h.label for h in handles], what=what)
