"""Pipeline any PyTorch model: `Trainer` over a local or a Ray backend.

    trainer = Trainer(model=nn.Sequential(...), loss_fn=F.mse_loss, data=source,
                      pipeline=PipelineConfig(stages=2, microbatches=4))
    reports = trainer.fit(100)

What every stage receives is built from the Trainer's arguments and dry-run in `build`; planned
iterations go through `planning`, a new layer split through `reshaping`, a smaller shape through `resizing`.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from rrfp_ray.errors import ExitCode, PlacementError
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.packing import Packing
from rrfp_ray.plan.planner import Arrangement, Planner, default_hints
from rrfp_ray.policy.policy import Policy
from rrfp_ray.runtime.worker import PipelineError
from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.backend import Backend, LocalBackend
from rrfp_ray.train.build import (
    OptimizerArg,
    check_global_batch,
    checked,
    make_workload,
    model_parameters,
    pipeline_shape,
)
from rrfp_ray.train.checkpoint import (
    Checkpointing,
    Manifest,
    Shape,
    commit,
    latest,
    parameters_fingerprint,
    resume_point,
)
from rrfp_ray.train.config import PLANNED, PipelineConfig
from rrfp_ray.train.export import unsplit_state_dict
from rrfp_ray.train.layers import ModelSource
from rrfp_ray.train.planning import Planning
from rrfp_ray.train.rebalancing import Move, Rebalancing
from rrfp_ray.train.reshaping import moved, resplit
from rrfp_ray.train.resizing import Resizing
from rrfp_ray.train.runner import LossFn
from rrfp_ray.train.sources import DataSource, check_packing

logger = logging.getLogger(__name__)


class Trainer(Resizing):
    """Trains `model` through a readiness-driven pipeline.

    `model`: a list of modules or an `nn.Sequential` (split evenly into stages x chunks), or any module with
    `split_points` (names of its children to cut before, one part per virtual stage), or a zero-argument builder of
    either (run under a torch RNG seeded with `seed`, so every stage builds the same weights). Modules given built
    are copied: the caller's are never trained in place. `optimizer`: `Optim` (AdamW, warmup, cosine, global-norm
    clipping; the default), or a factory `params -> torch.optim.Optimizer` (its own learning rates, no clipping;
    `FactoryOptim(factory, max_grad_norm=...)` clips). `backend`: `LocalBackend()` (the default: threads of this
    process) or `actors.backend.RayBackend()` (one Ray actor per stage). `slow_devices`: stage -> factor, that
    stage's device emulated as computing factor times slower (`rrfp_ray.runtime.measure.Throttle`). `injected`: a
    `Trace` of delays every op sleeps, or one per iteration (cycling); its rows are data microbatches, and its
    features, where it has them, are what the data shows a planner.

    With `pipeline.resize_after`, a restart whose stages the cluster does not hold within that
    many seconds runs on at a smaller shape (`rrfp_ray.train.resize`) from the last checkpoint,
    and at each later checkpoint goes back to `pipeline` once the cluster holds it again;
    `self.pipeline` is the shape in use, `self.target` the one asked for.
    """

    def __init__(
        self,
        *,
        model: ModelSource,
        loss_fn: LossFn,
        data: DataSource,
        pipeline: PipelineConfig,
        optimizer: OptimizerArg | None = None,
        split_points: Sequence[str] | None = None,
        val_data: DataSource | None = None,
        backend: Backend | None = None,
        seed: int = 0,
        injected: Trace | Sequence[Trace] | None = None,
        checkpoints: Checkpointing | None = None,
        device: str = "cpu",
        slow_devices: dict[int, float] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.target = pipeline
        self.checkpoints = checkpoints
        self.workload = make_workload(
            model=model,
            loss_fn=loss_fn,
            data=data,
            pipeline=pipeline,
            optimizer=optimizer,
            split_points=split_points,
            val_data=val_data,
            seed=seed,
            injected=injected,
            device=device,
            slow_devices=slow_devices,
        )
        self.workload = checked(self.workload, pipeline=pipeline)
        self._target_workload = self.workload
        self.planning = Planning(run=self)
        if pipeline.policy == PLANNED:
            self.planning.check_arrange(pipeline.arrange)
        built = self.workload.layers()
        self.parameters = model_parameters(built)
        self.fingerprint = parameters_fingerprint(self.parameters)
        self._n_layers = len(built)
        resume = None
        if checkpoints is not None and checkpoints.resume:  # a CheckpointError saying what is wrong, before any start
            directory = Path(checkpoints.directory)
            resume = resume_point(directory=directory, fingerprint=self.fingerprint, parameters=self.parameters)
            check_global_batch(saved=resume.shape, pipeline=pipeline)
        self.backend: Backend = LocalBackend() if backend is None else backend
        self.backend.start(pipeline=pipeline, workload=self.workload)
        self.iteration = 0
        self.restarts = 0
        self._restored = 0  # the restart whose first iteration is still to run (0: none)
        self.skipped_steps = 0  # iterations whose gradient norm was inf or NaN: no stage stepped
        self._policies: dict[str, Policy] = {}
        self.resumed: str | None = None  # what the last checkpoint loaded was: its iteration, its shape and this one
        self.resizes: list[tuple[int, PipelineConfig]] = []  # (iteration, shape): each resize, where it resumed
        self._device = device
        self.rebalancing = self._rebalancing()
        if resume is not None:
            self._restore(resume)

    def step(
        self, *, policy: str | None = None, arrange: Arrangement | None = None, packing: Packing | None = None
    ) -> IterationReport:
        """One iteration (all microbatches, then the optimizer step) under `policy` (default: the config's),
        then the checkpoint, if one is due. `arrange`: what a `planned` iteration's plan arranges (default: the
        config's). `packing`: a fixed policy's iteration trains on these microbatches (per data microbatch of
        every replica, D x M, the indexes of the global batch's samples it holds; `SampleSource`), not the
        data's own; a `planned` iteration packs by its plan.

        A lost stage, in the iteration or in its checkpoint, rebuilds the pipeline from the last
        checkpoint and goes on, up to `checkpoints.max_restarts` times; the iterations since that
        checkpoint run again.
        """
        while True:
            try:
                name = self.pipeline.policy if policy is None else policy
                if name == PLANNED:
                    if packing is not None:
                        raise ValueError(
                            "packing is for a fixed policy: a planned iteration packs by its plan (arrange)"
                        )
                    report = self.planning.iteration(arrange)
                else:
                    if packing is not None:
                        check_packing(packing=packing, workload=self.workload, iteration=self.iteration)
                    report = self.planning.bytegate.run(
                        backend=self.backend, iteration=self.iteration, policy=self._policy(name), packing=packing
                    )
            except PipelineError as error:
                self._recover(error, failed=f"iteration {self.iteration}")
                continue
            report.restart, self._restored = self._restored, 0
            if self.pipeline is not self.target:
                report.shape = self._describe(self.pipeline)
            if report.skipped_step:
                self.skipped_steps += 1
                logger.warning(
                    "iteration %d skipped its optimizer step: non-finite gradients (%d so far)",
                    report.iteration, self.skipped_steps,
                )  # fmt: skip
            self.iteration += 1
            if self.rebalancing is not None:
                self.rebalancing.after(report)
            if self.checkpoints is None or not self.checkpoints.every or self.iteration % self.checkpoints.every:
                return report
            try:
                self.save()
                self._grow_back()
                return report
            except PipelineError as error:
                self._recover(error, failed=f"the checkpoint of iteration {self.iteration}")

    @property
    def moves(self) -> list[Move]:
        """The rebalancer's moves so far, in order (none without `pipeline.balance.rebalance`)."""
        return [] if self.rebalancing is None else list(self.rebalancing.moves)

    def state_dict(self) -> dict[str, Tensor]:
        """The unsplit model's weights, gathered from every stage, chunk and TP shard (tied ones once):
        what `model.load_state_dict` takes for the model as given (`rrfp_ray.train.export.load_unsplit`)."""
        return unsplit_state_dict(
            layers=self.workload.layers,
            stages=self.pipeline.stages,
            chunks=self.pipeline.chunks,
            tp=self.pipeline.tp,
            shards=self.backend.chunk_states(),
            placement=self.pipeline.layout.placement,
            sizes=self.pipeline.layer_split,
        )

    def save(self) -> Path:
        """Checkpoint now: every stage writes its file, then the manifest is committed.

        A stage that fails or dies while writing, or a manifest that cannot be written, is a
        PipelineError; the manifest is then not written, so the previous checkpoint stays the newest."""
        if self.checkpoints is None:
            raise ValueError("save() needs checkpoints=Checkpointing(directory=...) given to the Trainer")
        directory = Path(self.checkpoints.directory)
        files = self.backend.save(directory=directory, iteration=self.iteration)
        planner = self.planner_state()
        manifest = Manifest(
            iteration=self.iteration,
            fingerprint=self.fingerprint,
            files=files,
            shape=self.shape,
            parameters=self.parameters,
            planner=planner,
        )
        try:
            path = commit(directory=directory, manifest=manifest)
        except OSError as error:
            raise PipelineError(
                f"the manifest of iteration {self.iteration} could not be written to {directory}: {error}"
            ) from error
        logger.info("checkpoint of iteration %d committed: %s", self.iteration, path)
        return path

    @property
    def shape(self) -> Shape:
        """This pipeline's shape, as a checkpoint records it."""
        return pipeline_shape(pipeline=self.pipeline, n_layers=self._n_layers)

    def reshape(self, *, layer_split: tuple[int, ...]) -> float:
        """Move the running pipeline (the same stages, TP, DP and chunks) to `layer_split` (layers per virtual
        stage) at this iteration boundary, losing no work: every stage writes its state by parameter to a
        scratch directory (a fresh `reshape-*` one in the checkpoint directory, else a temporary one; the
        committed checkpoints are left alone, and it is removed after), takes the workload of the new split
        (its ties found again) and loads what it now holds. Training goes on as if the split had always been
        this one. Returns the seconds it took; logs which layers moved between which stages. Stage actors on
        several nodes need the checkpoint directory (shared storage) for the scratch save.

        A stage lost meanwhile is a PipelineError to the caller (no restart here): lost in the save, the
        pipeline keeps its split; lost after, it holds the new one, and a restart loads the last checkpoint."""
        started = time.perf_counter()
        pipeline, workload = resplit(pipeline=self.pipeline, workload=self.workload, layer_split=layer_split)
        before = self.shape
        base = None
        if self.checkpoints is not None:
            base = Path(self.checkpoints.directory)
            base.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="reshape-", dir=base) as scratch:
            directory = Path(scratch)
            files = self.backend.save(directory=directory, iteration=self.iteration)
            manifest = Manifest(
                iteration=self.iteration, fingerprint=self.fingerprint, files=files, shape=before,
                parameters=self.parameters,
            )  # fmt: skip
            self.backend.set_workload(workload=workload)
            if self.pipeline is self.target:  # the asked-for shape takes the new split too
                self.target, self._target_workload = pipeline, workload
            self.pipeline, self.workload = pipeline, workload  # what the stages now run, whether the load works or not
            self.backend.load(directory=directory, manifest=manifest)
        seconds = time.perf_counter() - started
        logger.info(
            "reshape at iteration %d: split %s -> %s; %s (every stage saved by name and reloaded: %.2f s)",
            self.iteration, ",".join(map(str, before.layer_split)), ",".join(map(str, self.shape.layer_split)),
            moved(before=before, after=self.shape), seconds,
        )  # fmt: skip
        return seconds

    def _latest(self) -> Manifest | None:
        return latest(
            directory=Path(self.checkpoints.directory), fingerprint=self.fingerprint, parameters=self.parameters
        )

    def _recover(self, error: PipelineError, *, failed: str) -> None:
        """Rebuild the pipeline and load the last checkpoint; a rebuild that fails too takes the next restart."""
        allowed = 0 if self.checkpoints is None else self.checkpoints.max_restarts
        while True:
            if self.restarts >= allowed:
                raise PipelineError(f"{failed} failed after {self.restarts} restart(s): {error}") from error
            self.restarts += 1
            manifest = self._latest()
            if manifest is None:
                restoring = "no checkpoint yet: the initial weights, from iteration 0"
            else:
                restoring = f"checkpoint {Path(self.checkpoints.directory) / f'manifest-{manifest.iteration:08d}.json'}"
                restoring += f" (iteration {manifest.iteration})"
            logger.warning(
                "restart %d of %d: %s in %s; restoring %s",
                self.restarts, allowed, error.culprit or "the pipeline failed", failed, restoring,
            )  # fmt: skip
            try:
                self.planning.reset()  # the checkpoint's planner, if any, plans again
                try:
                    self.backend.restart()
                except PlacementError as unplaced:
                    if self.pipeline.resize_after is None:
                        raise
                    self._shrink(manifest=manifest, unplaced=unplaced, failed=self.pipeline)  # restores the manifest
                else:
                    self._resume(manifest)
                self._restored = self.restarts
                return
            except PipelineError as again:
                if again.exit_code is ExitCode.BAD_INPUT:
                    raise  # a checkpoint the stages refuse: no restart can load it
                error, failed = again, f"restart {self.restarts}"

    def _rebalancing(self) -> Rebalancing | None:
        """The rebalancer of the pipeline in use, when its config asks for one."""
        if not self.pipeline.balance.rebalance:
            return None
        hint = default_hints(chunks=1)[0] if self.pipeline.policy == PLANNED else self.pipeline.policy
        return Rebalancing(pipeline=self.pipeline, policy=self._policy(hint), device=self._device, reshape=self.reshape)

    def _describe(self, pipeline: PipelineConfig) -> str:
        return pipeline_shape(pipeline=pipeline, n_layers=self._n_layers).describe()

    def _resume(self, manifest: Manifest | None) -> None:
        if manifest is None:
            self.iteration = 0  # the fresh stages hold the initial weights
        else:
            self._restore(manifest)

    def _restore(self, manifest: Manifest) -> None:
        shape = self.shape
        onto = "the same shape" if manifest.shape == shape else shape.describe()
        self.resumed = (
            f"resuming iteration {manifest.iteration} of a {manifest.shape.describe()} checkpoint onto {onto}"
        )
        logger.info("%s", self.resumed)
        self.backend.load(directory=Path(self.checkpoints.directory), manifest=manifest)
        self.iteration = manifest.iteration
        self.planning.restore(manifest.planner)
        logger.info("resumed from the checkpoint of iteration %d in %s", manifest.iteration, self.checkpoints.directory)

    def fit(self, iterations: int, *, policy: str | None = None) -> list[IterationReport]:
        if iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {iterations}")
        return [self.step(policy=policy) for _ in range(iterations)]

    def evaluate(self) -> float:
        """Mean loss over the validation microbatches (forward only)."""
        if self.workload.val_data is None:
            raise ValueError("evaluate() needs val_data, given to the Trainer")
        return self.backend.evaluate(microbatches=self.workload.val_data.microbatches)

    def reset(self) -> None:
        """Start again from the initial weights, fresh optimizer state, at iteration 0."""
        self.backend.set_workload(workload=self.workload)
        self.iteration = 0

    def close(self) -> None:
        self.planning.stop()
        self.backend.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def planner(self) -> Planner | None:
        """The planner of the planned iterations (None until the first one, and after a restart or a new shape)."""
        return self.planning.planner

    @planner.setter
    def planner(self, planner: Planner | None) -> None:
        self.planning.planner = planner

    @property
    def planning_s(self) -> list[float]:
        """Per planned iteration: the seconds its plan took (nan: the last plan ran)."""
        return self.planning.planning_s

    @property
    def plan_wait_s(self) -> list[float]:
        """Per planned iteration: the seconds it waited for its plan."""
        return self.planning.plan_wait_s

    def planner_state(self) -> dict[str, Any] | None:
        """The planner's state as the checkpoint keeps it (`Planning.state`)."""
        return self.planning.state()

    def _policy(self, name: str) -> Policy:
        if name not in self._policies:
            self._policies[name] = self.pipeline.resolved_policy(name)
        return self._policies[name]
