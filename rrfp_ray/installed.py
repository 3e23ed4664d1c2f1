"""Whether this Python holds the project's core packages: a job run by another Python (say
`ray job submit -- python ...` on a head started outside the virtualenv) says so at once,
not with a ModuleNotFoundError from deep inside an import; and what an optional extra's
absence skips. Imports nothing outside the standard library."""

from __future__ import annotations

import importlib
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


def missing_extra(module: str, *, extra: str) -> str | None:
    """Why the optional `extra` cannot be used here (its `module` does not import), or None: for a
    job that goes on without it, saying so in one line."""
    try:
        importlib.import_module(module)
    except ImportError:
        return f"{module} is not installed (pip install 'rrfp-ray[{extra}]')"
    return None
