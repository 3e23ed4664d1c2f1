"""Connecting to Ray: attach to a running cluster, else start an embedded local one."""

from __future__ import annotations

import os
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parent.parent
# Workers find this repository without an install (the stage actors add RAY_PROFILING
# themselves: actors.stage_actor.STAGE_ENV); a short resolver timeout stops torch's TCPStore
# from stalling 5 s on reverse DNS where no resolver answers (seen on sandboxed machines).
WORKER_ENV = {"PYTHONPATH": str(ROOT), "RES_OPTIONS": "timeout:1 attempts:1"}


def init_ray(*, num_cpus: int, log_to_driver: bool = True, log_level: str | None = None) -> bool:
    """Connect this process to Ray; returns True if it started a local Ray (the caller shuts it down).

    Under `ray job submit` (RAY_ADDRESS set) it attaches, and the job's runtime env applies.
    Otherwise it starts a local Ray declaring `num_cpus` logical CPUs, one per stage actor:
    always a new one (`address="local"`), never the cluster a leftover `ray_current_cluster`
    file in Ray's temp dir names (a Ray that died without `ray stop` leaves it behind).
    `log_level` (e.g. "INFO"): the level of the workers' Python logging (the driver and stage actors' messages).
    """
    if ray.is_initialized():
        return False
    logging = {} if log_level is None else {"logging_config": ray.LoggingConfig(log_level=log_level)}
    if attaching():
        ray.init(address=os.environ["RAY_ADDRESS"], **logging)
        return False
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        runtime_env={"env_vars": WORKER_ENV},
        **logging,
    )
    return True


def attaching() -> bool:
    """Whether `init_ray` attaches to a running cluster (RAY_ADDRESS set) rather than start one here."""
    return bool(os.environ.get("RAY_ADDRESS"))


def start_ray(*, num_cpus: int, log_level: str | None = None) -> str:
    """Attach to a running cluster (as under `ray job submit`), else start an embedded local Ray."""
    if init_ray(num_cpus=num_cpus, log_level=log_level):
        return f"embedded local Ray ({num_cpus} logical CPUs)"
    return f"attached to {os.environ.get('RAY_ADDRESS', 'the running Ray')}"
