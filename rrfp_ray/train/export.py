"""The unsplit model's state dict, gathered from every stage, chunk and TP shard.

Each stage holds `nn.Sequential` chunks over its share of the layer list, so a chunk's
key `k.name` is layer `part.start + k`'s `name`. A reference build of the model (its
structure; its values are not used) maps every such tensor to its key in the model the
user gave. A tensor several layers share (a tied weight) appears once, under its first
key. The GPT's TP blocks are put back together from their ranks' slices. A checkpoint, keyed by
names in the layer list already, maps the same way (`checkpoint_state_dict`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor, nn

from rrfp_ray.models.gpt import Block
from rrfp_ray.models.tp import unshard_block_tensors
from rrfp_ray.schedule.actions import Placement
from rrfp_ray.train.checkpoint import Manifest
from rrfp_ray.train.layers import ModelLayers, to_layers
from rrfp_ray.train.partition import partition
from rrfp_ray.train.state import whole_weights

ChunkStates = dict[int, dict[str, Tensor]]  # one stage (TP shard)'s chunks: chunk -> its state dict


def unsplit_state_dict(
    *,
    layers: ModelLayers,
    stages: int,
    chunks: int,
    tp: int,
    shards: Sequence[ChunkStates],
    placement: Placement = Placement.LOOPED,
    sizes: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """`shards[stage * tp + rank]` is that shard's chunk states (`sizes`: layers per virtual stage, default
    even); returns the unsplit model's state dict."""
    if len(shards) != stages * tp:
        raise ValueError(f"need stages x tp = {stages * tp} shards, got {len(shards)}")
    model = layers.model()
    modules = to_layers(model, split_points=layers.split_points)
    parts = partition(n_layers=len(modules), parts=stages * chunks, sizes=sizes)
    keys = _model_keys(model)
    gathered: dict[str, Tensor] = {}
    for stage in range(stages):
        for chunk in range(chunks):
            part = parts[placement.virtual_stage(stage=stage, chunk=chunk, stages=stages)]
            for k, i in enumerate(part):
                ranks = [_layer_state(shards[stage * tp + rank][chunk], index=k) for rank in range(tp)]
                state = unshard_block_tensors(ranks) if tp > 1 and isinstance(modules[i], Block) else ranks[0]
                reference = modules[i].state_dict(keep_vars=True)
                for name, value in state.items():
                    gathered.setdefault(keys[id(reference[name])], value.detach().cpu())
    return {key: gathered[key] for key in dict.fromkeys(keys.values()) if key in gathered}


def checkpoint_state_dict(*, layers: ModelLayers, directory: Path, manifest: Manifest) -> dict[str, Tensor]:
    """The unsplit model's state dict from the checkpoint `manifest` records, whatever shape wrote it."""
    model = layers.model()
    keys = _model_keys(model)
    weights = whole_weights(directory=directory, manifest=manifest)
    gathered: dict[str, Tensor] = {}
    for i, module in enumerate(to_layers(model, split_points=layers.split_points)):
        for name, tensor in module.state_dict(keep_vars=True).items():
            gathered.setdefault(keys[id(tensor)], weights[f"{i}.{name}"])
    return {key: gathered[key] for key in dict.fromkeys(keys.values()) if key in gathered}


def _model_keys(model: nn.Module) -> dict[int, str]:
    """Each tensor's first key in the model's state dict, by the tensor's id."""
    keys: dict[int, str] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        keys.setdefault(id(tensor), key)
    return keys


def _layer_state(chunk_state: dict[str, Tensor], *, index: int) -> dict[str, Tensor]:
    prefix = f"{index}."
    return {key[len(prefix) :]: value for key, value in chunk_state.items() if key.startswith(prefix)}


def load_unsplit(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load an exported state dict; the only keys it may lack are second names of tied tensors."""
    first: dict[int, str] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), key)
    aliases = {key for key, tensor in model.state_dict(keep_vars=True).items() if first[id(tensor)] != key}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - aliases:
        raise ValueError(f"state dict does not fit the model: missing {missing}, unexpected {unexpected}")
