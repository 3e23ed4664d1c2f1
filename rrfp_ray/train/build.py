"""What a `Trainer` builds from its arguments: the workload every stage receives, checked by one dry
forward in the caller's process (`dryrun.dry_run`), and the parameters and shape a checkpoint records.

Data sources give microbatches by (iteration, index) and declare how many an iteration has
(`microbatches`); `InMemoryData` is one over batches held in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.checkpoint import CheckpointError, Shape
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.dryrun import dry_run
from rrfp_ray.train.layers import ModelSource, model_layers
from rrfp_ray.train.optim import FactoryOptim, Optim, OptimSpec
from rrfp_ray.train.partition import partition
from rrfp_ray.train.runner import LossFn
from rrfp_ray.train.sources import DataSource
from rrfp_ray.train.workload import ModelWorkload

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
    injected: Trace | Sequence[Trace] | None = None,
    device: str = "cpu",
    slow_devices: dict[int, float] | None = None,
) -> ModelWorkload:
    """What every stage receives (not yet dry-run); the arguments are `Trainer`'s."""
    if not isinstance(pipeline, PipelineConfig):
        raise ValueError(f"pipeline must be a PipelineConfig, got {type(pipeline).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(output, targets), got {type(loss_fn).__name__}")
    injected = () if injected is None else (injected,) if isinstance(injected, Trace) else tuple(injected)
    for trace in injected:
        trace.check(stages=pipeline.stages, microbatches=pipeline.microbatches, chunks=pipeline.chunks)
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
