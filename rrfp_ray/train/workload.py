"""Real training through the pipeline: any model given as a list of modules.

`ModelWorkload` is plain data sent to every stage; each stage builds the whole module
list from the same seed, keeps its own chunks, and returns a `ModelExecutor` that the
runtime drives action by action. Stage 0 reads its inputs and the stage holding the last
virtual stage (`Layout.loss_stage`: the last stage when looped, stage 0 under V) its
targets from the data source by (iteration, microbatch): no data passes through the
driver. After every action of an iteration, the stages agree on the global gradient
norm (one all-reduce over all stages), clip, and step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rrfp_ray.models.tp import TPLayers
from rrfp_ray.runtime.reduce import gather_owned, owners
from rrfp_ray.runtime.worker import StepResult
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.deps import Layout, Message
from rrfp_ray.sim.variability import Trace
from rrfp_ray.train.checkpoint import StageFile, load_stage, save_stage
from rrfp_ray.train.runner import LossFn, StageRunner, build_stage, clip_coef, lr_at


class DataSource(Protocol):
    microbatches: int  # how many microbatches an iteration has (validation: how many `evaluate` runs)

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of microbatch `index` of `iteration`; the same in every process."""
        ...

_GATHER_BUCKET_BYTES = 25 * 2**20  # ZeRO-1: bytes per all-gather of the stepped parameters


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
            raise ValueError(f"optimizer factory {self.factory!r} returned {type(optimizer).__name__}, not an Optimizer")
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


@dataclass(frozen=True)
class ModelWorkload:
    layers: Callable[[], Sequence[nn.Module]]  # deterministic: every process builds the same weights
    loss_fn: LossFn
    data: DataSource
    microbatches: int
    optim: OptimSpec = field(default_factory=Optim)
    injected: Trace | None = None  # extra delays (ms) per action and message, to inject variability
    val_data: DataSource | None = None
    device: str = "cpu"  # where each stage computes; payloads move to and from each link's own device
    dp: int = 1  # data-parallel replicas: `data` holds dp x microbatches microbatches an iteration
    dp_rank: int = 0  # this replica: it reads microbatches dp_rank x microbatches onwards
    zero_sum: Callable[[Tensor], Tensor] | None = None  # ZeRO-1: the DP group's sum (set by with_dp)

    def executor(self, *, stage: int, layout: Layout) -> ModelExecutor:
        runner = build_stage(
            layers=[layer.to(self.device) for layer in self.layers()],
            stages=layout.stages,
            chunks=layout.chunks,
            placement=layout.placement,
            stage=stage,
            loss_fn=self.loss_fn,
            loss_scale=1.0 / (self.microbatches * self.dp),  # summed over the replicas: the global mean's gradients
            optimizer_factory=self.optim.optimizer if self.zero_sum is None else self._shard_optimizer,
        )
        return ModelExecutor(stage=stage, runner=runner, layout=layout, workload=self)

    def latency(self, message: Message) -> float:
        return 0.0 if self.injected is None else self.injected.latency(message)

    def with_tp(self, *, rank: int, size: int, all_reduce: Callable[[Tensor], Tensor]) -> ModelWorkload:
        """The GPT's blocks split Megatron-style over `size` ranks (other models: ValueError at build)."""
        return replace(self, layers=TPLayers(layers=self.layers, rank=rank, size=size, all_reduce=all_reduce))

    def with_dp(self, *, rank: int, zero_sum: Callable[[Tensor], Tensor] | None = None) -> ModelWorkload:
        if not 0 <= rank < self.dp:
            raise ValueError(f"dp rank must be in [0, {self.dp}), got {rank}")
        return replace(self, dp_rank=rank, zero_sum=zero_sum)

    def _shard_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """ZeRO-1: the optimizer over the parameters this replica owns (`owners`)."""
        owned = [p for p, o in zip(params, owners([p.numel() for p in params], replicas=self.dp)) if o == self.dp_rank]
        if not owned:
            raise ValueError(f"ZeRO-1: {len(params)} parameters on a stage are too few to shard over {self.dp} replicas")
        return self.optim.optimizer(owned)


