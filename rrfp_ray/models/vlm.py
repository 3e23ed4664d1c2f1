"""A small vision-language model: a ViT-style encoder over image patches, a projection into the
language model's width, and our GPT decoder over [image tokens, text tokens]. It knows nothing
about pipelining.

A sample holds 0..`max_images` images and a caption. A microbatch is one tensor batch:

- inputs ``(images, counts, text)``: every image of the microbatch, sample after sample,
  ``(N, channels, image_size, image_size)`` float; images per sample ``(B,)`` int64; the caption
  tokens ``(B, T)`` int64, right-padded with ``VLMConfig.pad``;
- targets ``(B, T)`` int64, ``IGNORE`` on padding.

The encoder runs on the N real images only, so its cost follows the images of the microbatch.
The decoder's sequence is each sample's image tokens, left-padded to the microbatch's most
images, then its caption; padding is masked out of attention (a sample's logits do not depend
on what it was batched with) and positions count real tokens only.

As the GPT, ``VLM.layers()`` lists modules whose sequential composition is ``forward``; each
passes a tuple of tensors to the next, so a pipeline can cut the list anywhere. The encoder's
layers come first and are most of the image-dependent work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from rrfp_ray.models.gpt import Block, GPTConfig, Head, init_weights, lm_loss_sum

Images = tuple[Tensor, Tensor, Tensor]  # (images or their patch features, counts, text)
Tokens = tuple[Tensor, Tensor]  # (x (B, L, C), real (B, L) bool)


class VLMConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    classes: int = Field(default=8, gt=1, description="kinds of image; a caption names its images' kinds")
    max_images: int = Field(default=8, ge=1, description="most images a sample holds")
    image_size: int = Field(default=16, gt=0, description="images are square, this many pixels a side")
    channels: int = Field(default=3, gt=0)
    patch_size: int = Field(default=4, gt=0, description="pixels a side of one patch")
    pool: int = Field(default=2, gt=0, description="the patch grid is average-pooled by this factor into image tokens")
    encoder_layers: int = Field(default=4, gt=0, description="ViT blocks")
    encoder_heads: int = Field(default=2, gt=0, description="the encoder's attention heads")
    encoder_embd: int = Field(default=64, gt=0, description="the encoder's width")
    n_layer: int = Field(default=2, gt=0, description="decoder (GPT) blocks")
    n_head: int = Field(default=4, gt=0)
    n_embd: int = Field(default=64, gt=0, description="the decoder's width")
    bias: bool = True
    tie_embeddings: bool = Field(default=True, description="the LM head reuses the caption embedding's weight")

    @model_validator(mode="after")
    def _shapes_fit(self) -> VLMConfig:
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size {self.patch_size} does not divide image_size {self.image_size}")
        if self.grid % self.pool:
            raise ValueError(f"pool {self.pool} does not divide the patch grid's side {self.grid}")
        for width, heads in (("encoder_embd", "encoder_heads"), ("n_embd", "n_head")):
            if getattr(self, width) % getattr(self, heads):
                raise ValueError(
                    f"{width} ({getattr(self, width)}) must be a multiple of {heads} ({getattr(self, heads)})"
                )
        return self

    @property
    def layer_count(self) -> int:
        """Modules in `VLM.layers`: the patch embedding, the encoder blocks, the projection, the join, the
        decoder blocks and the head."""
        return self.encoder_layers + self.n_layer + 4

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patches(self) -> int:
        return self.grid**2

    @property
    def image_tokens(self) -> int:
        """Decoder tokens per image."""
        return (self.grid // self.pool) ** 2

    @property
    def bos(self) -> int:
        return self.classes

    @property
    def eos(self) -> int:
        return self.classes + 1

    @property
    def pad(self) -> int:
        """The caption input's padding token."""
        return self.classes + 2

    def decoder(self) -> GPTConfig:
        longest = self.max_images * self.image_tokens + self.max_images + 1  # images, BOS and a class per image
        return GPTConfig(
            vocab_size=self.classes + 3,
            block_size=longest,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            bias=self.bias,
            tie_embeddings=self.tie_embeddings,
        )

    def encoder(self) -> GPTConfig:
        return GPTConfig(
            block_size=self.patches,
            n_layer=self.encoder_layers,
            n_head=self.encoder_heads,
            n_embd=self.encoder_embd,
            bias=self.bias,
        )


class PatchEmbed(nn.Module):
    """Images (N, C, S, S) -> patch features (N, patches, encoder width), with learned positions."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.patch = config.patch_size
        self.proj_in = nn.Linear(config.channels * config.patch_size**2, config.encoder_embd, bias=config.bias)
        self.position = nn.Embedding(config.patches, config.encoder_embd)

    def forward(self, inputs: Images) -> Images:
        images, counts, text = inputs
        p = self.patch
        patches = images.unfold(2, p, p).unfold(3, p, p)  # (N, C, g, g, p, p)
        patches = patches.permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)  # (N, g*g, C*p*p)
        positions = torch.arange(patches.shape[1], device=images.device)
        return self.proj_in(patches) + self.position(positions), counts, text


class EncoderBlock(nn.Module):
    """A GPT block attending over all of an image's patches (no causal mask)."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.block = Block(config.encoder())

    def forward(self, inputs: Images) -> Images:
        z, counts, text = inputs
        everywhere = torch.ones(z.shape[1], z.shape[1], dtype=torch.bool, device=z.device)
        return self.block(z, everywhere), counts, text


