"""Packing at run time: an iteration trained on its samples packed anew into microbatches (`SampleSource`,
`IterationArgs.packing`) has the unpacked iteration's loss and gradients under a (sum, count) loss, on the
GPT's varlen text and on the VLM; a mean loss refuses it; the planner packs by its predicted sample costs."""

from __future__ import annotations

import pytest
import torch
from gradients import GradCapture

from rrfp_ray.models.vlm import VLMConfig
from rrfp_ray.plan.packing import pack, packings
from rrfp_ray.plan.planner import Arrangement, Planner, PlannerConfig, default_hints
from rrfp_ray.policy.caps import Cap
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import corpus_source, gpt_trainer
from rrfp_ray.recipes.vlm_workload import caption_source, vlm_trainer
from rrfp_ray.train.data import IGNORE

GPT = RunConfig(
    model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 64},
    pipeline={"stages": 2, "microbatches": 4, "policy": "1f1b", "timeout_s": 30},
    train={"micro_batch_size": 3, "seq_len": 64, "iterations": 3, "varlen": True},
)
VLM = VLMConfig(classes=4, encoder_layers=2, n_layer=2, encoder_embd=32, n_embd=32, max_images=4, image_size=8)
VLM_RUN = RunConfig(
    pipeline={"stages": 2, "microbatches": 4, "policy": "1f1b", "timeout_s": 60},
    train={"micro_batch_size": 3, "iterations": 2},
)
# 12 samples in 4 microbatches of 1, 2, 4 and 5 samples, each drawn from several of the data's microbatches
UNEVEN = ((7,), (11, 0), (3, 8, 1, 5), (2, 10, 4, 9, 6))


def _captured(make, packing):
    with make() as trainer:
        trainer.backend.executors = captures = [GradCapture(e) for e in trainer.backend.executors]
        report = trainer.step(packing=packing)
    return report, [c.grads for c in captures]


def _same_iteration(make) -> None:
    base, base_grads = _captured(make, None)
    packed, grads = _captured(make, UNEVEN)
    assert packed.packing == [list(g) for g in UNEVEN] and base.packing is None
    assert packed.loss == pytest.approx(base.loss, rel=1e-5)
    for got_stage, want_stage in zip(grads, base_grads):
        assert len(got_stage) == len(want_stage) > 0
        for got, want in zip(got_stage, want_stage):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_packed_varlen_iteration_trains_as_the_unpacked_one():
    _same_iteration(lambda: gpt_trainer(GPT))


def test_a_packed_vlm_iteration_trains_as_the_unpacked_one():
    _same_iteration(lambda: vlm_trainer(VLM_RUN, model=VLM, tail=0.5))


@pytest.mark.parametrize("make", ["gpt", "vlm"])
def test_samples_make_the_sources_own_microbatches(make: str):
    if make == "gpt":
        source = corpus_source(GPT)
    else:
        source = caption_source(VLM_RUN, model=VLM, tail=0.5)
    per = source.sample_features(iteration=1)
    assert len(per) == 12 and [sum(per[3 * m : 3 * m + 3]) for m in range(4)] == source.features(iteration=1)
    for m in range(4):
        want = source.microbatch(iteration=1, index=m)
        got = source.samples(iteration=1, indexes=[3 * m, 3 * m + 1, 3 * m + 2])
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, targets = source.samples(iteration=1, indexes=UNEVEN[3])
    assert targets.shape[0] == 5
    assert [int((row != IGNORE).sum()) for row in targets] == [
        int(per[i]) + (make == "vlm") for i in UNEVEN[3]
    ]  # a target per real token (the VLM's: a class per image, then EOS), the rest padding
    with pytest.raises(ValueError, match=r"indexes must be a non-empty list of samples in \[0, 12\)"):
        source.samples(iteration=1, indexes=[12])


def test_a_mean_loss_refuses_packing():
    fixed = GPT.model_copy(update={"train": GPT.train.model_copy(update={"varlen": False})})
    with gpt_trainer(fixed) as trainer:
        with pytest.raises(ValueError, match=r"changes a per-microbatch mean loss: it needs a loss_fn that returns"):
            trainer.step(packing=UNEVEN)
    planned = fixed.model_copy(update={"pipeline": fixed.pipeline.replaced(policy="planned", arrange="packing")})
    with pytest.raises(
        ValueError, match=r"arrange packing: packing regroups samples between microbatches, which changes"
    ):
        gpt_trainer(planned)


