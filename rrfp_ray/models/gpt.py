"""A nanoGPT-sized, byte-level GPT. It knows nothing about pipelining.

The one concession to splitting: ``GPT.layers()`` lists modules whose sequential
composition is ``forward``'s logits, so a pipeline can cut the list anywhere.
The token embedding and the output head share one weight by default (as in GPT-2 and
nanoGPT; ``tie_embeddings=False`` unties them), so the first and the last layer share a
parameter: a pipeline keeps one copy per stage and sums their gradients.
There is no dropout: a run is a deterministic function of its seeds.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

INIT_STD = 0.02


class GPTConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(default=256, gt=0, description="token ids are bytes: 256")
    block_size: int = Field(default=64, gt=0, description="longest sequence the position table covers")
    n_layer: int = Field(default=4, gt=0, description="transformer blocks")
    n_head: int = Field(default=4, gt=0, description="attention heads per block")
    n_embd: int = Field(default=64, gt=0, description="model width; a multiple of n_head")
    bias: bool = Field(default=True, description="biases in Linear and LayerNorm layers")
    tie_embeddings: bool = Field(default=True, description="the LM head reuses the token embedding's weight")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        return self


class Embed(nn.Module):
    """Token ids (B, T) int64 -> token + position embeddings (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, idx: Tensor) -> Tensor:
        length = idx.shape[-1]
        if length > self.block_size:
            raise ValueError(f"sequence length {length} exceeds block_size {self.block_size}")
        positions = torch.arange(length, device=idx.device)
        return self.wte(idx) + self.wpe(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Causal attention, or with `mask` (bool, broadcast to (B, heads, T, T); True: may attend) that mask's."""
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection: (B, T, C) -> logits (B, T, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """``GPT(config, seed=s)`` initialises its weights from ``seed`` alone.

    Construction runs under a forked RNG, so the caller's global torch RNG state is
    neither read nor changed: every process that builds ``GPT(config, seed=s)`` holds
    the same weights, which is how pipeline stages agree without sending any.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        embed, *blocks, head = build_layers(config, seed=seed)
        self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head

    def layers(self) -> list[nn.Module]:
        """``[Embed, Block, ..., Block, Head]``: composed in order, they compute the logits."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        x = idx
        for layer in self.layers():
            x = layer(x)
        return x, None if targets is None else lm_loss(x, targets)


def build_layers(config: GPTConfig, *, seed: int, keep: Collection[int] | None = None) -> list[nn.Module]:
    """``GPT(config, seed=seed).layers()``, value for value; a layer whose index is not in `keep`
    (None: all) lives on the meta device and holds no memory.

    The RNG runs through every layer in the same order either way: a dropped layer is built on
    the CPU and moved to meta at once (one layer at a time is ever held), and its init draws land
    in a scratch tensor of the same size. A tied weight stays one tensor, real when either
    owner is kept.
    """
    count = config.n_layer + 2
    keep = set(range(count)) if keep is None else set(keep)
    makers = [Embed, *[Block] * config.n_layer, Head]
    names = ["embed", *(f"blocks.{i}" for i in range(config.n_layer)), "head"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = []
        for index, make in enumerate(makers):
            layer = make(config)
            layers.append(layer if index in keep else layer.to("meta"))
        embed, head = layers[0], layers[-1]
        if config.tie_embeddings:
            if 0 in keep or count - 1 not in keep:
                head.lm_head.weight = embed.wte.weight
            else:
                embed.wte.weight = head.lm_head.weight
        for prefix, layer in zip(names, layers):
            init_weights(layer, n_layer=config.n_layer, prefix=prefix)
    return layers


def init_weights(layer: nn.Module, *, n_layer: int, prefix: str = "") -> None:
    """GPT-2's initialisation, in place: weights normal(0, 0.02), the residual projections' scaled
    by 1/sqrt(2 n_layer), biases 0. A meta weight's draws land in a scratch tensor (the RNG advances alike)."""
    residual_std = INIT_STD / math.sqrt(2 * n_layer)
    for name, module in layer.named_modules(prefix=prefix):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = residual_std if name.endswith(".proj") else INIT_STD
            weight = module.weight
            target = torch.empty(weight.shape, dtype=weight.dtype) if weight.is_meta else weight
            nn.init.normal_(target, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None and not module.bias.is_meta:
            nn.init.zeros_(module.bias)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every token of the batch (targets -100 are padding, left out)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lm_loss_sum(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy and the number of tokens it counts (targets -100 are padding):
    a pipeline divides by the iteration's total, the token-weighted mean."""
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
    return total, (targets != -100).sum()
