"""What the Ray dashboard calls our actors: `rrfp-driver-<run>` and
`rrfp-stage-<s>[-tp<t>][-dp<d>]-<run>`.

`<run>` is `<job>-<tag>`, the job's id and a short random tag, one for the driver and its
stages, so that two jobs (or two Trainers of one job) on one cluster never ask for the same
name. Actors that replace others keep it and add a count, since the ones they replace may
not have released their names yet: stages rebuilt the n-th time `-r<n>`, the n-th driver
started after its predecessor died `-d<n>` (and its stages with it). Look actors up by
prefix (`rrfp-stage-2-`).
"""

from __future__ import annotations

import uuid

import ray


def run_tag() -> str:
    """A fresh `<job id>-<4 hex digits>` for one pipeline's actors."""
    return f"{ray.get_runtime_context().get_job_id()}-{uuid.uuid4().hex[:4]}"


def driver_name(*, run: str) -> str:
    return f"rrfp-driver-{run}"


def stage_name(*, run: str, stage: int, tp_rank: int | None = None, dp_rank: int | None = None) -> str:
    """`tp_rank` / `dp_rank`: None where that kind of parallelism is off (size 1)."""
    tp = "" if tp_rank is None else f"-tp{tp_rank}"
    dp = "" if dp_rank is None else f"-dp{dp_rank}"
    return f"rrfp-stage-{stage}{tp}{dp}-{run}"


def replacement(run: str, *, mark: str, count: int) -> str:
    """The run tag of actors that replace a run's first ones for the `count`-th time (0: the first ones):
    `<run>-<mark><count>`; `mark` is "r" for rebuilt stages, "d" for a new driver."""
    return run if count == 0 else f"{run}-{mark}{count}"
