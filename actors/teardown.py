"""Ending actors so that Ray records every call they answered as finished.

An actor that is killed, or whose placement group is removed, before it has flushed its
task events (Ray sends them about every second) takes them along: Ray then counts the calls
it had answered as FAILED (WORKER_DIED) once the job ends. So each actor is asked to exit
after its queued calls (`__ray_terminate__`, or its last handle dropped) and its death is
awaited before anything else is removed; only an actor that does not exit in time is killed.
Even a graceful exit can lose its last events: a second after a worker's death, Ray's
dashboard fails every call of it whose end it has not heard of, and on a loaded machine the
events an exiting worker flushes can arrive later. So an actor is let live through two of
those reports after its last answered call before it is asked to exit (`let_report`).
"""

from __future__ import annotations

import logging
import time

import ray
from ray._private import state  # the GCS's view of an actor: the only way to see it has exited without a dashboard

logger = logging.getLogger(__name__)

REPORTED_S = 2.0  # two of Ray's task-event reports, one a second (RAY_task_events_report_interval_ms)


def let_report() -> None:
    """Wait until the calls an actor has answered are reported to Ray, before it is asked to exit."""
    time.sleep(REPORTED_S)


def end_actors(actors: list[ray.actor.ActorHandle], *, timeout_s: float) -> None:
    """Let `actors` exit on their own, wait until Ray holds them dead, kill what is left after `timeout_s`."""
    let_report()
    exits = [actor.__ray_terminate__.remote() for actor in actors]
    ray.wait(exits, num_returns=len(exits), timeout=timeout_s)
    alive = await_exit([actor._actor_id.hex() for actor in actors], timeout_s=timeout_s)
    for actor in actors:
        if actor._actor_id.hex() in alive:
            logger.warning("actor %s did not exit within %g s; killing it", actor._actor_id.hex(), timeout_s)
            ray.kill(actor)


def await_exit(actor_ids: list[str], *, timeout_s: float) -> list[str]:
    """Wait until Ray holds these actors dead; returns those still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    alive = list(actor_ids)
    while alive:
        alive = [actor for actor in alive if state.actors(actor_id=actor).get("State") != "DEAD"]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return alive
