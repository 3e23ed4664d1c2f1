"""Tied weights: a parameter shared by the first and the last stage trains exactly as in the
unsplit model (losses and weights), its copies stay identical; untied models are unchanged;
copies that would start different are refused before any stage starts."""

from __future__ import annotations

import itertools

import pytest
import torch
from real_models import PaddedTokens, tied_model, token_loss
from torch import nn

from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.train.optim import clip_coef
from rrfp_ray.train.partition import partition

OPTIM = Optim(lr=3e-2, warmup=2, total=6, max_grad_norm=0.5)


def _unsplit(model: nn.Module, *, data, iterations: int) -> list[float]:
    optimizer = OPTIM.optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for it in range(iterations):
        batches = [data.microbatch(iteration=it, index=m) for m in range(data.microbatches)]
        loss = sum(token_loss(model(x), y) for x, y in batches) / len(batches)
        loss.backward()
        total = sum(float(p.grad.double().square().sum()) for p in model.parameters())
        coef = clip_coef(total_sq_norm=total, max_norm=OPTIM.max_grad_norm)
        for p in model.parameters():
            p.grad.mul_(coef)
        for group in optimizer.param_groups:
            group["lr"] = OPTIM.lr_at(it)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _stage_weights(trainer: Trainer, *, stages: int, chunks: int) -> dict[int, dict[str, torch.Tensor]]:
    """Each stage's weights by their names in the layer list ("<layer>.<name>")."""
    parts = partition(n_layers=5, parts=stages * chunks)
    weights = {}
    for s, executor in enumerate(trainer.backend.executors):
        weights[s] = {}
        for c in range(chunks):
            for key, value in executor.runner.module(c).state_dict().items():
                index, _, name = key.partition(".")
                vs = trainer.pipeline.layout.virtual_stage(stage=s, chunk=c)
                weights[s][f"{parts[vs].start + int(index)}.{name}"] = value
    return weights


@pytest.mark.parametrize(
    ("tie", "policy", "stages", "chunks"),
    [(True, "bfw", 3, 1), (True, "bf", 2, 2), (True, "zbv", 2, 2), (False, "1f1b", 3, 1)],
)
def test_a_tied_model_trains_like_the_unsplit_tied_model(tie, policy, stages, chunks):
    data = PaddedTokens(microbatches=4)
    pipeline = PipelineConfig(stages=stages, chunks=chunks, microbatches=4, policy=policy, timeout_s=30)
    with Trainer(
        model=lambda: tied_model(tie=tie), loss_fn=token_loss, data=data, pipeline=pipeline, optimizer=OPTIM
    ) as trainer:
        assert len(trainer.workload.ties) == int(tie and policy != "zbv")  # V: stage 0 holds embedding and head
        losses = [trainer.step().loss for _ in range(4)]
        weights = _stage_weights(trainer, stages=stages, chunks=chunks)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        reference = tied_model(tie=tie)
    want = _unsplit(reference, data=data, iterations=4)
    assert losses == pytest.approx(want, rel=1e-5)
    expected = {k: v for k, v in nn.Sequential(*reference).state_dict().items()}
    for stage_weights in weights.values():
        for name, value in stage_weights.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6)
    copies = [w[n] for w in weights.values() for n in ("0.wte.weight", "4.out.weight") if n in w]
    assert len(copies) == 2  # under V both on stage 0: one tensor there
    if tie:
        assert all(torch.equal(a, b) for a, b in itertools.pairwise(copies))


def test_tied_copies_that_would_start_different_are_refused_before_any_stage_starts():
    builds = itertools.count()

    def drifting():  # ignores the seed: every build draws other weights
        model = tied_model()
        with torch.no_grad():
            model[0].wte.weight.add_(next(builds))
        return model

    pipeline = PipelineConfig(stages=3, microbatches=4, policy="bf", timeout_s=30)
    with pytest.raises(
        ValueError, match=r"tied parameter 0\.wte\.weight \(also 4\.out\.weight\), shared by stages \[0, 2\]"
    ):
        Trainer(model=drifting, loss_fn=token_loss, data=PaddedTokens(microbatches=4), pipeline=pipeline)


@pytest.mark.parametrize(("tie", "tp"), [(True, 1), (True, 2), (False, 1)])
def test_the_gpt_ties_embedding_and_head_by_default_and_its_gradients_equal_the_unsplit_models(tie, tp):
    from gradients import GradCapture, gpt_reference

    from rrfp_ray.recipes.config import RunConfig
    from rrfp_ray.recipes.gpt_workload import gpt_trainer

    run = RunConfig(
        model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16, "tie_embeddings": tie},
        pipeline={"stages": 3, "microbatches": 4, "policy": "bfw", "timeout_s": 30, "tp": tp},
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 2},
    )
    with gpt_trainer(run) as trainer:
        assert [t.names for t in trainer.workload.ties] == ([("0.wte.weight", "3.lm_head.weight")] if tie else [])
        trainer.backend.executors = captures = [GradCapture(e) for e in trainer.backend.executors]
        report = trainer.step()
    loss, layers = gpt_reference(run)
    assert report.loss == pytest.approx(loss, rel=1e-5)
    assert (layers[-1].lm_head.weight is layers[0].wte.weight) == tie
    for stage, part in enumerate(partition(n_layers=len(layers), parts=3)):
        whole = [i for i in part if i in (0, len(layers) - 1)]  # a TP block's gradients are shards (test_tp.py)
        want = list({id(p): p.grad for i in whole for p in layers[i].parameters()}.values())
        got = captures[stage * tp].grads
        for g, w in zip(got, want, strict=False):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


# ZeRO-1 over 3 replicas: the tied weight has another owner on each of its two stages, so its
# DP sums must reach every replica before the tie sums them over the stages. zbv: stage 0 holds
# the embedding and the head, so two of its chunks share the weight, which is summed over DP once.
@pytest.mark.parametrize(
    ("dp", "microbatches", "zero", "policy", "chunks"),
    [(2, 2, 0, "bf", 1), (3, 2, 1, "bf", 1), (2, 4, 0, "zbv", 2), (2, 4, 1, "zbv", 2)],
)
def test_data_parallel_replicas_keep_their_tied_copies_and_token_counts_apart(dp, microbatches, zero, policy, chunks):
    from real_models import token_sum_count

    def run(dp: int, microbatches: int, zero: int = 0) -> list[float]:
        pipeline = PipelineConfig(
            stages=2, chunks=chunks, microbatches=microbatches, policy=policy, timeout_s=30, dp=dp, zero=zero
        )
        data = PaddedTokens(microbatches=dp * microbatches)
        with Trainer(
            model=tied_model, loss_fn=token_sum_count, data=data, pipeline=pipeline, optimizer=OPTIM
        ) as trainer:
            return [trainer.step().loss for _ in range(3)]

    # dp=D x M microbatches computes what dp=1 x D*M does
    assert run(dp, microbatches, zero) == pytest.approx(run(1, dp * microbatches), rel=1e-5)