class Project(nn.Module):
    """Patch features -> image tokens in the decoder's width: the grid average-pooled by `pool`."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.grid, self.pool = config.grid, config.pool
        self.ln = nn.LayerNorm(config.encoder_embd, bias=config.bias)
        self.proj_out = nn.Linear(config.encoder_embd, config.n_embd, bias=config.bias)

    def forward(self, inputs: Images) -> Images:
        z, counts, text = inputs
        n, g, width = z.shape[0], self.grid, z.shape[2]
        grid = self.ln(z).transpose(1, 2).reshape(n, width, g, g)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)  # (N, image tokens, E)
        return self.proj_out(pooled), counts, text


class Join(nn.Module):
    """Image tokens and the caption's embeddings as one left-padded sequence, with position embeddings."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        decoder = config.decoder()
        self.wte = nn.Embedding(decoder.vocab_size, decoder.n_embd)
        self.wpe = nn.Embedding(decoder.block_size, decoder.n_embd)
        self.pad = config.pad

    def forward(self, inputs: Images) -> Tokens:
        v, counts, text = inputs
        batch = text.shape[0]
        per_image, width = v.shape[1], v.shape[2]
        most = int(counts.max())
        sample = torch.repeat_interleave(torch.arange(batch, device=counts.device), counts)  # (N,) owner of each image
        first = torch.cumsum(counts, 0) - counts
        slot = most - counts[sample] + torch.arange(len(sample), device=counts.device) - first[sample]
        where = slot[:, None] * per_image + torch.arange(per_image, device=counts.device)  # (N, per image)
        rows = sample[:, None].expand_as(where)
        image_part = v.new_zeros(batch, most * per_image, width).index_put((rows, where), v)
        x = torch.cat([image_part, self.wte(text)], dim=1)
        real_images = torch.zeros(batch, most * per_image, dtype=torch.bool, device=counts.device)
        real_images[rows, where] = True
        real_text = text != self.pad
        real = torch.cat([real_images, real_text], dim=1)
        positions = (torch.cumsum(real, dim=1) - 1).clamp(min=0)
        if x.shape[1] > self.wpe.num_embeddings:
            raise ValueError(
                f"sequence of {x.shape[1]} tokens exceeds the decoder's block_size {self.wpe.num_embeddings}"
            )
        return x + self.wpe(positions), real


class DecoderBlock(nn.Module):
    """A GPT block, causal over the real tokens (a padding position attends only to itself)."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.block = Block(config.decoder())

    def forward(self, inputs: Tokens) -> Tokens:
        x, real = inputs
        length = x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        itself = torch.eye(length, dtype=torch.bool, device=x.device)
        mask = (causal & real[:, None, None, :]) | itself  # (B, 1, L, L)
        return self.block(x, mask), real


class TextHead(nn.Module):
    """The GPT's head over the decoder's output: logits (B, L, vocab)."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.head = Head(config.decoder())

    def forward(self, inputs: Tokens) -> Tensor:
        return self.head(inputs[0])


class VLM(nn.Module):
    """``VLM(config, seed=s)`` initialises its weights from ``seed`` alone, under a forked RNG
    (the caller's global RNG state is neither read nor changed), like `GPT`."""

    def __init__(self, config: VLMConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.patch_embed = PatchEmbed(config)
            self.encoder = nn.ModuleList(EncoderBlock(config) for _ in range(config.encoder_layers))
            self.project = Project(config)
            self.join = Join(config)
            self.decoder = nn.ModuleList(DecoderBlock(config) for _ in range(config.n_layer))
            self.head = TextHead(config)
            if config.tie_embeddings:
                self.head.head.lm_head.weight = self.join.wte.weight
            for layer in (self.patch_embed, *self.encoder, self.project):
                init_weights(layer, n_layer=config.encoder_layers)
            for layer in (self.join, *self.decoder, self.head):
                init_weights(layer, n_layer=config.n_layer)

    def layers(self) -> list[nn.Module]:
        """``[PatchEmbed, EncoderBlock..., Project, Join, DecoderBlock..., TextHead]``: composed in
        order, they compute the logits."""
        return [self.patch_embed, *self.encoder, self.project, self.join, *self.decoder, self.head]

    def forward(self, inputs: Images) -> Tensor:
        x = inputs
        for layer in self.layers():
            x = layer(x)
        return x


def caption_loss(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy over the caption positions (the last T of the sequence) and the tokens
    it counts (targets IGNORE are padding): token-weighted, as the GPT's `lm_loss_sum`."""
    return lm_loss_sum(logits[:, -targets.shape[1] :], targets)
