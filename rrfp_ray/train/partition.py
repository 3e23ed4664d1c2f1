"""How a model's layers are cut into virtual stages, and which of them a stage holds."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch import nn

from rrfp_ray.schedule.actions import Placement


def partition(*, n_layers: int, parts: int, sizes: Sequence[int] | None = None) -> list[range]:
    """Contiguous ranges covering ``range(n_layers)``: ``sizes`` layers each where given (a split
    a user set or the rebalancer chose), else sizes differing by at most one, the larger parts
    first (the last part also computes the loss)."""
    if sizes is not None:
        sizes = tuple(sizes)
        if len(sizes) != parts or min(sizes, default=0) < 1 or sum(sizes) != n_layers:
            raise ValueError(
                f"split {','.join(map(str, sizes))} must give each of the {parts} parts (stages x chunks) at least "
                f"one layer and {n_layers} layers in all"
            )
        starts = [sum(sizes[:i]) for i in range(parts + 1)]
        return [range(start, end) for start, end in itertools.pairwise(starts)]
    if parts < 1 or parts > n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {parts} parts (stages x chunks)")
    size, extra = divmod(n_layers, parts)
    starts = [i * size + min(i, extra) for i in range(parts + 1)]
    return [range(start, end) for start, end in zip(starts, starts[1:])]


def stage_chunks(
    *,
    layers: Sequence[nn.Module],
    stages: int,
    chunks: int,
    stage: int,
    placement: Placement = Placement.LOOPED,
    sizes: Sequence[int] | None = None,
) -> dict[int, nn.Sequential]:
    """The modules ``stage`` holds: its chunk c runs the virtual stage the placement gives it
    (looped: ``c * stages + stage``)."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in [0, {stages})")
    parts = partition(n_layers=len(layers), parts=stages * chunks, sizes=sizes)
    held = {c: placement.virtual_stage(stage=stage, chunk=c, stages=stages) for c in range(chunks)}
    return {c: nn.Sequential(*(layers[i] for i in parts[vs])) for c, vs in held.items()}
