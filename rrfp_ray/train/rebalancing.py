"""The Trainer's rebalancing: each finished iteration goes to the rebalancer (`rrfp_ray.plan.rebalance`);
where it decides, the pipeline moves to the new split at the iteration boundary, and every move is kept
as plain data with what it was predicted and measured to gain."""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.rebalance import Decision, Rebalancer, RebalanceSettings, layers_moved
from rrfp_ray.policy.policy import Policy
from rrfp_ray.train.config import PipelineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Move:
    """A move the pipeline made: from `before` to `after` at the end of `iteration`, the stages whose
    layer count changed, how many layers changed stage, the predicted iteration ms before and after, the
    seconds the move took, and the median measured iteration over the `window` iterations before it and,
    once they ran, the `window` after it (None until then)."""

    iteration: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    stages: tuple[int, ...]
    layers: int
    predicted_before_ms: float
    predicted_after_ms: float
    seconds: float
    measured_before_ms: float
    measured_after_ms: float | None = None

    @classmethod
    def of(cls, *, decision: Decision, seconds: float, measured_before_ms: float) -> Move:
        before, after = decision.current, decision.split
        return cls(
            iteration=decision.iteration,
            before=before,
            after=after,
            stages=tuple(s for s, (n, m) in enumerate(zip(before, after)) if n != m),
            layers=layers_moved(before=before, after=after),
            predicted_before_ms=decision.before_ms,
            predicted_after_ms=decision.after_ms,
            seconds=seconds,
            measured_before_ms=measured_before_ms,
        )


def stage_memory_bytes(*, pipeline: PipelineConfig, device: str) -> float:
    """Each stage's memory for the rebalancer's splits: `balance.stage_memory_mb`, else the device's."""
    if pipeline.balance.stage_memory_mb is not None:
        return pipeline.balance.stage_memory_mb * 2**20
    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return math.inf


class Rebalancing:
    """`after(report)` after every finished iteration; `reshape(layer_split=...) -> seconds` moves the
    pipeline. `policy` is what the rebalancer simulates the pipeline under."""

    def __init__(self, *, pipeline: PipelineConfig, policy: Policy, device: str, reshape: Callable[..., float]) -> None:
        self.pipeline, self.policy, self.reshape = pipeline, policy, reshape
        self.memory = stage_memory_bytes(pipeline=pipeline, device=device)
        self.rebalancer: Rebalancer | None = None  # made by the first measured iteration
        self.moves: list[Move] = []
        self.recent: deque[float] = deque(maxlen=pipeline.balance.rebalance_window)  # the last iterations' ms

    def after(self, report: IterationReport) -> None:
        self.recent.append(report.makespan_ms)
        window = self.pipeline.balance.rebalance_window
        if self.moves and self.moves[-1].measured_after_ms is None and len(self.recent) == window:
            move = self.moves[-1] = replace(self.moves[-1], measured_after_ms=statistics.median(self.recent))
            logger.info(
                "the move after iteration %d: %.1f -> %.1f ms measured (%.1f -> %.1f predicted)",
                move.iteration, move.measured_before_ms, move.measured_after_ms,
                move.predicted_before_ms, move.predicted_after_ms,
            )  # fmt: skip
        if self.rebalancer is None:
            self.rebalancer = self._new(report)
            if self.rebalancer is None:
                return
        decision = self.rebalancer.observe(iteration=report.iteration, stages=report.stages)
        if decision is None:
            return
        if not decision.moves:
            logger.debug("iteration %d: %s", decision.iteration, decision.reason)
            return
        before = statistics.median(self.recent)
        seconds = self.reshape(layer_split=decision.split)
        self.rebalancer.applied(split=decision.split, seconds=seconds)
        move = Move.of(decision=decision, seconds=seconds, measured_before_ms=before)
        self.moves.append(move)
        self.recent.clear()
        logger.info(
            "after iteration %d: rebalanced %s -> %s (stages %s, %d layers moved) in %.2f s: %s",
            move.iteration, ",".join(map(str, move.before)), ",".join(map(str, move.after)),
            ",".join(map(str, move.stages)), move.layers, seconds, decision.reason,
        )  # fmt: skip

    def _new(self, report: IterationReport) -> Rebalancer | None:
        """The rebalancer, on the split `report` measured (None: it measured nothing)."""
        held = {stats.stage: len(stats.layer_costs) for stats in report.stages if stats.layer_costs}
        if not held:
            return None
        balance = self.pipeline.balance
        return Rebalancer(
            settings=RebalanceSettings(
                threshold=balance.rebalance_threshold, window=balance.rebalance_window, memory_bytes=self.memory
            ),
            split=tuple(held[s] for s in range(self.pipeline.stages)),
            policy=self.policy,
            cap=self.pipeline.cap,
            microbatches=self.pipeline.microbatches,
        )
