"""The Ray backend of a `Trainer`: one actor per stage, under a `PipelineDriver` actor.

    from actors.backend import RayBackend
    trainer = Trainer(..., backend=RayBackend())

Uses the Ray this process is connected to; with none, starts an embedded local Ray (one
logical CPU per stage, this repository on the workers' PYTHONPATH) and shuts it down on
`close`. The workload reaches the actors through Ray's cloudpickle: builders may be
lambdas or local functions, and classes defined in `__main__` travel by value; classes
in other modules must be importable on the workers.
"""

from __future__ import annotations

from pathlib import Path

import ray

from actors.driver import PipelineDriver
from rrfp_ray.config import PipelineConfig
from rrfp_ray.policy import Policy
from rrfp_ray.telemetry import IterationReport
from rrfp_ray.training import ModelWorkload

ROOT = Path(__file__).resolve().parent.parent


class RayBackend:
    def __init__(self, *, use_gpu: bool = False) -> None:
        self.use_gpu = use_gpu
        self.driver: ray.actor.ActorHandle | None = None
        self.startup_s: float | None = None  # placement, actors and links, as the driver measured it
        self._owns_ray = False

    def start(self, *, pipeline: PipelineConfig, workload: ModelWorkload) -> None:
        if self.driver is not None:
            raise RuntimeError("this RayBackend has already started; use one backend per Trainer")
        if not ray.is_initialized():
            ray.init(
                num_cpus=max(2, pipeline.stages),
                include_dashboard=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
            )
            self._owns_ray = True
        self.driver = PipelineDriver.remote(pipeline=pipeline, workload=workload, use_gpu=self.use_gpu)
        try:
            self.startup_s = ray.get(self.driver.startup_seconds.remote())
        except BaseException:
            self.close()
            raise

    def set_workload(self, *, workload: ModelWorkload) -> None:
        ray.get(self._driver().set_workload.remote(workload=workload))

    def run_iteration(self, *, iteration: int, policy: Policy) -> IterationReport:
        return ray.get(self._driver().run_iteration.remote(iteration=iteration, policy=policy))

    def evaluate(self, *, microbatches: int) -> float:
        return ray.get(self._driver().evaluate.remote(microbatches=microbatches))

    def close(self) -> None:
        """Shut the stages down gracefully, then end the driver (and the Ray this backend started)."""
        if self.driver is not None:
            try:
                ray.get(self.driver.shutdown.remote())
            except ray.exceptions.RayError:
                pass  # the driver died already (e.g. during startup); killing it below is all that is left
            finally:
                ray.kill(self.driver)
                self.driver = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def _driver(self) -> ray.actor.ActorHandle:
        if self.driver is None:
            raise RuntimeError("the RayBackend is not running: start() it first (a Trainer does), or it was closed")
        return self.driver
