"""A stage's state keyed by parameter, not by the pipeline's shape, so that any shape can load it.

A name is a layer's index in the model's layer list and the name inside the layer
(`3.attn.qkv.weight`, the form `rrfp_ray.train.ties` uses); a tensor several layers share
is written under each of its names. A stage writes the weights of its layers (TP rank 0
every tensor; other ranks only the slices of the blocks' split tensors, `SHARDED_IN_BLOCK`)
and the optimizer state of the parameters it steps (per parameter: Adam's moments and step,
and its param group's hyperparameters), and reports which names its file holds. A stage of
any other shape then reads the names it holds from whichever files hold them, putting TP
slices back together (`unshard_tensor`) and cutting them to its own rank (`shard_tensor`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rrfp_ray.models.tp import SHARDED_IN_BLOCK, TPBlock, shard_tensor, unshard_tensor
from rrfp_ray.train.checkpoint import CheckpointError, Manifest, load_stage

Layers = Mapping[int, nn.Module]  # a stage's layers, by index into the model's layer list


def parameter_names(layers: Layers) -> dict[int, list[str]]:
    """Every name of each of the layers' parameters, by the parameter's id."""
    names: dict[int, list[str]] = {}
    for i, layer in layers.items():
        for name, param in layer.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(f"{i}.{name}")
    return names


def _sharded(layer: nn.Module, name: str) -> bool:
    """Whether `name` of `layer` is a TP slice (each rank holds its own part) rather than a whole copy."""
    return isinstance(layer, TPBlock) and name in SHARDED_IN_BLOCK


def stage_state(*, layers: Layers, optimizer: torch.optim.Optimizer, tp_rank: int, weights: bool) -> dict[str, Any]:
    """What a stage's file holds: its layers' weights (when `weights`: one replica writes them) and the
    optimizer state of every parameter it steps, by name, on the CPU."""
    written: dict[str, Tensor] = {}
    for i, layer in layers.items() if weights else ():
        for name, tensor in layer.state_dict().items():
            if tp_rank == 0 or _sharded(layer, name):
                written[f"{i}.{name}"] = tensor.detach().to("cpu", copy=True)
    names = parameter_names(layers)
    state: dict[str, dict[str, Any]] = {}
    group_of: dict[str, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            held = optimizer.state.get(param)
            if not held or not (tp_rank == 0 or any(_sharded(*_locate(layers, n)) for n in names[id(param)])):
                continue
            copied = {k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in held.items()}
            for name in names[id(param)]:
                state[name], group_of[name] = copied, g
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"weights": written, "optimizer": state, "group_of": group_of, "groups": hyper}


def held_names(state: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names whose weights and whose optimizer state a `stage_state` holds (what the manifest indexes)."""
    return tuple(state["weights"]), tuple(state["optimizer"])


def _locate(layers: Layers, name: str) -> tuple[nn.Module, str]:
    index, _, local = name.partition(".")
    return layers[int(index)], local


class _Files:
    """The manifest's files, each read (digest-checked) at most once, and only when a name it holds is needed."""

    def __init__(self, *, directory: Path, manifest: Manifest) -> None:
        self._directory = directory
        self._files = manifest.files
        self._read: dict[int, dict[str, Any]] = {}
        self.weights: dict[str, dict[int, int]] = {}  # name: {TP rank: file}
        self.optimizer: dict[str, dict[int, int]] = {}
        for index, file in sorted(manifest.files.items()):
            for name in file.weights:
                self.weights.setdefault(name, {})[file.tp_rank] = index
            for name in file.optimizer:
                self.optimizer.setdefault(name, {})[file.tp_rank] = index

    def state(self, index: int) -> dict[str, Any]:
        if index not in self._read:
            self._read[index] = load_stage(directory=self._directory, file=self._files[index])
        return self._read[index]

    @property
    def count(self) -> int:
        return len(self._read)


def _whole(name: str, parts: list[Any], *, where: Callable[[Any], Any]) -> Any:
    """A tensor whole again from its TP slices (rank order), or the one whole copy; `where(part)` picks it."""
    values = [where(part) for part in parts]
    if len(values) == 1 or not isinstance(values[0], Tensor) or values[0].dim() == 0:
        return values[0]
    return unshard_tensor(name.partition(".")[2], values)


def _mine(layer: nn.Module, local: str, value: Any, *, tp_rank: int, tp_size: int) -> Any:
    if isinstance(value, Tensor) and value.dim() > 0 and _sharded(layer, local):
        return shard_tensor(local, value, rank=tp_rank, size=tp_size)
    return value


def load_state(
    *,
    directory: Path,
    manifest: Manifest,
    layers: Layers,
    optimizer: torch.optim.Optimizer,
    tp_rank: int,
    tp_size: int,
) -> int:
    """Load into `layers` (this stage's, as this TP rank of `tp_size` holds them) and `optimizer` (over
    the parameters this stage steps) what `manifest`'s files hold of them, whatever shape wrote them.
    Returns how many files were read."""
    files = _Files(directory=directory, manifest=manifest)
    for i, layer in layers.items():
        loaded = {}
        for local in layer.state_dict():
            name = f"{i}.{local}"
            at = files.weights.get(name)
            if at is None:
                raise CheckpointError(f"the checkpoint in {directory} holds no weights for {name}")
            parts = [files.state(at[rank]) for rank in sorted(at)]
            whole = _whole(name, parts, where=lambda state, name=name: state["weights"][name])
            loaded[local] = _mine(layer, local, whole, tp_rank=tp_rank, tp_size=tp_size)
        layer.load_state_dict(loaded)
    names = parameter_names(layers)
    saved = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    for g, (group, ids) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        for param, pid in zip(group["params"], ids["params"]):
            name = next((n for n in names[id(param)] if n in files.optimizer), None)
            if name is None:
                continue  # not stepped before the checkpoint
            at = files.optimizer[name]
            parts = [files.state(at[rank]) for rank in sorted(at)]
            layer, local = _locate(layers, name)
            keys = parts[0]["optimizer"][name]
            state[pid] = {
                key: _mine(
                    layer,
                    local,
                    _whole(name, parts, where=lambda s, name=name, key=key: s["optimizer"][name][key]),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                )
                for key in keys
            }
            hyper = parts[0]["groups"][parts[0]["group_of"][name]]
            saved["param_groups"][g] = {**ids, **hyper, "params": ids["params"]}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    return files.count


def whole_weights(*, directory: Path, manifest: Manifest) -> dict[str, Tensor]:
    """Every weight the checkpoint holds, whole (TP slices put back together), by its name in the layer list."""
    files = _Files(directory=directory, manifest=manifest)
    return {
        name: _whole(
            name, [files.state(at[r]) for r in sorted(at)], where=lambda state, name=name: state["weights"][name]
        )
        for name, at in files.weights.items()
    }
