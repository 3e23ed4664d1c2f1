"""The GPT job through the public API: our GPT, the byte corpus and the run config as a `Trainer`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from rrfp_ray.models.gpt import GPT, GPTConfig, lm_loss
from rrfp_ray.train.api import Trainer, make_workload
from rrfp_ray.train.backend import Backend
from rrfp_ray.train.checkpoint import Checkpointing
from rrfp_ray.train.config import RunConfig
from rrfp_ray.train.data import CorpusSource
from rrfp_ray.train.workload import ModelWorkload, Optim


@dataclass(frozen=True)
class GPTLayers:
    """Picklable builder of the GPT's layer list; the same weights in every process."""

    config: GPTConfig
    seed: int

    def __call__(self) -> list[nn.Module]:
        return GPT(self.config, seed=self.seed).layers()


def corpus_source(run: RunConfig, *, split: str = "train", microbatches: int | None = None) -> CorpusSource:
    return CorpusSource(
        path=run.train.data,
        micro_batch_size=run.train.micro_batch_size,
        seq_len=run.train.seq_len,
        microbatches=microbatches or run.pipeline.global_microbatches,
        seed=run.train.seed,
        split=split,
    )


def gpt_trainer(run: RunConfig, *, backend: Backend | None = None) -> Trainer:
    """The GPT of `run` as a `Trainer` (the local backend unless `backend` is given)."""
    train = run.train
    checkpoints = None
    if train.checkpoint_dir is not None:
        checkpoints = Checkpointing(
            directory=train.checkpoint_dir,
            every=train.checkpoint_every,
            resume=train.resume,
            max_restarts=train.max_restarts,
        )
    return Trainer(pipeline=run.pipeline, backend=backend, checkpoints=checkpoints, **_arguments(run))


def gpt_workload(run: RunConfig) -> ModelWorkload:
    """What every stage of `gpt_trainer(run)` runs, for driving a pipeline directly."""
    return make_workload(pipeline=run.pipeline, **_arguments(run))


def _arguments(run: RunConfig) -> dict[str, Any]:
    train = run.train
    injected = None
    if run.variability.scenario != "none" or run.variability.trace_file is not None:
        injected = run.variability.trace(pipeline=run.pipeline)
    return {
        "model": GPTLayers(config=run.model, seed=train.seed),
        "loss_fn": lm_loss,
        "data": corpus_source(run),
        "optimizer": Optim(
            lr=train.lr,
            min_lr=train.min_lr,
            warmup=min(train.warmup, train.iterations),
            total=train.iterations,
            weight_decay=train.weight_decay,
            max_grad_norm=train.max_grad_norm,
        ),
        "val_data": corpus_source(run, split="val", microbatches=train.val_microbatches),
        "seed": train.seed,
        "injected": injected,
        "device": train.device,
    }
