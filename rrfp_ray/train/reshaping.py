"""What `Trainer.reshape` moves the running pipeline to: the same stages at a new layer split, and
which layers that moves between which stages, in words."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rrfp_ray.schedule.actions import Placement
from rrfp_ray.train.checkpoint import Shape
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.ties import find_ties
from rrfp_ray.train.workload import ModelWorkload


def resplit(
    *, pipeline: PipelineConfig, workload: ModelWorkload, layer_split: Sequence[int]
) -> tuple[PipelineConfig, ModelWorkload]:
    """`pipeline` and its `workload` at `layer_split` (layers per virtual stage), the ties found again; a
    ValueError when the new split would tie parameters between other stages than the running pipeline links."""
    pipeline = pipeline.replaced(layer_split=tuple(layer_split))
    layers = workload.layers()
    layout = pipeline.layout
    ties = find_ties(
        layers, stages=layout.stages, chunks=layout.chunks, placement=layout.placement, sizes=pipeline.layer_split
    )
    groups, now = (tuple(dict.fromkeys(t.stages for t in found)) for found in (ties, workload.ties))
    if groups != now:
        raise ValueError(
            f"layer_split {','.join(map(str, layer_split))}: tied parameters would be shared by the stages "
            f"{list(groups)} instead of {list(now)}, whose links the running pipeline has not got; restart it "
            "with this split instead (resume a checkpoint: any split loads it)"
        )
    workload = replace(workload, layer_split=pipeline.layer_split, ties=ties)
    return pipeline, workload


def moved(*, before: Shape, after: Shape) -> str:
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
