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
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rrfp_ray.errors import ExitCode, PlacementError
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.ahead import Lookahead, Seen, seen
from rrfp_ray.plan.packing import Packing
from rrfp_ray.plan.planner import Arrangement, Planner, PlannerConfig, default_hints
from rrfp_ray.policy.policy import Policy
from rrfp_ray.runtime.worker import PipelineError
from rrfp_ray.schedule.actions import Placement
from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.backend import Backend, LocalBackend
from rrfp_ray.train.checkpoint import (
    CheckpointError,
    Checkpointing,
    Manifest,
    Shape,
    commit,
    latest,
    parameters_fingerprint,
    resume_point,
)
from rrfp_ray.train.config import PLANNED, PipelineConfig
from rrfp_ray.train.dryrun import dry_run
from rrfp_ray.train.export import unsplit_state_dict
from rrfp_ray.train.layers import ModelSource, model_layers
from rrfp_ray.train.rebalancing import Move, Rebalancing
from rrfp_ray.train.resize import shapes
from rrfp_ray.train.runner import LossFn, partition
from rrfp_ray.train.ties import find_ties
from rrfp_ray.train.workload import (
    DataSource,
    FactoryOptim,
    FeatureSource,
    ModelWorkload,
    Optim,
    OptimSpec,
    check_packing,
    packing_refusal,
)

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