class ModelExecutor:
    def __init__(self, *, stage: int, runner: StageRunner, layout: Layout, workload: ModelWorkload) -> None:
        self.stage = stage
        self.runner = runner
        self._layout = layout
        self._workload = workload

    def begin(self, *, iteration: int) -> None:
        self.runner.reset_iteration()
        if self._workload.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

    def run(self, *, action: Action, iteration: int, payload: Tensor | None) -> Tensor | None:
        vs = self._layout.vs(action)
        m, c = action.microbatch, action.chunk
        payload = _to(payload, device=self._workload.device)
        if action.kind is Kind.F:
            inputs, targets = payload, None
            if vs == 0 or vs == self._layout.virtual_stages - 1:
                index = self._workload.dp_rank * self._workload.microbatches + m
                x, y = _to(self._workload.data.microbatch(iteration=iteration, index=index), device=self._workload.device)
                inputs = x if vs == 0 else inputs
                targets = y if vs == self._layout.virtual_stages - 1 else None
            out = self.runner.forward(chunk=c, microbatch=m, inputs=inputs, targets=targets)
        elif action.kind is Kind.I:
            out = self.runner.backward_input(chunk=c, microbatch=m, grad=payload)
        elif action.kind is Kind.B:
            out = self.runner.backward(chunk=c, microbatch=m, grad=payload)
        else:
            out = self.runner.backward_weight(chunk=c, microbatch=m)
        self._inject(action)
        return out

    def _inject(self, action: Action) -> None:
        if self._workload.injected is not None:
            time.sleep(self._workload.injected.duration(action) / 1e3)

    def gradients(self, *, chunk: int) -> list[Tensor]:
        return self.runner.chunk_grads(chunk)

    def finish(self, *, iteration: int, all_reduce: Callable[[float], float]) -> StepResult:
        """Clip by the global gradient norm (summed over all stages; replica 0's alone, since the
        replicas hold the same summed gradients) and step."""
        total = all_reduce(self.runner.grad_sq_norm() if self._workload.dp_rank == 0 else 0.0)
        lr = self._workload.optim.lr_at(iteration)
        coef = clip_coef(total_sq_norm=total, max_norm=self._workload.optim.max_grad_norm)
        self.runner.step(clip_coef=coef, lr=lr)
        if self._workload.zero_sum is not None:
            params = self.runner.parameters()
            gather_owned(
                params,
                owner=owners([p.numel() for p in params], replicas=self._workload.dp),
                rank=self._workload.dp_rank,
                all_reduce=self._workload.zero_sum,
                bucket_bytes=_GATHER_BUCKET_BYTES,
            )
        losses = self.runner.losses()
        return StepResult(
            loss=sum(losses) / len(losses) if losses else None,
            grad_norm=total**0.5,
            lr=lr,
            peak_bytes=(
                torch.cuda.max_memory_allocated() if self._workload.device.startswith("cuda") else self.runner.peak_held_bytes
            ),
            optim_bytes=self.runner.optim_bytes,
        )

    def save(self, *, directory: Path, iteration: int, shard: int) -> StageFile:
        """Write this stage's (TP shard's) chunks and optimizer state atomically; the driver commits the manifest."""
        return save_stage(directory=directory, iteration=iteration, stage=shard, state=self.runner.state_dict())

    def load(self, *, directory: Path, file: StageFile) -> None:
        self.runner.load_state_dict(load_stage(directory=directory, file=file))

    @torch.no_grad()
    def evaluate(self, *, chunk: int, inputs: Tensor | None, index: int) -> Tensor:
        """Forward only on validation microbatch `index`: the activation, or the loss on the last virtual stage."""
        if self._workload.val_data is None:
            raise ValueError("this workload has no validation data (val_data)")
        vs = self._layout.virtual_stage(stage=self.stage, chunk=chunk)
        x, y = _to(self._workload.val_data.microbatch(iteration=0, index=index), device=self._workload.device)
        out = self.runner.module(chunk)(x if vs == 0 else _to(inputs, device=self._workload.device))
        return (self._workload.loss_fn(out, y) if vs == self._layout.virtual_stages - 1 else out).cpu()


def _to(value: Any, *, device: str) -> Any:
    """A tensor, or a tuple/list of them, on `device`."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device=device) for v in value)
    return value
