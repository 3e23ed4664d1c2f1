"""Checkpoints that a crash cannot corrupt, and that any pipeline shape can load.

Each stage writes its own file atomically (temp file, fsync, rename) and returns its
digest and the parameter names it holds; the driver commits a manifest, also atomically,
only after every stage has succeeded. The files are keyed by parameter, not by stage
(`rrfp_ray.train.state`): the manifest records the shape that wrote them and which file
holds each parameter (and which TP slice), and fits any shape of the same model. Loading
takes the newest manifest whose files are all present and intact, so a crash during a
write leaves the previous checkpoint usable. The data position
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

from rrfp_ray.errors import BadInput

_MANIFEST = re.compile(r"^manifest-(\d{8})\.json$")
_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")  # how torch names what it refused


@dataclass(frozen=True)
class StageFile:
    path: str  # relative to the checkpoint directory
    sha256: str
    tp_rank: int = 0  # the TP rank that wrote it: a name several ranks hold is sliced, in rank order
    weights: tuple[str, ...] = ()  # the parameter (and buffer) names whose weights it holds
    optimizer: tuple[str, ...] = ()  # the parameter names whose optimizer state it holds

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageFile:
        return cls(
            path=str(data["path"]),
            sha256=str(data["sha256"]),
            tp_rank=int(data["tp_rank"]),
            weights=tuple(data["weights"]),
            optimizer=tuple(data["optimizer"]),
        )


@dataclass(frozen=True)
class Shape:
    """The pipeline shape that wrote a checkpoint (any shape can load it)."""

    stages: int
    tp: int
    dp: int
    chunks: int
    placement: str
    layer_split: tuple[int, ...]  # layers per virtual stage
    zero: int
    microbatches: int

    def describe(self) -> str:
        split = ",".join(map(str, self.layer_split))
        zero = f" zero {self.zero}" if self.zero else ""
        return f"P={self.stages} T={self.tp} D={self.dp} v={self.chunks} M={self.microbatches} split {split}{zero}"


@dataclass(frozen=True)
class Manifest:
    iteration: int  # the next iteration to run
    fingerprint: str  # what the files fit: the model's parameter names and whole shapes
    files: dict[int, StageFile]
    shape: Shape
    parameters: dict[str, tuple[int, ...]]  # every parameter's whole shape, by name (`model_parameters`)
    planner: dict[str, Any] | None = None  # the planner's state (`Planner.to_dict`), with policy planned

    def to_json(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "fingerprint": self.fingerprint,
            "shape": asdict(self.shape),
            "parameters": {name: list(shape) for name, shape in self.parameters.items()},
            "files": {str(s): asdict(f) for s, f in self.files.items()},
            "planner": self.planner,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        if "shape" not in data and {"fingerprint", "files"} <= set(data):
            raise OldFormat(
                "this checkpoint was written in the chunk-indexed format, which only the exact pipeline shape "
                "that wrote it could load and this version no longer reads; resume it with the version that "
                "wrote it, or start afresh in another directory"
            )
        shape = data["shape"]
        return cls(
            iteration=int(data["iteration"]),
            fingerprint=str(data["fingerprint"]),
            files={int(s): StageFile.from_json(f) for s, f in data["files"].items()},
            shape=Shape(**{**shape, "layer_split": tuple(shape["layer_split"])}),
            parameters={name: tuple(shape) for name, shape in data["parameters"].items()},
            planner=data.get("planner"),
        )


def fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def parameters_fingerprint(parameters: dict[str, tuple[int, ...]]) -> str:
    """What a checkpoint must match to load: the model's parameter names and whole shapes, nothing of the pipeline."""
    return fingerprint(sorted(parameters.items()))


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


class CheckpointError(BadInput):
    """A checkpoint that cannot be used; the message names the file and what is wrong with it."""


class OldFormat(CheckpointError):
    """A manifest of the chunk-indexed format (no shape, no index of parameters)."""


