"""The Trainer's rebalancing: a throttled stage gives layers away at an iteration boundary, the moves
are kept as plain data, training goes on; an even pipeline does not move."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rrfp_ray.train.api import InMemoryData, Trainer
from rrfp_ray.train.config import PipelineConfig


def _trainer(*, slow: dict[int, float], threshold: float = 0.1, window: int = 3) -> Trainer:
    torch.manual_seed(0)
    batches = [(torch.randn(32, 512), torch.randn(32, 512)) for _ in range(4)]
    pipeline = PipelineConfig(
        stages=4,
        microbatches=4,
        policy="1f1b",
        rebalance=True,
        measure_every=1,
        rebalance_threshold=threshold,
        rebalance_window=window,
    )
    return Trainer(
        model=lambda: [nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)],
        loss_fn=F.mse_loss,
        data=InMemoryData(batches=batches, microbatches=4),
        pipeline=pipeline,
        slow_devices=slow,
    )


def test_a_throttled_stage_gives_layers_away() -> None:
    with _trainer(slow={3: 8.0}, window=5) as trainer:
        reports = trainer.fit(12)
        moves = trainer.moves
        split = trainer.pipeline.layer_split
    assert moves, "the throttled stage kept its layers"
    first = moves[0]
    assert first.before == (2, 2, 2, 2) and first.after[3] < 2 and 3 in first.stages and first.layers >= 1
    assert first.iteration >= 4  # it waited for the window
    assert first.predicted_after_ms < first.predicted_before_ms and first.seconds > 0
    assert split == moves[-1].after
    assert all(math.isfinite(r.loss) for r in reports)


def test_an_even_pipeline_does_not_move() -> None:
    with _trainer(slow={}, threshold=0.5, window=4) as trainer:
        trainer.fit(8)
        assert trainer.moves == [] and trainer.pipeline.layer_split is None
