"""The Trainer's resizing: a restart whose stages the cluster does not hold within `resize_after` seconds
runs on at the first smaller shape it holds (`rrfp_ray.train.resize.shapes`) from the last checkpoint, and
at each later checkpoint goes back to the target once the cluster holds it again."""

from __future__ import annotations

import logging
from dataclasses import replace

from rrfp_ray.errors import PlacementError
from rrfp_ray.policy.policy import Policy
from rrfp_ray.train.backend import Backend
from rrfp_ray.train.build import checked
from rrfp_ray.train.checkpoint import Manifest
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.planning import Planning
from rrfp_ray.train.rebalancing import Rebalancing
from rrfp_ray.train.resize import shapes
from rrfp_ray.train.workload import ModelWorkload

logger = logging.getLogger(__name__)


class Resizing:
    """The resize steps of `rrfp_ray.train.api.Trainer`, which holds the state they change and the steps
    they share with its restarts (`_latest`, `_resume`, `_rebalancing`, `_describe`)."""

    pipeline: PipelineConfig
    target: PipelineConfig
    workload: ModelWorkload
    _target_workload: ModelWorkload
    backend: Backend
    planning: Planning
    _policies: dict[str, Policy]
    rebalancing: Rebalancing | None
    iteration: int
    resizes: list[tuple[int, PipelineConfig]]

    def _shrink(self, *, manifest: Manifest | None, unplaced: PlacementError, failed: PipelineConfig) -> None:
        """Bring the stages up from `manifest` at the first shape the cluster holds now (`resize.shapes`,
        each tried once but `failed`, whose placement did not finish); a PlacementError when none is placed."""
        for shape in shapes(target=self.target):
            if shape == failed or not self.backend.can_place(pipeline=shape):
                continue
            logger.warning(
                "resizing: the cluster did not hold %s within %g s; going on at %s from %s",
                self._describe(failed), self.pipeline.resize_after, self._describe(shape), _source(manifest),
            )  # fmt: skip
            try:
                self._resize_to(shape, manifest=manifest)
                return
            except PlacementError as again:
                unplaced, failed = again, shape
        raise PlacementError(f"resize: no shape of {self._describe(self.target)} could be placed; last: {unplaced}")

    def _grow_back(self) -> None:
        """At a smaller shape, go back to the target from the checkpoint just committed if the cluster holds it now."""
        if self.pipeline is self.target or not self.backend.can_place(pipeline=self.target):
            return
        manifest = self._latest()
        logger.warning(
            "resizing: the cluster holds %s again; leaving %s from %s",
            self._describe(self.target), self._describe(self.pipeline), _source(manifest),
        )  # fmt: skip
        try:
            self._resize_to(self.target, manifest=manifest)
        except PlacementError as unplaced:  # its nodes went again before the stages were placed
            self._shrink(manifest=manifest, unplaced=unplaced, failed=self.target)

    def _resize_to(self, shape: PipelineConfig, *, manifest: Manifest | None) -> None:
        """Fresh stages at `shape`, resumed from `manifest` (None: the initial weights, iteration 0)."""
        workload = self._target_workload
        if shape is not self.target:
            changed = {"microbatches": shape.microbatches, "dp": shape.dp, "layer_split": shape.layer_split}
            workload = checked(replace(workload, **changed), pipeline=shape)
        self.planning.reset()  # a planner plans one shape: the checkpoint's, if of this shape, or a fresh one
        self.backend.restart(pipeline=shape, workload=workload)
        self.pipeline, self.workload = shape, workload
        self._policies.clear()  # built for the shape in use
        self.rebalancing = self._rebalancing()  # measures and moves this shape's layers afresh
        self._resume(manifest)
        self.resizes.append((self.iteration, shape))
        logger.warning("resized to %s at iteration %d", self._describe(shape), self.iteration)


def _source(manifest: Manifest | None) -> str:
    return "the initial weights" if manifest is None else f"the checkpoint of iteration {manifest.iteration}"
