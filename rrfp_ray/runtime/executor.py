"""What the runtime asks of the work it runs: a `Workload` (plain data sent to every stage) builds
each stage's `Executor`, which runs the stage's actions and ends each iteration with a `StepResult`.

Every method the runtime calls is declared here; `ExecutorWrapper` forwards all of them, for
executors that change one (fault injection, profiling)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.measure import Costs
from rrfp_ray.runtime.reduce import ChunkGradients, GradSink
from rrfp_ray.schedule.actions import Action
from rrfp_ray.schedule.layout import Layout, Message


@dataclass(frozen=True)
class StepResult:
    loss: float | None  # mean training loss of the iteration (last stage only)
    grad_norm: float
    lr: float | None  # None: the optimizer's own rates
    peak_bytes: int  # the most activation bytes the stage held for backward work at once
    optim_bytes: int = 0  # optimizer state held (with ZeRO-1: this replica's shard)
    skipped: bool = False  # the global gradient norm was not finite: no stage stepped
    kept: tuple[tuple[int, int, int], ...] = ()  # (chunk, microbatch slot, activation bytes its forward kept)


class Executor(Protocol):
    def begin(self, *, args: IterationArgs) -> None:
        """Before the iteration's first action: `args.order[slot]` is the data microbatch slot `slot` reads,
        `args.packing[j]` (None: the data's own) the samples data microbatch j holds; with `args.measure`,
        `measure` follows the iteration's `finish` (the executor keeps what it replays)."""
        ...

    def measure(self) -> Costs:
        """After `finish` of an iteration begun with `measure`: each of the stage's layers' costs and
        its device's probe, timed on this (the compute) thread (`rrfp_ray.runtime.measure`)."""
        ...

    def finish(self, *, iteration: int, all_reduce: Callable[[float], float]) -> StepResult | None:
        """After every action of the iteration: e.g. clip by the global norm and step."""
        ...

    def run(
        self, *, action: Action, iteration: int, payload: torch.Tensor | None, release: GradSink | None = None
    ) -> torch.Tensor | None:
        """Run one action on its input (activation or gradient); return what it sends, if anything.

        I is the input gradient alone, W the weight gradient, B both. `release` is given when the
        action is its chunk's last weight-gradient op under data parallelism: the chunk's gradients
        go to it in parts as they become final during the op; by the time `run` returns, the parts
        in order make up `gradients(chunk=action.chunk)`, in its order."""
        ...

    def gradients(self, *, chunk: int) -> ChunkGradients:
        """The tensors data parallelism sums over the DP group once `chunk`'s last weight-gradient op
        is done (in place; the gradients of its parameters, or a synthetic payload), with their owners under ZeRO-1."""
        ...

    # The model's state, for evaluation, checkpoints and export (a synthetic workload's executors hold none).
    def evaluate(self, *, chunk: int, inputs: torch.Tensor | None, index: int) -> torch.Tensor:
        """Forward of validation microbatch `index` through `chunk` (`inputs`: the previous virtual stage's output)."""
        ...

    def save(self, *, directory: Path, iteration: int, shard: int) -> Any:
        """Write this stage's checkpoint file (`shard`: its actor index); returns what the manifest records of it."""
        ...

    def load(self, *, directory: Path, manifest: Any) -> None:
        """Load this stage's share of the checkpoint `manifest` records (`rrfp_ray.train.checkpoint.Manifest`)."""
        ...

    def chunk_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """This stage's chunk weights, on the CPU: {chunk: state dict}."""
        ...


class TieSpec(Protocol):
    """A parameter held by more than one stage (`rrfp_ray.train.ties.Tie`)."""

    stages: tuple[int, ...]  # the stages that hold a copy, ascending


class Workload(Protocol):
    """Plain data sent to every stage; each stage builds its own executor from it."""

    ties: Sequence[TieSpec]  # parameters shared between stages: their gradients are summed over them

    def executor(self, *, stage: int, layout: Layout) -> Executor: ...

    def latency(self, message: Message, *, iteration: int) -> float:
        """Injected communication latency in ms before iteration `iteration`'s `message` is handed over (0 for real
        work)."""
        ...

    def with_tp(self, *, rank: int, size: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> Workload:
        """This workload as TP rank `rank` of `size` runs it (its tensor-parallel layers sum over `all_reduce`)."""

    def with_dp(self, *, rank: int, zero_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Workload:
        """As data-parallel replica `rank` (its share of each iteration's data); `zero_sum`: the DP sum, for ZeRO-1."""

    def with_ties(self, *, reduce: Callable[[tuple[int, ...], torch.Tensor], torch.Tensor]) -> Workload:
        """As a stage runs it, summing each tie's gradients over `reduce(owning stages, tensor)`."""


class ExecutorWrapper:
    """Runs `inner`; a subclass overrides what it changes."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    def begin(self, *, args: IterationArgs) -> None:
        self.inner.begin(args=args)

    def measure(self) -> Costs:
        return self.inner.measure()

    def finish(self, *, iteration: int, all_reduce: Callable[[float], float]) -> StepResult | None:
        return self.inner.finish(iteration=iteration, all_reduce=all_reduce)

    def run(
        self, *, action: Action, iteration: int, payload: torch.Tensor | None, release: GradSink | None = None
    ) -> torch.Tensor | None:
        return self.inner.run(action=action, iteration=iteration, payload=payload, release=release)

    def gradients(self, *, chunk: int) -> ChunkGradients:
        return self.inner.gradients(chunk=chunk)

    def evaluate(self, *, chunk: int, inputs: torch.Tensor | None, index: int) -> torch.Tensor:
        return self.inner.evaluate(chunk=chunk, inputs=inputs, index=index)

    def save(self, *, directory: Path, iteration: int, shard: int) -> Any:
        return self.inner.save(directory=directory, iteration=iteration, shard=shard)

    def load(self, *, directory: Path, manifest: Any) -> None:
        self.inner.load(directory=directory, manifest=manifest)

    def chunk_states(self) -> dict[int, dict[str, torch.Tensor]]:
        return self.inner.chunk_states()
