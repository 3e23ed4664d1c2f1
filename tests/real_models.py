"""Toy models shaped like real ones, for the tests of tree-shaped boundaries and ties: stages that pass a
(hidden, attention_mask) tuple or a dict, a tied embedding/head, token-weighted losses on
variable-length batches; and the unsplit model's reference gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rrfp_ray.train.layers import to_layers
from rrfp_ray.train.partition import partition

VOCAB, WIDTH, PAD = 13, 16, 0


@dataclass(frozen=True)
class PaddedTokens:
    """Sequences of varying length, right-padded with PAD; targets are -100 on padding."""

    microbatches: int
    batch: int = 3

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1000 * iteration + index)
        lengths = torch.randint(2, 9, (self.batch,), generator=g)
        width = int(lengths.max())
        ids = torch.full((self.batch, width + 1), PAD)
        for row, length in enumerate(lengths.tolist()):
            ids[row, : length + 1] = torch.randint(1, VOCAB, (length + 1,), generator=g)
        targets = ids[:, 1:].clone()
        targets[ids[:, 1:] == PAD] = -100
        return ids[:, :-1], targets


class TupleEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.wte(ids), (ids != PAD).long()


class TupleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, mask = inputs
        return hidden + torch.tanh(self.fc(hidden)) * mask[..., None].to(hidden.dtype), mask


class TupleHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        return self.out(inputs[0])


def tuple_model() -> nn.Sequential:
    return nn.Sequential(TupleEmbed(), TupleBlock(), TupleBlock(), TupleBlock(), TupleHead())


class DictEmbed(nn.Module):
    """Two differentiable leaves (hidden, skip), int positions and a float leaf needing no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.skip = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids: Tensor) -> dict[str, Tensor]:
        hidden = self.wte(ids)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return {"hidden": hidden, "skip": self.skip(hidden), "positions": positions, "scale": torch.tensor(0.5)}


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.wpe = nn.Embedding(16, WIDTH)

    def forward(self, x: dict[str, Tensor]) -> dict[str, Tensor]:
        hidden = x["hidden"] + torch.tanh(self.fc(x["hidden"] + self.wpe(x["positions"]))) * x["scale"]
        return {**x, "hidden": hidden, "skip": x["skip"] * 0.9}


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: dict[str, Tensor]) -> Tensor:
        return self.out(x["hidden"] + x["skip"])


def dict_model() -> nn.Sequential:
    return nn.Sequential(DictEmbed(), DictBlock(), DictBlock(), DictBlock(), DictHead())


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


def token_sum_count(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Token-weighted: the summed loss and how many tokens it counts."""
    total = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return total, (targets != -100).sum()


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: Tensor) -> Tensor:
        return self.wte(ids)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


class TiedHead(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = embedding.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


def tied_model(*, tie: bool = True) -> nn.Sequential:
    embed = Embed()
    head = TiedHead(embed.wte)
    if not tie:
        head.out.weight = nn.Parameter(embed.wte.weight.detach().clone())
    return nn.Sequential(embed, Block(), Block(), Block(), head)


def reference(*, model: nn.Module, loss_fn, data, microbatches: int, stages: int, chunks: int, iteration: int = 0):
    """The unsplit model's loss on `iteration` and each stage's expected gradients (by module order)."""
    batches = [data.microbatch(iteration=iteration, index=m) for m in range(microbatches)]
    outputs = [loss_fn(model(x), y) for x, y in batches]
    if isinstance(outputs[0], tuple):
        count = sum(float(c) for _, c in outputs)
        loss = sum(s for s, _ in outputs) / count
    else:
        loss = sum(outputs) / len(outputs)
    loss.backward()
    groups = to_layers(model, split_points=None)
    parts = partition(n_layers=len(groups), parts=stages * chunks)
    grads = []
    for s in range(stages):
        seen: set[int] = set()
        stage = []
        for c in range(chunks):
            for i in parts[c * stages + s]:
                for w in groups[i].parameters():
                    if id(w) not in seen:
                        seen.add(id(w))
                        stage.append(w.grad)
        grads.append(stage)
    return float(loss.detach()), grads
