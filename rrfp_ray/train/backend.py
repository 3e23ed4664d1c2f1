"""Where a `Trainer`'s stages run: the backend protocol, and the one-process backend.

Both backends drive their stages with one `rrfp_ray.runtime.group.StageGroup`.
`LocalBackend` runs every stage as a thread of the caller's process over in-memory
channels (a `rrfp_ray.runtime.local.LocalPipeline`, the group in the caller's process): the same workers, arbiters,
telemetry and orchestration as on Ray, for debugging and tests. The Ray backend (stage actors under a
driver actor that runs the group) is `actors.backend.RayBackend`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from torch import Tensor

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.packing import Packing
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.runtime.executor import Executor
from rrfp_ray.runtime.group import StageGroup
from rrfp_ray.runtime.iteration import measures
from rrfp_ray.runtime.local import LocalPipeline
from rrfp_ray.train.checkpoint import Manifest, StageFile
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.workload import ModelWorkload


class Backend(Protocol):
    def start(self, *, pipeline: PipelineConfig, workload: ModelWorkload) -> None:
        """Bring the stages up and give each its share of `workload`."""
        ...

    def set_workload(self, *, workload: ModelWorkload) -> None:
        """Give every stage a fresh workload (another split of the same pipeline too: `Trainer.reshape`); the
        weights start again from the model as given."""
        ...

    def run_iteration(
        self,
        *,
        iteration: int,
        policy: Policy,
        cap: Cap | None = None,
        order: tuple[int, ...] | None = None,
        packing: Packing | None = None,
    ) -> IterationReport:
        """One iteration under `cap` (None: the pipeline's), slot s reading data microbatch `order[s]`, data
        microbatch j made of the samples `packing[j]` (None: the data's own microbatches)."""
        ...

    def evaluate(self, *, microbatches: int) -> float:
        """Mean validation loss over the first `microbatches` validation microbatches."""
        ...

    def save(self, *, directory: Path, iteration: int) -> dict[int, StageFile]:
        """Every stage writes its state; returns each stage's file for the manifest."""
        ...

    def load(self, *, directory: Path, manifest: Manifest) -> None:
        """Every stage loads what it holds from `manifest`'s files, whatever pipeline shape wrote them."""
        ...

    def chunk_states(self) -> list[dict[int, dict[str, Tensor]]]:
        """Every stage's (TP shard's, in `Mesh` index order) chunk weights, on the CPU."""
        ...

    def restart(self, *, pipeline: PipelineConfig | None = None, workload: ModelWorkload | None = None) -> None:
        """Tear the stages down (whatever state they are in) and bring fresh ones up with the workload;
        with `pipeline` and its `workload`, at that shape (`rrfp_ray.train.resize`). A cluster that does
        not hold them in time is a `rrfp_ray.errors.PlacementError`."""
        ...

    def can_place(self, *, pipeline: PipelineConfig) -> bool:
        """Whether the cluster holds `pipeline`'s stages now, counting what the running stages hold as
        free (they would make room for it)."""
        ...

    def close(self) -> None: ...


def run_iteration(
    *,
    group: StageGroup,
    pipeline: PipelineConfig,
    iteration: int,
    policy: Policy,
    cap: Cap | None = None,
    order: tuple[int, ...] | None = None,
    packing: Packing | None = None,
) -> IterationReport:
    """One iteration under `pipeline`'s receive-buffer limit, TP protocol and cap (unless `cap`), measuring
    its layers' costs when `pipeline.balance` says (`measures`): either backend's."""
    return group.run_iteration(
        iteration=iteration,
        policy=policy,
        cap=pipeline.cap if cap is None else cap,
        buffer_limit=pipeline.buffer_limit,
        tp_protocol=pipeline.tp_protocol,
        order=order,
        packing=packing,
        measure=measures(iteration=iteration, period=pipeline.balance.measure_period),
    )


class LocalBackend:
    def __init__(self) -> None:
        self._config: PipelineConfig | None = None
        self._local: LocalPipeline | None = None

    @property
    def executors(self) -> list[Executor]:
        """One per stage (per TP rank); tests may replace them."""
        return self._pipeline().executors

    @executors.setter
    def executors(self, executors: list[Executor]) -> None:
        self._pipeline().executors = executors

    def start(self, *, pipeline: PipelineConfig, workload: ModelWorkload) -> None:
        if self._local is not None:
            raise RuntimeError("this LocalBackend has already started; use one backend per Trainer")
        self._config = pipeline
        self._local = LocalPipeline(
            layout=pipeline.layout,
            timeout_s=pipeline.timeout_s,
            link_timeout_s=pipeline.link_timeout_s,
            tp=pipeline.tp,
            dp=pipeline.dp_spec,
            ties=tuple(dict.fromkeys(tie.stages for tie in workload.ties)),
        )
        try:
            self.set_workload(workload=workload)
        except BaseException:
            self.close()
            raise

    def set_workload(self, *, workload: ModelWorkload) -> None:
        self._running().set_workload(workload=workload)

    def run_iteration(
        self,
        *,
        iteration: int,
        policy: Policy,
        cap: Cap | None = None,
        order: tuple[int, ...] | None = None,
        packing: Packing | None = None,
    ) -> IterationReport:
        return run_iteration(
            group=self._running(),
            pipeline=self._config,
            iteration=iteration,
            policy=policy,
            cap=cap,
            order=order,
            packing=packing,
        )

    def evaluate(self, *, microbatches: int) -> float:
        return self._running().evaluate(microbatches=microbatches)

    def save(self, *, directory: Path, iteration: int) -> dict[int, StageFile]:
        return self._running().save(directory=str(directory), iteration=iteration)

    def load(self, *, directory: Path, manifest: Manifest) -> None:
        self._running().load(directory=str(directory), manifest=manifest)

    def chunk_states(self) -> list[dict[int, dict[str, Tensor]]]:
        return self._running().chunk_states()

    def restart(self, *, pipeline: PipelineConfig | None = None, workload: ModelWorkload | None = None) -> None:
        if pipeline is None:
            self._running().restart()
            return
        if workload is None:
            raise ValueError("restart at another pipeline shape needs that shape's workload")
        self.close()
        self.start(pipeline=pipeline, workload=workload)

    def can_place(self, *, pipeline: PipelineConfig) -> bool:
        return True  # threads of this process: any shape

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None

    def _running(self) -> StageGroup:
        return self._pipeline().group

    def _pipeline(self) -> LocalPipeline:
        if self._local is None:
            raise RuntimeError("the LocalBackend is not running: start() it first (a Trainer does), or it was closed")
        return self._local
