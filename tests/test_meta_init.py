"""Each stage materializes only its own layers: the GPT's layers come out value for value as the
whole model's seeded init gives them (today's and before), the others on the meta device."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rrfp_ray.models.gpt import GPT, INIT_STD, Block, Embed, GPTConfig, Head, build_layers
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer

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
        held = [[p.is_meta for p in executor.runner.parameters()] for executor in trainer.backend.executors]
        built = trainer.workload.layers.stage_layers(stages=3, chunks=1, stage=1)
    assert held and not any(any(h) for h in held)  # what each stage steps is real
    assert [any(p.is_meta for p in layer.parameters()) for layer in built] == [True, True, False, False, True, True]
    for key, value in nn.Sequential(*reference.layers()).state_dict().items():
        if key in state:
            assert torch.equal(state[key], value), key


class Scaled(nn.Module):
    """Init the way user code does it: a draw into a transposed view, a parameter derived from a
    temporary, a random buffer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        nn.init.normal_(self.linear.weight.t(), std=0.05)
        self.gain = nn.Parameter(torch.randn(width) * 0.1 + 1)
        self.register_buffer("offset", torch.rand(width))

    def forward(self, x):
        return torch.tanh(self.linear(x)) * self.gain + self.offset


class TiedHead(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embed.embedding_dim)
        self.out = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
        self.out.weight = embed.weight  # tied, as GPT-2 ties its embedding and LM head

    def forward(self, x):
        return self.out(self.norm(x))


def user_builder() -> list[nn.Module]:
    embed = nn.Embedding(32, 16)
    return [embed, *(Scaled(16) for _ in range(4)), TiedHead(embed)]


def _storages(layers) -> set[int]:
    return {
        t.untyped_storage()._cdata for layer in layers for t in [*layer.parameters(), *layer.buffers()] if not t.is_meta
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_users_builder_materializes_only_the_stages_own_layers_with_the_whole_builds_values(stage):
    from rrfp_ray.train.layers import model_layers

    layers = model_layers(model=user_builder, seed=5)
    whole = layers()
    built = layers.stage_layers(stages=3, chunks=1, stage=stage)
    own = range(2 * stage, 2 * stage + 2)
    assert _storages(built) == _storages(built[i] for i in own)  # nothing else holds memory (a tie is one tensor)
    for index in own:
        for (name, x), (_, y) in zip(built[index].state_dict().items(), whole[index].state_dict().items(), strict=True):
            assert not x.is_meta and torch.equal(x, y), (index, name)


def test_a_users_builder_trains_exactly_like_the_same_modules_built_eagerly():
    from rrfp_ray import InMemoryData, PipelineConfig, Trainer

    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 32, (4, 8), generator=gen), torch.randint(0, 32, (4, 8), generator=gen)) for _ in range(3)
    ]

    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))

    def train(model):
        with Trainer(
            model=model,
            loss_fn=loss_fn,
            data=InMemoryData(batches=batches, microbatches=3),
            pipeline=PipelineConfig(stages=3, microbatches=3, policy="bfw", timeout_s=30),
            seed=2,
        ) as trainer:
            losses = [trainer.step().loss for _ in range(3)]
            held = [list(executor.runner.parameters()) for executor in trainer.backend.executors]
            return losses, trainer.state_dict(), held

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        eager = user_builder()
    want_losses, want_state, _ = train(eager)
    losses, state, held = train(user_builder)
    assert not any(p.is_meta for params in held for p in params)
    assert losses == want_losses
    assert state.keys() == want_state.keys()
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key


def test_a_builder_that_reads_values_is_built_whole_with_a_warning(caplog):
    from rrfp_ray.train.layers import model_layers

    def reads_values() -> list[nn.Module]:
        first = nn.Linear(4, 4)
        width = 4 if float(first.weight.detach().sum()) < 100 else 5  # data-dependent: meta tensors have no values
        return [first, nn.Linear(4, width), nn.Linear(width, 4)]

    layers = model_layers(model=reads_values, seed=0)
    with caplog.at_level("WARNING", logger="rrfp_ray.train.meta_init"):
        built = layers.stage_layers(stages=3, chunks=1, stage=2)
    assert "building the whole model" in caplog.text
    for x, y in zip(nn.Sequential(*built).state_dict().values(), nn.Sequential(*layers()).state_dict().values()):
        assert not x.is_meta and torch.equal(x, y)
