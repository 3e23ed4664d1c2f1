"""A job resizes on Ray's own autoscaler (the fake_multinode provider, tests/fake_autoscaler.py):
the GPT trains with D 2 replicas of one stage on two one-GPU stand-in nodes; the node cap drops
to one, so the autoscaler terminates a node (as a cloud reclaiming it would) and cannot replace
it: the job shrinks to D 1 (M 4, the same D x M) from its last checkpoint and goes on; the cap
rises again, and at a later checkpoint the job grows back to D 2. Its weights are then those of
a local run that took the same shapes over the same iterations, resuming from its own
checkpoints by hand. Slow (a few minutes), run by CI (`make test-slow`)."""

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from fake_autoscaler import ROOT, STANDIN_RESOURCE, FakeCluster

from actors.train_gpt import parse
from rrfp_ray.recipes.gpt_workload import gpt_trainer

pytestmark = pytest.mark.slow

_RESIZE_AFTER_S = 20
_MODEL = [
    "--stages", "1", "--micro-batch-size", "2", "--seq-len", "16", "--block-size", "16", "--n-layer", "2",
    "--n-embd", "16", "--n-head", "2", "--val-every", "0", "--scenario", "none", "--data", str(ROOT / "README.md"),
    "--policy", "bf", "--checkpoint-every", "1", "--iterations", "100000",  # the lr schedule spans the iterations
]  # fmt: skip
_RESIZED = r"resized to P=1 T=1 D={dp} v=1 M={m} split \S+ at iteration (\d+)"


def _shape(dp: int) -> list[str]:
    return ["--dp", str(dp), "--microbatches", str(4 // dp)]


@pytest.fixture
def fake_cluster():
    cluster = FakeCluster.start(idle_timeout_minutes=1.0, max_workers=2, node_types=("gpu_1x",))
    yield cluster
    cluster.stop()
    assert cluster.pids() == []


def test_a_job_shrinks_when_a_node_goes_and_grows_back_when_the_cluster_can_hold_it(fake_cluster, tmp_path):
    checkpoints = fake_cluster.home / "shared" / "checkpoints"
    submission = f"rrfp-resize-{os.getpid()}"
    job = [
        "python", "jobs/train_gpt.py", *_MODEL, *_shape(2), "--no-compare", "--no-dp-check",
        "--checkpoint-dir", str(checkpoints), "--max-restarts", "3", "--resize-after", str(_RESIZE_AFTER_S),
        "--stage-resources", json.dumps({STANDIN_RESOURCE: 1}), "--placement-timeout", "300", "--log-level", "info",
    ]  # fmt: skip
    address = ("--address", fake_cluster.dashboard_url)
    submitted = fake_cluster.ray(
        "job", "submit", *address, "--submission-id", submission, "--no-wait", "--working-dir", str(ROOT), "--", *job,
        timeout=300,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    started = time.monotonic()

    def logs() -> str:
        return fake_cluster.ray("job", "logs", *address, submission).stdout

    def seen(pattern: str) -> re.Match | None:
        return re.search(pattern, logs())

    try:
        fake_cluster.wait_for(lambda: seen(r"iter +3 "), what="iteration 3 at D 2", timeout_s=400)
        assert fake_cluster.worker_nodes()[0] == 2
        fake_cluster.set_max_workers(1)
        fake_cluster.wait_for(lambda: seen(_RESIZED.format(dp=1, m=4)), what="the shrink to D 1", timeout_s=300)
        shrunk = int(seen(_RESIZED.format(dp=1, m=4)).group(1))
        fake_cluster.wait_for(
            lambda: seen(rf"iter +{shrunk + 1} .*at P=1 T=1 D=1"), what="an iteration at D 1", timeout_s=120
        )
        fake_cluster.set_max_workers(2)
        fake_cluster.wait_for(lambda: seen(_RESIZED.format(dp=2, m=2)), what="the growth back to D 2", timeout_s=300)
        grown = int(seen(_RESIZED.format(dp=2, m=2)).group(1))
        fake_cluster.wait_for(lambda: seen(rf"iter +{grown + 2} "), what="iterations at D 2 again", timeout_s=120)
    finally:
        fake_cluster.ray("job", "stop", *address, submission, timeout=120)
        print(f"resize job ran {time.monotonic() - started:.0f} s:\n{logs()[-6000:]}")
    output = logs()
    assert re.search(r"resizing: the cluster did not hold P=1 T=1 D=2 v=1 M=2 split \S+ within 20 s", output)
    assert re.search(r"resizing: the cluster holds P=1 T=1 D=2 v=1 M=2 split \S+ again", output)
    assert not re.search(rf"iter +{grown + 1} .*at P=", output)  # grown back: no shape named
    last = max(int(m.group(1)) for p in checkpoints.iterdir() if (m := re.match(r"manifest-(\d+)\.json$", p.name)))
    assert shrunk < grown < last

    # the same shapes over the same iterations, by hand: each part resumes from the last one's checkpoint
    reference = tmp_path / "reference"
    for dp, resume, until in ((2, False, shrunk), (1, True, grown), (2, True, last)):
        with _local(*_shape(dp), checkpoints=reference, resume=resume) as trainer:
            trainer.fit(until - trainer.iteration)
    resized, by_hand = (_weights(directory) for directory in (checkpoints, reference))
    assert resized.keys() == by_hand.keys()
    # Ray's all-reduce and the local one round differently, and Adam grows that on weights whose gradients
    # are nearly zero (a key bias, a rarely seen byte's embedding), so a few weights may differ by more than
    # rounding: the weights are compared as a whole. One iteration more moves them 5.7e-3 of their norm.
    names = sorted(resized)
    moved = torch.cat([(resized[n] - by_hand[n]).flatten() for n in names]).norm()
    norm = torch.cat([by_hand[n].flatten() for n in names]).norm()
    print(f"resized against by hand: {moved / norm:.2e} of the weights' norm")
    assert moved / norm < 5e-4


def _local(*shape: str, checkpoints: Path, resume: bool):
    """A local Trainer of the job's GPT at `shape`."""
    _, run = parse([*_MODEL, *shape, "--no-compare", "--checkpoint-dir", str(checkpoints)]
                   + (["--resume"] if resume else []))  # fmt: skip
    return gpt_trainer(run)


def _weights(checkpoints: Path) -> dict[str, torch.Tensor]:
    """The model's weights in the newest checkpoint of `checkpoints` (read at D 1: every replica holds them)."""
    with _local(*_shape(1), checkpoints=checkpoints, resume=True) as trainer:
        return trainer.state_dict()
