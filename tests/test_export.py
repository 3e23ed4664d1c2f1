"""Export: `Trainer.state_dict()` is the unsplit model's, gathered from every stage, chunk and
TP shard with tied weights once; loaded into the unsplit model it gives the pipeline's outputs.
`jobs/export.py` writes the same from a checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from real_models import PaddedTokens, tied_model, token_loss, tuple_model
from toy_vlm import SPLIT_POINTS, Captions, ToyVLM, text_loss

from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer
from rrfp_ray.train.export import load_unsplit

ROOT = Path(__file__).resolve().parent.parent


def _loss(model, loss_fn, data, *, iteration: int) -> float:
    batches = [data.microbatch(iteration=iteration, index=m) for m in range(data.microbatches)]
    with torch.no_grad():
        return sum(float(loss_fn(model(x), y)) for x, y in batches) / len(batches)


CASES = {
    "tuple": ({"model": tuple_model, "loss_fn": token_loss, "data": PaddedTokens(microbatches=4)}, (3, 1)),
    "tied": ({"model": tied_model, "loss_fn": token_loss, "data": PaddedTokens(microbatches=4)}, (2, 2)),
    "split_points": (
        {"model": ToyVLM, "split_points": SPLIT_POINTS, "loss_fn": text_loss, "data": Captions(microbatches=4)},
        (2, 2),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_exported_weights_in_the_unsplit_model_give_the_pipelines_loss(name):
    arguments, (stages, chunks) = CASES[name]
    pipeline = PipelineConfig(stages=stages, chunks=chunks, microbatches=4, policy="bf", timeout_s=30)
    with Trainer(pipeline=pipeline, optimizer=Optim(lr=3e-2, warmup=0), **arguments) as trainer:
        trainer.fit(2)
        state = trainer.state_dict()
        following = trainer.step().loss  # computed with the weights exported above
        model = trainer.workload.layers.model()
    if name == "tied":
        assert "4.out.weight" not in state and "0.wte.weight" in state  # a tied weight appears once
    load_unsplit(model, state)
    assert _loss(model, arguments["loss_fn"], arguments["data"], iteration=2) == pytest.approx(following, rel=1e-5)


def test_a_tp_pipelines_export_is_the_whole_gpt(tmp_path):
    run = RunConfig(
        model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16},
        pipeline={"stages": 2, "microbatches": 2, "policy": "1f1b", "timeout_s": 30, "tp": 2},
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 3, "checkpoint_dir": str(tmp_path / "ckpt")},
    )
    with gpt_trainer(run) as trainer:
        trainer.fit(2)
        trainer.save()
        state = trainer.state_dict()
        following = trainer.step().loss
        model = trainer.workload.layers.model()
        loss_fn, data = trainer.workload.loss_fn, trainer.workload.data
    load_unsplit(model, state)
    assert _loss(model, loss_fn, data, iteration=2) == pytest.approx(following, rel=1e-5)
    out = tmp_path / "model.pt"
    subprocess.run(
        [sys.executable, "jobs/export.py", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], state[k]) for k in state)
