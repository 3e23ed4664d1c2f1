"""How the benchmark jobs show their library's log: the `benchmarks` loggers' progress lines
(INFO) on stdout and their warnings on stderr, each as the bare message."""

from __future__ import annotations

import logging
import sys


class _Console(logging.StreamHandler):
    """A handler writing to whatever sys.stdout or sys.stderr is at the time of each record."""

    def __init__(self, *, stream_name: str) -> None:
        self.stream_name = stream_name
        super().__init__()

    @property
    def stream(self):  # logging.StreamHandler's attribute
        return getattr(sys, self.stream_name)

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler.__init__ sets it; always the current one
        pass


def show_progress(*, name: str = "benchmarks") -> None:
    """Send logger `name` and its children to the console, not to the root logger; once (again is a no-op)."""
    logger = logging.getLogger(name)
    if any(isinstance(handler, _Console) for handler in logger.handlers):
        return
    info = _Console(stream_name="stdout")
    info.addFilter(lambda record: record.levelno < logging.WARNING)
    warnings = _Console(stream_name="stderr")
    warnings.setLevel(logging.WARNING)
    for handler in (info, warnings):
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
