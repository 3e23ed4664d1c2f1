"""A user's model as the ordered module list that the pipeline splits into stages x chunks.

Three forms: a list of modules (or an `nn.Sequential` / `nn.ModuleList`), split evenly;
any module plus `split_points`, the names of its children to cut before (one part per
virtual stage); or a zero-argument builder returning either. Every stage process calls
`ModelLayers` and keeps only its own chunks, so the list must come out identical
everywhere: a builder runs under a torch RNG seeded with `seed`, and modules given
already built are deep-copied on every call (each stage, and each restart, begins from
the weights given; the caller's modules are never trained in place).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from rrfp_ray.schedule.actions import Placement
from rrfp_ray.train.meta_init import build_partial
from rrfp_ray.train.partition import partition

Model = nn.Module | Sequence[nn.Module]
ModelSource = Model | Callable[[], Model]


@runtime_checkable
class PartialModel(Protocol):
    """A builder that can materialize some of its layers only, with exactly the values a whole
    build gives them (the GPT's `GPTLayers`); the others come back on the meta device."""

    def __call__(self) -> Sequence[nn.Module]: ...

    def count(self) -> int: ...

    def build(self, *, keep: Collection[int]) -> Sequence[nn.Module]: ...


@dataclass(frozen=True)
class ModelLayers:
    """Picklable `ModelWorkload.layers`; build it with `model_layers`."""

    source: ModelSource
    split_points: tuple[str, ...] | None = None
    seed: int = 0

    def __call__(self) -> list[nn.Module]:
        return to_layers(self.model(), split_points=self.split_points)

    def stage_layers(
        self,
        *,
        stages: int,
        chunks: int,
        stage: int,
        placement: Placement = Placement.LOOPED,
        sizes: Sequence[int] | None = None,
    ) -> list[nn.Module]:
        """The layer list as `stage` of a stages x chunks pipeline needs it: a builder materializes only
        that stage's layers, with the whole build's values (the others on the meta device); modules
        given built are copied whole. A `PartialModel` builds its own layers; any other builder is
        run by `build_partial`."""
        if _is_built(self.source):
            return self()

        def own(count: int) -> set[int]:
            parts = partition(n_layers=count, parts=stages * chunks, sizes=sizes)
            return {
                i for c in range(chunks) for i in parts[placement.virtual_stage(stage=stage, chunk=c, stages=stages)]
            }

        if isinstance(self.source, PartialModel):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                return list(self.source.build(keep=own(self.source.count())))
        return build_partial(self._build, keep=own, seed=self.seed)

    def model(self) -> nn.Module:
        """A fresh copy of the whole model (the layers' parent)."""
        if _is_built(self.source):
            return copy.deepcopy(as_module(self.source))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return self._built()

    def _built(self) -> nn.Module:
        built = self.source()
        if not _is_built(built):
            raise ValueError(f"model builder {self.source!r} returned {type(built).__name__}, not modules")
        return as_module(built)

    def _build(self) -> list[nn.Module]:
        return to_layers(self._built(), split_points=self.split_points)


def model_layers(*, model: ModelSource, split_points: Sequence[str] | None = None, seed: int = 0) -> ModelLayers:
    """Check the form of `model` now; snapshot modules given already built."""
    if _is_built(model):
        as_module(model)
        model = copy.deepcopy(model)
    elif not callable(model):
        raise ValueError(f"model must be modules or a zero-argument builder of them, got {type(model).__name__}")
    if split_points is not None:
        if isinstance(split_points, str) or not all(isinstance(p, str) and p for p in split_points):
            raise ValueError(
                f"split_points must be a list of child names like ['blocks.2', 'head'], got {split_points!r}"
            )
        split_points = tuple(split_points)
    return ModelLayers(source=model, split_points=split_points, seed=seed)


def as_module(model: Model) -> nn.Module:
    """A list or tuple of modules as an `nn.Sequential`; a module as itself."""
    if isinstance(model, nn.Module):
        return model
    for i, item in enumerate(model):
        if not isinstance(item, nn.Module):
            raise ValueError(f"model[{i}] is {type(item).__name__}, not an nn.Module (wrap functions in a module)")
    return nn.Sequential(*model)


def to_layers(model: nn.Module, *, split_points: Sequence[str] | None) -> list[nn.Module]:
    """The list the stages split: a container's children, or the parts `split_points` cut."""
    if split_points is None:
        if not isinstance(model, (nn.Sequential, nn.ModuleList)):
            raise ValueError(
                f"model is a {type(model).__name__}, not nn.Sequential or a list of modules: give split_points, "
                "the names of its children to cut before (e.g. ['blocks.2', 'head'])"
            )
        return list(model)
    units = _units(model, prefix="", points=set(split_points))
    names = [name for name, _ in units]
    missing = [p for p in split_points if p not in names]
    if missing:
        raise ValueError(f"split_points {missing} are not children of the model; cut before one of {names}")
    cuts = [names.index(p) for p in split_points]
    if cuts[0] == 0 or cuts != sorted(set(cuts)):
        raise ValueError(
            f"split_points {list(split_points)} must be distinct, in forward order, and not cut before the "
            f"first child {names[0]!r}"
        )
    bounds = [0, *cuts, len(units)]
    return [nn.Sequential(*(module for _, module in units[a:b])) for a, b in itertools.pairwise(bounds)]


def _units(module: nn.Module, *, prefix: str, points: set[str]) -> list[tuple[str, nn.Module]]:
    """Children in order by dotted name, opening only the children that hold a split point."""
    units = []
    for name, child in module.named_children():
        full = prefix + name
        if any(point.startswith(full + ".") for point in points):
            units += _units(child, prefix=full + ".", points=points)
        else:
            units.append((full, child))
    return units


def _is_built(model: object) -> bool:
    return isinstance(model, (nn.Module, list, tuple))