def load_stage(*, directory: Path, file: StageFile) -> dict[str, Any]:
    """One stage's state: tensors and plain data only, so a tampered file cannot run code here.

    The digest check catches corruption but authenticates nothing (the manifest sits beside the files).
    """
    path = directory / file.path
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != file.sha256:
        raise CheckpointError(f"checkpoint file {path} is corrupt (its digest does not match the manifest)")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as error:
        named = _GLOBAL.search(str(error))
        raise CheckpointError(
            f"checkpoint file {path} holds objects other than tensors and plain data"
            + (f" ({named.group(1)})" if named else "")
            + ", so it was refused unread; load only checkpoints this project wrote"
        ) from None


def latest(
    *, directory: Path, fingerprint: str, parameters: dict[str, tuple[int, ...]] | None = None
) -> Manifest | None:
    """The newest complete manifest in `directory`, or None if there is none.

    A manifest for another model (naming the first of `parameters`, the model's, that does not match),
    or of the old chunk-indexed format, is an error, not a silent skip. Manifests that cannot be read,
    or whose files are missing or corrupt, are passed over.
    """
    for path in reversed(_manifests(directory)):
        try:
            manifest = _read_manifest(path)
        except OldFormat:
            raise
        except CheckpointError:
            continue
        if manifest.fingerprint != fingerprint:
            raise CheckpointError(
                f"checkpoint {path} was written for another model"
                + _first_mismatch(saved=manifest.parameters, model=parameters)
                + f" (fingerprint {manifest.fingerprint}, this run {fingerprint})"
            )
        if _problem(directory=directory, manifest=manifest) is None:
            return manifest
    return None


def resume_point(
    *, directory: Path, fingerprint: str, parameters: dict[str, tuple[int, ...]] | None = None
) -> Manifest:
    """The manifest to resume from; with none usable, a CheckpointError naming each manifest and its fault."""
    manifest = latest(directory=directory, fingerprint=fingerprint, parameters=parameters)
    if manifest is not None:
        return manifest
    if not directory.is_dir():
        raise CheckpointError(f"resume: the checkpoint directory {directory} does not exist")
    manifests = _manifests(directory)
    if not manifests:
        raise CheckpointError(f"resume: no manifest-*.json in {directory} (no checkpoint was committed there)")
    problems = []
    for path in reversed(manifests):
        try:
            problems.append(f"{path}: {_problem(directory=directory, manifest=_read_manifest(path))}")
        except CheckpointError as error:
            problems.append(str(error))
    raise CheckpointError(f"resume: no usable checkpoint in {directory}\n  " + "\n  ".join(problems))


def _first_mismatch(*, saved: dict[str, tuple[int, ...]], model: dict[str, tuple[int, ...]] | None) -> str:
    if model is None:
        return ""
    for name in dict.fromkeys([*model, *saved]):
        if name not in saved:
            return f": this model's parameter {name} {list(model[name])} is not in it"
        if name not in model:
            return f": its parameter {name} {list(saved[name])} is not in this model"
        if saved[name] != model[name]:
            return f": parameter {name} is {list(saved[name])} there, {list(model[name])} in this model"
    return ""


def _manifests(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    numbered = ((_MANIFEST.match(p.name), p) for p in directory.iterdir())
    return [p for _, p in sorted((int(m.group(1)), p) for m, p in numbered if m)]


def _read_manifest(path: Path) -> Manifest:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: the manifest cannot be read ({error})") from None
    if not text.strip():
        raise CheckpointError(f"{path}: the manifest is empty")
    try:
        return Manifest.from_json(json.loads(text))
    except OldFormat as error:
        raise OldFormat(f"{path}: {error}") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: the manifest is not JSON ({error.msg}, line {error.lineno})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{path}: the manifest lacks a field or has a bad one ({error!r})") from None


def _problem(*, directory: Path, manifest: Manifest) -> str | None:
    """What is wrong with a manifest's stage files, if anything."""
    for file in manifest.files.values():
        path = directory / file.path
        if not path.is_file():
            return f"its file {path} is missing"
        if hashlib.sha256(path.read_bytes()).hexdigest() != file.sha256:
            return f"its file {path} is corrupt (the digest does not match)"
    return None


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
