"""Byte-level text corpus; microbatches addressed by (iteration, index).

A batch is a pure function of the corpus and (seed, split, iteration, index), so
stage 0 (which reads the inputs) and the last stage (which reads the targets) draw
the same windows without any data passing between them.

Two kinds of batch: fixed windows of `seq_len` bytes anywhere in the text, or (varlen)
whole documents at their natural length, capped at `seq_len`, right-padded to the
longest in the microbatch, padding targets `IGNORE` (left out of the loss). A document
is a paragraph: the text up to and including a blank line. (The stdlib's files are
~15 KB each, so a file would always fill the block and no length would vary.)
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

STDLIB_BYTES = 4 << 20  # enough text for the tiny models, read in well under a second
VAL_FRACTION = 0.1  # the last tenth of the bytes is the validation split
SPLITS = ("train", "val")
_SNIFF = 8192  # a file whose first bytes hold a NUL is binary
IGNORE = -100  # target of a padding position (cross-entropy's default ignore_index)
PAD = 0  # input byte at a padding position


@dataclass(frozen=True)
class Corpus:
    data: Tensor  # uint8, the whole corpus
    source: str  # where it came from, for logs

    @classmethod
    def from_path(cls, path: str | None) -> Corpus:
        """``None``: the standard library's own ``.py`` files (the first few MB in sorted order).

        A file is read whole; a directory recursively, skipping binary files.
        """
        if path is None:
            root = Path(sysconfig.get_paths()["stdlib"])
            return cls(data=_tensor(_read(_walk(root, suffix=".py"), limit=STDLIB_BYTES)), source=f"stdlib {root}")
        target = Path(path)
        if not target.exists():
            raise ValueError(f"--data {path}: no such file or directory")
        files = [target] if target.is_file() else _walk(target, suffix="")
        text = _read(files, limit=None)
        if not text:
            raise ValueError(f"--data {path}: no text found")
        return cls(data=_tensor(text), source=str(target))

    @cached_property
    def documents(self) -> Tensor:
        """(N, 2) int64 [start, end) of every paragraph of two bytes or more."""
        newline = self.data == ord("\n")
        ends = (torch.nonzero(newline[:-1] & newline[1:]).flatten() + 2).tolist()
        bounds = torch.tensor([0, *ends, self.data.numel()]).unique()
        spans = torch.stack([bounds[:-1], bounds[1:]], dim=1)
        return spans[spans[:, 1] - spans[:, 0] >= 2]

    def varlen_batch(
        self, *, split: str, iteration: int, index: int, micro_batch_size: int, seq_len: int, seed: int
    ) -> tuple[Tensor, Tensor]:
        """`micro_batch_size` documents of the split, each capped at `seq_len` + 1 bytes, padded to the longest."""
        picked = self.varlen_spans(
            split=split, iteration=iteration, index=index, micro_batch_size=micro_batch_size, seed=seed
        )
        return self.padded(spans=picked.tolist(), seq_len=seq_len)

    def padded(self, *, spans: Sequence[Sequence[int]], seq_len: int) -> tuple[Tensor, Tensor]:
        """The documents [start, end) of `spans`, each capped at `seq_len` + 1 bytes, right-padded to the longest."""
        rows = [self.data[start : min(end, start + seq_len + 1)].long() for start, end in spans]
        width = max(len(row) for row in rows) - 1
        x = torch.full((len(rows), width), PAD, dtype=torch.long)
        y = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for i, row in enumerate(rows):
            x[i, : len(row) - 1], y[i, : len(row) - 1] = row[:-1], row[1:]
        return x, y

    def varlen_spans(self, *, split: str, iteration: int, index: int, micro_batch_size: int, seed: int) -> Tensor:
        """(B, 2) [start, end) of the documents `varlen_batch` takes, before the cap."""
        cut = self.data.numel() - int(self.data.numel() * VAL_FRACTION)
        docs = self.documents
        docs = docs[docs[:, 1] <= cut] if split == "train" else docs[docs[:, 0] >= cut]
        if len(docs) == 0:
            raise ValueError(f"the {split} split of {self.source} holds no document (paragraph) of two bytes or more")
        generator = torch.Generator().manual_seed(stream_seed(seed, split, iteration, index, "varlen"))
        return docs[torch.randint(0, len(docs), (micro_batch_size,), generator=generator)]

    def split(self, name: str) -> Tensor:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        cut = self.data.numel() - int(self.data.numel() * VAL_FRACTION)
        return self.data[:cut] if name == "train" else self.data[cut:]

    def batch(
        self,
        *,
        split: str,
        iteration: int,
        index: int,
        micro_batch_size: int,
        seq_len: int,
        microbatches: int,
        seed: int,
    ) -> tuple[Tensor, Tensor]:
        """Microbatch ``index`` of ``iteration``: (x, y) int64 (B, T), y is x shifted by one byte."""
        if not 0 <= index < microbatches:
            raise ValueError(f"index must be in [0, microbatches={microbatches}), got {index}")
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        for name, value in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        text = self.split(split)
        if text.numel() < seq_len + 1:
            raise ValueError(
                f"seq_len {seq_len} needs {seq_len + 1} bytes, the {split} split of {self.source} has {text.numel()}"
            )
        generator = torch.Generator().manual_seed(stream_seed(seed, split, iteration, index))
        starts = torch.randint(0, text.numel() - seq_len, (micro_batch_size,), generator=generator)
        windows = text[starts[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def stream_seed(*parts: object) -> int:
    """A seed of 63 bits from `parts`: one random stream per (seed, split, iteration, index, ...)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _walk(root: Path, *, suffix: str) -> list[Path]:
    """Files under ``root`` ending in ``suffix``, in sorted order; skips site-packages and caches."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__") and not d.startswith("."))
        found += [Path(directory, n) for n in sorted(names) if n.endswith(suffix) and not n.startswith(".")]
    return found


def _read(files: list[Path], *, limit: int | None) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for file in files:
        if limit is not None and total >= limit:
            break
        content = file.read_bytes()
        if b"\0" in content[:_SNIFF]:
            continue
        chunks.append(content if limit is None else content[: limit - total])
        total += len(chunks[-1])
    return b"".join(chunks)


def _tensor(text: bytes) -> Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


@dataclass(frozen=True)
class CorpusSource:
    """A training `DataSource` over a corpus; each process loads the corpus once, lazily."""

    path: str | None
    micro_batch_size: int
    seq_len: int
    microbatches: int
    seed: int
    split: str = "train"
    varlen: bool = False  # whole documents of varying length, padded (targets IGNORE)

    @cached_property
    def corpus(self) -> Corpus:
        return Corpus.from_path(self.path)

    def tokens(self, *, iteration: int) -> int:
        """Real (not padding) target tokens in `iteration`'s microbatches."""
        return int(sum(self.features(iteration=iteration)))

    def features(self, *, iteration: int) -> list[float]:
        """What each microbatch of `iteration` shows before it runs: its real target tokens (no batch is made)."""
        per = self.sample_features(iteration=iteration)
        B = self.micro_batch_size
        return [float(sum(per[m * B : (m + 1) * B])) for m in range(self.microbatches)]

    def sample_features(self, *, iteration: int) -> list[float]:
        """Per sample (a window, or a document under varlen) of `iteration`, microbatch by microbatch: its real
        target tokens."""
        if not self.varlen:
            return [float(self.seq_len)] * (self.microbatches * self.micro_batch_size)
        return [
            float(min(end - start, self.seq_len + 1) - 1)
            for m in range(self.microbatches)
            for start, end in self._spans(iteration=iteration, index=m).tolist()
        ]

    def samples(self, *, iteration: int, indexes: Sequence[int]) -> tuple[Tensor, Tensor]:
        """One microbatch of the samples `indexes` of `iteration` (sample i: row i mod B of microbatch i // B):
        windows, or documents padded to the longest of them."""
        B = self.micro_batch_size
        if not indexes or not all(0 <= i < self.microbatches * B for i in indexes):
            raise ValueError(
                f"indexes must be a non-empty list of samples in [0, {self.microbatches * B}), got {list(indexes)}"
            )
        if self.varlen:
            spans = {m: self._spans(iteration=iteration, index=m).tolist() for m in sorted({i // B for i in indexes})}
            return self.corpus.padded(spans=[spans[i // B][i % B] for i in indexes], seq_len=self.seq_len)
        batches = {m: self.microbatch(iteration=iteration, index=m) for m in sorted({i // B for i in indexes})}
        x = torch.stack([batches[i // B][0][i % B] for i in indexes])
        y = torch.stack([batches[i // B][1][i % B] for i in indexes])
        return x, y

    def _spans(self, *, iteration: int, index: int) -> Tensor:
        return self.corpus.varlen_spans(
            split=self.split, iteration=iteration, index=index, micro_batch_size=self.micro_batch_size, seed=self.seed
        )

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "corpus"}  # each process reads its own copy

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        if self.varlen:
            if not 0 <= index < self.microbatches:
                raise ValueError(f"index must be in [0, microbatches={self.microbatches}), got {index}")
            return self.corpus.varlen_batch(
                split=self.split,
                iteration=iteration,
                index=index,
                micro_batch_size=self.micro_batch_size,
                seq_len=self.seq_len,
                seed=self.seed,
            )
        return self.corpus.batch(
            split=self.split,
            iteration=iteration,
            index=index,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            microbatches=self.microbatches,
            seed=self.seed,
        )
