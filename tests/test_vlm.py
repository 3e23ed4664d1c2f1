"""The VLM workload (in-process): the pipeline's gradients are the unsplit model's on microbatches
with varied image counts, a sample's logits do not depend on its microbatch, the loss falls, the
images per microbatch reach the planner as its features, and data parallelism changes nothing."""

from __future__ import annotations

import functools
import math
import statistics

import pytest
import torch
from gradients import GradCapture

from rrfp_ray.models.vlm import VLM, VLMConfig, caption_loss
from rrfp_ray.plan.costs import Backward
from rrfp_ray.plan.planner import HINTS, Planner, PlannerConfig
from rrfp_ray.policy.caps import Cap
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_run import dp_check
from rrfp_ray.recipes.gpt_workload import corpus_source
from rrfp_ray.recipes.vlm_workload import caption_source, vlm_trainer
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.train.data import IGNORE
from rrfp_ray.train.partition import partition

MODEL = VLMConfig(classes=4, encoder_layers=2, n_layer=2, encoder_embd=32, n_embd=32, max_images=4, image_size=8)
TAIL = 0.5


def _run(**train: object) -> RunConfig:
    return RunConfig(
        pipeline={"stages": 2, "chunks": 2, "microbatches": 4, "policy": "bfw", "timeout_s": 60},
        train={"micro_batch_size": 3, "iterations": 2, **train},
    )


def test_captions_name_the_images_and_the_counts_are_heavy_tailed():
    source = caption_source(_run(), model=MODEL, tail=1.5)
    (images, counts, text), targets = source.microbatch(iteration=0, index=1)
    assert images.shape == (int(counts.sum()), MODEL.channels, MODEL.image_size, MODEL.image_size)
    assert text.shape == targets.shape == (3, int(counts.max()) + 1)
    assert ((targets != IGNORE).sum(dim=1) == counts + 1).all()  # a class per image, then EOS
    drawn = torch.cat([source.counts(iteration=i, index=m) for i in range(25) for m in range(4)])
    share = torch.bincount(drawn, minlength=MODEL.max_images + 1).double() / len(drawn)
    assert share[0] > share[1] > share[2] > share[MODEL.max_images] > 0  # every count occurs, fewer ever more rarely
    again = source.microbatch(iteration=0, index=1)
    torch.testing.assert_close(again[0][0], images, rtol=0, atol=0)


def test_pipeline_gradients_are_the_unsplit_models_on_varied_image_counts():
    run = _run()
    source = caption_source(run, model=MODEL, tail=TAIL)
    counts = [source.counts(iteration=0, index=m).tolist() for m in range(4)]
    assert len({sum(c) for c in counts}) > 1 and 0 in {
        n for c in counts for n in c
    }  # varied, and a sample without images
    with vlm_trainer(run, model=MODEL, tail=TAIL) as trainer:
        trainer.backend.executors = captures = [GradCapture(e) for e in trainer.backend.executors]
        report = trainer.step()
    model = VLM(MODEL, seed=run.train.seed)
    sums = [caption_loss(model(x), y) for x, y in (source.microbatch(iteration=0, index=m) for m in range(4))]
    count = sum(int(c) for _, c in sums)
    loss = sum(s for s, _ in sums) / count
    loss.backward()
    assert report.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    layers = model.layers()
    parts = partition(n_layers=len(layers), parts=4)
    for stage in range(2):  # looped: stage s holds virtual stages s and s + 2
        own = [i for vs in (stage, stage + 2) for i in parts[vs]]
        want = list({id(p): p.grad for i in own for p in layers[i].parameters()}.values())
        got = captures[stage].grads
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g / count, w, rtol=1e-4, atol=1e-6)


def test_a_samples_logits_do_not_depend_on_its_microbatch():
    source = caption_source(_run(), model=MODEL, tail=TAIL)
    (images, counts, text), _ = source.microbatch(iteration=0, index=1)
    model = VLM(MODEL, seed=0).eval()
    with torch.no_grad():
        together = model((images, counts, text))
        start = 0
        for row, n in enumerate(counts.tolist()):
            length = n + 1  # BOS and a class per image
            alone = model((images[start : start + n], counts[row : row + 1], text[row : row + 1, :length]))
            torch.testing.assert_close(alone[0, -length:], together[row, -text.shape[1] :][:length])
            start += n


