"""Faults on purpose: stages that crash mid-iteration or mid-checkpoint on a seeded schedule.

    plan = FaultPlan.seeded(seed=3, count=3, shards=6, iterations=20, actions=8,
                            checkpoint_every=5, directory=str(tmp), crash=Crash.EXIT)
    trainer.backend.set_workload(workload=FaultyWorkload(inner=trainer.workload, plan=plan))

`FaultyWorkload` wraps any workload; its executors run the inner ones and crash where the
plan says. Each fault fires once per run: it leaves a marker file in `plan.directory`
before firing, so the rebuilt stage, replaying the same iterations, runs on. Which faults
fired is `plan.fired()`.
"""

from __future__ import annotations

import enum
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rrfp_ray.runtime.executor import Executor, ExecutorWrapper, TieSpec, Workload
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.mesh import Mesh
from rrfp_ray.runtime.reduce import GradSink
from rrfp_ray.schedule.actions import Action
from rrfp_ray.schedule.layout import Layout, Message


class Moment(enum.Enum):
    ACTION = "action"  # before the `index`-th action the shard runs in `iteration`
    SAVE = "save"  # right after the shard wrote its checkpoint file of `iteration`, before any manifest


class Crash(enum.Enum):
    RAISE = "raise"  # an exception in the stage: its call fails, the process lives on
    EXIT = "exit"  # the process ends at once, as if killed (stage actors only: in-process it ends the caller)
    STALL = "stall"  # the stage hangs for `FaultPlan.stall_s`, then goes on: a straggler past every timeout


@dataclass(frozen=True)
class Fault:
    shard: int  # the `Mesh` index of the actor whose executor crashes
    iteration: int
    moment: Moment
    index: int = 0  # Moment.ACTION: which of the shard's actions in the iteration


@dataclass(frozen=True)
class FaultPlan:
    directory: str  # where fired faults leave their markers (shared by every stage process)
    faults: tuple[Fault, ...]
    crash: Crash = Crash.RAISE
    stall_s: float = 3600.0  # Crash.STALL: how long

    @classmethod
    def seeded(
        cls,
        *,
        seed: int,
        count: int,
        shards: int,
        iterations: int,
        actions: int,
        checkpoint_every: int,
        directory: str,
        crash: Crash = Crash.RAISE,
        savers: int | None = None,
    ) -> FaultPlan:
        """`count` faults on distinct iterations in [1, iterations): each hits a random shard,
        mid-iteration (before one of its first `actions` actions) or, on a checkpoint
        iteration, mid-checkpoint (a save of iteration k runs after iteration k - 1) of one of
        the first `savers` shards, those that write checkpoint files (default: all; with DP
        and no ZeRO, replica 0's)."""
        rng = random.Random(seed)
        faults = []
        for iteration in sorted(rng.sample(range(1, iterations), count)):
            saves = checkpoint_every > 0 and iteration % checkpoint_every == 0
            moment = Moment.SAVE if saves and rng.random() < 0.5 else Moment.ACTION
            index = rng.randrange(actions) if moment is Moment.ACTION else 0
            pool = shards if moment is Moment.ACTION or savers is None else savers
            faults.append(Fault(shard=rng.randrange(pool), iteration=iteration, moment=moment, index=index))
        return cls(directory=directory, faults=tuple(faults), crash=crash)

    def fired(self) -> list[Fault]:
        return [f for i, f in enumerate(self.faults) if self._marker(i).exists()]

    def fire(self, *, shard: int, iteration: int, moment: Moment, index: int = 0) -> None:
        """Crash here if a fault not yet fired names this point."""
        point = Fault(shard=shard, iteration=iteration, moment=moment, index=index if moment is Moment.ACTION else 0)
        for i, fault in enumerate(self.faults):
            if fault == point and self._claim(i):
                if self.crash is Crash.EXIT:
                    os._exit(1)
                if self.crash is Crash.STALL:
                    time.sleep(self.stall_s)
                    return
                raise RuntimeError(f"injected fault: shard {shard}, iteration {iteration}, {moment.value} {index}")

    def _marker(self, i: int) -> Path:
        return Path(self.directory) / f"fault-{i}.fired"

    def _claim(self, i: int) -> bool:
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self._marker(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


@dataclass(frozen=True)
class FaultyWorkload:
    """`inner`, whose executors crash where `plan` says; TP rank `rank` of `size` in DP replica
    `replica` (its shard: that actor's `Mesh` index)."""

    inner: Workload
    plan: FaultPlan
    rank: int = 0
    size: int = 1
    replica: int = 0

    @property
    def ties(self) -> Sequence[TieSpec]:
        return self.inner.ties

    def executor(self, *, stage: int, layout: Layout) -> FaultyExecutor:
        # an index does not depend on how many replicas follow this one
        mesh = Mesh(stages=layout.stages, tp=self.size, dp=self.replica + 1)
        shard = mesh.index(replica=self.replica, stage=stage, rank=self.rank)
        return FaultyExecutor(inner=self.inner.executor(stage=stage, layout=layout), plan=self.plan, shard=shard)

    def latency(self, message: Message, *, iteration: int) -> float:
        return self.inner.latency(message, iteration=iteration)

    def with_tp(self, *, rank: int, size: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> FaultyWorkload:
        return replace(
            self, inner=self.inner.with_tp(rank=rank, size=size, all_reduce=all_reduce), rank=rank, size=size
        )

    def with_ties(self, *, reduce: Callable[[tuple[int, ...], torch.Tensor], torch.Tensor]) -> FaultyWorkload:
        return replace(self, inner=self.inner.with_ties(reduce=reduce))

    def with_dp(self, *, rank: int, zero_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> FaultyWorkload:
        return replace(self, inner=self.inner.with_dp(rank=rank, zero_sum=zero_sum), replica=rank)


class FaultyExecutor(ExecutorWrapper):
    def __init__(self, *, inner: Executor, plan: FaultPlan, shard: int) -> None:
        super().__init__(inner)
        self.plan = plan
        self.shard = shard
        self._index = 0

    def begin(self, *, args: IterationArgs) -> None:
        self._index = 0
        self.inner.begin(args=args)

    def run(
        self, *, action: Action, iteration: int, payload: torch.Tensor | None, release: GradSink | None = None
    ) -> torch.Tensor | None:
        self.plan.fire(shard=self.shard, iteration=iteration, moment=Moment.ACTION, index=self._index)
        self._index += 1
        return self.inner.run(action=action, iteration=iteration, payload=payload, release=release)

    def save(self, *, directory: Path, iteration: int, shard: int) -> Any:
        file = self.inner.save(directory=directory, iteration=iteration, shard=shard)
        self.plan.fire(shard=self.shard, iteration=iteration, moment=Moment.SAVE)
        return file
