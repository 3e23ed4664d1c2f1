"""Placement and the link backend on a simulated multi-node cluster (`ray.cluster_utils.Cluster`,
logical GPUs, no autoscaler): the T ranks of a stage share a node, what the cluster can never
hold is refused at once, what is only busy waits until the placement timeout, and each stage
resolves `auto` where it runs. The tests on that cluster are the slow tier (`make test-slow`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray
from torch import nn

from actors.backend import RayBackend
from actors.capacity import CapacityError, Demand, check_capacity
from actors.driver import RayFabric
from actors.local_ray import WORKER_ENV, init_ray
from actors.placement import PlacementError, StagePlacement, place
from actors.stage_actor import StageActor
from examples.mlp import Regression, mlp
from rrfp_ray import PipelineConfig, Trainer
from rrfp_ray.runtime.mesh import Mesh
from rrfp_ray.runtime.transport import LinkTransport

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs and two nodes of 3 CPUs: one with 2 logical GPUs whose workers "see CUDA
    and cupy" (RRFP_FAKE_CUDA=1, tests/fake_cuda.py), one with a `plain` resource to aim at it.
    Gives the session's Ray back after."""
    from ray.cluster_utils import Cluster

    had_ray = ray.is_initialized()
    if had_ray:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=3, num_gpus=2, env_vars={"RRFP_FAKE_CUDA": "1"})
    cluster.add_node(num_cpus=3, resources={"plain": 3})
    ray.init(
        address=cluster.address,
        log_to_driver=False,
        runtime_env={"env_vars": WORKER_ENV, "worker_process_setup_hook": "tests.fake_cuda.pretend_cuda_where_told"},
    )
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    if had_ray:
        init_ray(num_cpus=16, log_to_driver=False)


def _live_groups() -> list:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


@pytest.mark.slow  # a cluster of its own: `make test-slow`
def test_the_tp_ranks_of_each_stage_share_a_node(cluster):
    """2 stages x 2 TP ranks on two nodes of 3 CPUs: packing the 4 bundles in order would put 3 on
    one node and split stage 1's ranks; a stage's ranks packed together cannot be split."""
    pipeline = PipelineConfig(stages=2, microbatches=2, policy="1f1b", tp=2, timeout_s=120, backend="gloo")
    mesh = Mesh(stages=pipeline.stages, tp=pipeline.tp)
    fabric = RayFabric(pipeline=pipeline, placement=StagePlacement(timeout_s=60), mesh=mesh)
    fabric.start()
    try:
        where = ray.get(
            [a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for a in fabric.actors]
        )
    finally:
        fabric.stop(graceful=True)
    assert where[0] == where[1] and where[2] == where[3]  # in mesh order: stage 0's ranks, then stage 1's
    assert where[0] != where[2]  # 3 CPUs a node: the stages cannot share one
    assert not _live_groups()


def test_capacity_names_the_demand_and_an_autoscaler_lifts_the_total_check():
    demand = Demand(bundle={"CPU": 1}, dp=2, stages=4, tp=2)
    nodes = [{"CPU": 4.0}, {"CPU": 4.0}]
    with pytest.raises(
        CapacityError,
        match=r"dp x stages x tp = 2 x 4 x 2 = 16 stage actors of \{CPU: 1\} need 16 CPU; "
        r"the cluster has 8 CPU and no autoscaler is configured",
    ):
        check_capacity(demand=demand, nodes=nodes, grows=False, source="the alive nodes")
    check_capacity(demand=demand, nodes=nodes, grows=True, source="node types")
    check_capacity(demand=demand, nodes=nodes * 2, grows=False, source="the alive nodes")
    with pytest.raises(
        CapacityError, match=r"no node can ever hold a stage's 2 TP ranks \(\{CPU: 2, GPU: 2\}\): node types"
    ):
        check_capacity(
            demand=Demand(bundle={"CPU": 1, "GPU": 1}, tp=2),
            nodes=[{"CPU": 8.0, "GPU": 1.0}],
            grows=True,
            source="node types",
        )
    assert str(Demand(bundle={"CPU": 1, "GPU": 1}, dp=2, stages=4)) == "8 x {CPU: 1, GPU: 1}"
    assert str(Demand(bundle={"CPU": 1}, stages=4, tp=2)) == "4 x (2 x {CPU: 1} on one node)"


def test_a_pipeline_bigger_than_the_local_ray_is_refused_before_any_actor_starts(ray_session):
    pipeline = PipelineConfig(stages=2, microbatches=2, policy="1f1b", dp=9)  # 18 actors; the session's Ray has 16 CPUs
    backend = RayBackend()
    with pytest.raises(CapacityError, match=r"9 x 2 x 1 = 18 stage actors .* need 18 CPU; the cluster has 16 CPU"):
        Trainer(
            model=mlp,
            loss_fn=nn.functional.mse_loss,
            data=Regression(microbatches=18),
            pipeline=pipeline,
            backend=backend,
        )
    assert backend.driver is None


