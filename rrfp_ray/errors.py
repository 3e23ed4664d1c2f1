"""What an error of this project's means to the job it reaches: bad input or configuration
(exit 2: fix the command, its flags or its files) or a run that failed (exit 1: it could not
go on). `rrfp_ray.job.run_job` ends a job on either with one line and that exit status.

Every layer's errors derive from these, so this module imports nothing of the project."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    RUN_FAILED = 1
    BAD_INPUT = 2


class RrfpError(Exception):
    """An error of this project's; `exit_code` says which kind it is."""

    exit_code: ExitCode = ExitCode.RUN_FAILED


class BadInput(RrfpError, ValueError):
    """Bad input or configuration: a flag, a file, a checkpoint that cannot be used, a cluster too small."""

    exit_code = ExitCode.BAD_INPUT


class RunFailed(RrfpError, RuntimeError):
    """A run that could not go on: a stage lost past its restarts, placement that timed out."""

    exit_code = ExitCode.RUN_FAILED


class PlacementError(RunFailed):
    """The cluster did not hold the stages within the wait: placement timed out (a job that
    resizes takes a smaller shape on it, `rrfp_ray.train.resize`)."""


def exit_code_of(error: BaseException | None) -> ExitCode:
    """`error`'s kind; anything not of ours (None: a stage that died or did not answer) is a failed run."""
    return error.exit_code if isinstance(error, RrfpError) else ExitCode.RUN_FAILED
