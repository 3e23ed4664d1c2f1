"""The Ray backend of a `Trainer`: one actor per stage, under a `PipelineDriver` actor.

    from actors.backend import RayBackend
    trainer = Trainer(..., backend=RayBackend())

Uses the Ray this process is connected to; with none, starts an embedded local Ray (one
logical CPU per stage, this repository on the workers' PYTHONPATH) and shuts it down on
`close`.

If the driver actor itself dies (killed, or its node lost), every call fails at once with a
PipelineError naming it (its stage actors die with it: Ray ends the actors an actor owns,
but not the placement groups it made, which live as long as the job); `restart` then removes
the dead driver's placement groups and brings up a new driver, with the pipeline and the last
workload given, so a Trainer with restarts left rebuilds it and resumes from its last manifest. The workload reaches the
actors through Ray's cloudpickle: builders may be lambdas or local functions, and classes defined in `__main__` travel
by value; classes in other modules must be importable on the workers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
from pydantic import ValidationError

from actors.driver import PipelineDriver
from actors.local_ray import init_ray
from actors.names import driver_name, replacement, run_tag
from actors.placement import DEFAULT_TIMEOUT_S, StagePlacement, can_place, remove_orphans
from actors.placement import check as check_placement
from actors.teardown import await_exit, let_report
from rrfp_ray.errors import RrfpError
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.packing import Packing
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.runtime.worker import PipelineError
from rrfp_ray.sim.memory import DataBytes
from rrfp_ray.train.checkpoint import Manifest, StageFile
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.workload import ModelWorkload

_EXIT_S = 30.0  # how long the driver gets to exit on its own once its stages are down
_PROBE_S = 10.0  # how long `can_place` waits for groups the cluster could hold at once
_SHUTDOWN_S = 90.0  # beyond the pipeline's timeout: the stages' exit, placement groups' removal, a loaded machine
logger = logging.getLogger(__name__)


class RayBackend:
    def __init__(
        self,
        *,
        gpus_per_stage: float = 0.0,
        stage_resources: dict[str, float] | None = None,
        placement_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """`stage_resources` adds Ray resources to every stage's bundle (aims stages at a node type);
        placement waits up to `placement_timeout_s` for an autoscaler to add the nodes. A pipeline the
        cluster can never hold is refused before any actor starts (`actors.capacity`)."""
        try:
            self.placement = StagePlacement(
                gpus_per_stage=gpus_per_stage, resources=stage_resources or {}, timeout_s=placement_timeout_s
            )
        except ValidationError as error:
            raise ValueError("; ".join(f"{e['loc'][0]}: {e['msg']}" for e in error.errors())) from None
        self.driver: ray.actor.ActorHandle | None = None
        self.startup_s: float | None = None  # placement, actors and links, as the driver measured it
        self._owns_ray = False
        self._name = ""  # the driver actor's
        self._run = ""  # its run tag (actors.names), once started
        self._drivers = 0  # how many drivers it has started
        self._pipeline: PipelineConfig | None = None
        self._workload: ModelWorkload | None = None  # the last given: a rebuilt driver starts with it
        self._driver_lost = False

    def start(self, *, pipeline: PipelineConfig, workload: ModelWorkload) -> None:
        if self.driver is not None:
            raise RuntimeError("this RayBackend has already started; use one backend per Trainer")
        self._owns_ray = init_ray(num_cpus=max(2, pipeline.actors))
        self._pipeline, self._workload = pipeline, workload
        try:
            check_placement(self.placement.demand(dp=pipeline.dp, stages=pipeline.stages, tp=pipeline.tp))
            self._spawn_driver()
        except BaseException:
            self.close()
            raise

    def _spawn_driver(self) -> None:
        self._run = self._run or run_tag()  # one tag for the job's driver and its stages (actors.names)
        run = replacement(self._run, mark="d", count=self._drivers)  # a dead driver may not have released its name
        placement = self.placement
        if self._drivers and self._pipeline.resize_after is not None:  # a restart: past this the job resizes
            placement = placement.model_copy(
                update={"timeout_s": min(placement.timeout_s, self._pipeline.resize_after)}
            )
        self._drivers += 1
        self._name = driver_name(run=run)
        self.driver = PipelineDriver.options(name=self._name).remote(
            pipeline=self._pipeline, workload=self._workload, placement=placement, run=run
        )
        self._driver_lost = False
        self.startup_s = self._call(self.driver.startup_seconds.remote())

    def set_workload(self, *, workload: ModelWorkload) -> None:
        self._workload = workload
        self._call(self._driver().set_workload.remote(workload=workload))

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
        return self._call(
            self._driver().run_iteration.remote(
                iteration=iteration, policy=policy, cap=cap, order=order, packing=packing, data_bytes=data_bytes
            )
        )

    def evaluate(self, *, microbatches: int) -> float:
        return self._call(self._driver().evaluate.remote(microbatches=microbatches))

    def save(self, *, directory: Path, iteration: int) -> dict[int, StageFile]:
        return self._call(self._driver().save.remote(directory=str(directory), iteration=iteration))

    def load(self, *, directory: Path, manifest: Manifest) -> None:
        self._call(self._driver().load.remote(directory=str(directory), manifest=manifest))

    def chunk_states(self) -> list[dict]:
        return self._call(self._driver().chunk_states.remote())

    def restart(self, *, pipeline: PipelineConfig | None = None, workload: ModelWorkload | None = None) -> None:
        """Fresh stage actors under the same driver; or, if the driver died, a fresh driver with fresh stages;
        with `pipeline` and its `workload`, a fresh driver at that shape once the old one has shut down.
        With `resize_after`, placement after the first waits that long at most."""
        if pipeline is not None:
            if workload is None:
                raise ValueError("restart at another pipeline shape needs that shape's workload")
            self._stop_driver()
            self._pipeline, self._workload = pipeline, workload
            self._spawn_driver()
            return
        if not self._driver_lost:
            self._call(self._driver().restart.remote())
            return
        logger.warning("the pipeline driver actor died; starting a new one")
        _end(self._driver())
        self._spawn_driver()

    def can_place(self, *, pipeline: PipelineConfig) -> bool:
        """Asks for the placement groups `pipeline` needs beyond those the running stages hold (every
        group is T bundles on one node, and T is the same at every shape a job resizes to), waiting up
        to `_PROBE_S`: a cluster whose autoscaler is adding the nodes says no now and yes at a later ask."""
        held = 0
        if self.driver is not None and not self._driver_lost and pipeline.tp == self._pipeline.tp:
            try:
                held = self._call(self.driver.placed_groups.remote())
            except PipelineError:
                held = 0  # the driver died: its groups are orphans, freed by the restart
        wanted = pipeline.dp * pipeline.stages - held
        if wanted <= 0:
            return True
        return can_place(demand=self.placement.demand(dp=1, stages=wanted, tp=pipeline.tp), timeout_s=_PROBE_S)

    def close(self) -> None:
        """Shut the stages down and wait for that call to finish, then let the driver exit (killed
        if it does not), and end the Ray this backend started: in that order, so that no call is
        left unrecorded (actors.teardown). A driver is killed at once only when its shutdown failed
        or did not finish in time, and then with a warning that says which."""
        self._stop_driver()
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def _stop_driver(self) -> None:
        if self.driver is not None:
            driver, self.driver = self.driver, None
            timeout_s = (self._pipeline.timeout_s if self._pipeline else 0.0) + _SHUTDOWN_S
            try:
                ray.get(driver.shutdown.remote(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                logger.warning("the pipeline driver did not shut its stages down within %g s; killing it", timeout_s)
                _end(driver)
            except ray.exceptions.RayActorError:
                _end(driver)  # it died already (e.g. during startup): nothing to wait for
            except ray.exceptions.RayError as error:
                logger.warning("the pipeline driver's shutdown failed; killing it: %s", error)
                _end(driver)
            else:
                # its last handle dropped, Ray ends it gracefully; a __ray_terminate__ call of this
                # process's might not be recorded before the job ends
                let_report()
                actor_id = driver._actor_id.hex()
                del driver
                if await_exit([actor_id], timeout_s=_EXIT_S):
                    logger.warning("the pipeline driver did not exit within %g s of its shutdown; killing it", _EXIT_S)
                    try:
                        ray.kill(ray.get_actor(self._name))
                    except ValueError:
                        pass  # it exited meanwhile and released its name

    def _call(self, ref: ray.ObjectRef) -> Any:
        """ray.get; a stage's failure arrives as the driver's PipelineError, the driver's own death as one."""
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, RrfpError):
                raise error.cause from None  # the driver's own (a PipelineError with its culprit, a PlacementError)
            raise
        except ray.exceptions.RayActorError as error:
            self._driver_lost = True
            raise PipelineError(f"the pipeline driver actor (PipelineDriver) died: {error}") from error

    def _driver(self) -> ray.actor.ActorHandle:
        if self.driver is None:
            raise RuntimeError("the RayBackend is not running: start() it first (a Trainer does), or it was closed")
        return self.driver


def _end(driver: ray.actor.ActorHandle) -> None:
    """Kill a lost driver (or one that cannot shut down) and free the placement groups it held:
    a group made in an actor outlives it, holding its CPUs until the job ends."""
    ray.kill(driver)
    await_exit([driver._actor_id.hex()], timeout_s=_EXIT_S)
    remove_orphans()
