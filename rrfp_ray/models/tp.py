"""Megatron-style tensor parallelism for the GPT's blocks (`rrfp_ray.models.gpt` stays unsplit).

A TP block on rank r of T holds slices of a built `Block`'s weights: attention heads
r*H/T .. (r+1)*H/T (the query, key and value rows of `qkv`, column-parallel), the matching
input columns of the attention output projection (row-parallel), rows r*4C/T .. of the MLP's
`fc` (column-parallel) and the matching input columns of its `proj` (row-parallel). A
row-parallel layer's partial outputs are summed over the group, then its bias added once.
`f` (identity forward, all-reduce backward) enters each column-parallel layer and `g`
(all-reduce forward, identity backward) leaves each row-parallel one, so every rank's
activations, LayerNorm inputs and so LayerNorm gradients equal the unsplit block's, and each
shard's gradient is the matching slice of the unsplit gradient. Every process builds the full
model from the same seed and keeps its slices.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rrfp_ray.models.gpt import Block

AllReduce = Callable[[Tensor], Tensor]


class _Enter(torch.autograd.Function):
    """`f`: identity forward; the input gradient summed over the group."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, all_reduce: AllReduce) -> Tensor:
        ctx.all_reduce = all_reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.all_reduce(grad.contiguous()), None


class _Leave(torch.autograd.Function):
    """`g`: the partial outputs summed over the group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, all_reduce: AllReduce) -> Tensor:
        return all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def check_tp(*, n_head: int, n_embd: int, size: int) -> None:
    """ValueError unless `size` ranks can split the heads and the MLP's hidden width."""
    if size < 1:
        raise ValueError(f"tp size must be >= 1, got {size}")
    if n_head % size:
        raise ValueError(f"n_head ({n_head}) must be a multiple of the tp size ({size})")
    if (4 * n_embd) % size:
        raise ValueError(
            f"n_embd: the MLP's hidden width 4*n_embd ({4 * n_embd}) must be a multiple of the tp size ({size})"
        )


SHARDED_IN_BLOCK = (
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "mlp.fc.weight",
    "mlp.fc.bias",
    "mlp.proj.weight",
)
_ROWS = ("mlp.fc.weight", "mlp.fc.bias")  # column-parallel: rank r holds rows r/T .. of the tensor
_COLUMNS = ("attn.proj.weight", "mlp.proj.weight")  # row-parallel: rank r holds its input columns


def shard_tensor(name: str, tensor: Tensor, *, rank: int, size: int) -> Tensor:
    """Rank `rank`'s slice of a `Block` tensor `name` (a parameter, its gradient or its optimizer state);
    a replicated one whole."""
    if name.startswith("attn.qkv."):  # the query, key and value rows of this rank's heads
        return torch.cat([part.chunk(size)[rank] for part in tensor.chunk(3)]).clone()
    if name in _ROWS:
        return tensor.chunk(size)[rank].clone()
    if name in _COLUMNS:
        return tensor.chunk(size, dim=1)[rank].clone()
    return tensor.clone()


def unshard_tensor(name: str, shards: Sequence[Tensor]) -> Tensor:
    """The whole `Block` tensor `name` from every rank's slice (`shard_tensor`, inverted), in rank order."""
    if name.startswith("attn.qkv."):
        parts = [shard.chunk(3) for shard in shards]  # each rank: its q, k and v rows
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
    if name in _ROWS:
        return torch.cat(list(shards))
    if name in _COLUMNS:
        return torch.cat(list(shards), dim=1)
    return shards[0].clone()


def shard_block_tensors(tensors: dict[str, Tensor], *, n_head: int, rank: int, size: int) -> dict[str, Tensor]:
    """Rank `rank`'s slices of a `Block`'s parameters (or of their gradients), by name."""
    check_tp(n_head=n_head, n_embd=tensors["attn.qkv.weight"].shape[1], size=size)
    return {name: shard_tensor(name, t, rank=rank, size=size) for name, t in tensors.items()}


def unshard_block_tensors(shards: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """A whole `Block`'s parameters from every rank's slices (`shard_block_tensors`, inverted), by name."""
    return {name: unshard_tensor(name, [shard[name] for shard in shards]) for name in shards[0]}


REPLICA = "tp_replica"  # parameter attribute: a copy of rank 0's, left out of the gradient norm
REPLICATED_IN_BLOCK = ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.proj.bias", "mlp.proj.bias")


class _Attention(nn.Module):
    def __init__(self, *, width: int, heads: int, size: int, bias: bool, all_reduce: AllReduce) -> None:
        super().__init__()
        self.heads = heads // size
        self.local = width // size
        self.all_reduce = all_reduce
        self.qkv = nn.Linear(width, 3 * self.local, bias=bias)
        self.proj = nn.Linear(self.local, width, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(_Enter.apply(x, self.all_reduce)).split(self.local, dim=2)
        q, k, v = (t.view(batch, length, self.heads, self.local // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, self.local)
        return _add_bias(_Leave.apply(F.linear(y, self.proj.weight), self.all_reduce), self.proj.bias)


class _MLP(nn.Module):
    def __init__(self, *, width: int, size: int, bias: bool, all_reduce: AllReduce) -> None:
        super().__init__()
        self.all_reduce = all_reduce
        self.fc = nn.Linear(width, 4 * width // size, bias=bias)
        self.proj = nn.Linear(4 * width // size, width, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden = F.gelu(self.fc(_Enter.apply(x, self.all_reduce)))
        return _add_bias(_Leave.apply(F.linear(hidden, self.proj.weight), self.all_reduce), self.proj.bias)


def _add_bias(x: Tensor, bias: Tensor | None) -> Tensor:
    return x if bias is None else x + bias


class TPBlock(nn.Module):
    """Rank `rank`'s share of `block`; its parameters have `block`'s names, in `block`'s order."""

    def __init__(self, block: Block, *, rank: int, size: int, all_reduce: AllReduce) -> None:
        super().__init__()
        width, n_head = block.attn.qkv.in_features, block.attn.n_head
        check_tp(n_head=n_head, n_embd=width, size=size)
        bias = block.attn.qkv.bias is not None
        self.ln_1 = copy.deepcopy(block.ln_1)
        self.attn = _Attention(width=width, heads=n_head, size=size, bias=bias, all_reduce=all_reduce)
        self.ln_2 = copy.deepcopy(block.ln_2)
        self.mlp = _MLP(width=width, size=size, bias=bias, all_reduce=all_reduce)
        state = {name: p.detach() for name, p in block.named_parameters()}
        self.load_state_dict(shard_block_tensors(state, n_head=n_head, rank=rank, size=size))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass(frozen=True)
class TPLayers:
    """A layer-list builder whose `Block`s become rank `rank`'s `TPBlock`s; the rest stay replicated."""

    layers: Callable[[], Sequence[nn.Module]]
    rank: int
    size: int
    all_reduce: AllReduce

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")

    def __call__(self) -> list[nn.Module]:
        layers = [
            TPBlock(layer, rank=self.rank, size=self.size, all_reduce=self.all_reduce)
            if isinstance(layer, Block)
            else layer
            for layer in self.layers()
        ]
        if self.rank > 0:  # every rank holds these whole: the global gradient norm counts them on rank 0 only
            for layer in layers:
                for name, param in layer.named_parameters():
                    if not isinstance(layer, TPBlock) or name in REPLICATED_IN_BLOCK:
                        setattr(param, REPLICA, True)
        return layers
