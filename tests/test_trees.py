"""Trees of tensors across stage boundaries: a (hidden, attention_mask) tuple and a dict with
int positions, a float needing no gradient and two differentiable leaves; gradients equal the
unsplit model's under 1f1b, bf and bfw."""

from __future__ import annotations

import pytest
import torch
from gradients import GradCapture
from real_models import PaddedTokens, dict_model, reference, token_loss, token_sum_count, tuple_model

from rrfp_ray import Optim, PipelineConfig, Trainer

MODELS = {"tuple": tuple_model, "dict": dict_model}


@pytest.mark.parametrize("policy", ["1f1b", "bf", "bfw"])
@pytest.mark.parametrize("name", ["tuple", "dict"])
def test_gradients_equal_the_unsplit_models_across_tree_boundaries(name, policy):
    stages, chunks = (2, 2) if policy == "bf" else (3, 1)
    pipeline = PipelineConfig(stages=stages, chunks=chunks, microbatches=4, policy=policy, timeout_s=30)
    data = PaddedTokens(microbatches=4)
    with Trainer(
        model=MODELS[name], loss_fn=token_loss, data=data, pipeline=pipeline, optimizer=Optim(lr=1e-2, warmup=0)
    ) as trainer:
        trainer.backend.executors = captures = [GradCapture(e) for e in trainer.backend.executors]
        report = trainer.step()
        model = trainer.workload.layers.model()
    loss, expected = reference(model=model, loss_fn=token_loss, data=data, microbatches=4, stages=stages, chunks=chunks)
    assert report.loss == pytest.approx(loss, rel=1e-5)
    for capture, want in zip(captures, expected, strict=True):
        assert len(capture.grads) == len(want) > 0
        for got, ref in zip(capture.grads, want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("policy", "stages", "chunks"), [("1f1b", 3, 1), ("bfw", 2, 2)])
def test_a_sum_count_loss_gives_the_global_token_mean_on_variable_length_batches(policy, stages, chunks):
    data = PaddedTokens(microbatches=4)
    counts = [int((data.microbatch(iteration=0, index=m)[1] != -100).sum()) for m in range(4)]
    assert len(set(counts)) > 1  # the microbatches hold different numbers of tokens
    pipeline = PipelineConfig(stages=stages, chunks=chunks, microbatches=4, policy=policy, timeout_s=30)
    with Trainer(
        model=tuple_model, loss_fn=token_sum_count, data=data, pipeline=pipeline, optimizer=Optim(lr=1e-2, warmup=0)
    ) as trainer:
        trainer.backend.executors = captures = [GradCapture(e) for e in trainer.backend.executors]
        report = trainer.step()
        model = trainer.workload.layers.model()
    loss, expected = reference(
        model=model, loss_fn=token_sum_count, data=data, microbatches=4, stages=stages, chunks=chunks
    )
    with torch.no_grad():
        mean_of_means = (
            sum(float(token_loss(model(x), y)) for x, y in (data.microbatch(iteration=0, index=m) for m in range(4)))
            / 4
        )
    assert report.loss == pytest.approx(loss, rel=1e-5)
    assert abs(loss - mean_of_means) > 1e-3  # the token mean is not the mean of microbatch means
    for capture, want in zip(captures, expected, strict=True):
        for got, ref in zip(capture.grads, want):
            torch.testing.assert_close(got / sum(counts), ref, rtol=1e-4, atol=1e-6)
