"""The interpreter's switch interval while stages compute.

A thread that wants the interpreter's lock waits up to the switch interval (CPython's default: 5 ms)
before the thread holding it is made to let go. A stage's compute thread takes the lock back after
every torch op, wait and system call, so beside any other busy thread of its process (another stage's,
a link's, the planner's) it can wait that long again and again. Stages compute with
`STAGE_INTERVAL_S`: the stage actors for their whole life, the in-process backend while an iteration
runs (docs/results/runtime_cost.md and docs/results/multimodal.md measure both).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

STAGE_INTERVAL_S = 2e-4

_lock = threading.Lock()
_holders = 0
_before = 0.0


@contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """The process's switch interval at `seconds` (None: as it is) while the block runs, and after it the one
    the process had before. Holds may nest and overlap across threads: the first sets the interval, the last
    restores it."""
    global _holders, _before
    if seconds is None:
        yield
        return
    if not seconds > 0:
        raise ValueError(f"a switch interval must be > 0 s, got {seconds!r}")
    with _lock:
        if _holders == 0:
            _before = sys.getswitchinterval()
            sys.setswitchinterval(seconds)
            log.debug("switch interval %g ms (was %g ms)", 1e3 * seconds, 1e3 * _before)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                sys.setswitchinterval(_before)