def model_parameters(layers: Sequence[torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Every parameter's whole (unsharded) shape, by its name in the layer list (`3.attn.qkv.weight`): all a
    checkpoint must match to load, whatever the pipeline's shape."""
    return {
        f"{i}.{name}": tuple(p.shape)
        for i, layer in enumerate(layers)
        for name, p in layer.named_parameters(remove_duplicate=False)
    }


def pipeline_shape(*, pipeline: PipelineConfig, n_layers: int) -> Shape:
    """The shape a checkpoint records of the pipeline that wrote it (the split spelled out even when even)."""
    parts = partition(n_layers=n_layers, parts=pipeline.layout.virtual_stages, sizes=pipeline.layer_split)
    return Shape(
        stages=pipeline.stages,
        tp=pipeline.tp,
        dp=pipeline.dp,
        chunks=pipeline.chunks,
        placement=pipeline.layout.placement.value,
        layer_split=tuple(len(part) for part in parts),
        zero=pipeline.zero,
        microbatches=pipeline.microbatches,
    )


def check_global_batch(*, saved: Shape, pipeline: PipelineConfig) -> None:
    """CheckpointError unless `pipeline` trains the global batch (D x M microbatches) the checkpoint's run did."""
    batch = saved.dp * saved.microbatches
    if batch != pipeline.global_microbatches:
        raise CheckpointError(
            f"resume: the checkpoint trained D x M = {saved.dp} x {saved.microbatches} = {batch} microbatches an "
            f"iteration, this pipeline D x M = {pipeline.dp} x {pipeline.microbatches} = "
            f"{pipeline.global_microbatches}: "
            + (
                f"give it microbatches {batch // pipeline.dp} to train the same"
                if batch % pipeline.dp == 0
                else f"dp {pipeline.dp} does not divide {batch}"
            )
        )


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
        injected: Trace | None = None,
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
        if pipeline.policy == PLANNED:
            self._check_arrange(pipeline.arrange)
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
        self.planner: Planner | None = None  # made by the first planned iteration
        self.resumed: str | None = None  # what the last checkpoint loaded was: its iteration, its shape and this one
        self._lookahead: Lookahead | None = None  # plans the next planned iteration while one runs
        self.planning_s: list[float] = []  # per planned iteration: the seconds its plan took (nan: the last plan ran)
        self.plan_wait_s: list[float] = []  # per planned iteration: the seconds it waited for its plan
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
                    report = self._planned_iteration(arrange)
                else:
                    if packing is not None:
                        check_packing(packing=packing, workload=self.workload, iteration=self.iteration)
                    report = self.backend.run_iteration(
                        iteration=self.iteration, policy=self._policy(name), packing=packing
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
        pipeline = self.pipeline.replaced(layer_split=tuple(layer_split))
        layers = self.workload.layers()
        layout = pipeline.layout
        ties = find_ties(
            layers, stages=layout.stages, chunks=layout.chunks, placement=layout.placement, sizes=pipeline.layer_split
        )
        groups, now = (tuple(dict.fromkeys(t.stages for t in found)) for found in (ties, self.workload.ties))
        if groups != now:
            raise ValueError(
                f"layer_split {','.join(map(str, layer_split))}: tied parameters would be shared by the stages "
                f"{list(groups)} instead of {list(now)}, whose links the running pipeline has not got; restart it "
                "with this split instead (resume a checkpoint: any split loads it)"
            )
        workload = replace(self.workload, layer_split=pipeline.layer_split, ties=ties)
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
            "reshape at iteration %d: split %s -> %s; %s (%.2f s)",
            self.iteration, ",".join(map(str, before.layer_split)), ",".join(map(str, self.shape.layer_split)),
            _moves(before=before, after=self.shape), seconds,
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
                self._stop_planning()  # the checkpoint's planner, if any, plans again
                self.planner = None
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
        self._stop_planning()
        self.planner = None  # a planner plans one shape: the checkpoint's, if of this shape, or a fresh one
        self.backend.restart(pipeline=shape, workload=workload)
        self.pipeline, self.workload = shape, workload
        self._policies.clear()  # built for the shape in use
        self.rebalancing = self._rebalancing()  # measures and moves this shape's layers afresh
        self._resume(manifest)
        self.resizes.append((self.iteration, shape))
        logger.warning("resized to %s at iteration %d", self._describe(shape), self.iteration)

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
        self.planner = None
        planned = {"stages": shape.stages, "chunks": shape.chunks, "microbatches": shape.microbatches}
        if manifest.planner is not None and manifest.planner["shape"] == planned:  # else it plans afresh
            restored = Planner.from_dict(manifest.planner)
            if restored.config.arrange is self.pipeline.arrange:  # else it plans afresh, arranging as asked
                self.planner = restored
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
        self._stop_planning()
        self.backend.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def planner_state(self) -> dict[str, Any] | None:
        """The planner's state (`Planner.to_dict`) once every plan and observation asked for is done, as the
        checkpoint keeps it; None without a planner, or when planning did not settle within the pipeline's timeout."""
        if self._lookahead is not None and not self._lookahead.settle(timeout_s=self.pipeline.timeout_s):
            logger.warning("the planner did not settle within %.1f s: its state is left out", self.pipeline.timeout_s)
            return None
        return None if self.planner is None else self.planner.to_dict()

    def _planned_iteration(self, arrange: Arrangement | None) -> IterationReport:
        """Run the plan made for this iteration while the one before ran (`rrfp_ray.plan.ahead`: from this
        iteration's features and the telemetry of iterations up to the one before that), ask for the next
        iteration's, then feed this one's report back. A new planner arranges as `arrange` says (None: the
        pipeline's arrange); the planner arranges as it was made unless `arrange` asks otherwise, then anew."""
        shape = {
            "stages": self.pipeline.stages,
            "chunks": self.pipeline.chunks,
            "microbatches": self.pipeline.microbatches,
        }
        changed = arrange is not None and self.planner is not None and self.planner.config.arrange is not arrange
        if self.planner is None or self.planner.shape != shape or changed:
            arrange = self.pipeline.arrange if arrange is None else arrange
            self._check_arrange(arrange)
            self._stop_planning()
            hints = default_hints(chunks=self.pipeline.chunks)
            config = PlannerConfig(hints=hints, cap=self.pipeline.cap, arrange=arrange)
            self.planner = Planner(config=config, **shape)
        if self._lookahead is None:
            self._lookahead = Lookahead(planner=self.planner, shows=self._seen, timeout_s=self.pipeline.timeout_s)
        taken = self._lookahead.take(iteration=self.iteration)
        self.planning_s.append(taken.planning_s)
        self.plan_wait_s.append(taken.wait_s)
        policy = taken.plan.validate(**shape)
        self._lookahead.ask(iteration=self.iteration + 1)
        order, packing = taken.plan.order, taken.plan.packing
        report = self.backend.run_iteration(
            iteration=self.iteration, policy=policy, cap=taken.plan.cap, order=order, packing=packing
        )
        self._lookahead.observe(report=report, taken=taken)
        logger.debug(
            "iteration %d: plan %s %s waited for %.2f ms (iteration %.1f ms)",
            self.iteration, taken.plan.hint, list(order), taken.wait_s * 1e3, report.makespan_ms,
        )  # fmt: skip
        return report

    def _seen(self, iteration: int) -> Seen | None:
        """What `iteration`'s data shows the planner; each replica reads its own M microbatches, in one order."""
        data = self.workload.data
        if not isinstance(data, FeatureSource):
            return None
        arrange = None if self.planner is None else self.planner.config.arrange
        packs = arrange is not None and arrange.packs and self._refusal(arrange) is None
        return seen(
            data.features(iteration=iteration),
            replicas=self.pipeline.dp,
            microbatches=self.pipeline.microbatches,
            samples=data.sample_features(iteration=iteration) if packs else None,
        )

    def _check_arrange(self, arrange: Arrangement) -> None:
        """ValueError naming what a planner that packs needs and this run has not got."""
        refusal = self._refusal(arrange)
        if refusal is not None:
            raise ValueError(refusal)

    def _refusal(self, arrange: Arrangement) -> str | None:
        """Why plans arranged so cannot pack this run's samples (None: they can, or they do not pack)."""
        if not arrange.packs:
            return None
        refusal = packing_refusal(self.workload)
        if refusal is None and not isinstance(self.workload.data, FeatureSource):
            refusal = f"planning needs features(iteration=) of the data source; {type(self.workload.data).__name__}"
            refusal += " has not got them"
        if refusal is None and self.pipeline.dp != 1:
            refusal = f"a plan packs the samples of one replica: it needs dp 1, got dp {self.pipeline.dp}"
        return None if refusal is None else f"arrange {arrange.value}: {refusal}"

    def _stop_planning(self) -> None:
        """Drop the plans in flight (after a restart, a new shape or on close)."""
        if self._lookahead is not None:
            self._lookahead.close()
        self._lookahead = None

    def _policy(self, name: str) -> Policy:
        if name not in self._policies:
            self._policies[name] = self.pipeline.resolved_policy(name)
        return self._policies[name]


def _source(manifest: Manifest | None) -> str:
    return "the initial weights" if manifest is None else f"the checkpoint of iteration {manifest.iteration}"


def _moves(*, before: Shape, after: Shape) -> str:
    """Which layers moved from which stage to which, in words."""

    def stages(shape: Shape) -> list[int]:
        placement = Placement(shape.placement)
        return [
            placement.locate(virtual_stage=vs, stages=shape.stages)[0]
            for vs, size in enumerate(shape.layer_split)
            for _ in range(size)
        ]

    runs: list[tuple[int, int, int, int]] = []  # first layer, last layer, from stage, to stage
    for layer, (old, new) in enumerate(zip(stages(before), stages(after))):
        if old == new:
            continue
        if runs and runs[-1][1] == layer - 1 and runs[-1][2:] == (old, new):
            runs[-1] = (runs[-1][0], layer, old, new)
        else:
            runs.append((layer, layer, old, new))
    if not runs:
        return "no layer moved between stages"
    return ", ".join(
        (f"layer {a}" if a == b else f"layers {a}-{b}") + f" moved from stage {old} to stage {new}"
        for a, b, old, new in runs
    )


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
