"""Where a `Trainer`'s stages run: the backend protocol, and the one-process backend.

`LocalBackend` runs every stage as a thread of the caller's process over in-memory
channels: the same workers, arbiters and telemetry as on Ray, for debugging and tests.
The Ray backend (stage actors under a driver actor) is `actors.backend.RayBackend`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.policy.pickers import Policy
from rrfp_ray.runtime.local import LocalPipeline
from rrfp_ray.runtime.worker import Executor
from rrfp_ray.schedule.actions import place
from rrfp_ray.train.checkpoint import Manifest, StageFile
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.workload import ModelWorkload


class Backend(Protocol):
    def start(self, *, pipeline: PipelineConfig, workload: ModelWorkload) -> None:
        """Bring the stages up and give each its share of `workload`."""
        ...

    def set_workload(self, *, workload: ModelWorkload) -> None:
        """Give every stage a fresh workload: the weights start again from the model as given."""
        ...

    def run_iteration(self, *, iteration: int, policy: Policy) -> IterationReport: ...

    def evaluate(self, *, microbatches: int) -> float:
        """Mean validation loss over the first `microbatches` validation microbatches."""
        ...

    def save(self, *, directory: Path, iteration: int) -> dict[int, StageFile]:
        """Every stage writes its state; returns each stage's file for the manifest."""
        ...

    def load(self, *, directory: Path, manifest: Manifest) -> None: ...

    def restart(self) -> None:
        """Tear the stages down (whatever state they are in) and bring fresh ones up with the workload."""
        ...

    def close(self) -> None: ...


class LocalBackend:
    def __init__(self) -> None:
        self.executors: list[Executor] = []  # one per stage; tests may wrap them
        self._config: PipelineConfig | None = None
        self._pipeline: LocalPipeline | None = None
        self._workload: ModelWorkload | None = None

    def start(self, *, pipeline: PipelineConfig, workload: ModelWorkload) -> None:
        if self._pipeline is not None:
            raise RuntimeError("this LocalBackend has already started; use one backend per Trainer")
        self._config = pipeline
        self._pipeline = LocalPipeline(
            layout=pipeline.layout, timeout_s=pipeline.timeout_s, link_timeout_s=pipeline.link_timeout_s, tp=pipeline.tp
        )
        try:
            self.set_workload(workload=workload)
        except BaseException:
            self.close()
            raise

    def set_workload(self, *, workload: ModelWorkload) -> None:
        config = self._started()
        self._workload = workload
        self.executors = []
        for stage in range(config.stages):
            for rank in range(config.tp):
                shard = workload
                if config.tp > 1:
                    all_reduce = self._pipeline.tp_all_reduce(stage=stage, rank=rank)
                    shard = workload.with_tp(rank=rank, size=config.tp, all_reduce=all_reduce)
                self.executors.append(shard.executor(stage=stage, layout=config.layout))

    def run_iteration(self, *, iteration: int, policy: Policy) -> IterationReport:
        config = self._started()
        return self._pipeline.run_iteration(
            iteration=iteration,
            policy=policy,
            cap=config.cap,
            executors=self.executors,
            buffer_limit=config.buffer_limit,
            latency=self._workload.latency,
            protocol=config.tp_protocol,
        )

    def evaluate(self, *, microbatches: int) -> float:
        config = self._started()

        def chain(index: int, rank: int) -> float:
            out = None
            for vs in range(config.layout.virtual_stages):
                stage, chunk = place(virtual_stage=vs, stages=config.stages)
                out = self.executors[stage * config.tp + rank].evaluate(chunk=chunk, inputs=out, index=index)
            return float(out)

        with ThreadPoolExecutor(max_workers=config.tp) as pool:  # TP ranks meet in their all-reduces
            losses = [list(pool.map(lambda rank, i=index: chain(i, rank), range(config.tp)))[0] for index in range(microbatches)]
        return sum(losses) / len(losses)

    def save(self, *, directory: Path, iteration: int) -> dict[int, StageFile]:
        self._started()
        return {s: e.save(directory=directory, iteration=iteration, shard=s) for s, e in enumerate(self.executors)}

    def load(self, *, directory: Path, manifest: Manifest) -> None:
        self._started()
        for stage, executor in enumerate(self.executors):
            executor.load(directory=directory, file=manifest.files[stage])

    def restart(self) -> None:
        config, workload = self._started(), self._workload
        self.close()
        self.start(pipeline=config, workload=workload)

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def _started(self) -> PipelineConfig:
        if self._pipeline is None or self._config is None:
            raise RuntimeError("the LocalBackend is not running: start() it first (a Trainer does), or it was closed")
        return self._config
