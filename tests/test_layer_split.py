"""A split users set (layers per virtual stage): the ranges it gives, the same training whatever the
split (tied embeddings included), and bad splits refused naming the field."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.partition import partition


def test_sizes_give_contiguous_ranges_in_forward_order() -> None:
    assert partition(n_layers=6, parts=4, sizes=(1, 1, 2, 2)) == [range(1), range(1, 2), range(2, 4), range(4, 6)]


@pytest.mark.parametrize("sizes", [(1, 1, 2), (0, 2, 2, 2), (2, 2, 2, 2)])
def test_sizes_that_miss_layers_or_parts_are_refused(sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"must give each of the 4 parts .* at least one layer and 6 layers in all"):
        partition(n_layers=6, parts=4, sizes=sizes)


def test_the_config_reads_the_split_as_text_and_checks_its_length() -> None:
    assert PipelineConfig(stages=2, layer_split="3,1").layer_split == (3, 1)
    with pytest.raises(ValidationError, match="layer_split\n.*3,1,1 must give each of the stages x chunks = 2"):
        PipelineConfig(stages=2, layer_split="3,1,1")
    with pytest.raises(ValidationError, match="comma-separated"):
        PipelineConfig(stages=2, layer_split="3;1")


def test_a_split_over_more_layers_than_the_model_has_names_both() -> None:
    with pytest.raises(ValidationError, match=r"layer_split 4,3 holds 7 layers; the model has 6"):
        RunConfig(model={"n_layer": 4}, pipeline={"stages": 2, "layer_split": (4, 3)})


def _run(split: tuple[int, ...] | None) -> RunConfig:
    return RunConfig(
        model={"n_layer": 4, "n_embd": 32, "n_head": 4, "block_size": 16},
        pipeline={"stages": 3, "microbatches": 4, "policy": "1f1b", "timeout_s": 60, "layer_split": split},
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 3},
    )


def test_training_is_the_same_whatever_the_split() -> None:
    losses, held, exported = {}, {}, {}
    for split in (None, (1, 1, 4), (4, 1, 1)):
        with gpt_trainer(_run(split)) as trainer:
            losses[split] = [report.loss for report in trainer.fit(3)]
            held[split] = [sum(p.numel() for p in e.runner.parameters()) for e in trainer.backend.executors]
            exported[split] = trainer.state_dict()
    assert held[(4, 1, 1)][0] > held[None][0] > held[(1, 1, 4)][0]
    assert held[(1, 1, 4)][2] > held[None][2] > held[(4, 1, 1)][2]
    for split in ((1, 1, 4), (4, 1, 1)):
        assert losses[split] == pytest.approx(losses[None], rel=1e-5)
        assert exported[split].keys() == exported[None].keys()  # the export gathers each split's layers
        for key, tensor in exported[None].items():
            torch.testing.assert_close(exported[split][key], tensor, rtol=1e-4, atol=1e-6)
