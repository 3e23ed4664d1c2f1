"""Captioned images for `rrfp_ray.models.vlm`: microbatches addressed by (iteration, index).

Each sample holds 0..`max_images` images, drawn with P(n) proportional to (n + 1) ** -`tail`
(a heavy tail: most samples hold few images, some many). An image is its kind's prototype (a
fixed random tensor per kind, from the seed) plus noise; the caption is BOS, then the kinds of
the sample's images in order, then EOS. Only the images tell the kinds and how many there are,
so the loss falls only by looking at them.

As the byte corpus, a microbatch is a pure function of (seed, split, iteration, index): the stage
that reads the inputs and the one that reads the targets draw the same. The images per sample
come from a generator of their own, so `features` reports them without making any image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from rrfp_ray.models.vlm import VLMConfig
from rrfp_ray.train.data import IGNORE, SPLITS, stream_seed

NOISE = 0.5  # standard deviation of the noise on a prototype


@dataclass(frozen=True)
class ImageCaptions:
    """A training `DataSource` of captioned images for `model`; `features` gives images per microbatch."""

    model: VLMConfig
    micro_batch_size: int
    microbatches: int
    seed: int
    tail: float = 1.5  # P(images = n) ~ (n + 1) ** -tail (1.5: about half text-only); 0: uniform over 0..max_images
    split: str = "train"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        for name in ("micro_batch_size", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.tail >= 0:
            raise ValueError(f"tail must be >= 0, got {self.tail}")

    def counts(self, *, iteration: int, index: int) -> Tensor:
        """Images of each sample of microbatch `index` of `iteration`: (B,) int64."""
        if not 0 <= index < self.microbatches:
            raise ValueError(f"index must be in [0, microbatches={self.microbatches}), got {index}")
        weights = (torch.arange(self.model.max_images + 1, dtype=torch.float64) + 1) ** -self.tail
        generator = torch.Generator().manual_seed(stream_seed(self.seed, self.split, iteration, index, "counts"))
        return torch.multinomial(weights, self.micro_batch_size, replacement=True, generator=generator)

    def features(self, *, iteration: int) -> list[float]:
        """What each microbatch of `iteration` shows before it runs: its images (no tensor is made)."""
        return [float(self.counts(iteration=iteration, index=m).sum()) for m in range(self.microbatches)]

    def sample_features(self, *, iteration: int) -> list[float]:
        """Per sample of `iteration`, microbatch by microbatch: its images."""
        return [float(n) for m in range(self.microbatches) for n in self.counts(iteration=iteration, index=m).tolist()]

    def tokens(self, *, iteration: int) -> int:
        """Real (not padding) target tokens in `iteration`'s microbatches: a class per image and EOS."""
        return sum(
            int(self.counts(iteration=iteration, index=m).sum()) + self.micro_batch_size
            for m in range(self.microbatches)
        )

    @cached_property
    def prototypes(self) -> Tensor:
        """(classes, C, S, S): what each kind of image looks like, from the seed alone (every split alike)."""
        m = self.model
        generator = torch.Generator().manual_seed(stream_seed(self.seed, "prototypes"))
        return torch.randn(m.classes, m.channels, m.image_size, m.image_size, generator=generator)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "prototypes"}  # each process makes its own

    def microbatch(self, *, iteration: int, index: int) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
        """((images (N, C, S, S), counts (B,), text (B, T)), targets (B, T)); T is 1 + the most images of a sample."""
        return self._batch(self._drawn(iteration=iteration, index=index))

    def samples(self, *, iteration: int, indexes: Sequence[int]) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
        """One microbatch of the samples `indexes` of `iteration` (sample i: sample i mod B of microbatch i // B),
        as `microbatch` makes one: the captions padded to the most images of those samples."""
        B = self.micro_batch_size
        if not indexes or not all(0 <= i < self.microbatches * B for i in indexes):
            raise ValueError(
                f"indexes must be a non-empty list of samples in [0, {self.microbatches * B}), got {list(indexes)}"
            )
        drawn = {m: self._drawn(iteration=iteration, index=m) for m in sorted({i // B for i in indexes})}
        return self._batch([drawn[i // B][i % B] for i in indexes])

    def _drawn(self, *, iteration: int, index: int) -> list[tuple[Tensor, Tensor]]:
        """Each sample of microbatch `index` of `iteration`: (its images' kinds, its images)."""
        m = self.model
        counts = self.counts(iteration=iteration, index=index)
        generator = torch.Generator().manual_seed(stream_seed(self.seed, self.split, iteration, index, "images"))
        kinds = torch.randint(0, m.classes, (int(counts.sum()),), generator=generator)
        noise = torch.randn(len(kinds), m.channels, m.image_size, m.image_size, generator=generator)
        images = self.prototypes[kinds] + NOISE * noise
        sizes = counts.tolist()
        return list(zip(torch.split(kinds, sizes), torch.split(images, sizes)))

    def _batch(self, samples: Sequence[tuple[Tensor, Tensor]]) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
        m = self.model
        counts = torch.tensor([len(kinds) for kinds, _ in samples], dtype=torch.long)
        length = int(counts.max()) + 1
        text = torch.full((len(samples), length), m.pad, dtype=torch.long)
        targets = torch.full((len(samples), length), IGNORE, dtype=torch.long)
        for row, (own, _) in enumerate(samples):
            caption = torch.cat([torch.tensor([m.bos]), own, torch.tensor([m.eos])])
            text[row, : len(own) + 1], targets[row, : len(own) + 1] = caption[:-1], caption[1:]
        return (torch.cat([images for _, images in samples]), counts, text), targets
