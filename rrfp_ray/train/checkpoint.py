"""Checkpoints that a crash cannot corrupt.

Each stage writes its own file atomically (temp file, fsync, rename) and returns its
digest; the driver commits a manifest, also atomically, only after every stage has
succeeded. Loading takes the newest manifest whose files are all present and intact,
so a crash during a write leaves the previous checkpoint usable. The data position
needs no saving: microbatches are addressed by iteration.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

_MANIFEST = re.compile(r"^manifest-(\d{8})\.json$")
_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")  # how torch names what it refused


@dataclass(frozen=True)
class StageFile:
    path: str  # relative to the checkpoint directory
    sha256: str


@dataclass(frozen=True)
class Manifest:
    iteration: int  # the next iteration to run
    fingerprint: str  # what the files fit: model, stages, chunks
    files: dict[int, StageFile]

    def to_json(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "fingerprint": self.fingerprint, "files": {str(s): asdict(f) for s, f in self.files.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        files = {int(s): StageFile(**f) for s, f in data["files"].items()}
        return cls(iteration=int(data["iteration"]), fingerprint=str(data["fingerprint"]), files=files)


def fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_stage(*, directory: Path, iteration: int, stage: int, state: dict[str, Any]) -> StageFile:
    """Write one stage's state for `iteration`; returns what the manifest records."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    relative = f"iter-{iteration:08d}/stage-{stage}.pt"
    atomic_write(directory / relative, data)
    return StageFile(path=relative, sha256=hashlib.sha256(data).hexdigest())


def commit(*, directory: Path, manifest: Manifest) -> Path:
    path = directory / f"manifest-{manifest.iteration:08d}.json"
    atomic_write(path, json.dumps(manifest.to_json(), indent=1).encode())
    return path


def load_stage(*, directory: Path, file: StageFile) -> dict[str, Any]:
    """One stage's state: tensors and plain data only, so a tampered file cannot run code here.

    The digest check catches corruption but authenticates nothing (the manifest sits beside the files).
    """
    path = directory / file.path
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != file.sha256:
        raise ValueError(f"checkpoint file {path} is corrupt (its digest does not match the manifest)")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as error:
        named = _GLOBAL.search(str(error))
        raise ValueError(
            f"checkpoint file {path} holds objects other than tensors and plain data"
            + (f" ({named.group(1)})" if named else "")
            + ", so it was refused unread; load only checkpoints this project wrote"
        ) from None


def latest(*, directory: Path, fingerprint: str) -> Manifest | None:
    """The newest complete manifest in `directory`, or None if there is none.

    A manifest for another model or pipeline shape is an error, not a silent skip.
    Manifests whose files are missing or corrupt are passed over.
    """
    if not directory.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _MANIFEST.match(p.name)))
    for _, path in reversed(found):
        try:
            manifest = Manifest.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            continue
        if manifest.fingerprint != fingerprint:
            raise ValueError(
                f"checkpoint {path} was written for another model or pipeline shape "
                f"(fingerprint {manifest.fingerprint}, this run {fingerprint})"
            )
        if all(_intact(directory / f.path, f.sha256) for f in manifest.files.values()):
            return manifest
    return None


def _intact(path: Path, sha256: str) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256


@dataclass(frozen=True)
class Checkpointing:
    """When a Trainer checkpoints, whether it resumes, and how often it may rebuild a lost pipeline."""

    directory: str
    every: int = 10  # iterations between checkpoints; 0: never
    resume: bool = False  # start from the newest complete manifest in `directory`
    max_restarts: int = 0  # rebuilds from the last manifest after a stage is lost

    def __post_init__(self) -> None:
        for name in ("every", "max_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"checkpoint {name} must be >= 0, got {getattr(self, name)}")
