"""The error a pipeline raises when it cannot go on."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """A pipeline that cannot go on; `culprit`: what failed first, e.g. "stage 1 (pid 4242) died"."""

    def __init__(self, message: str, *, culprit: str | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit
