"""Training losses are bit-identical to those of a fixed earlier revision (`BASE`), both run here.

A few tiny trainings in the in-process fabric (an MLP over 3 stages; over 2 stages of 2 chunks in 2
replicas; the GPT with tied embedding and head under TP 2 and under DP 2) run twice in fresh
subprocesses: once on this checkout's code, once on `BASE`'s, exported with `git archive` into a
temporary directory. Their losses must be equal to the last bit (compared as `float.hex`). Nothing is
recorded: both sides run on this machine, now, so no float measured on one CPU meets another's.

When `BASE` is not in this clone (a shallow clone, or a copy without `.git`), the test skips and says
so: there is nothing to run the comparison against, and a recorded list of losses would compare this
CPU's floats with another's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = "74cf89b1e43e3f9a290ee8c4036909f11b75358b"
ITERATIONS = 3

# Runs in the tree given as argv[1] (its code first on sys.path) and prints every configuration's losses.
TRAIN = """
import json, sys
from pathlib import Path

import torch
from torch import nn

import rrfp_ray
from rrfp_ray import InMemoryData, PipelineConfig, Trainer
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer

tree, iterations = Path(sys.argv[1]).resolve(), int(sys.argv[2])
assert Path(rrfp_ray.__file__).resolve().is_relative_to(tree), rrfp_ray.__file__


def mlp(pipeline):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    batches = [(x[i : i + 8], x[i : i + 8].pow(2).sum(dim=1, keepdim=True)) for i in range(0, 64, 8)]
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 1)]
    return Trainer(
        model=nn.Sequential(*layers),
        loss_fn=nn.functional.mse_loss,
        data=InMemoryData(batches=batches, microbatches=pipeline.global_microbatches),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        pipeline=pipeline,
    )


def gpt(**pipeline):
    return gpt_trainer(
        RunConfig(
            model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16, "tie_embeddings": True},
            pipeline={"stages": 3, "microbatches": 4, "policy": "bfw", "timeout_s": 60, **pipeline},
            train={"micro_batch_size": 2, "seq_len": 16, "iterations": iterations},
        )
    )


runs = {
    "mlp P=3 bfw": lambda: mlp(PipelineConfig(stages=3, microbatches=4, policy="bfw", timeout_s=60)),
    "mlp P=2 v=2 dp=2 bf": lambda: mlp(
        PipelineConfig(stages=2, chunks=2, dp=2, microbatches=4, policy="bf", timeout_s=60)
    ),
    "tied gpt tp=2": lambda: gpt(tp=2),
    "tied gpt dp=2": lambda: gpt(dp=2),
}
losses = {}
for name, make in runs.items():
    with make() as trainer:
        losses[name] = [float(report.loss).hex() for report in trainer.fit(iterations)]
print(json.dumps(losses))
"""


def _losses(tree: Path) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", TRAIN, str(tree), str(ITERATIONS)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"training in {tree} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _export(tmp_path: Path) -> Path:
    """`BASE`'s tree in `tmp_path`; skips when this clone does not hold it."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("no git repository here: the earlier revision's code is not available to compare with")
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{BASE}^{{commit}}"], cwd=ROOT, capture_output=True, check=False, timeout=30
    )
    if known.returncode != 0:
        pytest.skip(f"revision {BASE[:9]} is not in this clone (a shallow clone?): nothing to compare with")
    archive = tmp_path / "base.tar"
    subprocess.run(["git", "archive", "-o", str(archive), BASE], cwd=ROOT, check=True, timeout=60)
    tree = tmp_path / "base"
    with tarfile.open(archive) as tar:  # extraction filters came with Python 3.11.4
        tar.extractall(tree, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return tree


def test_training_losses_are_bit_identical_to_the_earlier_revisions(tmp_path: Path) -> None:
    base = _losses(_export(tmp_path))
    now = _losses(ROOT)
    assert now == base
    assert all(len(losses) == ITERATIONS for losses in now.values()) and len(now) == 4
