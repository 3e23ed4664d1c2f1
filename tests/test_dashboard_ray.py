"""Stage actors put one span per executed action on the Ray timeline (RAY_PROFILING=1)."""

from __future__ import annotations

import time

from actors.driver import PipelineDriver
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.config import PipelineConfig


def test_every_action_is_a_span_on_the_ray_timeline(ray_session):
    ray = ray_session
    config = PipelineConfig(stages=2, microbatches=4, timeout_s=30)
    trace = generate(scenario="none", stages=2, microbatches=4, chunks=1, seed=0, t_f=1.0)
    driver = PipelineDriver.remote(pipeline=config, workload=SyntheticWorkload(trace=trace, payload_elems=16))
    started_us = time.time() * 1e6  # other tests' spans are older
    try:
        report = ray.get(driver.run_iteration.remote(iteration=0, policy=config.resolved_policy("bfw")))
        expected = sorted(e.action for e in report.events)
        deadline = time.monotonic() + 30
        while True:  # the actors flush profile events in batches, so poll (before they are killed)
            spans = [e for e in ray.timeline() if str(e.get("cat", "")).startswith("stage ") and e["ts"] >= started_us]
            names = sorted(e["name"] for e in spans if e["args"].get("iteration") == "0" and e["name"] in expected)
            if names == expected or time.monotonic() > deadline:
                break
            time.sleep(1)
        ray.get(driver.shutdown.remote())
    finally:
        ray.kill(driver)
    assert names == expected
