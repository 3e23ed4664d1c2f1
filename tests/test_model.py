import math

import pytest
import torch

from rrfp_ray.models.gpt import GPT, GPTConfig, lm_loss

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)


def _tokens(*, shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"dropout": 0.1}, "dropout"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_default_config_is_byte_level() -> None:
    config = GPTConfig()
    assert (config.vocab_size, config.block_size, config.n_layer, config.n_head, config.n_embd) == (256, 64, 4, 4, 64)


def test_init_depends_on_the_seed_only_and_leaves_the_global_rng_alone() -> None:
    before = torch.get_rng_state()
    a, b, c = GPT(TINY, seed=3), GPT(TINY, seed=3), GPT(TINY, seed=4)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), pb, _pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.wte.weight, c.embed.wte.weight)


def test_layers_compose_to_forward_logits() -> None:
    model = GPT(TINY, seed=0)
    idx = _tokens(shape=(3, 16), seed=0)
    layers = model.layers()
    assert len(layers) == TINY.n_layer + 2
    x = idx
    for layer in layers:
        x = layer(x)
    logits, loss = model(idx)
    assert loss is None
    assert logits.shape == (3, 16, 256)
    assert torch.equal(x, logits)
    assert {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in model.parameters()}


def test_initial_loss_is_near_uniform() -> None:
    model = GPT(TINY, seed=0)
    idx, targets = _tokens(shape=(4, 16), seed=1), _tokens(shape=(4, 16), seed=2)
    logits, loss = model(idx, targets)
    assert loss is not None
    assert torch.equal(loss, lm_loss(logits, targets))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal() -> None:
    model = GPT(TINY, seed=0)
    idx = _tokens(shape=(1, 16), seed=0)
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    before, _ = model(idx)
    after, _ = model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_sequence_longer_than_block_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY, seed=0)(_tokens(shape=(1, 17), seed=0))


def test_bias_false_drops_every_bias() -> None:
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=8, bias=False), seed=0)
    assert not [name for name, _ in model.named_parameters() if name.endswith("bias")]
