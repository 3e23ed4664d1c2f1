"""How every job script ends on an error of this project's: one line on stderr naming the
program and what is wrong, no traceback, and the error's exit status (`rrfp_ray.errors`:
2 for bad input or configuration, 1 for a run that failed). With `--log-level debug` the
traceback follows. Imports nothing heavy: a job's `--help` stays fast."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

from rrfp_ray.errors import RrfpError

logger = logging.getLogger(__name__)  # under "rrfp_ray": at debug when the job's --log-level is


def run_job(main: Callable[[], object], *, program: str | None = None) -> None:
    """Run a job's `main`; an RrfpError out of it ends the process as above (any other error is a bug: its
    traceback)."""
    try:
        main()
    except RrfpError as error:
        name = program or Path(sys.argv[0]).name
        logger.debug("%s: the traceback of the error below", name, exc_info=error)
        print(f"{name}: error: {error}", file=sys.stderr)
        raise SystemExit(int(error.exit_code)) from None
