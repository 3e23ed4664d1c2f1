"""Admission in bytes for a `Trainer`'s readiness rules: what each microbatch of the next iteration will hold on each
stage, learned from the stages' telemetry (`StageStats.activation_bytes`) against what the data shows before it runs
(its cost feature and, where the samples are shown, its padded size: `rrfp_ray.plan.costs.padded_size`).

A rule with a `Kx` cap then gates on those bytes as the simulator does (`rrfp_ray.sim.memory.DataBytes`: K x the
peak bytes of the rule's own list on the same predicted bytes); before any telemetry, or where every microbatch is
predicted to weigh the same, the cap counts microbatches. Fixed schedules are never gated. A planned iteration gates
on its planner's own predictions (`rrfp_ray.plan.planner.Planner.data_bytes`)."""

from __future__ import annotations

from collections.abc import Callable

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.ahead import Seen
from rrfp_ray.plan.costs import CostModel, padded_size
from rrfp_ray.plan.packing import Packing
from rrfp_ray.plan.planner import measured_bytes
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.sim.memory import DataBytes
from rrfp_ray.train.backend import Backend
from rrfp_ray.train.config import PipelineConfig


class ByteGate:
    """`shows(iteration)`: what that iteration's data shows (None: nothing); `pipeline()`: the shape in use."""

    def __init__(self, *, shows: Callable[[int], Seen | None], pipeline: Callable[[], PipelineConfig]) -> None:
        self._shows = shows
        self._pipeline = pipeline
        self._model = CostModel()
        self._shape: tuple[int, int, int, tuple[int, ...] | None] | None = None  # what the bytes were learned on

    def run(self, *, backend: Backend, iteration: int, policy: Policy, packing: Packing | None) -> IterationReport:
        """One iteration on `backend` under the pipeline's cap, gated by `data_bytes`, its bytes then learned."""
        gate = self.data_bytes(iteration=iteration, policy=policy, cap=self._pipeline().cap)
        report = backend.run_iteration(iteration=iteration, policy=policy, packing=packing, data_bytes=gate)
        self.observe(report=report, packing=packing)
        return report

    def data_bytes(self, *, iteration: int, policy: Policy, cap: Cap) -> DataBytes | None:
        """What `iteration`'s arbiters gate `policy` by, in the data's own order (None: count microbatches)."""
        if policy.fixed or cap.multiple is None or self._shape != self._current():
            return None
        shown = self._shows(iteration)
        if shown is None:
            return None
        stages, chunks, microbatches, _ = self._shape
        padded = None if shown.samples is None else [padded_size(row) for row in shown.samples]
        rows = [
            self._model.activation_bytes(block=vs, features=shown.planned, count=microbatches, padded=padded)
            for vs in range(stages * chunks)
        ]
        if any(row is None for row in rows) or all(max(row) == min(row) for row in rows):
            return None
        return DataBytes(rows=tuple(tuple(row) for row in rows))

    def observe(self, *, report: IterationReport, packing: Packing | None) -> None:
        """Learn the bytes `report`'s stages measured (its microbatches made of the samples `packing`, if given)."""
        shape = self._current()
        if shape != self._shape:
            self._model, self._shape = CostModel(), shape
        stages, chunks, microbatches, _ = shape
        order = report.order or list(range(microbatches))
        measured = measured_bytes(report=report, order=order, stages=stages, chunks=chunks)
        shown = self._shows(report.iteration)
        if measured is None or shown is None:
            return
        if packing is not None:
            if shown.samples is None:
                return
            shown = shown.under(packing)
        padded = None if shown.samples is None else [padded_size(row) for row in shown.samples]
        self._model.observe_bytes(
            iteration=report.iteration, activation_bytes=measured, features=shown.observed, padded=padded
        )

    def _current(self) -> tuple[int, int, int, tuple[int, ...] | None]:
        """The shape in use: a new one, or layers moved between its stages, learns its bytes afresh."""
        pipeline = self._pipeline()
        return pipeline.stages, pipeline.chunks, pipeline.microbatches, pipeline.layer_split
