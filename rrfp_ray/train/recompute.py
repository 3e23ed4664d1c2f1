"""Activation checkpointing: each block recomputes its internals in its backward.

A *block* is a layer of the pipeline's layer list whose class occurs there more than once
and that holds parameters (a transformer's blocks; not its embedding or head). Its
forward runs under non-reentrant `torch.utils.checkpoint`, so a stage keeps only each
block's input, and the autograd graph keeps every node: the split backward
(`split_backward`) still finds the weight nodes inside a block, and the gradients are
exactly the full run's. The cost: a full backward recomputes each block once; with the
B/W split the input pass recomputes it once and the weight pass once per autograd call
it makes (one per group of weights, `WeightPass`), since a recomputation is freed when
the autograd call that made it ends. The state dict's names do not change.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rrfp_ray.runtime.tree import flatten


def blocks(layers: Sequence[nn.Module]) -> list[nn.Module]:
    counts = collections.Counter(type(layer) for layer in layers)
    return [layer for layer in layers if counts[type(layer)] > 1 and any(True for _ in layer.parameters())]


def check_blocks(layers: Sequence[nn.Module]) -> None:
    if not blocks(layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(
            f"activation_checkpointing: the model has no blocks to checkpoint (a block is a layer with parameters "
            f"whose class occurs more than once in the layer list; its layers are {kinds})"
        )


def checkpoint_blocks(layers: Sequence[nn.Module]) -> None:
    """Make every block of `layers` recompute its internals in its backward (in place)."""
    check_blocks(layers)
    for block in blocks(layers):
        block.forward = _Recomputed(block.forward)


class _Recomputed:
    def __init__(self, forward: Callable[..., Any]) -> None:
        self._forward = forward

    def __call__(self, *args: Any) -> Any:
        leaves, _ = flatten(args)
        _Held.apply(*leaves)  # the block's inputs stay alive for the recomputation: count them as held
        return checkpoint(self._forward, *args, use_reentrant=False)


class _Held(torch.autograd.Function):
    """Saves its inputs for backward (so the runner's byte count sees them) and does nothing else."""

    @staticmethod
    def forward(ctx: Any, *tensors: Tensor) -> None:
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[None, ...]:
        return (None,) * len(ctx.saved_tensors)
