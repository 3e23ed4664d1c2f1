"""Placement on a multi-node cluster (`ray.cluster_utils.Cluster`, in a process of its own; the slow
tier): the T ranks of a stage share a node, and a pipeline the cluster cannot hold is refused up front."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from actors.backend import RayBackend
from actors.capacity import check_capacity
from examples.mlp import Regression, mlp
from rrfp_ray import PipelineConfig, Trainer

ROOT = Path(__file__).resolve().parent.parent

# Two nodes of 3 CPUs for 2 stages x 2 TP ranks: packing the 4 bundles in order would put
# 3 on one node and split stage 1's ranks; a stage's ranks packed together cannot be split.
SCRIPT = """
import json
import ray
from ray.cluster_utils import Cluster
from actors.driver import RayStages
from actors.local_ray import WORKER_ENV
from rrfp_ray.train.config import PipelineConfig

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
nodes = [cluster.add_node(num_cpus=3) for _ in range(2)]
ray.init(address=cluster.address, runtime_env={"env_vars": WORKER_ENV}, log_to_driver=False)
cluster.wait_for_nodes()
fabric = RayStages(pipeline=PipelineConfig(stages=2, microbatches=2, policy="1f1b", tp=2, timeout_s=120), gpus_per_stage=0.0)
fabric.start()
where = ray.get([a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for a in fabric.stages])
print("NODES " + json.dumps(where))
fabric.stop(graceful=True)
ray.shutdown()
cluster.shutdown()
"""


@pytest.mark.slow  # a three-node cluster of its own: `make test-slow`
def test_the_tp_ranks_of_each_stage_share_a_node_on_a_two_node_cluster():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("NODES ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    nodes = json.loads(lines[0].removeprefix("NODES "))  # actor index (stage x 2 + rank) -> node
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3]
    assert nodes[0] != nodes[2]  # 3 CPUs a node: the stages cannot share one


def test_capacity_names_the_demand_and_an_autoscaler_lifts_the_check():
    with pytest.raises(ValueError, match=r"dp x stages x tp = 2 x 4 x 2 = 16 stage actors of \{CPU: 1\} need 16 CPU; "
                       r"the cluster has 8 CPU and no autoscaler is configured"):
        check_capacity(dp=2, stages=4, tp=2, bundle={"CPU": 1}, cluster={"CPU": 8.0}, autoscaler=False)
    check_capacity(dp=2, stages=4, tp=2, bundle={"CPU": 1}, cluster={"CPU": 8.0}, autoscaler=True)
    check_capacity(dp=2, stages=4, tp=2, bundle={"CPU": 1}, cluster={"CPU": 16.0}, autoscaler=False)


def test_a_pipeline_bigger_than_the_cluster_is_refused_before_any_actor_starts(ray_session):
    pipeline = PipelineConfig(stages=2, microbatches=2, policy="1f1b", dp=9)  # 18 actors; the session's Ray has 16 CPUs
    backend = RayBackend()
    with pytest.raises(ValueError, match=r"9 x 2 x 1 = 18 stage actors .* need 18 CPU; the cluster has 16 CPU"):
        Trainer(model=mlp, loss_fn=nn.functional.mse_loss, data=Regression(microbatches=18), pipeline=pipeline, backend=backend)
    assert backend.driver is None
