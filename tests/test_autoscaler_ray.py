"""`ray job submit` of the GPT job to Ray's own autoscaler on one machine (the fake_multinode
provider, tests/fake_autoscaler.py): from zero worker nodes the placement group's demand makes
the autoscaler add stand-ins of cluster.yaml's GPU node types, the job completes with its
outputs under the head's home, and the nodes idle out. Slow (about a minute or two), run by CI."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_autoscaler import ROOT, STANDIN_RESOURCE, FakeCluster

pytestmark = pytest.mark.slow  # `make test-slow`


@pytest.fixture
def fake_cluster():
    cluster = FakeCluster.start(idle_timeout_minutes=1.0, max_workers=2)  # shorter: nodes go while actors start
    yield cluster
    cluster.stop()
    assert cluster.pids() == []  # everything it started is gone, and nothing else was touched


def test_a_submitted_job_scales_the_cluster_up_from_zero_and_back(fake_cluster):
    assert fake_cluster.worker_nodes() == (0, 0)
    job = [
        "python", "jobs/train_gpt.py", "--stages", "2", "--iterations", "2", "--microbatches", "2",
        "--micro-batch-size", "2", "--seq-len", "16", "--block-size", "16", "--n-layer", "2", "--n-embd", "16",
        "--n-head", "2", "--no-compare", "--val-every", "0", "--scenario", "none", "--log-level", "info",
        "--data", "README.md", "--stage-resources", json.dumps({STANDIN_RESOURCE: 1}), "--placement-timeout", "300",
    ]  # fmt: skip
    submitted = fake_cluster.ray(
        "job", "submit", "--address", fake_cluster.dashboard_url, "--working-dir", str(ROOT), "--", *job,
        timeout=600,
    )  # fmt: skip
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, output[-4000:]
    assert "succeeded" in output, output[-4000:]
    assert "placement group ready: 2 x {CPU: 1, rrfp_standin: 1}" in output
    out = re.search(r"outputs: (\S+)", output).group(1)
    assert out.startswith(str(fake_cluster.home / "rrfp-runs")), out  # not in the unpacked working dir
    summary = json.loads((Path(out) / "summary.json").read_text())
    assert summary["iterations"] == 2
    _, ever = fake_cluster.worker_nodes()
    assert ever >= 1  # the autoscaler added stand-ins for the demand
    fake_cluster.wait_for(lambda: fake_cluster.worker_nodes()[0] == 0, what="the worker nodes to idle out", timeout_s=240)
