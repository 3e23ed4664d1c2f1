"""The optimizer every stage builds and drives: its learning-rate schedule and global-norm clipping."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


def lr_at(*, step: int, warmup: int, total: int, lr: float, min_lr: float) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, cosine decay to ``min_lr`` at ``total``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0 <= warmup <= total:
        raise ValueError(f"warmup must be in [0, total={total}], got {warmup}")
    if not 0 <= min_lr <= lr:
        raise ValueError(f"min_lr must be in [0, lr={lr}], got {min_lr}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / (total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def clip_coef(*, total_sq_norm: float, max_norm: float) -> float:
    """The factor that brings the global gradient norm down to ``max_norm`` (1 when already below)."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    if not (math.isfinite(total_sq_norm) and total_sq_norm >= 0):
        raise ValueError(f"total_sq_norm must be finite and >= 0, got {total_sq_norm}")
    return min(1.0, max_norm / (math.sqrt(total_sq_norm) + 1e-6))


@dataclass(frozen=True)
class Optim:
    """AdamW with linear warmup, cosine decay and global gradient-norm clipping."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 5
    total: int = 100
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0

    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=(0.9, 0.95))

    def lr_at(self, step: int) -> float:
        return lr_at(step=step, warmup=self.warmup, total=self.total, lr=self.lr, min_lr=self.min_lr)


@dataclass(frozen=True)
class FactoryOptim:
    """A user's optimizer factory; each param group keeps the learning rate the factory gave it.

    Gradients are clipped by the global norm (over all stages) only when `max_grad_norm` is finite.
    """

    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    max_grad_norm: float = math.inf

    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = self.factory(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer factory {self.factory!r} returned {type(optimizer).__name__}, not an Optimizer"
            )
        return optimizer

    def lr_at(self, step: int) -> None:
        return None


class OptimSpec(Protocol):
    """How every stage builds and drives its optimizer (`Optim`, or `FactoryOptim` over a user's factory)."""

    max_grad_norm: float

    def optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer: ...

    def lr_at(self, step: int) -> float | None:
        """The learning rate of every group at `step`; None: the optimizer keeps its own rates."""
        ...
