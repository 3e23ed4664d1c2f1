"""The one wait on a fabric's calls: dead stages first, a grace period after the first failure, a culprit."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

import pytest

from rrfp_ray.runtime.errors import PipelineError
from rrfp_ray.runtime.waits import GRACE_S, Outcome, wait_named


def _wait(pending: list[Future], *, died: set[int] = frozenset(), timeout_s: float = 0.5) -> None:
    index = {id(f): i for i, f in enumerate(pending)}

    def outcome(future: Future) -> Outcome | None:
        error = future.exception()
        if error is None:
            return None
        return Outcome(
            died=index[id(future)] in died, error=str(error), process=" (pid 7)" * (index[id(future)] in died)
        )

    wait_named(
        pending,
        labels=[f"stage {i}" for i in range(len(pending))],
        what="iteration 3",
        timeout_s=timeout_s,
        wait_some=lambda left, timeout: wait_futures(left, timeout=timeout, return_when=FIRST_COMPLETED).done,
        outcome=outcome,
    )


def _failed(message: str) -> Future:
    future: Future = Future()
    future.set_exception(RuntimeError(message))
    return future


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def test_every_call_succeeding_returns():
    _wait([_done(), _done()])


def test_a_dead_stage_is_the_culprit_before_the_errors_it_caused():
    with pytest.raises(PipelineError) as failed:
        _wait([_failed("link 0->1 broke"), _failed("killed")], died={1})
    lines = str(failed.value).splitlines()
    assert lines == ["stage 1 died during iteration 3: killed", "stage 0 failed during iteration 3: link 0->1 broke"]
    assert failed.value.culprit == "stage 1 (pid 7) died"


def test_a_silent_stage_is_named_within_the_grace_period_after_a_failure():
    started = time.monotonic()
    with pytest.raises(PipelineError) as failed:
        _wait([_failed("timed out"), Future()], timeout_s=60.0)
    assert time.monotonic() - started < 60.0  # the grace period, not the whole timeout
    assert f"iteration 3: no answer within {GRACE_S:g} s of the first failure from stage 1" in str(failed.value)
    assert failed.value.culprit == "stage 0 failed"


def test_no_answer_at_all_names_the_stalled_stages_and_the_timeout():
    with pytest.raises(PipelineError, match=r"no answer within 0.1 s from stage 1") as failed:
        _wait([_done(), Future()], timeout_s=0.1)
    assert failed.value.culprit == "stage 1 stalled"
