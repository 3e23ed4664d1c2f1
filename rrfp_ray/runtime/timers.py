"""Timed waits that end on time.

Linux lets each thread's timed waits (a sleep, a poll's deadline) end late by up to that thread's
timer slack, 50 us by default: on a stage whose ops last a few milliseconds, that is a percent or
more of every op. The runtime's threads set theirs to the least, where the OS has one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

log = logging.getLogger(__name__)

_PR_SET_TIMERSLACK = 29


def tighten_timer_slack() -> None:
    """The calling thread's timer slack at 1 ns (Linux; elsewhere, or where refused, it stays)."""
    if not sys.platform.startswith("linux"):
        return
    if _libc().prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0) != 0:
        log.debug("timer slack unchanged: errno %d", ctypes.get_errno())


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