def test_a_packing_must_place_every_sample_once():
    with gpt_trainer(GPT) as trainer:
        with pytest.raises(ValueError, match="place each of the 12 samples of iteration 0 once in"):
            trainer.step(packing=UNEVEN[:3])
        with pytest.raises(ValueError, match="a planned iteration packs by its plan"):
            trainer.step(policy="planned", packing=UNEVEN)


@pytest.mark.parametrize("arrange", list(Arrangement))
def test_planned_packs_as_arranged_and_trains_as_the_fixed_run(arrange: Arrangement):
    with gpt_trainer(GPT) as trainer:
        fixed = [trainer.step().loss for _ in range(3)]
    with gpt_trainer(GPT) as trainer:
        reports = [trainer.step(policy="planned", arrange=arrange) for _ in range(3)]
    assert [r.loss for r in reports] == pytest.approx(fixed, rel=1e-4)  # any packing: the same token-weighted steps
    for report in reports:
        assert (report.packing is not None) is arrange.packs
        if not arrange.orders:
            assert report.order == [0, 1, 2, 3]
    if arrange.packs:
        assert any(
            sorted(map(sorted, r.packing)) != [[3 * m, 3 * m + 1, 3 * m + 2] for m in range(4)] for r in reports
        )  # it moved samples


def test_the_planner_packs_by_predicted_costs_deterministically():
    rows = [[40.0, 3.0, 9.0], [2.0, 60.0, 1.0], [5.0, 7.0, 50.0], [30.0, 4.0, 6.0]]
    features = [sum(row) for row in rows]
    config = PlannerConfig(hints=default_hints(chunks=1), cap=Cap.parse("2x"), seed=3)
    plans = [
        Planner(config=config, stages=2, chunks=1, microbatches=4).plan(iteration=5, features=features, samples=rows)
        for _ in range(2)
    ]
    assert plans[0] == plans[1] and plans[0].packing is not None
    planner = Planner(config=config, stages=2, chunks=1, microbatches=4)
    flat = [x for row in rows for x in row]
    costs = planner.sample_costs(samples=rows, features=features)  # the prior: proportional to the feature
    assert costs == pytest.approx([x * costs[0] / flat[0] for x in flat])
    tried = [packing for packing, _, _ in packings(samples=rows, costs=costs, microbatches=4, blocks=2)]
    assert tried[0] == pack(costs=costs, bins=4) and plans[0].packing in tried  # balanced, or with light ends
    order_only = Planner(config=PlannerConfig(hints=config.hints, cap=config.cap, arrange=Arrangement.ORDER),
                         stages=2, chunks=1, microbatches=4)  # fmt: skip
    assert order_only.plan(iteration=5, features=features, samples=rows).packing is None
    assert PlannerConfig.from_dict(config.to_dict()) == config


def test_with_data_parallelism_each_replica_reads_its_packed_microbatches():
    run = GPT.model_copy(update={"pipeline": GPT.pipeline.replaced(dp=2)})
    # the global batch's 24 samples in 8 microbatches, 4 a replica, samples moved between the replicas
    packing = ((19,), (11, 0), (3, 8, 1, 5), (2, 22, 4, 9, 6), (7,), (23, 12), (15, 20, 13, 17), (14, 10, 16, 21, 18))
    base, base_grads = _captured(lambda: gpt_trainer(run), None)
    packed, grads = _captured(lambda: gpt_trainer(run), packing)
    assert packed.loss == pytest.approx(base.loss, rel=1e-5)
    for got_stage, want_stage in zip(grads, base_grads):
        for got, want in zip(got_stage, want_stage):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_resumed_run_plans_as_its_pipeline_asks(tmp_path):
    def trainer(arrange: str, *, resume: bool, simulations: int = 12):
        train = {"checkpoint_dir": str(tmp_path), "checkpoint_every": 1, "resume": resume}
        pipeline = GPT.pipeline.replaced(policy="planned", arrange=arrange, plan_simulations=simulations)
        return gpt_trainer(GPT.model_copy(update={"pipeline": pipeline, "train": GPT.train.model_copy(update=train)}))

    with trainer("order", resume=False) as first:
        first.fit(1)
        assert first.planner is not None and first.planner.config.simulations == 12
    with trainer("order", resume=True) as same:
        assert same.planner is not None and same.planner.config.arrange is Arrangement.ORDER
    with trainer("order", resume=True, simulations=20) as larger:
        assert larger.planner is None  # it plans afresh, with the budget asked for
        larger.step()
        assert larger.planner is not None and larger.planner.config.simulations == 20
    with trainer("both", resume=True) as other:
        assert other.planner is None  # it plans afresh, packing
        assert other.step().packing is not None
