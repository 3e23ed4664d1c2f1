"""--varlen: paragraphs at natural length capped at the block, padding out of the loss; the
pipeline's loss and gradients are the unsplit GPT's token-weighted mean."""

from __future__ import annotations

import pytest
import torch
from gradients import GradCapture

from rrfp_ray.models.gpt import GPT, lm_loss_sum
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import corpus_source, gpt_trainer
from rrfp_ray.train.data import IGNORE
from rrfp_ray.train.partition import partition

RUN = RunConfig(
    model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 64},
    pipeline={"stages": 2, "microbatches": 4, "policy": "bfw", "timeout_s": 30},
    train={"micro_batch_size": 4, "seq_len": 64, "iterations": 2, "varlen": True},
)


def test_varlen_batches_hold_whole_paragraphs_padded_with_ignored_targets():
    source = corpus_source(RUN)
    batches = [source.microbatch(iteration=i, index=m) for i in range(3) for m in range(4)]
    assert len({int((y != IGNORE).sum()) for _, y in batches}) > 3  # the real tokens per microbatch vary
    for x, y in batches:
        assert x.shape == y.shape and x.shape[1] <= 64
        real = y != IGNORE
        assert real[:, 0].all() and (real[:, 1:] <= real[:, :-1]).all()  # padding only at the end
    assert source.tokens(iteration=0) == sum(int((y != IGNORE).sum()) for _, y in batches[:4])


def test_varlen_gradients_are_the_unsplit_gpts_token_weighted_mean():
    with gpt_trainer(RUN) as trainer:
        trainer.backend.executors = captures = [GradCapture(e) for e in trainer.backend.executors]
        report = trainer.step()
    model = GPT(RUN.model, seed=RUN.train.seed)
    source = corpus_source(RUN)
    sums = [lm_loss_sum(model(x)[0], y) for x, y in (source.microbatch(iteration=0, index=m) for m in range(4))]
    count = sum(int(c) for _, c in sums)
    loss = sum(s for s, _ in sums) / count
    loss.backward()
    assert report.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    layers = model.layers()
    for stage, part in enumerate(partition(n_layers=len(layers), parts=2)):
        want = list({id(p): p.grad for i in part for p in layers[i].parameters()}.values())
        got = captures[stage].grads
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g / count, w, rtol=1e-4, atol=1e-6)
