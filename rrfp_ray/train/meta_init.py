"""Materialize only some layers of any model builder, with exactly the values of a whole build.

The builder runs twice under the same seed, inside a dispatch mode that sees every tensor op:
1. on the meta device (no memory), recording which layers every tensor creation ends up in
   (through the ops that derive one tensor from another);
2. for real, except that a creation no kept layer needs is made on the meta device, and a
   random op on a meta tensor draws into a scratch tensor of the same shape and strides, so the
   RNG advances exactly as in the whole build and the kept layers get the whole build's values.

A builder that reads tensor values (`.item()`, data-dependent branches) cannot run on meta:
it is then built whole, with a warning saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

logger = logging.getLogger(__name__)
META = torch.device("meta")


def build_partial(
    build: Callable[[], Sequence[nn.Module]], *, keep: Callable[[int], Collection[int]], seed: int
) -> list[nn.Module]:
    """The layers `build()` gives under a torch RNG seeded with `seed`; `keep(number of layers)`
    names those to materialize, with the values of a whole build. The others' tensors sit on the
    meta device, unless a kept layer shares them (a tied weight)."""
    try:
        recorder = _Record()
        with torch.random.fork_rng(devices=[]), recorder:
            torch.manual_seed(seed)
            skeleton = list(build())
        kept = set(keep(len(skeleton)))
        needed = recorder.needed(layers=skeleton, keep=kept)
        with torch.random.fork_rng(devices=[]), _Build(needed=needed):
            torch.manual_seed(seed)
            layers = list(build())
        if len(layers) != len(skeleton) or any(_tensors_on_meta(layers[i]) for i in kept):
            raise RuntimeError("the builder made different layers on the second run")
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:  # what meta tensors raise
        logger.warning("building the whole model on every stage: the builder cannot run on the meta device (%s)", error)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return list(build())
    return layers


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _tensors(layer: nn.Module) -> list[Tensor]:
    return [*layer.parameters(), *layer.buffers()]


def _tensors_on_meta(layer: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(layer))


def _inputs(args: tuple, kwargs: dict) -> list[Tensor]:
    return [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]


class _Record(TorchDispatchMode):
    """Run everything on meta; remember which creations (ops with no tensor input) each storage derives from."""

    def __init__(self) -> None:
        super().__init__()
        self.creations = 0
        self.sources: dict[int, set[int]] = {}
        self.alive: list[Tensor] = []  # keeps storages alive, so that their keys stay unique

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _inputs(args, kwargs)
        if inputs:
            sources = set().union(*(self.sources.get(_storage(t), ()) for t in inputs))
        else:
            sources = {self.creations}
            self.creations += 1
            kwargs = _on_meta(func, kwargs)
        out = func(*args, **kwargs)
        for tensor in _inputs((out,), {}):
            self.sources.setdefault(_storage(tensor), set()).update(sources)
            self.alive.append(tensor)
        return out

    def needed(self, *, layers: list[nn.Module], keep: set[int]) -> set[int]:
        """The creations a kept layer derives from, and those that end in no layer (temporaries)."""
        owners: dict[int, set[int]] = {}
        for index, layer in enumerate(layers):
            for tensor in _tensors(layer):
                for creation in self.sources.get(_storage(tensor), ()):
                    owners.setdefault(creation, set()).add(index)
        return {c for c in range(self.creations) if c not in owners or owners[c] & keep}


class _Build(TorchDispatchMode):
    """Run for real, but make unneeded creations on meta and draw their random ops into scratch."""

    def __init__(self, *, needed: set[int]) -> None:
        super().__init__()
        self.needed = needed
        self.creations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _inputs(args, kwargs)
        unneeded = False
        if not inputs:
            unneeded = self.creations not in self.needed
            self.creations += 1
            if unneeded:
                kwargs = _on_meta(func, kwargs)
        if (unneeded or any(t.is_meta for t in inputs)) and torch.Tag.nondeterministic_seeded in func.tags:
            return _draw_into_scratch(func, args, kwargs)
        return func(*args, **kwargs)


def _on_meta(func, kwargs: dict) -> dict:
    """A factory op's kwargs with its device set to meta."""
    if any(argument.name == "device" for argument in func._schema.arguments):
        return {**kwargs, "device": META}
    return kwargs


def _draw_into_scratch(func, args: tuple, kwargs: dict):
    """What `func` returns on meta, after drawing its random numbers into CPU tensors of the same layout."""

    def scratch(leaf):
        if isinstance(leaf, Tensor) and leaf.is_meta:
            return torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype)
        return leaf

    real_args, real_kwargs = tree_map(scratch, (args, kwargs))
    if "device" in real_kwargs:
        real_kwargs["device"] = torch.device("cpu")
    out = func(*real_args, **real_kwargs)
    if func._schema.is_mutable:
        return args[0]  # an in-place draw (normal_, uniform_) returns its meta target
    return tree_map(
        lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=META) if isinstance(t, Tensor) else t,
        out,
    )
