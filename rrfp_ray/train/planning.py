"""A `Trainer`'s planned iterations (`policy planned`): its planner, the lookahead that plans the next
iteration while one runs (`rrfp_ray.plan.ahead`), and what each iteration waited for its plan."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.ahead import Lookahead, Seen, Taken, seen
from rrfp_ray.plan.planner import Arrangement, Planner, PlannerConfig, default_hints
from rrfp_ray.sim.trace import of_iteration
from rrfp_ray.train.backend import Backend
from rrfp_ray.train.bytegate import ByteGate
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.sources import FeatureSource, SampleSource, packing_refusal
from rrfp_ray.train.workload import ModelWorkload

logger = logging.getLogger(__name__)


class PlannedRun(Protocol):
    """What planning reads of the run it plans, each time as the run holds it then."""

    pipeline: PipelineConfig
    workload: ModelWorkload
    backend: Backend
    iteration: int


class Planning:
    """The planned path of `run`. `planner` is made by the first planned iteration (None until then);
    `planning_s` and `plan_wait_s` hold, per planned iteration, the seconds its plan took (nan: the last
    plan ran) and the seconds it waited for it. `bytegate` gates the run's unplanned iterations in bytes."""

    def __init__(self, *, run: PlannedRun) -> None:
        self._run = run
        self.planner: Planner | None = None
        self._lookahead: Lookahead | None = None  # plans the next planned iteration while one runs
        self.planning_s: list[float] = []
        self.plan_wait_s: list[float] = []
        self.bytegate = ByteGate(shows=self.shown, pipeline=lambda: run.pipeline)  # for the unplanned iterations

    def state(self) -> dict[str, Any] | None:
        """The planner's state (`Planner.to_dict`) once every plan and observation asked for is done, as the
        checkpoint keeps it; None without a planner, or when planning did not settle within the pipeline's timeout."""
        timeout_s = self._run.pipeline.timeout_s
        if self._lookahead is not None and not self._lookahead.settle(timeout_s=timeout_s):
            logger.warning("the planner did not settle within %.1f s: its state is left out", timeout_s)
            return None
        return None if self.planner is None else self.planner.to_dict()

    @property
    def ran(self) -> Taken | None:
        """The plan the last planned iteration ran, with the bytes its arbiters gated by (None: none yet)."""
        return None if self._lookahead is None else self._lookahead.ran

    def ahead(self, *, iteration: int) -> Taken | None:
        """The plan made ahead for `iteration`, if it is made (`Lookahead.ahead`)."""
        return None if self._lookahead is None else self._lookahead.ahead(iteration=iteration)

    def restore(self, state: dict[str, Any] | None) -> None:
        """Take a checkpoint's planner state (`state`) when it plans the pipeline in use as the pipeline asks
        (its shape, cap, arrangement and search budget); else plan afresh."""
        pipeline = self._run.pipeline
        self.planner = None
        planned = {"stages": pipeline.stages, "chunks": pipeline.chunks, "microbatches": pipeline.microbatches}
        if state is not None and state["shape"] == planned:
            restored = Planner.from_dict(state)
            if restored.config == self._config(pipeline.arrange):
                self.planner = restored

    def _config(self, arrange: Arrangement) -> PlannerConfig:
        """The planner the pipeline asks for, arranging as `arrange` says."""
        pipeline = self._run.pipeline
        return PlannerConfig(
            hints=default_hints(chunks=pipeline.chunks),
            cap=pipeline.cap,
            arrange=arrange,
            simulations=pipeline.plan_simulations,
            samples=pipeline.plan_samples,
        )

    def iteration(self, arrange: Arrangement | None) -> IterationReport:
        """Run the plan made for this iteration while the one before ran (`rrfp_ray.plan.ahead`: from this
        iteration's features and the telemetry of iterations up to the one before that), ask for the next
        iteration's, then feed this one's report back. A new planner arranges as `arrange` says (None: the
        pipeline's arrange); the planner arranges as it was made unless `arrange` asks otherwise, then anew."""
        pipeline, iteration = self._run.pipeline, self._run.iteration
        shape = {"stages": pipeline.stages, "chunks": pipeline.chunks, "microbatches": pipeline.microbatches}
        changed = arrange is not None and self.planner is not None and self.planner.config.arrange is not arrange
        if self.planner is None or self.planner.shape != shape or changed:
            arrange = pipeline.arrange if arrange is None else arrange
            self.check_arrange(arrange)
            self.stop()
            self.planner = Planner(config=self._config(arrange), **shape)
        if self._lookahead is None:
            self._lookahead = Lookahead(planner=self.planner, shows=self.shown, timeout_s=pipeline.timeout_s)
        taken = self._lookahead.take(iteration=iteration)
        self.planning_s.append(taken.planning_s)
        self.plan_wait_s.append(taken.wait_s)
        self._lookahead.ask(iteration=iteration + 1)
        report = run_taken(backend=self._run.backend, taken=taken, iteration=iteration, shape=shape)
        self._lookahead.observe(report=report, taken=taken)
        logger.debug(
            "iteration %d: plan %s %s waited for %.2f ms (iteration %.1f ms)",
            iteration, taken.plan.hint, list(taken.plan.order), taken.wait_s * 1e3, report.makespan_ms,
        )  # fmt: skip
        return report

    def check_arrange(self, arrange: Arrangement) -> None:
        """ValueError naming what a planner that packs needs and this run has not got."""
        refusal = self._refusal(arrange)
        if refusal is not None:
            raise ValueError(refusal)

    def stop(self) -> None:
        """Drop the plans in flight (after a restart, a new shape or on close)."""
        if self._lookahead is not None:
            self._lookahead.close()
        self._lookahead = None

    def reset(self) -> None:
        """Drop the plans in flight and the planner (after a restart or a new shape): the checkpoint's planner,
        when it plans the shape then in use, or a fresh one plans on."""
        self.stop()
        self.planner = None

    def shown(self, iteration: int) -> Seen | None:
        """What `iteration`'s data shows the planner; each replica reads its own M microbatches, in one order. An
        injected trace of the iteration that records features stands for the data's cost: its features are what the
        data shows of each microbatch (every replica's microbatch j sleeps the trace's row j); a plan that packs
        still sees the data source's samples."""
        workload, dp = self._run.workload, self._run.pipeline.dp
        data, trace = workload.data, of_iteration(workload.injected, iteration)
        if trace is not None and trace.features is not None:
            features = list(trace.features) * dp
        elif isinstance(data, FeatureSource):
            features = data.features(iteration=iteration)
        else:
            return None
        shows = isinstance(data, SampleSource) and dp == 1  # for packing and padded sizes
        return seen(
            features,
            replicas=dp,
            microbatches=self._run.pipeline.microbatches,
            samples=data.sample_features(iteration=iteration) if shows else None,
        )

    def _refusal(self, arrange: Arrangement) -> str | None:
        """Why plans arranged so cannot pack this run's samples (None: they can, or they do not pack)."""
        if not arrange.packs:
            return None
        workload = self._run.workload
        refusal = packing_refusal(workload)
        if refusal is None and not isinstance(workload.data, FeatureSource):
            refusal = f"planning needs features(iteration=) of the data source; {type(workload.data).__name__}"
            refusal += " has not got them"
        if refusal is None and self._run.pipeline.dp != 1:
            refusal = f"a plan packs the samples of one replica: it needs dp 1, got dp {self._run.pipeline.dp}"
        return None if refusal is None else f"arrange {arrange.value}: {refusal}"


def run_taken(*, backend: Backend, taken: Taken, iteration: int, shape: dict[str, int]) -> IterationReport:
    """Iteration `iteration` of `backend` under the plan `taken` (for a pipeline of `shape`: stages, chunks,
    microbatches), its arbiters gated by the bytes the plan was scored with (a fixed hint is its own cap)."""
    plan = taken.plan
    policy = plan.validate(**shape)
    return backend.run_iteration(
        iteration=iteration,
        policy=policy,
        cap=plan.cap,
        order=plan.order,
        packing=plan.packing,
        data_bytes=None if policy.fixed else taken.data_bytes,
    )