def test_can_place_counts_the_groups_the_running_stages_hold_and_gives_back_what_it_asked_for(ray_session):
    pipeline = PipelineConfig(stages=2, microbatches=2, policy="1f1b")
    trainer = Trainer(
        model=mlp, loss_fn=nn.functional.mse_loss, data=Regression(microbatches=2), pipeline=pipeline,
        backend=RayBackend(),
    )  # fmt: skip
    with trainer:
        held = len(_live_groups())
        assert trainer.backend.can_place(pipeline=pipeline)  # its own: held already
        assert trainer.backend.can_place(pipeline=pipeline.replaced(dp=2))  # 2 groups more: free
        started = time.monotonic()
        assert not trainer.backend.can_place(pipeline=pipeline.replaced(dp=10))  # 18 more than the 16 CPUs: never
        assert time.monotonic() - started < 5  # refused by the capacity check, not by waiting
        assert len(_live_groups()) == held


@pytest.mark.slow  # a cluster of its own: `make test-slow`
def test_train_gpt_names_the_flags_when_no_node_can_ever_hold_a_stage(cluster, monkeypatch, tmp_path, capsys):
    import train_gpt

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)  # attached: its GPUs are the cluster's to have
    tiny = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--seq-len", "16"]
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.main(
            ["--stages", "2", "--gpus-per-stage", "4", "--data", str(ROOT / "README.md"), "--out", str(tmp_path), *tiny]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--gpus-per-stage/--stage-resources: no node can ever hold a stage's bundle {CPU: 1, GPU: 4}" in err


@pytest.mark.slow  # a cluster of its own: `make test-slow`
def test_a_bundle_no_node_can_hold_fails_at_once(cluster):
    started = time.monotonic()
    demand = Demand(bundle={"CPU": 1, "GPU": 4}, stages=2)
    with pytest.raises(CapacityError, match=r"no node can ever hold a stage's bundle \{CPU: 1, GPU: 4\}") as error:
        place(demand=demand, timeout_s=300, labels=["stage 0", "stage 1"])
    assert time.monotonic() - started < 60  # not the placement timeout
    assert '"GPU": 2.0' in str(error.value) and "no autoscaler" in str(error.value)
    assert not _live_groups()


@pytest.mark.slow  # a cluster of its own: `make test-slow`
def test_a_demand_that_fits_but_is_not_free_waits_for_the_timeout(cluster):
    blocker = ray.util.placement_group([{"CPU": 1}] * 6)  # every CPU of the cluster
    ray.get(blocker.ready(), timeout=60)
    try:
        with pytest.raises(
            PlacementError,
            match=r"timed out after 2 s waiting for 2 x \{CPU: 1\}: "
            r"0 placed \(pending: stage 0, stage 1\); see ray status",
        ):
            place(demand=Demand(bundle={"CPU": 1}, stages=2), timeout_s=2, labels=["stage 0", "stage 1"])
    finally:
        ray.util.remove_placement_group(blocker)
    assert not _live_groups()


@pytest.mark.slow  # a cluster of its own: `make test-slow`
def test_auto_is_resolved_by_the_stage_where_its_gpu_is(cluster):
    from actors import collective

    assert collective.resolve_transport(transport=LinkTransport.AUTO) is LinkTransport.TCP  # here: no CUDA
    mesh = Mesh(stages=2)
    on_gpu = StageActor.options(num_cpus=1, num_gpus=1).remote(mesh=mesh, index=0, timeout_s=10, link_timeout_s=10)
    on_cpu = StageActor.options(num_cpus=1, resources={"plain": 1}).remote(
        mesh=mesh, index=1, timeout_s=10, link_timeout_s=10
    )
    try:
        assert ray.get(on_gpu.resolve_transport.remote(transport=LinkTransport.AUTO), timeout=60) is LinkTransport.NCCL
        assert ray.get(on_cpu.resolve_transport.remote(transport=LinkTransport.AUTO), timeout=60) is LinkTransport.TCP
        with pytest.raises(ray.exceptions.RayTaskError, match="stage 1: backend nccl: no CUDA device"):
            ray.get(on_cpu.resolve_transport.remote(transport=LinkTransport.NCCL), timeout=60)
    finally:
        ray.kill(on_gpu)
        ray.kill(on_cpu)


@pytest.mark.slow  # a cluster of its own: `make test-slow`
def test_stages_that_resolve_different_backends_are_named(cluster):
    """4 stage actors on two nodes of 3 CPUs: some land on the node with (fake) CUDA, some on the other."""
    pipeline = PipelineConfig(stages=2, microbatches=2, policy="1f1b", dp=2, timeout_s=60)
    with pytest.raises(Exception, match=r"different link transports \(nccl on .*; tcp on .*\)"):
        Trainer(
            model=mlp,
            loss_fn=nn.functional.mse_loss,
            data=Regression(microbatches=4),
            pipeline=pipeline,
            backend=RayBackend(placement_timeout_s=60),
        )
    assert not _live_groups()
