"""Pipeline any PyTorch model: `Trainer` over a local or a Ray backend.

    trainer = Trainer(model=nn.Sequential(...), loss_fn=F.mse_loss, data=source,
                      pipeline=PipelineConfig(stages=2, microbatches=4))
    reports = trainer.fit(100)

Everything a stage needs is plain, picklable data (`ModelWorkload`), built here and
checked by one dry forward in the caller's process (`dryrun.dry_run`) before any stage
starts. Data sources give microbatches by (iteration, index) and declare how many an
iteration has (`microbatches`); stage 0 reads the inputs and the last stage the targets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from rrfp_ray.errors import ExitCode
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.planner import Planner, PlannerConfig, default_hints
from rrfp_ray.policy.policy import Policy
from rrfp_ray.runtime.worker import PipelineError
from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.backend import Backend, LocalBackend
from rrfp_ray.train.checkpoint import Checkpointing, Manifest, commit, fingerprint, latest, resume_point
from rrfp_ray.train.config import PLANNED, PipelineConfig
from rrfp_ray.train.dryrun import dry_run
from rrfp_ray.train.export import unsplit_state_dict
from rrfp_ray.train.layers import ModelSource, model_layers
from rrfp_ray.train.runner import LossFn
from rrfp_ray.train.workload import DataSource, FactoryOptim, FeatureSource, ModelWorkload, Optim, OptimSpec

logger = logging.getLogger(__name__)

OptimizerArg = Optim | FactoryOptim | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class InMemoryData:
    """A data source over microbatches held in memory, cycled through in order.

    Iteration k's microbatch i is `batches[(k * microbatches + i) % len(batches)]`.
    """

    batches: Sequence[tuple[Tensor, Tensor]]
    microbatches: int

    def __post_init__(self) -> None:
        if not self.batches:
            raise ValueError("batches must hold at least one (inputs, targets) pair")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        return self.batches[(iteration * self.microbatches + index) % len(self.batches)]


def make_workload(
    *,
    model: ModelSource,
    loss_fn: LossFn,
    data: DataSource,
    pipeline: PipelineConfig,
    optimizer: OptimizerArg | None = None,
    split_points: Sequence[str] | None = None,
    val_data: DataSource | None = None,
    seed: int = 0,
    injected: Trace | None = None,
    device: str = "cpu",
    slow_devices: dict[int, float] | None = None,
) -> ModelWorkload:
    """What every stage receives (not yet dry-run); the arguments are `Trainer`'s."""
    if not isinstance(pipeline, PipelineConfig):
        raise ValueError(f"pipeline must be a PipelineConfig, got {type(pipeline).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(output, targets), got {type(loss_fn).__name__}")
    if injected is not None:
        injected.check(stages=pipeline.stages, microbatches=pipeline.microbatches, chunks=pipeline.chunks)
    return ModelWorkload(
        layers=model_layers(model=model, split_points=split_points, seed=seed),
        loss_fn=loss_fn,
        data=data,
        microbatches=pipeline.microbatches,
        optim=_optim(optimizer),
        injected=injected,
        val_data=val_data,
        device=device,
        dp=pipeline.dp,
        precision=pipeline.precision,
        activation_checkpointing=pipeline.activation_checkpointing,
        layer_split=pipeline.layer_split,
        slow_devices=dict(slow_devices or {}),
    )


def checked(workload: ModelWorkload, *, pipeline: PipelineConfig) -> ModelWorkload:
    """`workload` dry-run (ValueError naming what cannot run), with what the dry run found:
    the loss's form and the parameters tied between stages."""
    findings = dry_run(
        layers=workload.layers,
        loss_fn=workload.loss_fn,
        optim=workload.optim,
        data=workload.data,
        val_data=workload.val_data,
        pipeline=pipeline,
    )
    return replace(workload, counted_loss=findings.counted_loss, ties=findings.ties)


