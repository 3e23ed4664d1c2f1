"""The runtime on Ray: stage actors under one driver, synthetic work over TCP links."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.runtime.worker import PipelineError
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.config import PipelineConfig

P, M = 4, 8
SETTLE_S = 30.0  # longest wait for Ray to end the actors and free their CPUs after a shutdown


def _alive(ray, ids: set[str]) -> set[str]:
    """Those of `ids` whose actors are not dead (the GCS table: list_actors needs the dashboard)."""
    table = ray._private.state.actors()
    return {i for i in ids if table.get(i, {}).get("State") != "DEAD"}


@contextmanager
def _driver(
    ray, *, stages: int = P, chunks: int = 1, t_f: float = 2.0, timeout_s: float = 20.0, tp: int = 1, policy: str = "bf"
):
    """A driver over a synthetic pipeline; on exit it is shut down, its actors are dead and their CPUs free."""
    from actors.driver import PipelineDriver

    cpus = ray.available_resources().get("CPU", 0.0)
    pipeline = PipelineConfig(stages=stages, chunks=chunks, microbatches=M, timeout_s=timeout_s, tp=tp, policy=policy)
    trace = generate(scenario="lognormal", stages=stages, microbatches=M, chunks=chunks, seed=1, t_f=t_f)
    driver = PipelineDriver.remote(pipeline=pipeline, workload=SyntheticWorkload(trace=trace, payload_elems=64))
    ids = {driver._actor_id.hex()}
    try:
        ids |= {actor._actor_id.hex() for actor in ray.get(driver.stage_actors.remote())}
        yield pipeline, driver
        ray.get(driver.shutdown.remote())
    finally:
        ray.kill(driver)
    deadline = time.monotonic() + SETTLE_S
    while (_alive(ray, ids) or ray.available_resources().get("CPU", 0.0) < cpus) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(ray, ids), "actors left alive after shutdown"
    assert ray.available_resources().get("CPU", 0.0) >= cpus, "CPUs still held after shutdown"


@pytest.mark.parametrize(("chunks", "names"), [(1, ("1f1b", "bf", "bfw")), (2, ("interleaved", "bf", "bfw"))])
def test_policies_take_turns_on_one_driver(ray_session, chunks, names):
    ray = ray_session
    with _driver(ray, chunks=chunks) as (pipeline, driver):
        iteration = 0
        for _ in range(2):
            for name in names:
                policy = pipeline.resolved_policy(name)
                report = ray.get(driver.run_iteration.remote(iteration=iteration, policy=policy))
                iteration += 1
                layout = Layout(stages=P, chunks=chunks, microbatches=M, split=policy.split)
                for stage in range(P):
                    ran = [e.action for e in sorted(report.events, key=lambda e: e.start_ms) if e.stage == stage]
                    assert sorted(ran) == sorted(str(a) for a in layout.actions(stage=stage)), (name, stage)
                    if policy.fixed:
                        assert ran == [str(a) for a in policy.order[stage]], (name, stage)


def test_zbv_runs_on_ray_with_the_v_turn_as_a_local_hand_off(ray_session):
    """V placement: stage s holds virtual stages s and 2P-1-s, the loss on stage 0; no link joins stage P-1 to
    itself."""
    ray = ray_session
    with _driver(ray, chunks=2, policy="zbv") as (pipeline, driver):
        layout = pipeline.layout
        assert layout.loss_stage == 0 and all(link.src != link.dst for link in layout.links())
        for iteration, name in enumerate(("zbv", "ready-zbv")):
            policy = pipeline.resolved_policy(name)
            report = ray.get(driver.run_iteration.remote(iteration=iteration, policy=policy))
            for stage in range(P):
                ran = [e.action for e in sorted(report.events, key=lambda e: e.start_ms) if e.stage == stage]
                assert sorted(ran) == sorted(str(a) for a in layout.actions(stage=stage)), (name, stage)
                if policy.fixed:
                    assert ran == [str(a) for a in policy.order[stage]], stage


@pytest.mark.slow  # 8 actors started and one killed: `make test-slow`
def test_eight_stage_actors_start_and_a_killed_one_is_named_within_the_timeout(ray_session):
    ray = ray_session
    with _driver(ray, stages=8, t_f=50.0, timeout_s=10.0) as (pipeline, driver):
        startup = ray.get(driver.startup_seconds.remote())
        print(f"\n8 stage actors (placement, actors, links) up in {startup:.1f} s (goal: under 15 s)")
        stages = ray.get(driver.stage_actors.remote())
        pending = driver.run_iteration.remote(iteration=0, policy=pipeline.resolved_policy("1f1b"))
        time.sleep(0.5)  # mid-iteration: with 8 stages one takes (M + 8 - 1) * 3 t_f = 2.25 s
        ray.kill(stages[2])
        with pytest.raises(PipelineError, match="stage 2 died during iteration 0"):
            ray.get(pending, timeout=2 * pipeline.timeout_s)  # a hang guard: the driver's own bound is timeout_s


@pytest.mark.slow  # a kill on Ray (in-process: a stalled TP rank named, tests/test_faults.py): `make test-slow`
def test_a_killed_tp_rank_is_named_and_its_peer_does_not_hang(ray_session):
    ray = ray_session
    with _driver(ray, stages=2, t_f=50.0, timeout_s=10.0, tp=2) as (pipeline, driver):
        stages = ray.get(driver.stage_actors.remote())
        pending = driver.run_iteration.remote(iteration=0, policy=pipeline.resolved_policy("bf"))
        time.sleep(0.5)  # mid-iteration: one takes about (M + 1) * 3 t_f = 1.35 s
        ray.kill(stages[3])
        started = time.monotonic()
        with pytest.raises(PipelineError, match="stage 1 TP rank 1 died during iteration 0"):
            ray.get(pending, timeout=2 * pipeline.timeout_s)
        assert time.monotonic() - started < pipeline.timeout_s  # its TP peer failed fast: the connection closed
