"""The GPT job through the public API: our GPT, the byte corpus and the run config as a `Trainer`."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from rrfp_ray.models.gpt import GPT, GPTConfig, build_layers, lm_loss, lm_loss_sum
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.sim.trace import Trace
from rrfp_ray.train.api import Trainer
from rrfp_ray.train.backend import Backend
from rrfp_ray.train.build import checked, make_workload
from rrfp_ray.train.checkpoint import Checkpointing
from rrfp_ray.train.data import CorpusSource
from rrfp_ray.train.layers import ModelLayers, model_layers
from rrfp_ray.train.optim import Optim
from rrfp_ray.train.workload import ModelWorkload


@dataclass(frozen=True)
class GPTLayers:
    """Picklable builder of the GPT's layer list; the same weights in every process."""

    config: GPTConfig
    seed: int

    def __call__(self) -> list[nn.Module]:
        return GPT(self.config, seed=self.seed).layers()

    def count(self) -> int:
        return self.config.n_layer + 2

    def build(self, *, keep: Collection[int]) -> list[nn.Module]:
        """Only the layers in `keep` materialized, with the values of the whole build (`build_layers`)."""
        return build_layers(self.config, seed=self.seed, keep=keep)


MODEL_FILE = "model.json"  # beside a GPT run's checkpoints: what jobs/export.py needs to rebuild the model


@dataclass(frozen=True)
class SavedModel:
    """The model of a GPT run, as written beside its checkpoints (which record the pipeline's shape themselves)."""

    config: GPTConfig
    seed: int

    @classmethod
    def of(cls, run: RunConfig) -> SavedModel:
        return cls(config=run.model, seed=run.train.seed)

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        data = {"model": self.config.model_dump(), "seed": self.seed}
        (directory / MODEL_FILE).write_text(json.dumps(data, indent=2))

    @classmethod
    def read(cls, directory: Path) -> SavedModel:
        data = json.loads((directory / MODEL_FILE).read_text())
        return cls(config=GPTConfig(**data["model"]), seed=int(data["seed"]))

    def layers(self) -> ModelLayers:
        return model_layers(model=GPTLayers(config=self.config, seed=self.seed), seed=self.seed)


def corpus_source(run: RunConfig, *, split: str = "train", microbatches: int | None = None) -> CorpusSource:
    return CorpusSource(
        path=run.train.data,
        micro_batch_size=run.train.micro_batch_size,
        seq_len=run.train.seq_len,
        microbatches=microbatches or run.pipeline.global_microbatches,
        seed=run.train.seed,
        split=split,
        varlen=run.train.varlen,
    )


def gpt_trainer(run: RunConfig, *, backend: Backend | None = None) -> Trainer:
    """The GPT of `run` as a `Trainer` (the local backend unless `backend` is given)."""
    checkpoints = checkpointing(run)
    if checkpoints is not None:
        SavedModel.of(run).write(Path(checkpoints.directory))
    return Trainer(pipeline=run.pipeline, backend=backend, checkpoints=checkpoints, **_arguments(run))


def checkpointing(run: RunConfig) -> Checkpointing | None:
    """The checkpoints `run.train` asks for; None without a checkpoint directory."""
    train = run.train
    if train.checkpoint_dir is None:
        return None
    return Checkpointing(
        directory=train.checkpoint_dir,
        every=train.checkpoint_every,
        resume=train.resume,
        max_restarts=train.max_restarts,
    )


def gpt_workload(run: RunConfig) -> ModelWorkload:
    """What every stage of `gpt_trainer(run)` runs, for driving a pipeline directly (dry-run: its ties found)."""
    return checked(make_workload(pipeline=run.pipeline, **_arguments(run)), pipeline=run.pipeline)


def _arguments(run: RunConfig) -> dict[str, Any]:
    return {
        "model": GPTLayers(config=run.model, seed=run.train.seed),
        "loss_fn": lm_loss_sum if run.train.varlen else lm_loss,
        "data": corpus_source(run),
        "val_data": corpus_source(run, split="val", microbatches=run.train.val_microbatches),
        **training_arguments(run),
    }


def training_arguments(run: RunConfig) -> dict[str, Any]:
    """`Trainer`'s arguments that `run` sets whatever the model: optimizer, seed, injected delays, device and
    slow devices."""
    train = run.train
    return {
        "optimizer": Optim(
            lr=train.lr,
            min_lr=train.min_lr,
            warmup=min(train.warmup, train.iterations),
            total=train.iterations,
            weight_decay=train.weight_decay,
            max_grad_norm=train.max_grad_norm,
        ),
        "seed": train.seed,
        "injected": injected_traces(run),
        "device": train.device,
        "slow_devices": dict(run.variability.slow_devices),
    }


def injected_traces(run: RunConfig) -> tuple[Trace, ...]:
    """The delays `run` injects, a trace per iteration (iteration k sleeps the k-th, cycling); none for `none`."""
    variability = run.variability
    if variability.scenario == "none" and variability.trace_file is None:
        return ()
    return variability.traces(pipeline=run.pipeline, iterations=run.train.iterations)
