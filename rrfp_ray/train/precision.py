"""Mixed precision: bf16 compute under autocast over fp32 master weights.

With `Precision.BF16` a stage runs its forward under `torch.autocast` (bf16 matmuls; the
weights, their gradients and the optimizer state stay fp32), and the floating tensors it
sends (activations forward, their gradients back) travel in bf16: half the bytes, and
the message header says the dtype.
"""

from __future__ import annotations

import contextlib
import enum

import torch
from torch import Tensor


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


def autocast(precision: Precision, *, device: str) -> contextlib.AbstractContextManager:
    if precision is Precision.FP32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def for_the_wire(precision: Precision, tensor: Tensor) -> Tensor:
    """A floating tensor as it crosses a boundary (inside the graph: its gradient comes back in that dtype too)."""
    if precision is Precision.BF16 and tensor.is_floating_point():
        return tensor.to(torch.bfloat16)
    return tensor
