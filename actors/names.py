"""What the Ray dashboard calls our actors: `rrfp-driver-<run>` and
`rrfp-stage-<s>[-tp<t>][-dp<d>]-<run>`.

`<run>` is the job's id and a short random tag, so that two jobs on one cluster, or
two pipelines (a restart) in one job, never ask for the same name; look actors up by
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
