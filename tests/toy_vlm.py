"""A toy vision-language model for the tests of the public API: image patches become tokens in
front of the text, split by `split_points` into 2 stages x 2 chunks.

Each microbatch has its own number of image patches and its own caption length, so the
activations change shape from one microbatch to the next (each message's header carries
its shape) and so does the work. The caption spells an arithmetic sequence whose start and
step are functions of the image, so the text alone cannot predict it.
(`rrfp_ray.models.vlm` is the real one: a ViT encoder and our GPT.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 16  # caption symbols; token VOCAB is the start of the caption
PATCH_DIM = 12
WIDTH = 32
MAX_PATCHES = 12
MAX_TEXT = 12
SPLIT_POINTS = ["blocks.1", "blocks.2", "blocks.3"]  # 4 parts: 2 stages x 2 chunks


@dataclass(frozen=True)
class Captions:
    """Microbatch (iteration, index): ((patches (B, n, PATCH_DIM), text (B, T)), targets (B, T)), n and T vary."""

    microbatches: int
    stream: int = 0  # 0: training samples, 1: validation samples
    batch_size: int = 8

    def microbatch(self, *, iteration: int, index: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
        g = torch.Generator().manual_seed((self.stream * 1_000_003 + iteration) * 1_000_003 + index)
        n = int(torch.randint(2, MAX_PATCHES + 1, (), generator=g))
        length = int(torch.randint(4, MAX_TEXT + 1, (), generator=g))
        patches = torch.randn(self.batch_size, n, PATCH_DIM, generator=g)
        summary = patches.mean(dim=1)  # what the caption is about
        start = summary[:, 0].gt(0).long() * 8 + summary[:, 1].gt(0).long() * 4
        step = 1 + summary[:, 2].gt(0).long()
        caption = (start[:, None] + step[:, None] * torch.arange(length)) % VOCAB
        text = torch.cat([torch.full((self.batch_size, 1), VOCAB), caption[:, :-1]], dim=1)
        return (patches, text), caption


class Prefix(nn.Module):
    """The vision encoder (patches -> tokens) and the text embedding, joined into one sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(PATCH_DIM, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        self.embed = nn.Embedding(VOCAB + 1, WIDTH)
        self.position = nn.Parameter(torch.zeros(MAX_PATCHES + MAX_TEXT, WIDTH))

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        patches, text = inputs
        x = torch.cat([self.vision(patches), self.embed(text)], dim=1)
        return x + self.position[: x.shape[1]]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.layer(x, src_mask=mask, is_causal=True)


class ToyVLM(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.prefix = Prefix()
        self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
        self.head = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))

    def forward(self, inputs: tuple[Tensor, Tensor]) -> Tensor:
        return self.head(self.blocks(self.prefix(inputs)))


def text_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy on the text positions only (the image tokens come first)."""
    text = logits[:, -targets.shape[1] :]
    return F.cross_entropy(text.reshape(-1, VOCAB), targets.reshape(-1))
