"""The VLM job through the public API: `rrfp_ray.models.vlm`, captioned images and the run config
as a `Trainer`. Everything but the model and its data is the GPT job's (`training_arguments`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from rrfp_ray.models.vlm import VLM, VLMConfig, caption_loss
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import checkpointing, training_arguments
from rrfp_ray.train.api import Trainer
from rrfp_ray.train.backend import Backend
from rrfp_ray.train.build import checked, make_workload
from rrfp_ray.train.vlm_data import ImageCaptions
from rrfp_ray.train.workload import ModelWorkload


@dataclass(frozen=True)
class VLMLayers:
    """Picklable builder of the VLM's layer list; the same weights in every process."""

    config: VLMConfig
    seed: int

    def __call__(self) -> list[nn.Module]:
        return VLM(self.config, seed=self.seed).layers()


def caption_source(
    run: RunConfig, *, model: VLMConfig, tail: float, split: str = "train", microbatches: int | None = None
) -> ImageCaptions:
    return ImageCaptions(
        model=model,
        micro_batch_size=run.train.micro_batch_size,
        microbatches=microbatches or run.pipeline.global_microbatches,
        seed=run.train.seed,
        tail=tail,
        split=split,
    )


def vlm_trainer(run: RunConfig, *, model: VLMConfig, tail: float, backend: Backend | None = None) -> Trainer:
    """`model` trained on captioned images (images per sample ~ (n + 1) ** -`tail`) as `run` says."""
    arguments = _arguments(run, model=model, tail=tail)
    return Trainer(pipeline=run.pipeline, backend=backend, checkpoints=checkpointing(run), **arguments)


def vlm_workload(run: RunConfig, *, model: VLMConfig, tail: float) -> ModelWorkload:
    """What every stage of `vlm_trainer` runs (dry-run: its ties found)."""
    workload = make_workload(pipeline=run.pipeline, **_arguments(run, model=model, tail=tail))
    return checked(workload, pipeline=run.pipeline)


def _arguments(run: RunConfig, *, model: VLMConfig, tail: float) -> dict[str, Any]:
    if run.pipeline.tp > 1:
        raise ValueError("the VLM has no tensor-parallel layers: tp must be 1")
    val = caption_source(run, model=model, tail=tail, split="val", microbatches=run.train.val_microbatches)
    return {
        "model": VLMLayers(config=model, seed=run.train.seed),
        "loss_fn": caption_loss,
        "data": caption_source(run, model=model, tail=tail),
        "val_data": val,
        **training_arguments(run),
    }
