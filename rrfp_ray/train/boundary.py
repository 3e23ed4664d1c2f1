"""What crosses a stage boundary as a `StageRunner` receives and sends it: activations and the
gradients that come back for them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rrfp_ray.runtime.tree import Tree, flatten, tree_map


def as_input(tensor: Tensor) -> Tensor:
    """A received leaf: differentiable (a fresh autograd leaf) when its sender said so."""
    return tensor.detach().requires_grad_(True) if tensor.requires_grad else tensor


def grad_message(grads: list[Tensor]) -> Tree:
    """The gradients of a chunk's differentiable inputs, in order: a lone tensor when there is one."""
    return grads[0] if len(grads) == 1 else tuple(grads)


def differentiable(tree: Tree) -> list[Tensor]:
    return [t for t in flatten(tree)[0] if t.requires_grad]


def to_send(tensor: Tensor) -> Tensor:
    """Detached; still marked requires_grad when a gradient must come back for it."""
    sent = tensor.detach()
    return sent.requires_grad_(True) if tensor.requires_grad else sent


def on_device(value: Any, *, device: str) -> Any:
    """A tree of tensors (or None) on `device`; a received leaf keeps its requires-grad mark."""
    if value is None:
        return None
    return tree_map(
        lambda t: (
            t if t.device.type == torch.device(device).type else t.detach().to(device).requires_grad_(t.requires_grad)
        ),
        value,
    )