def model_fingerprint(*, layers: Callable[[], Sequence[torch.nn.Module]], stages: int, chunks: int, tp: int) -> str:
    """What a checkpoint must match to load: the split and the parameters' shapes."""
    return fingerprint(stages, chunks, tp, [tuple(p.shape) for m in layers() for p in m.parameters()])


def workload_fingerprint(*, pipeline: PipelineConfig, workload: ModelWorkload) -> str:
    """What a checkpoint must have been written for: the pipeline's shape and every parameter's."""
    shapes = [tuple(p.shape) for m in workload.layers() for p in m.parameters()]
    zero = [f"zero{pipeline.zero} dp{pipeline.dp}"] if pipeline.zero else []  # a file per replica's shard
    return fingerprint(pipeline.stages, pipeline.chunks, pipeline.tp, shapes, *zero)


class Trainer:
    """Trains `model` through a readiness-driven pipeline.

    `model`: a list of modules or an `nn.Sequential` (split evenly into stages x chunks),
    or any module with `split_points` (names of its children to cut before, one part per
    virtual stage), or a zero-argument builder of either (run under a torch RNG seeded
    with `seed`, so every stage builds the same weights). Modules given built are copied:
    the caller's are never trained in place. `optimizer`: `Optim` (AdamW, warmup, cosine,
    global-norm clipping; the default), or a factory `params -> torch.optim.Optimizer`
    (its own learning rates, no clipping; `FactoryOptim(factory, max_grad_norm=...)` clips).
    `backend`: `LocalBackend()` (the default: threads of this process) or
    `actors.backend.RayBackend()` (one Ray actor per stage). `slow_devices`: stage -> factor, that
    stage's device emulated as computing factor times slower (`rrfp_ray.runtime.measure.Throttle`).
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
        injected: Trace | None = None,
        checkpoints: Checkpointing | None = None,
        device: str = "cpu",
        slow_devices: dict[int, float] | None = None,
    ) -> None:
        self.pipeline = pipeline
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
        self.fingerprint = workload_fingerprint(pipeline=pipeline, workload=self.workload)
        resume = None
        if (
            checkpoints is not None and checkpoints.resume
        ):  # a CheckpointError saying what is wrong, before any stage starts
            resume = resume_point(directory=Path(checkpoints.directory), fingerprint=self.fingerprint)
        self.backend: Backend = LocalBackend() if backend is None else backend
        self.backend.start(pipeline=pipeline, workload=self.workload)
        self.iteration = 0
        self.restarts = 0
        self._restored = 0  # the restart whose first iteration is still to run (0: none)
        self.skipped_steps = 0  # iterations whose gradient norm was inf or NaN: no stage stepped
        self._policies: dict[str, Policy] = {}
        self.planner: Planner | None = None  # made by the first planned iteration
        self.planning_s: list[float] = []  # per planned iteration: the seconds its plan took
        if resume is not None:
            self._restore(resume)

    def step(self, *, policy: str | None = None) -> IterationReport:
        """One iteration (all microbatches, then the optimizer step) under `policy` (default: the config's),
        then the checkpoint, if one is due.

        A lost stage, in the iteration or in its checkpoint, rebuilds the pipeline from the last
        checkpoint and goes on, up to `checkpoints.max_restarts` times; the iterations since that
        checkpoint run again.
        """
        while True:
            try:
                name = self.pipeline.policy if policy is None else policy
                if name == PLANNED:
                    report = self._planned_iteration()
                else:
                    report = self.backend.run_iteration(iteration=self.iteration, policy=self._policy(name))
            except PipelineError as error:
                self._recover(error, failed=f"iteration {self.iteration}")
                continue
            report.restart, self._restored = self._restored, 0
            if report.skipped_step:
                self.skipped_steps += 1
                logger.warning(
                    "iteration %d skipped its optimizer step: non-finite gradients (%d so far)",
                    report.iteration, self.skipped_steps,
                )  # fmt: skip
            self.iteration += 1
            if self.checkpoints is None or not self.checkpoints.every or self.iteration % self.checkpoints.every:
                return report
            try:
                self.save()
                return report
            except PipelineError as error:
                self._recover(error, failed=f"the checkpoint of iteration {self.iteration}")

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
        )

    def save(self) -> Path:
        """Checkpoint now: every stage writes its file, then the manifest is committed.

        A stage that fails or dies while writing, or a manifest that cannot be written, is a
        PipelineError; the manifest is then not written, so the previous checkpoint stays the newest."""
        if self.checkpoints is None:
            raise ValueError("save() needs checkpoints=Checkpointing(directory=...) given to the Trainer")
        directory = Path(self.checkpoints.directory)
        files = self.backend.save(directory=directory, iteration=self.iteration)
        planner = None if self.planner is None else self.planner.to_dict()
        manifest = Manifest(iteration=self.iteration, fingerprint=self.fingerprint, files=files, planner=planner)
        try:
            path = commit(directory=directory, manifest=manifest)
        except OSError as error:
            raise PipelineError(
                f"the manifest of iteration {self.iteration} could not be written to {directory}: {error}"
            ) from error
        logger.info("checkpoint of iteration %d committed: %s", self.iteration, path)
        return path

    def _latest(self) -> Manifest | None:
        return latest(directory=Path(self.checkpoints.directory), fingerprint=self.fingerprint)

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
                self.backend.restart()
                self._restored = self.restarts
                if manifest is None:
                    self.iteration = 0  # the restarted stages hold the initial weights
                else:
                    self._restore(manifest)
                return
            except PipelineError as again:
                if again.exit_code is ExitCode.BAD_INPUT:
                    raise  # a checkpoint the stages refuse: no restart can load it
                error, failed = again, f"restart {self.restarts}"

    def _restore(self, manifest: Manifest) -> None:
        self.backend.load(directory=Path(self.checkpoints.directory), manifest=manifest)
        self.iteration = manifest.iteration
        self.planner = None if manifest.planner is None else Planner.from_dict(manifest.planner)
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
        self.backend.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _planned_iteration(self) -> IterationReport:
        """Plan this iteration synchronously from its data's features and every finished iteration's
        telemetry, run the plan's hint policy with its microbatch order, and feed the report back."""
        shape = {
            "stages": self.pipeline.stages,
            "chunks": self.pipeline.chunks,
            "microbatches": self.pipeline.microbatches,
        }
        if self.planner is None:
            config = PlannerConfig(hints=default_hints(chunks=self.pipeline.chunks), cap=self.pipeline.cap)
            self.planner = Planner(config=config, **shape)
        data = self.workload.data
        shown = isinstance(data, FeatureSource) and self.pipeline.dp == 1  # D x M features: not planned per replica yet
        features = data.features(iteration=self.iteration) if shown else None
        started = time.perf_counter()
        plan = self.planner.plan(iteration=self.iteration, features=features)
        self.planning_s.append(time.perf_counter() - started)
        policy = plan.validate(**shape)
        report = self.backend.run_iteration(iteration=self.iteration, policy=policy, cap=plan.cap, order=plan.order)
        self.planner.observe(report=report, plan=plan, features=features)
        return report

    def _policy(self, name: str) -> Policy:
        if name not in self._policies:
            self._policies[name] = self.pipeline.resolved_policy(name)
        return self._policies[name]


def _optim(optimizer: OptimizerArg | None) -> OptimSpec:
    if optimizer is None:
        return Optim()
    if isinstance(optimizer, (Optim, FactoryOptim)):
        return optimizer
    if callable(optimizer):
        return FactoryOptim(factory=optimizer)
    raise ValueError(
        f"optimizer must be an Optim or a factory params -> torch.optim.Optimizer, got {type(optimizer).__name__}"
    )
