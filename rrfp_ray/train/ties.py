"""Tied weights: one parameter held by modules that land on different stages.

Every stage builds its own copy of the model, so a parameter shared by, say, the token
embedding (stage 0) and the LM head (the last stage) becomes one copy per owning stage.
Each iteration, before clipping and the step, the owners sum their copies' gradients
(one all-reduce per group of owning stages, Megatron's embedding group), so the copies
take the same steps and stay identical. The global gradient norm counts a tied
parameter once: on its first owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rrfp_ray.schedule.actions import Placement
from rrfp_ray.train.partition import partition

TieReduce = Callable[[tuple[int, ...], Tensor], Tensor]  # (owning stages, tensor) -> its sum over them


@dataclass(frozen=True)
class Tie:
    """A parameter held by modules on more than one stage."""

    names: tuple[str, ...]  # its names in the layer list: "<layer index>.<name in the layer>"
    stages: tuple[int, ...]  # the stages that hold a copy, ascending


def find_ties(
    layers: Sequence[nn.Module],
    *,
    stages: int,
    chunks: int,
    placement: Placement = Placement.LOOPED,
    sizes: Sequence[int] | None = None,
) -> tuple[Tie, ...]:
    """The parameters that `layers`, split into stages x chunks (`sizes` layers each), share between stages."""
    parts = partition(n_layers=len(layers), parts=stages * chunks, sizes=sizes)
    stage_of = {i: placement.locate(virtual_stage=vs, stages=stages)[0] for vs, part in enumerate(parts) for i in part}
    owners: dict[int, tuple[list[str], set[int]]] = {}
    for i, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=False):
            names, held = owners.setdefault(id(param), ([], set()))
            names.append(f"{i}.{name}")
            held.add(stage_of[i])
    return tuple(
        Tie(names=tuple(names), stages=tuple(sorted(held))) for names, held in owners.values() if len(held) > 1
    )


def parameter(layers: Sequence[nn.Module], name: str) -> nn.Parameter:
    index, _, local = name.partition(".")
    return layers[int(index)].get_parameter(local)


def check_copies_agree(*, first: Sequence[nn.Module], second: Sequence[nn.Module], ties: Sequence[Tie]) -> None:
    """ValueError naming the module when two builds of the model disagree on a tied parameter."""
    for tie in ties:
        a, b = parameter(first, tie.names[0]), parameter(second, tie.names[0])
        if a.shape != b.shape or not torch.equal(a.detach(), b.detach()):
            raise ValueError(
                f"tied parameter {tie.names[0]} (also {', '.join(tie.names[1:])}), "
                f"shared by stages {list(tie.stages)}: "
                "two builds of the model give it different values. Every stage builds its own copy, so the copies "
                "would start different; the model builder must give the same weights every time (build from the seed)"
            )


class TiedGradients:
    """One stage's share of the ties: sums its copies' gradients with the other owners'."""

    def __init__(
        self,
        *,
        stage: int,
        stages: int,
        chunks: int,
        placement: Placement,
        layers: Sequence[nn.Module],
        ties: Sequence[Tie],
        reduce: TieReduce | None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        found = find_ties(layers, stages=stages, chunks=chunks, placement=placement, sizes=sizes)
        if set(found) != set(ties):
            raise ValueError(
                f"the model shares parameters between stages {[t.names for t in found]}, but the workload declares "
                f"{[t.names for t in ties]}: build it through Trainer or dry_run, which find the ties"
            )
        mine = [tie for tie in ties if stage in tie.stages]
        if mine and reduce is None:
            raise ValueError(f"stage {stage} holds tied parameters {[t.names[0] for t in mine]} but has no tie reduce")
        self._reduce = reduce
        self._groups: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for tie in mine:
            self._groups.setdefault(tie.stages, []).append(parameter(layers, tie.names[0]))
        self.duplicates = {id(parameter(layers, t.names[0])) for t in mine if t.stages[0] != stage}
        self.ids = frozenset(id(parameter(layers, t.names[0])) for t in mine)  # this stage's tied parameters

    def all_reduce(self) -> None:
        """Every owner calls the groups in the same order (the ties' order), so none waits on another."""
        for stages, params in self._groups.items():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            total = self._reduce(stages, torch.cat([g.reshape(-1) for g in grads]))
            offset = 0
            for param, grad in zip(params, grads):
                param.grad = total[offset : offset + grad.numel()].view_as(grad).clone()
                offset += grad.numel()
