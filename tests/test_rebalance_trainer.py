"""The Trainer's rebalancing: a throttled stage of the GPT gives layers away at an iteration boundary,
the moves are kept as plain data and the losses are an unmoved run's; an even pipeline does not move."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer
from rrfp_ray.train.api import Trainer
from rrfp_ray.train.build import InMemoryData
from rrfp_ray.train.config import PipelineConfig


def _even() -> Trainer:
    """Eight equal layers over 4 stages on equal devices; a high threshold keeps a busy host's noise out."""
    torch.manual_seed(0)
    batches = [(torch.randn(32, 512), torch.randn(32, 512)) for _ in range(4)]
    pipeline = PipelineConfig(
        stages=4,
        microbatches=4,
        policy="1f1b",
        rebalance=True,
        measure_every=1,
        rebalance_threshold=0.5,
        rebalance_window=4,
    )
    return Trainer(
        model=lambda: [nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)],
        loss_fn=F.mse_loss,
        data=InMemoryData(batches=batches, microbatches=4),
        pipeline=pipeline,
    )


def _gpt(*, rebalance: bool) -> RunConfig:
    return RunConfig(
        model={"n_layer": 6, "n_embd": 128, "n_head": 4, "block_size": 64},
        pipeline={
            "stages": 4,
            "microbatches": 4,
            "policy": "1f1b",
            "timeout_s": 60,
            "rebalance": rebalance,
            "measure_every": 1,
            "rebalance_window": 4,
        },
        train={"micro_batch_size": 4, "seq_len": 64, "iterations": 10},
        variability={"slow_devices": {3: 8.0}},
    )


def test_a_throttled_stage_gives_layers_away_and_training_is_unchanged() -> None:
    losses, moves, split = {}, {}, {}
    for rebalance in (True, False):
        with gpt_trainer(_gpt(rebalance=rebalance)) as trainer:
            losses[rebalance] = [report.loss for report in trainer.fit(10)]
            moves[rebalance], split[rebalance] = trainer.moves, trainer.pipeline.layer_split
    assert moves[False] == [] and split[False] is None
    assert moves[True], "the throttled stage kept its layers"
    first = moves[True][0]
    assert first.before == (2, 2, 2, 2) and first.after[3] < 2 and 3 in first.stages and first.layers >= 1
    assert first.iteration >= 3  # it waited for the window
    assert first.predicted_after_ms < first.predicted_before_ms and first.seconds > 0
    assert split[True] == moves[True][-1].after
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)  # the split never changes the mathematics


def test_an_even_pipeline_does_not_move() -> None:
    with _even() as trainer:
        trainer.fit(8)
        assert trainer.moves == [] and trainer.pipeline.layer_split is None
