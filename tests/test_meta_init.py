"""Each stage materializes only its own layers: the GPT's layers come out value for value as the
whole model's seeded init gives them (today's and before), the others on the meta device."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rrfp_ray.models.gpt import GPT, INIT_STD, Block, Embed, GPTConfig, Head, build_layers
from rrfp_ray.train.config import RunConfig
from rrfp_ray.train.gpt_workload import gpt_trainer

CONFIG = GPTConfig(block_size=16, n_layer=3, n_head=2, n_embd=16)


def _whole_model_init(config: GPTConfig, seed: int) -> list[nn.Module]:
    """The GPT's init as it was written before layers could be built apart (whole model, then init)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Module()
        model.embed = Embed(config)
        model.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        model.head = Head(config)
        if config.tie_embeddings:
            model.head.lm_head.weight = model.embed.wte.weight
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = INIT_STD / math.sqrt(2 * config.n_layer) if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
    return [model.embed, *model.blocks, model.head]


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("keep", [None, {0}, {4}, {1, 2}, {3, 4}])
def test_kept_layers_hold_exactly_the_whole_models_weights_and_the_rest_no_memory(tie, keep):
    config = CONFIG.model_copy(update={"tie_embeddings": tie})
    want = _whole_model_init(config, seed=7)
    got = build_layers(config, seed=7, keep=keep)
    assert [p for m in GPT(config, seed=7).layers() for p in m.state_dict().values()] != []
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        kept = keep is None or index in keep
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            if kept:
                assert torch.equal(x, y), (index, name)
            elif not x.is_meta:  # a tied weight is real when its other owner is kept
                assert tie and name in ("wte.weight", "lm_head.weight") and torch.equal(x, y)
    if tie:
        assert got[0].wte.weight is got[-1].lm_head.weight


def test_a_stage_of_the_gpt_trainer_holds_only_its_own_layers_with_the_unsplit_weights():
    run = RunConfig(
        model={"n_layer": 4, "n_embd": 32, "n_head": 4, "block_size": 16},
        pipeline={"stages": 3, "microbatches": 3, "policy": "1f1b", "timeout_s": 30},
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 1},
    )
    reference = GPT(run.model, seed=run.train.seed)
    with gpt_trainer(run) as trainer:
        state = trainer.state_dict()
        held = [
            [p.is_meta for p in executor.runner.parameters()] for executor in trainer.backend.executors
        ]
        built = trainer.workload.layers.stage_layers(stages=3, chunks=1, stage=1)
    assert held and not any(any(h) for h in held)  # what each stage steps is real
    assert [any(p.is_meta for p in layer.parameters()) for layer in built] == [True, True, False, False, True, True]
    for key, value in nn.Sequential(*reference.layers()).state_dict().items():
        if key in state:
            assert torch.equal(state[key], value), key