def test_a_microbatch_without_images_runs_forward_and_backward():
    model = VLM(MODEL, seed=0)
    images = torch.zeros(0, MODEL.channels, MODEL.image_size, MODEL.image_size)
    text = torch.full((2, 1), MODEL.bos)
    total, count = caption_loss(model((images, torch.zeros(2, dtype=torch.long), text)), torch.full((2, 1), MODEL.eos))
    total.backward()
    assert int(count) == 2 and torch.isfinite(total)


def blind_loss(*, model: VLMConfig, tail: float) -> float:
    """The least mean loss per caption token of a model that never looks at the images: it knows
    only how many images have been named so far, so it guesses each kind and when EOS comes."""
    weights = [(n + 1) ** -tail for n in range(model.max_images + 1)]
    p = [w / sum(weights) for w in weights]
    total = tokens = 0.0
    for n, share in enumerate(p):
        for k in range(n + 1):
            ends = p[k] / sum(p[k:])  # P(no more images | k named)
            total += share * (-math.log(ends) if k == n else -math.log((1 - ends) / model.classes))
        tokens += share * (n + 1)
    return total / tokens


def test_the_loss_falls_below_what_a_model_blind_to_the_images_can_reach():
    run = _run(iterations=30, micro_batch_size=6)
    with vlm_trainer(run, model=MODEL, tail=TAIL) as trainer:
        losses = [r.loss for r in trainer.fit(30)]
        val = trainer.evaluate()
    blind = blind_loss(model=MODEL, tail=TAIL)
    assert losses[0] > blind
    assert statistics.mean(losses[-5:]) < 0.85 * blind, (blind, losses)
    assert val < blind, (blind, val)


def test_the_data_sources_report_their_features_without_loading_and_the_planner_takes_them():
    run = _run()
    source = caption_source(run, model=MODEL, tail=TAIL)
    features = source.features(iteration=3)
    truth = [float(len(source.microbatch(iteration=3, index=m)[0][0])) for m in range(4)]
    assert features == truth and len(set(features)) > 1
    planner = Planner(config=PlannerConfig(hints=HINTS, cap=Cap.parse("1x")), stages=2, chunks=1, microbatches=4)
    predicted = planner.predicted(iteration=3, features=features)[0]
    forward = predicted.F[0]  # before telemetry, the cost of an op is proportional to its microbatch's feature
    for f, d in zip(features, forward):
        assert d == pytest.approx(f * len(features) / sum(features))
    assert planner.model.durations(
        block=0, kind=Kind.F, family=Backward.FULL, features=features, count=4
    ) == pytest.approx(forward)
    text = corpus_source(_run(varlen=True, seq_len=64))
    tokens = [float((text.microbatch(iteration=0, index=m)[1] != IGNORE).sum()) for m in range(4)]
    assert text.features(iteration=0) == tokens and len(set(tokens)) > 1


def test_two_data_parallel_replicas_train_as_one_pipeline_of_all_their_microbatches():
    run = RunConfig(
        pipeline={"stages": 2, "microbatches": 2, "dp": 2, "policy": "1f1b", "timeout_s": 60},
        train={"micro_batch_size": 3, "iterations": 2},
    )
    trainer_for = functools.partial(vlm_trainer, model=MODEL, tail=TAIL)
    with trainer_for(run) as trainer:
        losses = [r.loss for r in trainer.fit(2)]
    assert dp_check(run=run, losses=losses, trainer_for=trainer_for)["max_rel_loss_diff"] < 1e-5


def test_the_library_example_trains(capsys):
    from examples.multimodal import main

    losses = main(["--iterations", "12"])
    assert losses[-1] < losses[0]
    assert "images per microbatch of iteration 0" in capsys.readouterr().out
