"""The one wait on a fabric's pending calls: every result within a deadline, or one error that
names each stage that failed or did not answer, with the culprit first.

After the first failure the others that follow within a grace period are reported too, stages
whose process died first: a dead stage also breaks its neighbours' links, and it is the cause.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from rrfp_ray.runtime.errors import PipelineError, joint_exit_code

P = TypeVar("P")  # a pending call: a Future in-process, an ObjectRef on Ray

SLACK_S = 5.0  # how much longer than a stage's own timeout the fabric waits for its answer
GRACE_S = 1.0  # how long to wait for the other stages' errors once one has failed


class Outcome(NamedTuple):
    """How a finished call failed."""

    died: bool  # the stage's process ended (not only its call)
    error: str
    process: str = ""  # names the dead stage's process, e.g. " (pid 4242)"
    cause: BaseException | None = None  # the stage's own error (None: it died), which sets the exit code


def wait_named(
    pending: Sequence[P],
    *,
    labels: Sequence[str],
    what: str,
    timeout_s: float,
    wait_some: Callable[[list[P], float], Sequence[P]],
    outcome: Callable[[P], Outcome | None],
) -> None:
    """Return once every call in `pending` has succeeded; else raise a PipelineError.

    `wait_some(left, timeout)`: the calls of `left` that finished within `timeout` s (none: timed out);
    `outcome(call)`: how a finished call failed (None: it succeeded)."""
    owners = dict(zip(pending, labels))
    deadline = time.monotonic() + timeout_s + SLACK_S
    left = list(pending)
    failures: list[tuple[bool, str, str]] = []  # (not died, message, culprit): dead stages sort first
    causes: list[BaseException | None] = []
    while left:
        done = set(wait_some(left, max(0.0, deadline - time.monotonic())))
        if not done:
            break
        for call in [c for c in left if c in done]:
            failed = outcome(call)
            if failed is not None:
                verb = "died" if failed.died else "failed"
                culprit = f"{owners[call]}{failed.process} {verb}"
                failures.append((not failed.died, f"{owners[call]} {verb} during {what}: {failed.error}", culprit))
                causes.append(failed.cause)
        left = [c for c in left if c not in done]
        if failures:
            deadline = min(deadline, time.monotonic() + GRACE_S)
    if left:  # a stalled stage is named beside the errors its neighbours ran into
        waited = f"{timeout_s:g} s" if not failures else f"{GRACE_S:g} s of the first failure"
        silent = ", ".join(owners[c] for c in left)
        failures.append((True, f"{what}: no answer within {waited} from {silent}", f"{silent} stalled"))
        causes.append(None)
    if failures:
        failures.sort(key=lambda f: f[0])
        raise PipelineError(
            "\n".join(message for _, message, _ in failures),
            culprit=failures[0][2],
            exit_code=joint_exit_code(causes),
        )
