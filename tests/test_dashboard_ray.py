"""Stage actors put one span per executed action on the Ray timeline (RAY_PROFILING=1), carrying
its policy and iteration as numbers; the driver and its stages carry one run tag in their names."""

from __future__ import annotations

import time

import pytest

from actors.backend import RayBackend
from actors.dashboard import span_args
from actors.driver import PipelineDriver
from actors.names import replacement
from rrfp_ray.runtime.errors import PipelineError
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.schedule.actions import parse_action
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.config import PipelineConfig


def test_a_span_carries_its_policy_and_numbers_as_numbers():
    action = parse_action("2F3", stages=2)
    args = span_args(action=action, policy="bf", iteration=7)
    assert args == {
        "name": "2F3",
        "policy": "bf",
        "iteration": 7,
        "stage": action.stage,
        "virtual_stage": 2,
        "microbatch": 3,
        "cname": "thread_state_running",
    }
    assert all(type(args[key]) is int for key in ("iteration", "stage", "virtual_stage", "microbatch"))


def test_replacement_actors_keep_the_run_tag_and_count_on():
    assert replacement("01000000-ab12", mark="r", count=0) == "01000000-ab12"
    assert replacement("01000000-ab12", mark="r", count=2) == "01000000-ab12-r2"
    assert replacement("01000000-ab12", mark="d", count=1) == "01000000-ab12-d1"


def test_every_action_is_a_span_on_the_ray_timeline_naming_its_policy_and_iteration(ray_session):
    ray = ray_session
    config = PipelineConfig(stages=2, microbatches=4, timeout_s=30)
    trace = generate(scenario="none", stages=2, microbatches=4, chunks=1, seed=0, t_f=1.0)
    driver = PipelineDriver.remote(pipeline=config, workload=SyntheticWorkload(trace=trace, payload_elems=16))
    started_us = time.time() * 1e6  # other tests' spans are older
    expected, found = {}, {}
    try:
        for policy in ("bfw", "1f1b"):  # both at iteration 0, as two runs of one job number theirs
            report = ray.get(driver.run_iteration.remote(iteration=0, policy=config.resolved_policy(policy)))
            expected[policy] = sorted(e.action for e in report.events)
        deadline = time.monotonic() + 30
        while True:  # the actors flush profile events in batches, so poll (before they are killed)
            spans = [e for e in ray.timeline() if str(e.get("cat", "")).startswith("stage ") and e["ts"] >= started_us]
            found = {
                policy: sorted(
                    e["name"] for e in spans if e["args"].get("policy") == policy and e["args"].get("iteration") == 0
                )
                for policy in expected
            }
            if found == expected or time.monotonic() > deadline:
                break
            time.sleep(1)
        ray.get(driver.shutdown.remote())
    finally:
        ray.kill(driver)
    assert found == expected


def _our_names(ray) -> set[str]:
    return {name for name in ray.util.list_named_actors() if name.startswith("rrfp-")}


def _start(*, stages: int) -> RayBackend:
    config = PipelineConfig(stages=stages, microbatches=4, timeout_s=30)
    trace = generate(scenario="none", stages=stages, microbatches=4, chunks=1, seed=0, t_f=1.0)
    backend = RayBackend()
    backend.start(pipeline=config, workload=SyntheticWorkload(trace=trace, payload_elems=16))
    return backend


def _run_of(backend: RayBackend) -> str:
    return backend._name.removeprefix("rrfp-driver-")


def test_the_driver_and_its_stages_carry_one_run_tag(ray_session):
    backend = _start(stages=2)
    try:
        run = _run_of(backend)
        job, tag = run.rsplit("-", 1)
        assert job == ray_session.get_runtime_context().get_job_id() and len(tag) == 4
        assert {f"rrfp-driver-{run}", f"rrfp-stage-0-{run}", f"rrfp-stage-1-{run}"} <= _our_names(ray_session)
    finally:
        backend.close()


@pytest.mark.slow  # three pipelines in turn: `make test-slow`
def test_rebuilt_stages_and_a_new_driver_keep_the_run_tag(ray_session):
    ray = ray_session
    backend = _start(stages=2)
    try:
        run = _run_of(backend)
        backend.restart()  # fresh stages under the same driver
        assert {f"rrfp-driver-{run}", f"rrfp-stage-0-{run}-r1", f"rrfp-stage-1-{run}-r1"} <= _our_names(ray)
        ray.kill(backend.driver)
        with pytest.raises(PipelineError, match="driver actor"):
            backend.set_workload(workload=backend._workload)
        backend.restart()  # a new driver, with stages of its own
        assert backend._name == f"rrfp-driver-{run}-d1"
        assert {f"rrfp-stage-0-{run}-d1", f"rrfp-stage-1-{run}-d1"} <= _our_names(ray)
    finally:
        backend.close()
