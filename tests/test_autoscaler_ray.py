"""`ray job submit` of the GPT job to Ray's own autoscaler on one machine (the fake_multinode
provider, tests/fake_autoscaler.py): from zero worker nodes the placement groups' demand makes
the autoscaler add stand-ins of cluster.yaml's GPU node types, the job completes with its
outputs under the head's home, the nodes idle out, and a second job resumes from the first
one's checkpoint on fresh nodes. Slow (a few minutes), run by CI (`make test`)."""

import json
import os
import re
import time
from pathlib import Path

import pytest
from fake_autoscaler import ROOT, STANDIN_RESOURCE, FakeCluster
from ray_tasks import job_tasks

pytestmark = pytest.mark.slow  # `make test-slow`


@pytest.fixture
def fake_cluster():
    cluster = FakeCluster.start(idle_timeout_minutes=1.0, max_workers=2)  # shorter: nodes go while actors start
    yield cluster
    cluster.stop()
    assert cluster.pids() == []  # everything it started is gone, and nothing else was touched


_MARKED_S = 20.0  # Ray marks a finished job's unfinished tasks FAILED 15 s after the job ends


def _submit(cluster: FakeCluster, name: str, *flags: str) -> str:
    """`ray job submit --submission-id <name>-...` of a tiny GPT run whose stages need the
    stand-ins; the job's output.

    `--data` is absolute: the fake nodes share the head's session dir, so a node joining unpacks
    the job's working dir again over the one the entrypoint runs in, and a path relative to the
    entrypoint's (now deleted) cwd is not found (on a real cluster every node has its own copy)."""
    job = [
        "python", "jobs/train_gpt.py", "--stages", "2", "--microbatches", "2",
        "--micro-batch-size", "2", "--seq-len", "16", "--block-size", "16", "--n-layer", "2", "--n-embd", "16",
        "--n-head", "2", "--no-compare", "--policy", "bf", "--val-every", "0", "--scenario", "none",
        "--log-level", "info",
        "--data", str(ROOT / "README.md"), "--stage-resources", json.dumps({STANDIN_RESOURCE: 1}),
        "--placement-timeout", "300", *flags,
    ]  # fmt: skip
    submitted = cluster.ray(
        "job", "submit", "--address", cluster.dashboard_url, "--submission-id", _submission(name),
        "--working-dir", str(ROOT), "--", *job, timeout=600,
    )  # fmt: skip
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0 and "succeeded" in output, output[-4000:]
    return output


def _submission(name: str) -> str:
    return f"rrfp-autoscaled-{name}-{os.getpid()}"


def _failed_tasks(cluster: FakeCluster, name: str) -> list:
    tasks = job_tasks(dashboard_url=cluster.dashboard_url, submission_id=_submission(name), env=cluster.env)
    assert any(n.startswith("PipelineDriver") and n.endswith(".shutdown") for n in tasks["names"]), tasks["names"]
    return tasks["failed"]


def test_a_job_scales_the_cluster_from_zero_and_another_resumes_after_its_nodes_went_away(fake_cluster):
    """The second job's stages run on fresh nodes; the checkpoint the first job's stages wrote on
    theirs (removed since) is read from shared storage (here the machine's own filesystem)."""
    assert fake_cluster.worker_nodes() == (0, 0)
    checkpoints = fake_cluster.home / "shared" / "checkpoints"
    first = _submit(
        fake_cluster, "first", "--iterations", "2", "--checkpoint-every", "1", "--checkpoint-dir", str(checkpoints)
    )
    assert re.search(r"placement ready in [\d.]+ s: 2 x \{CPU: 1, rrfp_standin: 1\}", first)
    out = re.search(r"outputs: (\S+)", first).group(1)
    assert out.startswith(str(fake_cluster.home / "rrfp-runs")), out  # not in the unpacked working dir
    assert json.loads((Path(out) / "summary.json").read_text())["iterations"] == 2
    _, ever = fake_cluster.worker_nodes()
    assert ever >= 1  # the autoscaler added stand-ins for the demand
    fake_cluster.wait_for(
        lambda: fake_cluster.worker_nodes()[0] == 0, what="the worker nodes to idle out", timeout_s=240
    )
    assert _failed_tasks(fake_cluster, "first") == []  # the driver's shutdown included: it ends before its actor does

    second = _submit(fake_cluster, "second", "--iterations", "3", "--checkpoint-dir", str(checkpoints), "--resume")
    assert "resumed from the checkpoint of iteration 2" in second, second[-4000:]
    assert "iter   2" in second and "iter   0" not in second
    assert fake_cluster.worker_nodes()[1] > ever  # fresh nodes held the resumed stages
    time.sleep(_MARKED_S)
    assert _failed_tasks(fake_cluster, "second") == []
