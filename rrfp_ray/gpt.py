"""The GPT job's workload: our GPT, the byte corpus and the run config, as a `ModelWorkload`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from rrfp_ray.config import RunConfig
from rrfp_ray.data import CorpusSource
from rrfp_ray.model import GPT, GPTConfig, lm_loss
from rrfp_ray.training import ModelWorkload, Optim


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
        microbatches=microbatches or run.pipeline.microbatches,
        seed=run.train.seed,
        split=split,
    )


def gpt_workload(run: RunConfig) -> ModelWorkload:
    train = run.train
    injected = None
    if run.variability.scenario != "none" or run.variability.trace_file is not None:
        injected = run.variability.trace(pipeline=run.pipeline)
    return ModelWorkload(
        layers=GPTLayers(config=run.model, seed=train.seed),
        loss_fn=lm_loss,
        data=corpus_source(run),
        microbatches=run.pipeline.microbatches,
        optim=Optim(
            lr=train.lr,
            min_lr=train.min_lr,
            warmup=min(train.warmup, train.iterations),
            total=train.iterations,
            weight_decay=train.weight_decay,
            max_grad_norm=train.max_grad_norm,
        ),
        injected=injected,
        val_data=corpus_source(run, split="val", microbatches=run.train.val_microbatches),
    )
