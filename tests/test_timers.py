import ctypes
import sys
import threading

import pytest

from rrfp_ray.runtime.timers import tighten_timer_slack

_PR_GET_TIMERSLACK = 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux thread attribute")
def test_a_thread_that_tightens_its_timer_slack_gets_the_least_and_leaves_the_others_alone() -> None:
    libc = ctypes.CDLL(None)
    before = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    seen: list[int] = []

    def tightened() -> None:
        tighten_timer_slack()
        seen.append(libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0))

    thread = threading.Thread(target=tightened)
    thread.start()
    thread.join(timeout=10)
    assert seen == [1]
    assert libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0) == before
