"""The error a pipeline raises when it cannot go on."""

from __future__ import annotations

from collections.abc import Sequence

from rrfp_ray.errors import ExitCode, RunFailed, exit_code_of


class PipelineError(RunFailed):
    """A pipeline that cannot go on; `culprit`: what failed first, e.g. "stage 1 (pid 4242) died".

    `exit_code`: BAD_INPUT when the stages failed on bad input alone (a checkpoint they refused), else RUN_FAILED."""

    def __init__(self, message: str, *, culprit: str | None = None, exit_code: ExitCode = ExitCode.RUN_FAILED) -> None:
        super().__init__(message)
        self.culprit = culprit
        self.exit_code = exit_code


def joint_exit_code(causes: Sequence[BaseException | None]) -> ExitCode:
    """What the stages' failures (each one's error; None for a stage that died or did not answer) mean together:
    bad input only when every one of them was."""
    codes = {exit_code_of(cause) for cause in causes}
    return ExitCode.BAD_INPUT if codes == {ExitCode.BAD_INPUT} else ExitCode.RUN_FAILED
