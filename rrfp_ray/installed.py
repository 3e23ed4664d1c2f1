"""Whether this Python holds the project's core packages: a job run by another Python (say
`ray job submit -- python ...` on a head started outside the virtualenv) says so at once,
not with a ModuleNotFoundError from deep inside an import. Imports nothing outside the
standard library."""

from __future__ import annotations

import importlib.util
import sys

CORE = ("torch", "ray", "pydantic", "numpy")  # pyproject.toml's dependencies, as imported


def require_core(*, program: str) -> None:
    """Exit 2 with one line naming this Python and what it lacks, if any core package is missing."""
    missing = [name for name in CORE if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"{program}: error: this Python ({sys.executable}) lacks {', '.join(missing)}: run it with the "
            "project's virtualenv (. .venv/bin/activate); under `ray job submit` the job runs the `python` "
            "on the Ray head's PATH, so start the head with the virtualenv activated",
            file=sys.stderr,
        )
        raise SystemExit(2)
