"""Byte-level text corpus; microbatches addressed by (iteration, index).

A batch is a pure function of the corpus and (seed, split, iteration, index), so
stage 0 (which reads the inputs) and the last stage (which reads the targets) draw
the same windows without any data passing between them.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

STDLIB_BYTES = 4 << 20  # enough text for the tiny models, read in well under a second
VAL_FRACTION = 0.1  # the last tenth of the bytes is the validation split
SPLITS = ("train", "val")
_SNIFF = 8192  # a file whose first bytes hold a NUL is binary


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
        generator = torch.Generator().manual_seed(_seed(seed, split, iteration, index))
        starts = torch.randint(0, text.numel() - seq_len, (micro_batch_size,), generator=generator)
        windows = text[starts[:, None] + torch.arange(seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def _seed(*parts: object) -> int:
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

    @cached_property
    def corpus(self) -> Corpus:
        return Corpus.from_path(self.path)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "corpus"}  # each process reads its own copy

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        return self.corpus.batch(
            split=self.split,
            iteration=iteration,
            index=index,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            microbatches=self.microbatches,
            seed=self.seed,
        )
