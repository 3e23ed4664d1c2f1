"""Checks run in the caller's process before any stage starts.

One forward of the unsplit module list on microbatch (0, 0) proves the split into
stages x chunks exists, that every stage boundary passes a tree of tensors (a tensor, or
tuples, lists and dicts of them: what a link carries; shapes and dtypes travel in the
message, so they may change from one microbatch to the next), that the loss is a scalar
or a (sum, count) pair, and that the optimizer builds over the model's parameters. Parameters shared by modules on
different stages (tied weights) are found here, and two builds of the model must agree on them. The data sources are
checked too: their declared microbatch counts, and that a microbatch is the same on a second read (stage 0 reads the
inputs and the last stage the targets, each on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rrfp_ray.runtime.tree import describe, flatten, is_tree
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.layers import ModelLayers, to_layers
from rrfp_ray.train.optim import OptimSpec
from rrfp_ray.train.partition import partition
from rrfp_ray.train.recompute import check_blocks
from rrfp_ray.train.runner import LossFn
from rrfp_ray.train.sources import DataSource
from rrfp_ray.train.ties import Tie, check_copies_agree, find_ties

DRY_RUN_SEED = 0  # dropout draws the same masks in the split and the whole forward


@dataclass(frozen=True)
class Findings:
    counted_loss: bool  # loss_fn returns (sum, count)
    ties: tuple[Tie, ...]  # parameters shared by modules on different stages


def dry_run(
    *,
    layers: ModelLayers,
    loss_fn: LossFn,
    optim: OptimSpec,
    data: DataSource,
    val_data: DataSource | None,
    pipeline: PipelineConfig,
) -> Findings:
    """Raise ValueError naming the offending argument if this model and data cannot run on `pipeline`;
    else return what the stages need to know about the model."""
    _check_count(data, name="data", pipeline=pipeline)
    inputs, targets = _first(data, name="data")
    if val_data is not None:
        _check_count(val_data, name="val_data", pipeline=None)
        _first(val_data, name="val_data")
    model = layers.model()
    modules = to_layers(model, split_points=layers.split_points)
    parts = _parts(n_modules=len(modules), pipeline=pipeline, explicit=layers.split_points is not None)
    if pipeline.activation_checkpointing:
        check_blocks(modules)
    with torch.no_grad():
        out = _forward(modules=modules, parts=parts, inputs=inputs)
        if layers.split_points is not None and not isinstance(model, nn.ModuleList):
            _compare_whole(model=model, inputs=inputs, split_output=out)
        counted = _check_loss(loss_fn, out=out, targets=targets)
    optim.optimizer([p for p in model.parameters() if p.requires_grad])
    ties = find_ties(
        modules,
        stages=pipeline.stages,
        chunks=pipeline.chunks,
        placement=pipeline.layout.placement,
        sizes=pipeline.layer_split,
    )
    if ties:
        again = to_layers(layers.model(), split_points=layers.split_points)
        check_copies_agree(first=modules, second=again, ties=ties)
    return Findings(counted_loss=counted, ties=ties)


def _check_count(data: DataSource, *, name: str, pipeline: PipelineConfig | None) -> None:
    count = getattr(data, "microbatches", None)
    if not isinstance(count, int) or count < 1:
        raise ValueError(
            f"{name} must declare `microbatches`, its microbatches per iteration (an int >= 1), got {count!r}"
        )
    if pipeline is None or count == pipeline.global_microbatches:
        return
    if pipeline.dp == 1:
        raise ValueError(
            f"{name}.microbatches = {count} differs from the pipeline's microbatches = {pipeline.microbatches}"
        )
    raise ValueError(
        f"{name}.microbatches = {count} differs from the pipeline's dp x microbatches = "
        f"{pipeline.dp} x {pipeline.microbatches} = {pipeline.global_microbatches} (each replica reads its own share)"
    )


def _first(data: DataSource, *, name: str) -> tuple[object, object]:
    """Microbatch (0, 0), read twice: it must be tensors, and the same both times."""
    batch = data.microbatch(iteration=0, index=0)
    if not (isinstance(batch, tuple) and len(batch) == 2):
        raise ValueError(f"{name}.microbatch must return (inputs, targets), got {describe(batch)}")
    for part, value in zip(("inputs", "targets"), batch):
        if not is_tree(value):
            raise ValueError(
                f"{name}.microbatch {part} must be a tensor, or tuples, "
                f"lists and dicts of tensors, got {describe(value)}"
            )
    again = data.microbatch(iteration=0, index=0)
    if not _same(batch, again):
        raise ValueError(
            f"{name}.microbatch(iteration=0, index=0) differs between two reads: stage 0 reads the inputs and the "
            "last stage the targets, each on its own, so a microbatch must depend on (iteration, index) alone"
        )
    return batch


def _parts(*, n_modules: int, pipeline: PipelineConfig, explicit: bool) -> list[range]:
    p, v = pipeline.stages, pipeline.chunks
    if explicit and n_modules != p * v:
        raise ValueError(
            f"split_points cut the model into {n_modules} parts; "
            f"the pipeline needs stages x chunks = {p} x {v} = {p * v}"
        )
    if n_modules < p * v:
        raise ValueError(
            f"the model has {n_modules} modules: too few to split into stages x chunks = {p} x {v} = {p * v} chunks"
        )
    return partition(n_layers=n_modules, parts=p * v, sizes=pipeline.layer_split)


def _forward(*, modules: list[nn.Module], parts: list[range], inputs: object) -> object:
    out = inputs
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DRY_RUN_SEED)
        for vs, part in enumerate(parts):
            where = f"virtual stage {vs} (modules {part.start}..{part.stop - 1})"
            try:
                for i in part:
                    out = modules[i](out)
            except Exception as error:
                raise ValueError(f"the dry forward of microbatch (0, 0) failed in {where}: {error}") from error
            last = vs == len(parts) - 1
            if not last and not is_tree(out):
                raise ValueError(
                    f"{where} returns {describe(out)}: between stages only tensors, and tuples, lists and dicts "
                    "(string keys) of them, can pass"
                )
    return out


def _compare_whole(*, model: nn.Module, inputs: object, split_output: object) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DRY_RUN_SEED)
        try:
            whole = model(inputs)
        except Exception as error:
            raise ValueError(
                f"split_points need the model's forward to run its children in order; it failed: {error}"
            ) from error
    try:
        torch.testing.assert_close(whole, split_output)
    except (AssertionError, TypeError) as error:
        raise ValueError(
            f"the model's forward differs from running its split_points parts in order ({error}); split_points only "
            "apply to a model whose forward runs its children one after another, returning the last one's output"
        ) from None


def _check_loss(loss_fn: LossFn, *, out: object, targets: object) -> bool:
    """True when `loss_fn` returns a (sum, count) pair, False for a scalar mean."""
    name = getattr(loss_fn, "__qualname__", repr(loss_fn))
    try:
        loss = loss_fn(out, targets)
    except Exception as error:
        raise ValueError(f"loss_fn {name} failed on the model's output for microbatch (0, 0): {error}") from error
    counted = isinstance(loss, tuple) and len(loss) == 2
    for part, value in zip(("sum", "count"), loss) if counted else [("loss", loss)]:
        if not isinstance(value, Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            what = "a scalar tensor, or a (sum, count) pair of scalar tensors"
            raise ValueError(f"loss_fn {name} must return {what}, got {part} of shape {shape}")
    if not (loss[0] if counted else loss).is_floating_point():
        raise ValueError(
            f"loss_fn {name} must return a floating-point scalar, got {(loss[0] if counted else loss).dtype}"
        )
    return counted


def _same(a: object, b: object) -> bool:
    if not is_tree(b):
        return False
    (left, structure), (right, other) = flatten(a), flatten(b)
    return structure == other and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(left, right)
    )
